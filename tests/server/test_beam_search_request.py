"""vLLM's use_beam_search and length_penalty on /v1/completions and /v1/chat/completions: beam
search runs offline here (LLM.beam_search), so a request that asks for it is refused with a 400
that names it, and one that sends the fields at their neutral values (as vLLM's clients may) is
served as before. Checked through the server's own request check, without starting a server."""
from types import SimpleNamespace

import pytest

from mini_engine.server.app import OpenAIServer
from mini_engine.server.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError

REQUESTS = {
    "completion": lambda **fields: CompletionRequest(model="m", prompt="Hello", **fields),
    "chat": lambda **fields: ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], **fields),
}


def check(req) -> None:
    """OpenAIServer.check, on a stand-in for the server: the served model, a generating engine."""
    server = SimpleNamespace(config=SimpleNamespace(runner="generate"), check_model=lambda model: None,
                             check_priority=lambda priority: None)
    OpenAIServer.check(server, req)


@pytest.mark.parametrize("kind", list(REQUESTS))
@pytest.mark.parametrize("fields, param", [
    (dict(use_beam_search=True, n=2), "use_beam_search"),
    (dict(use_beam_search=True, n=2, length_penalty=0.5), "use_beam_search"),
    (dict(length_penalty=2.0), "length_penalty"),
])
def test_beam_search_is_a_400_that_names_it(kind, fields, param):
    with pytest.raises(ProtocolError, match=f"{param}=.* is not supported") as e:
        check(REQUESTS[kind](**fields))
    assert (e.value.status_code, e.value.param) == (400, param)


@pytest.mark.parametrize("kind", list(REQUESTS))
def test_the_neutral_values_are_served(kind):
    check(REQUESTS[kind](use_beam_search=False, length_penalty=1.0))
    check(REQUESTS[kind]())
