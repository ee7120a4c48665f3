"""The offline API as a vLLM user calls it: SamplingParams' optional fields and the prompt forms
LLM.generate takes."""
import pytest

from mini_engine import SamplingParams


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


def test_chat_without_a_template_says_so(tiny_checkpoint):
    from mini_engine import LLM
    with pytest.raises(ValueError, match="no chat template"):
        LLM(tiny_checkpoint, device="cpu", num_kv_blocks=16).chat([{"role": "user", "content": "Hi"}])
