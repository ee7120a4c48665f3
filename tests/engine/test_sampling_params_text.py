"""vLLM's text options of SamplingParams offline: skip_special_tokens, spaces_between_special_tokens,
detokenize and truncate_prompt_tokens. The oracle for the text is transformers' fast tokenizer over
the same tokenizer.json (its decode of the output's token ids, with the same flags); the oracle for
a truncated prompt is a run on the prompt already cut."""
import os
import random

import pytest

from mini_engine import LLM, SamplingParams
from mini_engine.detokenizer import IncrementalDetokenizer
from tests.server.conftest import write_tiny_model
from tests.server.test_detokenizer import byte_tokens

transformers = pytest.importorskip("transformers")

THINK = ("<think>", "</think>")     # as in Qwen3: added tokens, but not special
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")     # special; <|im_end|> is the EOS
MULTIBYTE = "é你😀"                 # 2, 3 and 4 bytes, one token per byte below


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3-think")), added_tokens=THINK)


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, device="cpu", num_kv_blocks=128)


@pytest.fixture(scope="module")
def hf_tokenizer(model_path):
    return transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_path, "tokenizer.json"))


@pytest.fixture(scope="module")
def ids(llm):
    """Token ids by name: the special tokens, the thought's tags, and single bytes of MULTIBYTE."""
    tok = llm.tokenizer
    return {"special": [tok.token_to_id(t) for t in SPECIAL], "think": [tok.token_to_id(t) for t in THINK],
            "bytes": byte_tokens(tok, MULTIBYTE), "ascii": tok.encode("Hi there").ids}


def test_the_tokenizer_marks_special_tokens_as_qwen3s_does(llm, ids):
    added = llm.tokenizer.get_added_tokens_decoder()
    assert all(added[i].special for i in ids["special"]) and not any(added[i].special for i in ids["think"])


def forced(ids: dict, names=("special", "think", "bytes", "ascii"), **params) -> SamplingParams:
    """Sampling among these tokens alone, seeded: outputs that mix special tokens, the thought's
    tags and multi-byte characters split across tokens."""
    allowed = sorted({t for name in names for t in ids[name]})
    return SamplingParams(**(dict(temperature=1.0, seed=0, max_tokens=48, ignore_eos=True, allowed_token_ids=allowed)
                             | params))


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.detokenize, p.skip_special_tokens, p.spaces_between_special_tokens, p.truncate_prompt_tokens,
            p.extra_args, p.logits_processors) == (True, True, True, None, None, None)


@pytest.mark.parametrize("kwargs, field", [
    *[(dict(truncate_prompt_tokens=k), "truncate_prompt_tokens") for k in (0, -2, 2.0, True, "8")],
    (dict(skip_special_tokens=1), "skip_special_tokens"), (dict(skip_special_tokens=None), "skip_special_tokens"),
    (dict(spaces_between_special_tokens="no"), "spaces_between_special_tokens"),
    (dict(detokenize=0), "detokenize"),
    (dict(detokenize=False, stop=["x"]), "detokenize"),     # stop strings are matched on the text
    (dict(extra_args=["a"]), "extra_args"),
    (dict(logits_processors=[lambda token_ids, logits: logits]), "logits_processors"),
])
def test_bad_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_accepted_values():
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1
    assert SamplingParams(truncate_prompt_tokens=1).truncate_prompt_tokens == 1
    assert SamplingParams(extra_args={"plugin": 1}).extra_args == {"plugin": 1}    # vLLM's: for plugins, ignored
    assert SamplingParams(logits_processors=[]).logits_processors == []            # none, as vLLM's V1 takes it
    assert SamplingParams(detokenize=False, stop_token_ids=[5]).stop_token_ids == [5]


# ---- incremental detokenization: the same text as one decode, with the same flags ----

def stream(detok: IncrementalDetokenizer, token_ids: list[int], rng: random.Random | None = None) -> list[str]:
    """The pieces the detokenizer sends for token_ids, one token a step (random chunks with rng)."""
    pieces, i = [], 0
    while i < len(token_ids):
        step = 1 if rng is None else rng.randint(1, 4)
        pieces.append(detok.update(token_ids[i:i + step], finished=i + step >= len(token_ids)))
        i += step
    return pieces


