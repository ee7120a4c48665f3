"""Incremental detokenization: streamed pieces add up to the full decode, never split a
multi-byte character, and cut stop strings out without ever having sent them."""
import random

import pytest

from mini_engine.detokenizer import IncrementalDetokenizer
from tests.server.conftest import train_tokenizer

TEXT = "Größe 你好, emoji 😀🚀 and 𠜎: déjà vu."


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def byte_tokens(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: the worst case, every multi-byte character split."""
    chars = byte_level_chars()
    return [tokenizer.token_to_id(chars[b]) for b in text.encode()]


def byte_level_chars() -> list[str]:
    """GPT-2's byte-to-unicode table, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    pieces = []
    for i in range(0, len(ids), chunk):
        pieces.append(detok.update(ids[i:i + chunk], finished=i + chunk >= len(ids)))
        if detok.stopped:
            break
    return pieces


@pytest.mark.parametrize("split", ["bpe", "bytes"])
def test_streamed_text_equals_full_decode(tokenizer, split):
    ids = tokenizer.encode(TEXT).ids if split == "bpe" else byte_tokens(tokenizer, TEXT)
    assert tokenizer.decode(ids) == TEXT
    pieces = stream(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces), "a piece split a multi-byte character"


def test_random_tokens_match_full_decode(tokenizer):
    """Random ids (invalid UTF-8 included) still add up to exactly what the full decode gives."""
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(rng.randint(1, 60))]
        assert "".join(stream(IncrementalDetokenizer(tokenizer), ids)) == tokenizer.decode(ids)


@pytest.mark.parametrize("stop", [["vu"], ["😀"], ["e 你", "zzz"], [", emoji 😀🚀 and"]])
def test_stop_string_cuts_text_and_is_never_sent(tokenizer, stop):
    ids = byte_tokens(tokenizer, TEXT)
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces = stream(detok, ids)
    cut = min(TEXT.find(s) for s in stop if s in TEXT)
    assert detok.stopped
    assert "".join(pieces) == TEXT[:cut]


def test_no_stop_match_sends_everything(tokenizer):
    ids = tokenizer.encode(TEXT).ids
    detok = IncrementalDetokenizer(tokenizer, ["not there at all"])
    assert "".join(stream(detok, ids)) == TEXT and not detok.stopped


def test_without_tokenizer_text_is_empty():
    detok = IncrementalDetokenizer(None, ["x"])
    assert detok.update([1, 2], False) == "" and detok.update([3], True) == ""


def test_a_stop_string_written_while_min_tokens_held_matching_back_is_not_found_later(tokenizer):
    """As vLLM's check_stop_strings: past min_tokens only a match that the new text completes.
    A longer stop string widens the held-back tail, and must not widen a short one's search."""
    def run(stop):
        detok = IncrementalDetokenizer(tokenizer, stop, min_tokens=2)
        ids = byte_tokens(tokenizer, "xabcdefg")        # one token a character
        for i, token in enumerate(ids):
            detok.update([token], finished=i == len(ids) - 1)
            if detok.stopped:
                break
        return detok.text, detok.stopped
    assert run(["a"]) == ("xabcdefg", False)                    # "a" came at token 2: held back
    assert run(["a", "zzzz"]) == ("xabcdefg", False)
    assert run(["ab"]) == ("x", True)                           # begun within min_tokens, completed past it


@pytest.mark.parametrize("stop", [["vu"], ["😀"], ["e 你", "zzz"], ["ö", "öß"]])
def test_include_stop_str_keeps_the_stop_string_and_holds_nothing_back(tokenizer, stop):
    """vLLM's include_stop_str_in_output: the text runs to the end of the first stop string to
    begin (of two that begin together, the shorter), and each piece goes out as soon as it is
    whole: a stop string in the output needs no held-back tail."""
    ids = byte_tokens(tokenizer, TEXT)
    detok = IncrementalDetokenizer(tokenizer, stop, include_stop=True)
    pieces = stream(detok, ids)
    start, length = min((TEXT.find(s), len(s)) for s in stop if s in TEXT)
    assert detok.stopped and "".join(pieces) == TEXT[:start + length]
    sent = 0
    for i in range(len(ids)):       # every prefix that ends on a whole character was sent by then
        sent += len(pieces[i]) if i < len(pieces) else 0
        whole = tokenizer.decode(ids[:i + 1])
        if i + 1 < len(pieces) and not whole.endswith("\ufffd"):
            assert sent == len(whole), (i, sent, whole)


def test_stop_strings_completed_together_end_the_text_at_the_first(tokenizer):
    """One update that completes several: the text ends at (or, kept, through) the first to begin,
    the shorter of two that begin together."""
    ids = tokenizer.encode(TEXT).ids
    for include, want in ((False, ""), (True, "Gr")):
        detok = IncrementalDetokenizer(tokenizer, ["vu", "Größe", "Gr"], include_stop=include)
        assert detok.update(ids, finished=False) == want and detok.stopped
