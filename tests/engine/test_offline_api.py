"""The offline API as a vLLM user calls it: SamplingParams' optional fields and the prompt forms
LLM.generate takes, and LLM.chat's options."""
import json
import shutil

import pytest
import torch

from mini_engine import SamplingParams
from tests.server.conftest import CHATML_TEMPLATE


def test_stop_and_stop_token_ids_of_none_mean_none():
    """vLLM's defaults for both are None, so callers pass None through; it meant a TypeError
    ('NoneType' object is not iterable) here."""
    params = SamplingParams(stop=None, stop_token_ids=None)
    assert params.stop == [] and params.stop_token_ids == []


def test_stop_token_ids_from_a_generator_are_kept():
    """Validation iterated the argument before copying it: a generator was used up, and the
    request silently had no stop tokens."""
    assert SamplingParams(stop_token_ids=(t for t in [5, 6])).stop_token_ids == [5, 6]


@pytest.mark.parametrize("kwargs, match", [(dict(stop=5), "stop"), (dict(stop_token_ids=5), "stop_token_ids")])
def test_a_stop_that_is_not_a_list_is_a_value_error_naming_it(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(tokenized_model):
    from mini_engine import LLM
    return LLM(tokenized_model, device="cpu", num_kv_blocks=64)


def test_vllm_prompt_dicts_are_taken(llm):
    """vLLM's TextPrompt and TokensPrompt ({"prompt": text}, {"prompt_token_ids": ids}): one alone
    raised KeyError: 0, and in a list the dict's keys were taken as token ids."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = llm.engine.tokenize("Größe")
    plain = llm.generate(["Hello", ids], params, use_tqdm=False)
    dicts = llm.generate([{"prompt": "Hello"}, {"prompt_token_ids": ids}], params, use_tqdm=False)
    def completions(outputs):
        return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outputs]
    assert completions(dicts) == completions(plain)
    assert [(o.prompt, o.prompt_token_ids) for o in dicts] == [("Hello", plain[0].prompt_token_ids), (None, ids)]
    alone = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [plain[1].outputs[0].token_ids]


def test_a_prompt_dict_with_other_keys_is_refused(llm):
    with pytest.raises(ValueError, match="prompt 1: .*prompt_token_ids"):
        llm.generate(["Hello", {"prompt": "Hi", "multi_modal_data": {}}], SamplingParams(max_tokens=2),
                     use_tqdm=False)
    assert llm.engine.num_free_blocks == 64 and not llm.engine.has_unfinished_requests()


def test_cumulative_logprob_is_the_sum_of_the_token_logprobs(llm):
    """vLLM's CompletionOutput.cumulative_logprob: the sum where logprobs were asked, else None
    (it was missing: AttributeError)."""
    asked, not_asked = (llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                             logprobs=lp), use_tqdm=False)[0].outputs[0]
                        for lp in (0, None))
    assert asked.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in asked.logprobs))
    assert asked.cumulative_logprob < 0 and not_asked.cumulative_logprob is None


def test_chat_renders_the_template_then_generates(llm):
    """vLLM's LLM.chat: one conversation or a list of them, each rendered by the checkpoint's chat
    template and generated as that text would be."""
    from mini_engine.chat_template import ChatTemplate
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = [{"role": "user", "content": "Hello"}]
    second = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": [{"type": "text", "text": "Größe"}, {"type": "text", "text": "?"}]}]
    template = ChatTemplate.from_pretrained(llm.engine.config.model)
    texts = [template.render(first), template.render([second[0], {"role": "user", "content": "Größe\n?"}])]
    expected = [o.outputs[0].text for o in llm.generate(texts, params, use_tqdm=False)]
    outputs = llm.chat([first, second], params, use_tqdm=False)
    assert [o.prompt for o in outputs] == texts and [o.outputs[0].text for o in outputs] == expected
    alone = llm.chat(first, params, use_tqdm=False)
    assert len(alone) == 1 and alone[0].outputs[0].text == expected[0]
    assert second[1]["content"][0] == {"type": "text", "text": "Größe"}, "the caller's messages are left as they were"
    continuing = llm.chat(first + [{"role": "assistant", "content": "Hi"}], params, use_tqdm=False,
                          add_generation_prompt=False)
    assert continuing[0].prompt == template.render(first + [{"role": "assistant", "content": "Hi"}], False)
    with pytest.raises(ValueError, match="only text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)


def test_chat_without_a_template_says_so_unless_given_one(llm, tmp_path):
    """A checkpoint with no chat template (the module's, without it): chat() says so, and renders
    with a template it is given, as the checkpoint with it would."""
    from mini_engine import LLM
    path = tmp_path / "untemplated"
    shutil.copytree(llm.engine.config.model, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    untemplated = LLM(str(path), device="cpu", num_kv_blocks=16)
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="no chat template"):
        untemplated.chat(messages)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [out] = untemplated.chat(messages, params, use_tqdm=False, chat_template=CHATML_TEMPLATE)
    [expected] = llm.chat(messages, params, use_tqdm=False)
    assert out.prompt == expected.prompt and out.outputs[0].text == expected.outputs[0].text


def test_chat_continue_final_message_continues_the_last_message(llm):
    """vLLM's LLM.chat(continue_final_message=True): the prompt is transformers' rendering with the
    final message left open, the output what generate() continues it with; with
    add_generation_prompt also True (its default), a ValueError."""
    transformers = pytest.importorskip("transformers")
    model = llm.engine.config.model
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{model}/tokenizer.json")
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Größe, and"}]
    text = hf.apply_chat_template(messages, chat_template=CHATML_TEMPLATE, tokenize=False, continue_final_message=True)
    assert text.endswith("assistant\nGröße, and")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [out] = llm.chat(messages, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    [expected] = llm.generate(text, params, use_tqdm=False)
    assert out.prompt == text and out.prompt_token_ids == expected.prompt_token_ids
    assert out.outputs[0].text == expected.outputs[0].text
    with pytest.raises(ValueError, match="cannot both be True"):
        llm.chat(messages, params, continue_final_message=True)


CUSTOM_TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                   "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")


def test_chat_with_a_template_of_the_callers(llm, tmp_path):
    """vLLM's LLM.chat(chat_template=...): the caller's template (its text, or a file's path as the
    server's --chat-template takes it) in place of the checkpoint's, with the checkpoint's special
    tokens; one that fails to compile or render is a ValueError."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    messages = [{"role": "user", "content": "Hello"}]
    text = "[USER] Hello<|im_end|>\n[ASSISTANT] "
    [expected] = llm.generate(text, params, use_tqdm=False)
    file = tmp_path / "custom.jinja"
    file.write_text(CUSTOM_TEMPLATE, encoding="utf-8")
    for template in (CUSTOM_TEMPLATE, str(file)):
        [out] = llm.chat(messages, params, use_tqdm=False, chat_template=template)
        assert out.prompt == text and out.outputs[0].text == expected.outputs[0].text
    assert llm.chat(messages, params, use_tqdm=False)[0].prompt.startswith("<|im_start|>user"), \
        "the checkpoint's template is the default again"
    for bad, match in [("{% if %}", "does not compile"), ("{{ 1 / 0 }}", "ZeroDivisionError"),
                       ("chatml", "looks like a file path")]:
        with pytest.raises(ValueError, match=match):
            llm.chat(messages, params, chat_template=bad)
    assert llm.engine.num_free_blocks == 64 and not llm.engine.has_unfinished_requests()


def test_get_tokenizer_is_transformers_over_the_checkpoint(llm):
    """vLLM's LLM.get_tokenizer, what its users build prompts with: transformers' tokenizer of the
    checkpoint, encoding as the engine encodes and rendering chats as LLM.chat renders them (the
    prompt it returns, generated as LLM.chat generates it)."""
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.get_tokenizer()
    text = "Hello, Größe 🚀 world"
    assert tokenizer.encode(text, add_special_tokens=False) == llm.engine.tokenize(text)
    ids = llm.engine.tokenize(text)
    assert tokenizer.decode(ids) == llm.engine.detokenize(ids)
    assert tokenizer.eos_token_id == llm.tokenizer.token_to_id("<|im_end|>")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    chatted = llm.chat(messages, params, use_tqdm=False)[0]
    assert chatted.prompt == prompt
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text == chatted.outputs[0].text


def test_start_and_stop_profile_write_a_chrome_trace(llm, tmp_path, monkeypatch):
    """vLLM's LLM.start_profile / stop_profile: the steps between them in a Chrome trace, in the
    folder given or $VLLM_TORCH_PROFILER_DIR; without either, or out of order, a clear error."""
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(ValueError, match="VLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()
    with pytest.raises(RuntimeError, match="start_profile"):
        llm.stop_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    llm.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile()
    llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    path = llm.stop_profile()
    assert path.startswith(str(tmp_path / "traces"))
    with open(path) as f:
        names = {event.get("name", "") for event in json.load(f)["traceEvents"]}
    assert any("linear" in name for name in names), sorted(names)[:20]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's kernels are profiled on a GPU")
def test_on_the_gpu_the_profile_holds_the_devices_kernels(tokenized_model, tmp_path):
    """On CUDA the trace has the device's side too: the kernels that the steps launched, those
    replayed inside a CUDA graph among them (a trace of host events alone would pass the test above)."""
    from mini_engine import LLM
    gpu = LLM(tokenized_model, num_kv_blocks=64)
    assert gpu.engine.runner.graph_runner is not None
    gpu.start_profile(str(tmp_path))
    gpu.generate("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    with open(gpu.stop_profile()) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert len(kernels) > 8 * gpu.engine.config.model_config.num_hidden_layers, len(kernels)
    assert any(e.get("name") == "cudaGraphLaunch" for e in events), sorted({e.get("name") for e in events})[:40]
