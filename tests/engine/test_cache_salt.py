"""vLLM's cache_salt: a prompt's prefix-cache blocks serve only prompts of the same salt. As in
vLLM (kv_cache_utils.generate_block_hash_extra_keys), the salt keys the first block's hash alone,
and every later block's hash chains from it. Blocks of 4 here: a 14-token prompt looks up its
first 3 blocks, (14 - 1) // 4, so a hit is 12 cached tokens."""
import pytest

from mini_engine import LLM, BeamSearchParams, LoRARequest, SamplingParams
from mini_engine.engine.block_manager import BlockManager, chained_blocks
from mini_engine.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(3, 17))
HIT = 12


def salted(ids: list[int], salt: str | None) -> dict:
    return {"prompt_token_ids": ids, "cache_salt": salt}


@pytest.fixture
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64, block_size=4)


def cached_tokens(llm: LLM, prompt) -> int:
    return llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens


def test_the_salt_keys_the_first_block_and_every_block_chains_from_it():
    bm = BlockManager(num_blocks=16, block_size=4)
    alice = Sequence("a", PROMPT, GREEDY, cache_salt="alice")
    plain = Sequence("p", PROMPT, GREEDY)
    assert bm.allocate_slots(alice, len(PROMPT)) and bm.allocate_slots(plain, len(PROMPT))
    # Past the first block the salt is no part of a key: only the chain carries it.
    assert alice.block_hashes == [h for _, _, h in chained_blocks(PROMPT, 4, 0, 3, alice.cache_root)]
    assert alice.cache_root is not None and plain.cache_root is None
    assert set(alice.block_hashes).isdisjoint(plain.block_hashes)      # no later block matches either
    assert bm.find_cached_prefix(Sequence("b", PROMPT, GREEDY, cache_salt="alice")) == alice.block_table[:3]
    assert bm.find_cached_prefix(Sequence("c", PROMPT, GREEDY)) == plain.block_table[:3]
    assert not bm.find_cached_prefix(Sequence("d", PROMPT, GREEDY, cache_salt="bob"))
    assert bm.prompt_cost(PROMPT, set(), alice.cache_root) == len(PROMPT) - HIT
    assert bm.prompt_cost(PROMPT, set(), Sequence("e", PROMPT, GREEDY, cache_salt="eve").cache_root) == len(PROMPT)


def test_a_salt_and_an_adapter_key_apart():
    """An adapter's blocks serve its own salted requests only; a salt is never taken for an
    adapter (vLLM's untagged keys let a LoRA name equal to a salt share blocks: its issue 44701)."""
    bm = BlockManager(num_blocks=16, block_size=4)
    lora = LoRARequest("x", 1, "/x")
    both = Sequence("a", PROMPT, GREEDY, lora_request=lora, cache_salt="s")
    assert bm.allocate_slots(both, len(PROMPT))
    assert bm.find_cached_prefix(Sequence("b", PROMPT, GREEDY, lora_request=lora, cache_salt="s"))
    for other in (Sequence("c", PROMPT, GREEDY, lora_request=lora), Sequence("d", PROMPT, GREEDY, cache_salt="s"),
                  Sequence("e", PROMPT, GREEDY, lora_request=lora, cache_salt="t")):
        assert not bm.find_cached_prefix(other)
    roots = {Sequence("f", PROMPT, GREEDY, cache_salt=salt, lora_request=lora_request).cache_root
             for salt in (None, "1", "x", "lora") for lora_request in (None, lora)}
    assert len(roots) == 8


def test_an_empty_salt_is_none_and_a_salt_must_be_a_string():
    """As vLLM's input processing (`if cache_salt := ...`): "" salts nothing."""
    assert Sequence("a", PROMPT, GREEDY, cache_salt="").cache_root is None
    with pytest.raises(ValueError, match="cache_salt must be a string"):
        Sequence("b", PROMPT, GREEDY, cache_salt=123)


