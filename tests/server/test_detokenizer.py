"""Incremental detokenization: streamed pieces add up to the full decode, never split a
multi-byte character, and cut stop strings out without ever having sent them."""
import random

import pytest
from tokenizers import Tokenizer, decoders, models

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


def test_ids_past_the_tokenizers_vocabulary_add_nothing(tokenizer):
    """The model's vocabulary is larger than its tokenizer's (Qwen3: 151,936 rows, 151,669 tokens):
    a sampled id with no token decodes to nothing, streamed or whole."""
    rng = random.Random(1)
    size = tokenizer.get_vocab_size()
    for _ in range(30):
        ids = [rng.randrange(size + 40) for _ in range(rng.randint(1, 40))]
        assert "".join(stream(IncrementalDetokenizer(tokenizer), ids)) == tokenizer.decode(ids)


def byte_fallback_tokenizer() -> Tokenizer:
    """Llama's and Gemma's kind of tokenizer: a token for each byte (<0xNN>), whose decoder turns
    the bytes back into text, invalid ones into U+FFFD."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "x": 258, "▁a": 259}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def test_a_byte_fallback_tokenizer_streams_invalid_bytes_without_failing():
    """Its decode of a window of invalid bytes need not extend the text before it (bytes that made
    a character turn to U+FFFD beside a lone lead byte), which stops tokenizers' DecodeStream with an
    error: the detokenizer starts a fresh stream and goes on; what it sent stands, and where the
    whole decode does extend it (a byte-level decoder's always does) the text is that decode."""
    tok = byte_fallback_tokenizer()
    ids = [259, 1 + 0xE4, 1 + 0xBD, 1 + 0xA0, 1 + 0xE5, 258]     # " a", 你 as three bytes, a lone lead byte, "x"
    assert tok.decode(ids) == "a\ufffd\ufffd\ufffd\ufffdx"            # the whole decode takes 你 back
    detok = IncrementalDetokenizer(tok)
    pieces = stream(detok, ids)
    assert "".join(pieces) == detok.text and detok.text.startswith("a你") and detok.text.endswith("x")
    # After the fresh stream a word keeps its leading space (the decoder strips the first token's).
    detok = IncrementalDetokenizer(tok)
    assert "".join(stream(detok, ids[:-1] + [259, 259])).endswith(" a a")
    rng = random.Random(2)
    extended = 0
    for _ in range(200):
        ids = [rng.randrange(260) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(tok)
        before = "".join(detok.update([token], False) for token in ids[:-1])
        last = detok.update(ids[-1:], True)
        assert before + last == detok.text
        whole = tok.decode(ids)
        if whole.startswith(before):        # the whole decode extends what was sent: it is the text
            extended += 1
            assert detok.text == whole
    assert extended > 50


def test_nothing_comes_after_the_last_update(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    ids = byte_tokens(tokenizer, "é!")
    detok.update(ids[:1], False)
    assert detok.update(ids[1:], True) == "é!"
    assert detok.update(byte_tokens(tokenizer, "x"), False) == "" and detok.text == "é!"
