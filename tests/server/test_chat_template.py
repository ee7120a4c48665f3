"""Our jinja2 rendering of the checkpoint's chat template agrees with transformers'."""
import pytest

from mini_engine.chat_template import ChatTemplate, continue_final_message
from tests.server.conftest import CHATML_TEMPLATE

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Größe? 你好 😀"},
    {"role": "assistant", "content": "Yes."},
    {"role": "user", "content": "And now?"},
]
# A template using what transformers adds to jinja2: loop controls, raise_exception, tojson, tokens.
RICH_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}"
    "  {{ m['role'] | upper }}: {{ m['content'] | tojson }}\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}{{ eos_token }}")


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, RICH_TEMPLATE])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(tiny_model, template, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{tiny_model}/tokenizer.json",
                                              bos_token="<|endoftext|>", eos_token="<|im_end|>")
    ours = ChatTemplate(template, {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"})
    expected = hf.apply_chat_template(MESSAGES, chat_template=template, tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
    assert ours.render(MESSAGES, add_generation_prompt) == expected


def test_from_pretrained_and_template_errors(tiny_model):
    template = ChatTemplate.from_pretrained(tiny_model)
    assert template.render(MESSAGES[:2]).endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="no tools"):
        ChatTemplate(RICH_TEMPLATE, {}).render([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, CHATML_TEMPLATE.replace("message['content']",
                                                                                 "message['content'] | trim")])
@pytest.mark.parametrize("final", ["Yes, and", "  Yes, and  "])
def test_continue_final_message_matches_transformers(tiny_model, template, final):
    """The rendered chat cut after the last message's content (stripped where the template wrote
    it stripped), as transformers' continue_final_message cuts it."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{tiny_model}/tokenizer.json")
    messages = MESSAGES[:2] + [{"role": "assistant", "content": final}]
    expected = hf.apply_chat_template(messages, chat_template=template, tokenize=False, continue_final_message=True)
    ours = ChatTemplate(template, {})
    assert continue_final_message(ours.render(messages, False), messages) == expected
    assert expected.rstrip().endswith("Yes, and") and "<|im_end|>" not in expected.split("assistant")[-1]
    for bad in ([{"role": "user", "content": ""}], []):
        with pytest.raises(ValueError, match="final message with text"):
            continue_final_message("x", bad)
