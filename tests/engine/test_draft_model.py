"""Speculative decoding with a draft model (speculative_config {"method": "draft_model", "model":
...}, runner/draft_model.py): outputs are plain decoding's whatever the draft proposes; a draft
that is the target itself is right at (nearly) every position, which it can only be if its own
K and V follow each sequence through chunked catch-up, rejected drafts, preemption and prefix
hits; and the configurations vLLM's users could give that cannot run are refused by name."""
import json
import os
import shutil

import pytest
import torch

from mini_engine import LLM, SamplingParams
from mini_engine.config import EngineConfig
from mini_engine.engine.engine import LLMEngine
from mini_engine.model.random_checkpoint import write_random_checkpoint
from mini_engine.runner.draft_model import DraftModel
from mini_engine.speculative import SpecDecodeStats, SpeculativeConfig
from tests.conftest import tiny_config

PROMPTS = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [12], list(range(20, 60)), [3, 3, 3, 3]]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# A draft that is the target itself proposes the target's own argmax; the two differ only where
# a batch's other shape moves a near tie (fp32 on CPU: measured 1.0 on every run here).
SELF_DRAFT_ACCEPTANCE = 0.95


def draft_config(model: str, k: int = 3, **extra) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k} | extra


@pytest.fixture(scope="module")
def other_draft(checkpoint_factory) -> str:
    """A draft of the target's vocabulary and nothing else in common (another tiny shape)."""
    return checkpoint_factory("untied-mha")


@pytest.fixture(scope="module")
def plain(tiny_checkpoint):
    return LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256)


def generate(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list[list[int]]]:
    llm.engine.spec_decode_stats = SpecDecodeStats()
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_all_blocks_free(llm: LLM) -> None:
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("params", [
    GREEDY,
    SamplingParams(temperature=0.9, seed=7, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True, n=2),
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=20, stop_token_ids=[33, 177]),
], ids=["greedy", "seeded", "n=2", "min-tokens"])
def test_outputs_are_plain_decodings_whatever_the_draft(tiny_checkpoint, other_draft, plain, params):
    """A draft of another model is mostly wrong: each step keeps the target's own token where it
    differs, so the outputs are plain decoding's (seeded ones too: the j-th token comes from the
    stream (seed, j) either way)."""
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256, speculative_config=draft_config(other_draft))
    assert generate(llm, params) == generate(plain, params)
    stats = llm.engine.spec_decode_stats
    assert stats.num_draft_tokens > 0
    assert_all_blocks_free(llm)


def test_a_draft_of_the_target_itself_is_accepted(tiny_checkpoint, plain):
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256, speculative_config=draft_config(tiny_checkpoint, k=4))
    assert generate(llm, GREEDY) == generate(plain, GREEDY)
    stats = llm.engine.spec_decode_stats
    assert stats.num_draft_tokens > 100 and stats.acceptance_rate >= SELF_DRAFT_ACCEPTANCE, stats
    assert stats.mean_acceptance_length > 3.5        # a step gives a sequence ~k + 1 tokens
    assert_all_blocks_free(llm)


def test_catch_up_in_chunks_through_preemption(tiny_checkpoint, plain):
    """A token budget below the prompts' lengths (the draft catches up over several steps of its
    own) and a pool that preempts: a preempted sequence's draft starts again from nothing."""
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=24, block_size=4, max_num_batched_tokens=16,
              speculative_config=draft_config(tiny_checkpoint))
    assert generate(llm, GREEDY) == generate(plain, GREEDY)
    stats = llm.engine.spec_decode_stats
    assert llm.engine.num_preemptions > 0
    assert stats.num_draft_tokens > 50 and stats.acceptance_rate >= SELF_DRAFT_ACCEPTANCE, stats
    assert_all_blocks_free(llm)