@pytest.mark.parametrize("skip", [True, False])
def test_streamed_text_is_one_decodes(llm, hf_tokenizer, ids, skip):
    """Special tokens and the thought's tags between characters split into single bytes: the pieces
    add up to transformers' decode (and tokenizers'), and none holds half a character."""
    tok = llm.tokenizer
    im_start, im_end = ids["special"][1], ids["special"][2]
    token_ids = ([im_start] + tok.encode("assistant\n").ids + [ids["think"][0]] + byte_tokens(tok, "é你")
                 + [ids["think"][1], im_end, im_start] + byte_tokens(tok, "😀 ok") + [im_end, ids["special"][0]])
    expected = hf_tokenizer.decode(token_ids, skip_special_tokens=skip)
    assert expected == tok.decode(token_ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in expected) != skip and "<think>é你</think>" in expected and "😀 ok" in expected
    pieces = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), token_ids)
    assert "".join(pieces) == expected
    assert not any("\ufffd" in p for p in pieces), "a piece split a multi-byte character"
    # The same, with a stop string that never comes (so the tail is held back as it grows).
    held_back = IncrementalDetokenizer(tok, ["never \u2603"], skip_special_tokens=skip)
    assert "".join(stream(held_back, token_ids)) == expected


@pytest.mark.parametrize("skip", [True, False])
def test_a_special_token_inside_a_character(llm, hf_tokenizer, ids, skip):
    """The bytes of one character on either side of a special token: dropped first, the token lets
    them join (skip); kept, it splits them into two replacement characters. Either way, as one decode."""
    tok = llm.tokenizer
    first, second = byte_tokens(tok, "é")
    token_ids = [first, ids["special"][2], second]
    expected = hf_tokenizer.decode(token_ids, skip_special_tokens=skip)
    assert expected == ("é" if skip else "\ufffd<|im_end|>\ufffd")
    assert "".join(stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), token_ids)) == expected


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_ids_stream_as_one_decode(llm, hf_tokenizer, ids, skip):
    """Random mixes (invalid UTF-8 included), in random chunks: what was sent is always the start
    of the final text, and all of it adds up to one decode."""
    tok, rng = llm.tokenizer, random.Random(1)
    pool = ids["special"] + ids["think"] + ids["bytes"] + ids["ascii"]
    for _ in range(200):
        token_ids = [rng.choice(pool) if rng.random() < 0.7 else rng.randrange(tok.get_vocab_size())
                     for _ in range(rng.randint(1, 30))]
        expected = hf_tokenizer.decode(token_ids, skip_special_tokens=skip)
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        sent = ""
        for piece in stream(detok, token_ids, rng):
            sent += piece
            assert expected.startswith(sent), token_ids
        assert sent == expected, token_ids


# ---- LLM.generate ----

def test_skip_special_tokens_in_generated_text(llm, hf_tokenizer, ids):
    """A special token sampled under ignore_eos shows in the text only with skip_special_tokens=False;
    the thought's tags (not special) either way; the token ids are the same."""
    kept, skipped = [llm.generate("Hello", forced(ids, skip_special_tokens=skip), use_tqdm=False)[0].outputs[0]
                     for skip in (False, True)]
    assert kept.token_ids == skipped.token_ids
    token_ids = kept.token_ids
    assert set(token_ids) & set(ids["special"]) and set(token_ids) & set(ids["think"]), \
        "the output should hold special tokens and the thought's tags"
    assert set(token_ids) & set(ids["bytes"]), "and pieces of multi-byte characters"
    assert kept.text == hf_tokenizer.decode(token_ids, skip_special_tokens=False)
    assert skipped.text == hf_tokenizer.decode(token_ids, skip_special_tokens=True)
    assert "<|im_end|>" in kept.text and "<|im_end|>" not in skipped.text
    assert "<think>" in kept.text or "</think>" in kept.text
    assert [t in kept.text for t in THINK] == [t in skipped.text for t in THINK]


