"""What a chat or completion request holds its output to, for structured outputs to enforce:
vLLM's structured_outputs, OpenAI's response_format (json_object, json_schema), or the call a
chat's tool_choice forces ("required", or a named function) as vLLM's schemas write it."""
from mini_engine.server.protocol import ChatCompletionRequest, ProtocolError, SamplingRequest
from mini_engine.structured_outputs import StructuredOutputsParams


def forced_tool(req: ChatCompletionRequest) -> str | None:
    """The call tool_choice forces: a function's name, "" for "required" (any of the tools), or
    None where it forces none."""
    choice = req.tool_choice
    if choice in (None, "none", "auto"):
        return None
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if choice != "required" and not isinstance(name, str):
        raise ProtocolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                            f'{{"name": ...}}}}, got {choice!r}', param="tool_choice")
    if not req.tools:
        raise ProtocolError(f"tool_choice={choice!r} needs tools", param="tool_choice")
    if name is not None and name not in {tool.function.name for tool in req.tools}:
        raise ProtocolError(f"tool_choice names {name!r}, which is not one of the request's tools",
                            param="tool_choice")
    return name or ""


def structured_outputs(req: SamplingRequest) -> StructuredOutputsParams | None:
    """What the request holds its output to, if anything: vLLM's structured_outputs, OpenAI's
    response_format json_object or json_schema, or a chat's forced tool_choice (at most one)."""
    given = {}
    if req.structured_outputs is not None:
        given["structured_outputs"] = dict(req.structured_outputs)
    kind = (req.response_format or {}).get("type")
    if kind == "json_object":
        given["response_format"] = {"json_object": True}
    elif kind == "json_schema":
        json_schema = req.response_format.get("json_schema")
        schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
        if not isinstance(schema, dict):
            raise ProtocolError('response_format json_schema needs {"json_schema": {"name": ..., "schema": '
                                f'{{...}}}}}}, got {req.response_format!r}', param="response_format")
        given["response_format"] = {"json": schema}
    if isinstance(req, ChatCompletionRequest) and (tool := forced_tool(req)) is not None:
        given["tool_choice"] = {"json": forced_tool_schema(req, tool)}
    if len(given) > 1:
        raise ProtocolError(f"{' and '.join(given)} both constrain the output: send one", param=next(iter(given)))
    if not given:
        return None
    (param, spec), = given.items()
    try:
        return StructuredOutputsParams(**spec)
    except (ValueError, TypeError) as e:
        raise ProtocolError(f"{param}: {e}", param=param) from None


def forced_tool_schema(req: ChatCompletionRequest, name: str) -> dict:
    """vLLM's schemas for a forced tool_choice: a named function's parameters (its arguments are
    the output); for "required" ("" here), an array of at least one {"name", "parameters"} of the
    request's tools (one at most where parallel_tool_calls is false)."""
    def parameters(tool) -> dict:
        return tool.function.parameters or {"type": "object", "properties": {}}
    if name:
        return parameters(next(tool for tool in req.tools if tool.function.name == name))
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                          "parameters": parameters(tool)},
         "required": ["name", "parameters"]} for tool in req.tools]}}
    return calls | ({"maxItems": 1} if req.parallel_tool_calls is False else {})