def test_a_prefix_hit_is_computed_again_by_the_draft(tiny_checkpoint, plain):
    """The first request runs with no drafts (two requests are more than disable_by_batch_size),
    so the draft never writes its prompt's blocks; the second takes them as a cached prefix. Its
    draft must compute that prefix itself: read as they are, the blocks hold no draft K and V,
    and the drafts would be wrong."""
    prompt = list(range(30, 70))
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256,
              speculative_config=draft_config(tiny_checkpoint, disable_by_batch_size=1))
    first = generate(llm, GREEDY, [prompt, [4] * 8])
    assert llm.engine.spec_decode_stats.num_draft_tokens == 0       # never alone: no drafts
    llm.engine.spec_decode_stats = SpecDecodeStats()
    (again,) = llm.generate([prompt + [1, 2]], GREEDY, use_tqdm=False)
    assert again.num_cached_tokens >= 32                            # the first prompt's whole blocks
    stats = llm.engine.spec_decode_stats
    assert stats.num_draft_tokens > 20 and stats.acceptance_rate >= SELF_DRAFT_ACCEPTANCE, stats
    assert [c.token_ids for c in again.outputs] == generate(plain, GREEDY, [prompt + [1, 2]])[0]
    assert first == generate(plain, GREEDY, [prompt, [4] * 8])


def test_method_is_inferred_from_a_model_as_vllm():
    assert SpeculativeConfig.resolve({"model": "/some/draft", "num_speculative_tokens": 2}) == SpeculativeConfig(
        "draft_model", 2, model="/some/draft", draft_tensor_parallel_size=1)


def rewritten_checkpoint(source: str, folder: str, **fields) -> str:
    shutil.copytree(source, folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config | fields, f)
    return folder


@pytest.mark.parametrize("extra, message", [
    ({"draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size must be 1"),
    ({"quantization": "int3"}, "quantization \\(the draft model's\\) must be one of"),
    ({"quantization": "awq"}, "the draft model: quantization='awq' needs an AWQ checkpoint"),
    ({"prompt_lookup_max": 3}, "are the ngram method's"),
    ({"model": ""}, "needs model"),
])
def test_bad_draft_configs_are_refused(tiny_checkpoint, extra, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(tiny_checkpoint, device="cpu", speculative_config=draft_config(tiny_checkpoint) | extra)


def test_drafts_that_cannot_run_are_refused(tiny_checkpoint, tmp_path):
    cases = [
        (draft_config(str(tmp_path / "missing")), {}, "cannot be read"),
        (draft_config(write_random_checkpoint(str(tmp_path / "v128"), tiny_config("untied-mha") | {"vocab_size": 128},
                                              dtype=torch.float32)), {}, "vocab_size 128 differs"),
        (draft_config(rewritten_checkpoint(tiny_checkpoint, str(tmp_path / "short"), max_position_embeddings=64)), {},
         "reaches 64 positions"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": tiny_checkpoint}, {}, "draft_model method's"),
        ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "fp8"}, {}, "draft_model method's"),
    ]
    for spec, options, message in cases:
        with pytest.raises(ValueError, match=message):
            EngineConfig(tiny_checkpoint, device="cpu", speculative_config=spec, **options)


@pytest.mark.parametrize("always_ahead", [False, True], ids=["as-guessed", "catch-up-ahead-every-step"])
def test_steps_without_drafts_after_a_rejection_leave_the_draft_right(tiny_checkpoint, other_draft, monkeypatch,
                                                                     always_ahead):
    """A draft of another model is mostly rejected; then a second request makes the batch larger
    than disable_by_batch_size, and the first runs steps without drafts past the positions where
    the draft wrote its rejected tokens' K and V. Once it drafts again, each proposal's first draft
    must still be the draft model's own greedy token after the sequence's tokens (those stale K and
    V, counted as the sequence's, made about a third of them other tokens). With a catch-up
    launched ahead behind every verifying step, whatever the step before did (launch_ahead), the
    wrong guesses' K and V lie past the sequence too, and must not count either."""
    proposals, launched_ahead = [], []
    propose = DraftModel.propose

    def recorded(self, seqs, num_drafts, ahead=None):
        proposal = propose(self, seqs, num_drafts, ahead)
        proposals.extend((list(seq.token_ids), d[0]) for seq, d in zip(seqs, proposal.read()))
        return proposal

    monkeypatch.setattr(DraftModel, "propose", recorded)
    if always_ahead:
        launch_ahead = DraftModel.launch_ahead

        def every_time(self, *args):
            self.guessed_right = True
            ahead = launch_ahead(self, *args)
            launched_ahead.append(ahead.handle is not None)
            return ahead
        monkeypatch.setattr(DraftModel, "launch_ahead", every_time)
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256,
              speculative_config=draft_config(other_draft, disable_by_batch_size=1))
    engine = llm.engine
    engine.add_request(list(range(20, 40)), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), "long")
    for _ in range(4):
        engine.step()
    engine.add_request([7, 8, 9], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), "short")
    while engine.has_unfinished_requests():
        engine.step()
    assert len(proposals) > 20 and engine.spec_decode_stats.acceptance_rate < 0.5
    draft_alone = LLM(other_draft, device="cpu", num_kv_blocks=256)
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    own = [o.outputs[0].token_ids[0]
           for o in draft_alone.generate([tokens for tokens, _ in proposals], one_token, use_tqdm=False)]
    assert [first for _, first in proposals] == own
    if always_ahead:
        assert sum(launched_ahead) > 20
    assert_all_blocks_free(llm)