@pytest.mark.parametrize("skip", [False, True])
def test_stop_string_matching_reads_the_same_text(llm, hf_tokenizer, ids, skip):
    """With stop strings the text is made incrementally as the request runs: the same text. A
    special token's text is a stop string only where the text holds it (skip_special_tokens=False)."""
    whole = llm.generate("Hello", forced(ids, skip_special_tokens=skip), use_tqdm=False)[0].outputs[0]
    never = llm.generate("Hello", forced(ids, skip_special_tokens=skip, stop=["never \u2603"]),
                         use_tqdm=False)[0].outputs[0]
    assert (never.text, never.token_ids) == (whole.text, whole.token_ids)
    out = llm.generate("Hello", forced(ids, skip_special_tokens=skip, stop=["<|im_start|>"]),
                       use_tqdm=False)[0].outputs[0]
    if skip:
        assert (out.text, out.finish_reason) == (whole.text, "length")
    else:
        assert ids["special"][1] in whole.token_ids, "the output should hold <|im_start|>"
        assert out.finish_reason == "stop" and out.token_ids[-1] == ids["special"][1]
        assert out.text == whole.text[:whole.text.index("<|im_start|>")]


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_an_eos_kept_by_include_stop_str_in_output(llm, hf_tokenizer, ids, skip, include):
    """The EOS that ends the request: its text only with include_stop_str_in_output and
    skip_special_tokens=False (min_tokens holds it back for 3 tokens, then the bias forces it)."""
    eos = ids["special"][2]
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=3, logit_bias={eos: 100.0},
                            include_stop_str_in_output=include, skip_special_tokens=skip)
    out = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    shown = out.token_ids if include else out.token_ids[:-1]
    assert out.text == hf_tokenizer.decode(shown, skip_special_tokens=skip)
    assert out.text.endswith("<|im_end|>") == (include and not skip)


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens_change_nothing(llm, hf_tokenizer, ids, spaces):
    """vLLM's fast detokenizer and transformers' fast tokenizer give the same text either way
    (tokenizer.json's decode writes added tokens as they are): so does this engine."""
    out = llm.generate("Hello", forced(ids, ("special", "think"), skip_special_tokens=False,
                                       spaces_between_special_tokens=spaces), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 48, "every token an added one, one after another"
    for oracle_spaces in (True, False):
        assert out.text == hf_tokenizer.decode(out.token_ids, skip_special_tokens=False,
                                               spaces_between_special_tokens=oracle_spaces)
    assert " " not in out.text


def test_detokenize_false_gives_token_ids_alone(llm, ids):
    params = dict(temperature=0, max_tokens=12, ignore_eos=True)
    with_text = llm.generate(["Hello", [5, 6, 7]], SamplingParams(**params), use_tqdm=False)
    outs = llm.generate(["Hello", [5, 6, 7]], SamplingParams(**params, detokenize=False), use_tqdm=False)
    assert all(o.outputs[0].text for o in with_text)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in with_text]
    assert all(o.outputs[0].text == "" and len(o.outputs[0].token_ids) == 12 for o in outs)
    # A stop token still ends it (the text is not needed for that); n completions have no text either.
    stop = with_text[0].outputs[0].token_ids[5]
    out = llm.generate("Hello", SamplingParams(**params, detokenize=False, stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.token_ids[-1]) == ("", "stop", stop)
    seeded = llm.generate("Hello", SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=5, detokenize=False),
                          use_tqdm=False)[0]
    assert [o.text for o in seeded.outputs] == ["", ""] and all(len(o.token_ids) >= 1 for o in seeded.outputs)


# ---- truncate_prompt_tokens ----

@pytest.mark.parametrize("k", [1, 7, 20])
def test_truncation_keeps_the_prompts_last_tokens(llm, k):
    """The output is the one of the prompt cut to its last k tokens (greedy, identical tokens), and
    its prompt_token_ids are those k."""
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3).ids
    assert len(prompt) > 20
    params = dict(temperature=0, max_tokens=10, ignore_eos=True)
    cut = llm.generate([prompt[-k:]], SamplingParams(**params), use_tqdm=False)[0]
    for given in (prompt, llm.tokenizer.decode(prompt)):        # token ids, and the same as text
        out = llm.generate(given, SamplingParams(**params, truncate_prompt_tokens=k), use_tqdm=False)[0]
        assert out.prompt_token_ids == prompt[-k:]
        assert out.outputs[0].token_ids == cut.outputs[0].token_ids and out.outputs[0].text == cut.outputs[0].text
    whole = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]
    assert whole.prompt_token_ids == prompt and whole.outputs[0].token_ids != cut.outputs[0].token_ids


def test_truncation_comes_before_validation(llm):
    """A prompt longer than max_model_len runs once cut; a cut longer than the prompt keeps it all;
    -1 is max_model_len (and leaves no room to generate in); a cut beyond max_model_len is refused."""
    max_model_len = llm.engine.config.max_model_len
    prompt = [5 + i % 200 for i in range(max_model_len + 40)]
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=16),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt[-16:] and len(out.outputs[0].token_ids) >= 1
    short = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=-1),
                         use_tqdm=False)[0]
    assert short.prompt_token_ids == [5, 6, 7]
    with pytest.raises(ValueError, match=f"prompt of {max_model_len} tokens plus max_tokens=4"):
        llm.generate([prompt], SamplingParams(max_tokens=4, truncate_prompt_tokens=-1), use_tqdm=False)
    with pytest.raises(ValueError, match=f"truncate_prompt_tokens={max_model_len + 1} exceeds max_model_len"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, truncate_prompt_tokens=max_model_len + 1),
                     use_tqdm=False)
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_truncation_with_n_completions(llm):
    prompt = llm.tokenizer.encode("Pack my box with five dozen liquor jugs.").ids
    params = dict(temperature=1.0, seed=7, n=3, max_tokens=6, ignore_eos=True)
    cut = llm.generate([prompt[-5:]], SamplingParams(**params), use_tqdm=False)[0]
    out = llm.generate([prompt], SamplingParams(**params, truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt[-5:]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in cut.outputs]
