"""vLLM's bad_words: a word's token sequence never completes in the output (its last token banned
where the output ends with the rest of it), whatever the scheduler does; the tokenization of a
word alone and after a space, as vLLM's; bad input refused."""
import pytest
import torch

from mini_engine import LLM, SamplingParams
from mini_engine.engine.bad_words import bad_word_bans, bad_words_token_ids

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(tokenized_model):
    return LLM(tokenized_model, device=DEVICE, num_kv_blocks=256)


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def greedy(llm, prompt=PROMPT, **params) -> list[int]:
    params = SamplingParams(**({"temperature": 0, "max_tokens": 32, "ignore_eos": True} | params))
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def word_of(llm, tokens: list[int], length: int) -> tuple[str, int]:
    """A word of `length` tokens in the output, and where: one whose text the tokenizer writes
    back as those tokens (alone, with no space before it)."""
    for i in range(len(tokens) - length + 1):
        text = llm.tokenizer.decode(tokens[i:i + length])
        if text.strip() == text and llm.tokenizer.encode(text).ids == tokens[i:i + length]:
            return text, i
    pytest.skip(f"no {length}-token word in this output")


@pytest.mark.parametrize("length", [1, 2, 3])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_bad_word_never_completes(tokenized_model, length, async_scheduling):
    llm = LLM(tokenized_model, device=DEVICE, num_kv_blocks=256, async_scheduling=async_scheduling)
    plain = greedy(llm)
    word, at = word_of(llm, plain, length)
    banned = greedy(llm, bad_words=[word])
    assert not any(contains(banned, ids) for ids in bad_words_token_ids(llm.tokenizer, [word]))
    # Up to the word's last token, the output is the plain one: nothing else was banned.
    assert banned[:at + length - 1] == plain[:at + length - 1] and banned != plain
    assert not llm.engine.needs_last_token


def test_rows_beside_a_bad_word_are_untouched(llm):
    plain = greedy(llm)
    word, _ = word_of(llm, plain, 2)
    other = "Hello"
    alone = greedy(llm, other)
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, bad_words=[word]),
              SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)]
    outs = llm.generate([PROMPT, other], params, use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    assert outs[0].outputs[0].token_ids == greedy(llm, bad_words=[word])


def test_the_tokenization_of_a_word_as_vllms():
    """Alone, and after a space where that makes a word of its own (another first token, as many
    tokens); the bans after some output."""
    class Tokenizer:
        table = {"fox": [5], " fox": [9], "red fox": [1, 2], " red fox": [3, 2], "big": [7, 8], " big": [7, 6],
                 "\x00": [], " \x00": [3]}

        def encode(self, text, add_special_tokens=False):
            return type("Encoding", (), {"ids": self.table[text]})

    assert bad_words_token_ids(Tokenizer(), ["fox", " red fox", "big"]) == [[5], [9], [1, 2], [3, 2], [7, 8]]
    with pytest.raises(ValueError, match="no tokens"):
        bad_words_token_ids(Tokenizer(), ["\x00"])
    sequences = [[5], [1, 2], [4, 1, 2]]
    assert bad_word_bans(sequences, [9, 9], 2) == [5]
    assert bad_word_bans(sequences, [9, 7, 1], 1) == [2, 5]
    assert bad_word_bans(sequences, [4, 1], 0) == [2, 5]
    # The prompt's tokens never count: only the output's, as vLLM's.
    assert bad_word_bans([[4, 1, 2]], [4, 1], 1) == [] and bad_word_bans([[4, 1, 2]], [3, 4, 1], 1) == [2]


def test_n_completions_and_preemption_keep_the_bans(tokenized_model):
    """Seeded completions of one prompt, in a pool that preempts: none completes a bad word, and
    each is what a roomy engine gives it. In fp32, and compared greedily where they must be equal:
    a preempted sequence's tokens are recomputed by prefill, whose sums in bf16 on CUDA may tip a
    near-tie of a sampled draw (seen on the H200 at one token of 192)."""
    roomy = LLM(tokenized_model, device=DEVICE, dtype="float32", num_kv_blocks=256, block_size=16)
    tight = LLM(tokenized_model, device=DEVICE, dtype="float32", num_kv_blocks=10, block_size=16)
    word, _ = word_of(roomy, greedy(roomy), 2)
    sequences = bad_words_token_ids(roomy.tokenizer, [word])
    sampled = SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=48, ignore_eos=True, bad_words=[word])
    prompt = PROMPT * 8
    completions = [c.token_ids for c in tight.generate(prompt, sampled, use_tqdm=False)[0].outputs]
    assert tight.engine.num_preemptions > 0 and len(completions) == 4
    assert not any(contains(tokens, ids) for tokens in completions for ids in sequences)
    prompts = [PROMPT * 8, "Hello " * 12, "def add(a, b): " * 4, "Größe 你好 " * 6]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, bad_words=[word])
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    preemptions = tight.engine.num_preemptions
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.num_preemptions > preemptions and got == expected
    assert not any(contains(tokens, ids) for tokens in got for ids in sequences)


def test_allowed_tokens_that_are_all_bad_words_are_refused(llm):
    """Nothing would be left to sample (the argmax of -inf is token 0, allowed or not)."""
    word, _ = word_of(llm, greedy(llm), 1)
    token = llm.tokenizer.encode(word).ids[0]
    end = llm.tokenizer.token_to_id("<|im_end|>")
    for params in [SamplingParams(allowed_token_ids=[token], bad_words=[word]),
                   SamplingParams(allowed_token_ids=[token, end], bad_words=[word], min_tokens=2)]:
        with pytest.raises(ValueError, match="nothing is left to sample"):
            llm.generate("Hello", params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.needs_last_token


@pytest.mark.parametrize("bad_words, match", [(["ok", "  "], "bad_words"), ([5], "bad_words"), (7, "bad_words")])
def test_bad_words_that_are_not_words_are_refused(bad_words, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(bad_words=bad_words)


def test_without_a_tokenizer_bad_words_are_refused(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=16)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(bad_words=["a"]), use_tqdm=False)