def test_a_failed_proposal_leaves_no_places_to_verify(tiny_checkpoint, plain, monkeypatch):
    """A draft step that fails fails the engine's step; the places the proposer had set are then
    cleared, so a later step (one without drafts, here) never verifies them as tokens."""
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256, speculative_config=draft_config(tiny_checkpoint))
    engine = llm.engine
    seq = engine.add_request(PROMPTS[2], GREEDY, "r")
    engine.step()                                       # the prompt: no drafts yet
    monkeypatch.setattr(DraftModel, "propose", lambda *_: (_ for _ in ()).throw(RuntimeError("draft failed")))
    with pytest.raises(RuntimeError, match="draft failed"):
        engine.step()
    assert all(not seq.spec_token_ids for seq in engine.scheduler.running)
    monkeypatch.undo()
    engine.config.speculative_config = None             # steps without drafts from here on
    while engine.has_unfinished_requests():
        engine.step()
    assert seq.output_token_ids == generate(plain, GREEDY, [PROMPTS[2]])[0][0]


def test_a_stand_in_runner_runs_without_drafts(tiny_checkpoint):
    """LLMEngine(config, runner=...) (the scheduling tests' stand-ins) starts no draft model, and
    so proposes nothing, rather than places no draft model fills."""
    from tests.engine.test_speculative import CacheReadingRunner
    config = EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                          speculative_config=draft_config(tiny_checkpoint))
    engine = LLMEngine(config, runner=CacheReadingRunner(64, config.block_size, 64, 4))
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.draft is None and engine.spec_decode_stats.num_draft_tokens == 0