def test_hits_only_under_the_same_salt(llm):
    outputs = []
    expected = [(salted(PROMPT, "a"), 0), (salted(PROMPT, "a"), HIT), (salted(PROMPT, "b"), 0), (PROMPT, 0),
                (PROMPT, HIT), (salted(PROMPT, ""), HIT), (salted(PROMPT, None), HIT), (salted(PROMPT, "b"), HIT)]
    for prompt, hit in expected:
        out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert out.num_cached_tokens == hit, prompt
        outputs.append(out.outputs[0].token_ids)
    assert llm.engine.prefix_cache_hit_tokens == HIT * 5
    assert all(o == outputs[0] for o in outputs)           # the salt changes which blocks, not the tokens


def test_prompts_of_one_step_share_blocks_by_salt(llm):
    """Added together, the first prompt's blocks are hashed as it is scheduled, and only the one
    after it with its salt takes them in that step (and the admission counts only that one's as
    cached: BlockManager.prompt_cost)."""
    prompts = [salted(PROMPT, "a"), salted(PROMPT, "a"), salted(PROMPT, "b"), PROMPT, {"prompt_token_ids": PROMPT}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, HIT, 0, 0, HIT]
    assert llm.engine.prefix_cache_hit_tokens == 2 * HIT
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1


def test_parallel_sampling_shares_the_prompt_under_its_salt(llm):
    """n completions of a salted prompt compute it once (the second and third hit the first's
    blocks); the unsalted prompt then finds none of them."""
    params = SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=4, ignore_eos=True)
    out = llm.generate(salted(PROMPT, "a"), params, use_tqdm=False)[0]
    assert llm.engine.prefix_cache_hit_tokens == 2 * HIT == 2 * out.num_cached_tokens
    assert cached_tokens(llm, PROMPT) == 0
    assert cached_tokens(llm, salted(PROMPT, "a")) == HIT
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_preemption_and_chunked_prefill_give_the_unsalted_tokens(tiny_checkpoint):
    """A pool too small for every request at once (so requests are preempted and recomputed) and
    a token budget that cuts prompts into chunks: salted or not, the same greedy tokens."""
    prompts = [[5 + i, 9, 11, 13, 17, 19, 23, 29, 31, 37] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = []
    for salts in ([None] * 4, ["a", "b", "a", "c"]):
        llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=12, block_size=4, max_num_batched_tokens=8)
        outs = llm.generate([salted(p, s) for p, s in zip(prompts, salts)], params, use_tqdm=False)
        assert sum(o.num_preemptions for o in outs) > 0
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]


def test_beam_search_steps_keep_the_prompts_salt(llm):
    """Each step of a salted prompt's beams is a request under its salt: the same beams as
    unsalted, and what they leave in the cache serves the salt alone."""
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    beams = llm.beam_search([salted(PROMPT, "a")], params)[0].sequences
    assert cached_tokens(llm, PROMPT) == 0
    assert cached_tokens(llm, salted(PROMPT, "a")) == HIT
    plain = llm.beam_search([PROMPT], params)[0].sequences
    # (The unsalted search finds the prompt cached, by cached_tokens above, and computes less of it
    # in its first step: its log-probabilities may differ in the last bits, 5e-7 on an AVX-512 CPU.)
    assert [b.tokens for b in beams] == [b.tokens for b in plain]
    assert [b.cum_logprob for b in beams] == pytest.approx([b.cum_logprob for b in plain], rel=1e-5, abs=1e-6)


def test_text_prompts_take_a_salt_and_a_bad_one_fails_the_call(tokenized_model):
    llm = LLM(tokenized_model, device="cpu", num_kv_blocks=64, block_size=4)
    text = "The quick brown fox jumps over the lazy dog."
    num_tokens = len(llm.engine.tokenize(text))
    hit = (num_tokens - 1) // 4 * 4
    assert hit > 0
    assert [cached_tokens(llm, {"prompt": text, "cache_salt": salt}) for salt in ("a", "a", "b")] == [0, hit, 0]
    out = llm.generate({"prompt": text, "cache_salt": "a"}, GREEDY, use_tqdm=False)[0]
    assert out.prompt == text and out.num_cached_tokens == hit
    with pytest.raises(ValueError, match="prompt 1: cache_salt must be a string"):
        llm.generate([text, {"prompt": text, "cache_salt": 7}], GREEDY, use_tqdm=False)
    assert llm.engine.num_free_blocks == 64 and not llm.engine.has_unfinished_requests()
