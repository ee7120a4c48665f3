"""Stop strings in the offline API: the output ends before the first one, the request stops
there (its blocks freed), and the other requests of the batch are untouched."""
import pytest

from mini_engine import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "def add(a, b):"]


@pytest.fixture(scope="module")
def llm(tokenized_model):
    return LLM(tokenized_model, device="cpu", num_kv_blocks=64)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **kw)


def test_sampling_params_take_one_string_or_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]


def test_output_ends_before_the_stop_string(llm):
    free = [o.outputs[0] for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
    text = free[0].text
    assert len(text) > 10, "the tiny model should write something to stop in"
    # Two ASCII letters past the start (a random model also writes bytes that decode to U+FFFD,
    # which a prefix cut inside a character decodes to as well: no stop string for a test).
    k = next(k for k in range(1, len(text) - 1) if text[k:k + 2].isascii() and text[k:k + 2].isalpha())
    stop = text[k:k + 2]
    cut = text.find(stop)
    outs = llm.generate(PROMPTS, [greedy(stop=[stop, "never appears \u2603"]), greedy()], use_tqdm=False)
    stopped, other = outs[0].outputs[0], outs[1].outputs[0]
    assert stopped.text == text[:cut] and stopped.finish_reason == "stop"
    # The token ids run up to the token that completed the stop string, and no further.
    assert len(stopped.token_ids) < len(free[0].token_ids)
    assert stopped.token_ids == free[0].token_ids[:len(stopped.token_ids)]
    assert llm.engine.detokenize(stopped.token_ids).startswith(text[:cut] + stop)
    assert not llm.engine.detokenize(stopped.token_ids[:-1]).startswith(text[:cut] + stop)
    # The other request of the batch is the same as without the stop string, and nothing leaks.
    assert other.token_ids == free[1].token_ids and other.text == free[1].text and other.finish_reason == "length"
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_no_match_leaves_the_output_whole(llm):
    free = llm.generate(PROMPTS[0], greedy(), use_tqdm=False)[0].outputs[0]
    out = llm.generate(PROMPTS[0], greedy(stop=["never appears \u2603"]), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason) == (free.text, free.token_ids, "length")


def test_a_stop_string_across_tokens_completed_by_the_last_token(llm):
    """The stop string spans two tokens and the second is the request's last (max_tokens): it is
    still in the held-back tail when the request ends by length, and must be cut there, with
    finish reason "stop"."""
    free = llm.generate(PROMPTS[1], greedy(), use_tqdm=False)[0].outputs[0]
    pieces = [llm.tokenizer.decode(free.token_ids[:k]) for k in range(len(free.token_ids) + 1)]

    def spans(j: int) -> bool:     # tokens j-1 and j end and start with printable ASCII
        a, b = pieces[j], pieces[j + 1]
        return 0 < len(a) < len(b) and b.startswith(a) and (a[-1] + b[len(a)]).isprintable() \
            and (a[-1] + b[len(a)]).isascii() and (a[-1] + b[len(a)]) not in b[:len(a)]
    j = next(j for j in range(1, len(free.token_ids)) if spans(j))
    stop = pieces[j][-1] + pieces[j + 1][len(pieces[j])]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=j + 1, ignore_eos=True, stop=stop),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.token_ids) == (pieces[j][:-1], "stop", free.token_ids[:j + 1])
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("stop", [[], ["never appears \u2603"]])
def test_a_stop_tokens_text_is_left_out(llm, stop):
    """As vLLM's: a request that ends on one of its stop_token_ids (or EOS) keeps the token in
    token_ids but not its text, with or without stop strings to match."""
    free = llm.generate(PROMPTS[0], greedy(), use_tqdm=False)[0].outputs[0]
    ids = free.token_ids
    # A token that first appears past the start and adds text of its own.
    k = next(k for k in range(3, len(ids)) if ids[k] not in ids[:k]
             and len(llm.tokenizer.decode(ids[:k + 1])) > len(llm.tokenizer.decode(ids[:k])))
    out = llm.generate(PROMPTS[0], greedy(stop_token_ids=[ids[k]], stop=stop), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (ids[:k + 1], "stop")
    assert out.text == llm.tokenizer.decode(ids[:k])


def test_min_tokens_holds_back_stop_strings(llm):
    """As vLLM's: no stop string ends the output until it has more than min_tokens tokens, and then
    only one that the newest text completes. A letter the greedy text holds twice, in different
    tokens: with min_tokens up to the token that writes the first, the output ends at the second."""
    prompt = PROMPTS[1]
    free = llm.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0]
    pieces = [llm.tokenizer.decode(free.token_ids[:k]) for k in range(len(free.token_ids) + 1)]

    def first_count(letter: str, times: int) -> int | None:
        """The number of tokens whose text first holds the letter `times` times, where that text
        ends on a whole character (else the detokenizer waits for the next token to write it)."""
        k = next((k for k, p in enumerate(pieces) if p.count(letter) >= times), None)
        return None if k is None or pieces[k].endswith("\ufffd") else k
    letter, first, second = next((c, first_count(c, 1), first_count(c, 2)) for c in sorted(set(pieces[-1]))
                                 if c.isascii() and c.isalpha() and None not in (first_count(c, 1), first_count(c, 2))
                                 and first_count(c, 1) < first_count(c, 2))
    text = pieces[-1]
    plain = llm.generate(prompt, greedy(stop=letter), use_tqdm=False)[0].outputs[0]
    assert plain.text == text[:text.index(letter)] and plain.token_ids == free.token_ids[:first]
    held = llm.generate(prompt, greedy(stop=letter, min_tokens=first), use_tqdm=False)[0].outputs[0]
    assert (held.text, held.finish_reason) == (text[:text.index(letter, text.index(letter) + 1)], "stop")
    assert held.token_ids == free.token_ids[:second]
    never = llm.generate(prompt, greedy(stop=letter, min_tokens=40), use_tqdm=False)[0].outputs[0]
    assert (never.text, never.finish_reason) == (free.text, "length")
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_token(llm):
    """vLLM's include_stop_str_in_output: the text runs through the stop string, or through the
    stop token's text; the token ids are those without it."""
    free = llm.generate(PROMPTS[0], greedy(), use_tqdm=False)[0].outputs[0]
    text, ids = free.text, free.token_ids
    k = next(k for k in range(1, len(text) - 1) if text[k:k + 2].isascii() and text[k:k + 2].isalpha())
    stop = text[k:k + 2]
    cut = text.find(stop)
    plain, kept = (llm.generate(PROMPTS[0], greedy(stop=stop, include_stop_str_in_output=include), use_tqdm=False)[0]
                   .outputs[0] for include in (False, True))
    assert (plain.text, kept.text) == (text[:cut], text[:cut + 2]) and kept.finish_reason == "stop"
    assert kept.token_ids == plain.token_ids
    k = next(k for k in range(3, len(ids)) if ids[k] not in ids[:k]
             and len(llm.tokenizer.decode(ids[:k + 1])) > len(llm.tokenizer.decode(ids[:k])))
    for stop in ([], ["never appears \u2603"]):      # without, and with, a stop-string matcher
        out = llm.generate(PROMPTS[0], greedy(stop_token_ids=[ids[k]], stop=stop, include_stop_str_in_output=True),
                           use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason, out.text) == (ids[:k + 1], "stop", llm.tokenizer.decode(ids[:k + 1]))