@pytest.mark.parametrize("budget", [None, 8], ids=["whole-prompts", "chunked-prompts"])
def test_a_proposal_is_decode_rows_launched_without_waiting(tiny_checkpoint, plain, monkeypatch, budget):
    """Once a sequence's prompt is caught up, a proposal's first step is decode rows (the accepted
    drafts and the target's token after them, one a token at its own position: what a CUDA graph
    replays) and its later steps take their input tokens from the step before's samples on the
    device; the target's verifying step takes the drafts on the device too, so the host waits for
    none of the draft's steps before all of them and the verifying step are launched. Outputs stay
    plain decoding's. (A budget below the prompts' lengths catches a prompt up over several steps,
    the host reading first drafts of the earlier ones.)"""
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256, speculative_config=draft_config(tiny_checkpoint, k=4),
              **({} if budget is None else {"max_num_batched_tokens": budget}))
    runner, proposals, used = llm.engine.draft.runner, [], []
    launch, propose = runner.launch, DraftModel.propose
    target_launch = llm.engine.runner.launch

    def recorded_target_launch(rows, **kwargs):
        if proposals and kwargs:                # a verifying step's: its drafts' places on the device
            proposals[-1].append(("verify", [r.prev_token_index for r in rows]))
        return target_launch(rows, **kwargs)

    def recorded_launch(rows, **kwargs):
        shape = [(len(r.token_ids), r.prev_token_index) for r in rows]
        proposals[-1].append(("ahead", shape) if kwargs else shape)    # (only launch_ahead gives prev_tokens)
        handle = launch(rows, **kwargs)
        result = handle.result

        def waited():
            proposals[-1].append("wait")
            return result()
        handle.result = waited
        return handle

    def recorded_propose(self, seqs, num_drafts, ahead=None):
        proposals.append([])
        proposal = propose(self, seqs, num_drafts, ahead)
        used.append(self.guessed_right and ahead.handle is not None)
        return proposal

    monkeypatch.setattr(runner, "launch", recorded_launch)
    monkeypatch.setattr(llm.engine.runner, "launch", recorded_target_launch)
    monkeypatch.setattr(DraftModel, "propose", recorded_propose)
    assert generate(llm, GREEDY) == generate(plain, GREEDY)
    assert len(used) == len(proposals)
    used = [u for u, events in zip(used, proposals) if events]
    proposals = [events for events in proposals if events]        # (a step whose sequences had no places)
    prompt_catch_ups = [events for events in proposals if isinstance(events[0], list) and
                        any(n > 1 for n, _ in events[0])]
    assert len(prompt_catch_ups) <= len(PROMPTS) and len(proposals) - len(prompt_catch_ups) >= 5
    # The draft is right at every position, so after the first verifying step of each run, the
    # catch-up launched behind each is the next proposal's (DraftModel.launch_ahead).
    assert sum(used) >= (len(proposals) - len(prompt_catch_ups)) // 2, used
    read_on_host = 0
    for events, used_ahead in zip(proposals, used):
        steps = [e for e in events if isinstance(e, list)]
        verify = [e for e in events if e[0] == "verify"]
        ahead = [e for e in events if e[0] == "ahead"]
        assert len(verify) == 1 and len(ahead) <= 1
        # A catch-up launched ahead: the step's last two samples, each sequence's, on the device.
        assert all(n == 1 and prev >= 0 for _, rows in ahead for n, prev in rows)
        if events in prompt_catch_ups:      # its earlier catch-up steps are waited for (their first drafts)
            assert events.index(verify[0]) > max(events.index(step) for step in steps)
        else:       # every step launched, then the verifying step (and a catch-up ahead), before the first wait
            assert events == steps + verify + ahead + ["wait"] * (len(steps) + used_ahead)
        if used_ahead:      # its catch-up ran behind the step before: only drafts over drafts
            assert events not in prompt_catch_ups and all(prev >= 0 for step in steps for _, prev in step)
            steps = [[(1, -1)]] + steps       # (the catch-up's place, for the checks below)
        # The verifying rows take each draft once from the proposal's tokens on the device: all of
        # its places, but those of first drafts that a prompt's catch-up of several steps read on the host.
        taken = sorted(p for p in verify[0][1] if p >= 0)
        if events in prompt_catch_ups:
            assert len(set(taken)) == len(taken), verify
            read_on_host += taken != list(range(len(taken)))
        else:
            assert taken == list(range(len(taken))) and taken, verify
        if events not in prompt_catch_ups:      # (a prompt's: chunks, then first drafts some read on the host)
            assert all(prev >= 0 for step in steps[1:] for _, prev in step)
            assert all(n == 1 and prev == -1 for n, prev in steps[0])
    assert (read_on_host > 0) == (budget is not None)
    assert llm.engine.spec_decode_stats.acceptance_rate >= SELF_DRAFT_ACCEPTANCE
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("budget, num_kv_blocks", [(None, 256), (8, 10)], ids=["whole-prompts", "chunked-preempting"])
def test_a_catch_up_launched_ahead_starts_the_next_proposal_where_the_guess_holds(tiny_checkpoint, plain, budget,
                                                                                num_kv_blocks):
    """A step whose sequences all accepted every draft starts from the catch-up launched behind the
    step before (launch_ahead); through chunked prompts, requests that finish (the guess's
    sequences then differ) and preemption, outputs stay plain decoding's, the draft stays right (a
    draft that is the target) and the pool ends free."""
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=num_kv_blocks,
              speculative_config=draft_config(tiny_checkpoint, k=3),
              **({} if budget is None else {"max_num_batched_tokens": budget}))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (64, 13, 27, 64)]
    want = [[o.outputs[0].token_ids] for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert [[o.outputs[0].token_ids] for o in llm.generate(PROMPTS, params, use_tqdm=False)] == want
    counts = llm.engine.draft.ahead_counts
    assert counts["catch-ups used"] >= 5 and counts["catch-ups used"] <= counts["catch-ups launched"], counts
    if num_kv_blocks == 256:        # none launched for a request the step ends (at max_tokens), so none wasted
        assert counts["catch-ups used"] == counts["catch-ups launched"], counts
    assert llm.engine.spec_decode_stats.acceptance_rate >= SELF_DRAFT_ACCEPTANCE
    if num_kv_blocks == 10:
        assert llm.engine.num_preemptions > 0
    assert_all_blocks_free(llm)


def test_a_launch_ahead_that_fails_costs_only_the_head_start(tiny_checkpoint, plain, monkeypatch):
    """launch_ahead runs after the verifying step is launched: where its launch fails, the step
    must still be resolved and the next proposal catch up as it would have. (Found by a review: the
    step was lost, and every later step fed its sequences a placeholder token.)"""
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256, speculative_config=draft_config(tiny_checkpoint))
    runner, launch_ahead = llm.engine.draft.runner, DraftModel.launch_ahead
    launch, calls = runner.launch, {"inside": False, "aheads": 0, "failed": 0}

    def failing_launch_once(rows, **kwargs):
        if calls["inside"]:
            if calls["aheads"] >= 3 and not calls["failed"]:
                calls["failed"] += 1
                raise RuntimeError("CUDA out of memory (simulated)")
        return launch(rows, **kwargs)

    def watched(self, *args):
        calls["inside"] = True
        calls["aheads"] += 1
        try:
            return launch_ahead(self, *args)
        finally:
            calls["inside"] = False

    monkeypatch.setattr(runner, "launch", failing_launch_once)
    monkeypatch.setattr(DraftModel, "launch_ahead", watched)
    assert generate(llm, GREEDY) == generate(plain, GREEDY)
    assert calls["failed"] == 1
    assert llm.engine.spec_decode_stats.acceptance_rate >= SELF_DRAFT_ACCEPTANCE
    assert_all_blocks_free(llm)


def test_a_tensor_parallel_target_drafts_on_rank_0(tiny_checkpoint, plain):
    """The draft runs whole on rank 0's device (draft_tensor_parallel_size 1, as vLLM allows), in
    the blocks of the target's split pool; its drafts go to the other ranks as the verifying
    step's rows. A draft that is the target itself is accepted at every position, and the outputs
    are plain decoding's."""
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256, tensor_parallel_size=2,
              speculative_config=draft_config(tiny_checkpoint))
    try:
        assert llm.engine.draft.runner.tp.size == 1 and llm.engine.draft.runner.workers is None
        assert generate(llm, GREEDY) == generate(plain, GREEDY)
        stats = llm.engine.spec_decode_stats
        assert stats.num_draft_tokens > 50 and stats.acceptance_rate >= SELF_DRAFT_ACCEPTANCE, stats
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("max_num_seqs, num_prompts", [(2, 1), (256, 128)])
def test_a_catch_up_of_more_decode_rows_than_max_num_seqs_goes_in_as_chunks(tiny_checkpoint, max_num_seqs,
                                                                           num_prompts):
    """A catch-up's decode rows (k + 1 a sequence at most) must fit the runner's max_num_seqs rows,
    its samples' size: here one 2-token prompt with 2 rows, and 128 prompts at 3 rows each (more
    than 256): each sequence's tokens then go in as one row. (Found by a review: these crashed.)"""
    prompts = [[5 + i % 50, 7] for i in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=1024, max_num_seqs=max_num_seqs,
              speculative_config=draft_config(tiny_checkpoint, k=3))
    plain_llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=1024, max_num_seqs=max_num_seqs)
    assert generate(llm, params, prompts) == generate(plain_llm, params, prompts)
    assert llm.engine.spec_decode_stats.num_draft_tokens > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("level", [1, 2])
def test_the_draft_sleeps_and_wakes_with_the_target(tiny_checkpoint, plain, level):
    """sleep() gives back the draft's memory too, its weights offloaded at either level (the
    trainer's load_weights gives the target's alone); waking brings both back, and the draft is
    again right at every position. At level 2 the target's weights come again from load_weights."""
    from safetensors.torch import load_file
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256, enable_sleep_mode=True,
              speculative_config=draft_config(tiny_checkpoint))
    want = generate(plain, GREEDY)
    assert generate(llm, GREEDY) == want
    draft = llm.engine.draft.runner
    llm.sleep(level=level)
    assert llm.is_sleeping() and draft.sleep_state.sleeping_tags == {"weights", "kv_cache"}
    assert draft.kv_cache.untyped_storage().nbytes() == 0
    assert all(p.untyped_storage().nbytes() == 0 for p in draft.model.parameters())
    llm.wake_up(tags=["weights"])
    assert draft.sleep_state.sleeping_tags == {"kv_cache"}
    if level == 2:
        llm.load_weights(load_file(os.path.join(tiny_checkpoint, "model.safetensors")).items())
    llm.wake_up()
    assert not llm.is_sleeping() and not draft.sleep_state.sleeping_tags
    assert generate(llm, GREEDY) == want
    stats = llm.engine.spec_decode_stats
    assert stats.num_draft_tokens > 50 and stats.acceptance_rate >= SELF_DRAFT_ACCEPTANCE, stats
    assert_all_blocks_free(llm)


def test_a_draft_quantized_to_fp8_as_it_loads(tiny_checkpoint, tmp_path):
    """speculative_config's quantization (vLLM's) is the draft's own: "fp8" puts a bf16 (here fp32)
    draft's projections in fp8 blocks as it loads, and leaves the target as it is; a draft of the
    target's own weights in fp8 still agrees with it often (measured 56% of drafts; a draft of other
    random weights of this shape: 0%, the unquantized one: 100%), and outputs are the target's."""
    from tests.model.test_qwen3_fp8 import FP8_TINY
    path = write_random_checkpoint(str(tmp_path / "wide"), FP8_TINY, dtype=torch.float32, std=0.3)
    plain_llm = LLM(path, device="cpu", num_kv_blocks=256)
    llm = LLM(path, device="cpu", num_kv_blocks=256, speculative_config=draft_config(path, quantization="fp8"))
    draft_proj = llm.engine.draft.runner.model.layers[0].self_attn.qkv_proj
    target_proj = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert draft_proj.weight.dtype == torch.float8_e4m3fn and target_proj.weight.dtype == torch.float32
    assert generate(llm, GREEDY) == generate(plain_llm, GREEDY)
    assert 0.3 <= llm.engine.spec_decode_stats.acceptance_rate < 1, llm.engine.spec_decode_stats
    assert_all_blocks_free(llm)
    # A draft too narrow for 128 x 128 blocks is refused as it starts, as such a target is.
    with pytest.raises(ValueError, match="must be whole 128-row blocks"):
        LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64, speculative_config=draft_config(tiny_checkpoint,
                                                                                        quantization="fp8"))


def test_a_wake_up_that_failed_in_the_draft_can_be_called_again(tiny_checkpoint, plain):
    """The draft wakes after the target, so it is the one to meet a full device: a wake-up that
    failed there leaves the engine asleep (is_sleeping), and calling it again wakes the rest.
    (Found by a review: the engine said it was awake, and no step could run.)"""
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=256, enable_sleep_mode=True,
              speculative_config=draft_config(tiny_checkpoint))
    want = generate(plain, GREEDY)
    llm.sleep(level=1)
    draft = llm.engine.draft.runner
    wake_up = draft.wake_up

    def out_of_memory_once(tags):
        draft.wake_up = wake_up
        raise RuntimeError("CUDA out of memory (simulated)")

    draft.wake_up = out_of_memory_once
    with pytest.raises(RuntimeError, match="out of memory"):
        llm.wake_up()
    assert llm.is_sleeping() and not llm.engine.runner.sleep_state.sleeping_tags
    llm.wake_up()
    assert not llm.is_sleeping() and not draft.sleep_state.sleeping_tags
    assert generate(llm, GREEDY) == want
