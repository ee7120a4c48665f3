"""Custom logits processors (vLLM v1's interface, mini_engine/logits_processors.py): the batch
updates replay to each step's rows; a processor changes the rows of the requests that opt in and
no other, whatever the scheduler does (chunked prefill, preemption, async scheduling); it reads a
request's output tokens as they are; argmax-invariant ones see the logits divided by temperature;
per-request callables through the adapter; bad requests and bad configurations refused."""
import random

import pytest
import torch

from mini_engine import LLM, SamplingParams
from mini_engine.config import EngineConfig
from mini_engine.logits_processors import LogitsRequest, MoveDirectionality, OutputTokens, PersistentBatch
from tests.logits_processor_examples import CountUp, FailsInApply, NoRepeat, ScaledMinP, TargetToken

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXAMPLES = "tests.logits_processor_examples"


class FakeSeq:
    def __init__(self, n):
        self.token_ids, self.num_prompt_tokens = list(range(n)), n


def replay(entries: dict, update, added_first: bool) -> None:
    """A processor's {index: request} kept by the update, applied in either order vLLM's processors use."""
    if update is None:
        return
    steps = [("added", update.added), ("removed", update.removed)]
    for kind, items in (steps if added_first else steps[::-1]):
        for item in items:
            if kind == "added":
                entries[item[0]] = item
            else:
                entries.pop(item, None)
    for a, b, direction in update.moved:
        at_a, at_b = entries.pop(a, None), entries.pop(b, None)
        if at_a is not None:
            entries[b] = at_a
        if direction is MoveDirectionality.SWAP and at_b is not None:
            entries[a] = at_b


@pytest.mark.parametrize("seed", range(4))
def test_batch_updates_replay_to_each_steps_rows(seed):
    rng = random.Random(seed)
    pool = [LogitsRequest(str(i), SamplingParams(seed=i), [i], OutputTokens(FakeSeq(1))) for i in range(40)]
    batch = PersistentBatch()
    views = ({}, {})
    for _ in range(300):
        rows = rng.sample(pool, rng.randint(0, 24))
        update = batch.update(rows)
        if update is not None:
            assert update.batch_size == len(rows)
            assert not {a[0] for a in update.added} & set(update.removed)
            # A move goes into an empty index (after removals and additions), a swap between two held ones.
            held = {i for i in views[0] if i not in update.removed} | {a[0] for a in update.added}
            for a, b, direction in update.moved:
                assert a in held and (b in held) == (direction is MoveDirectionality.SWAP)
                if direction is MoveDirectionality.UNIDIRECTIONAL:
                    held = held - {a} | {b}
        for view, added_first in zip(views, (False, True)):
            replay(view, update, added_first)
            assert {i: entry[1] for i, entry in view.items()} == {i: r.params for i, r in enumerate(rows)}
            assert all(view[i][2] is r.prompt_token_ids for i, r in enumerate(rows))


def test_an_unchanged_batch_is_no_update():
    rows = [LogitsRequest(str(i), SamplingParams(), [i], OutputTokens(FakeSeq(1))) for i in range(3)]
    batch = PersistentBatch()
    assert batch.update(rows).added and batch.update(rows) is None
    swapped = batch.update(rows[::-1])
    assert swapped.moved == [(2, 0, MoveDirectionality.SWAP)] and not swapped.added and not swapped.removed


def test_output_tokens_view_follows_the_sequence():
    seq = FakeSeq(3)
    view = OutputTokens(seq)
    assert len(view) == 0 and list(view) == []
    seq.token_ids += [7, 8]
    assert len(view) == 2 and view[-1] == 8 and view[0] == 7 and view[:] == [7, 8] and list(view) == [7, 8]
    with pytest.raises(IndexError):
        view[2]


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(n)
    return [[rng.randrange(1, 200) for _ in range(rng.randint(5, 40))] for _ in range(n)]


@pytest.mark.parametrize("options", [
    dict(),                                                         # everything at once
    dict(max_num_batched_tokens=32),                                # chunked prefill
    dict(num_kv_blocks=10, max_num_batched_tokens=48),              # preemption
    dict(async_scheduling=False),
])
def test_only_the_opted_in_rows_change(tiny_checkpoint, options):
    options = dict(num_kv_blocks=64, block_size=16) | options     # 16-slot blocks on CUDA too: the pool the cases reckon
    llm = LLM(tiny_checkpoint, device=DEVICE, logits_processors=[TargetToken], **options)
    plain = LLM(tiny_checkpoint, device=DEVICE, **options)
    batch = prompts(10)
    params = [SamplingParams(temperature=0 if i % 3 else 0.8, seed=i, max_tokens=24, ignore_eos=True,
                             extra_args={"target_token": 5 + i} if i % 2 else None) for i in range(len(batch))]
    got = llm.generate(batch, params, use_tqdm=False)
    want = plain.generate(batch, [SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=24,
                                                 ignore_eos=True) for p in params], use_tqdm=False)
    for i, (g, w) in enumerate(zip(got, want)):
        if i % 2:
            assert g.outputs[0].token_ids == [5 + i] * 24
        else:
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
    if options["num_kv_blocks"] == 10:
        assert llm.engine.num_preemptions > 0
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_a_processor_reads_each_requests_output_as_it_is(tiny_checkpoint):
    """NoRepeat bans the newest output token, read on the host: its outputs equal a token-at-a-time
    reference that bans the same token by logit_bias (async scheduling on, as by default)."""
    llm = LLM(tiny_checkpoint, device=DEVICE, num_kv_blocks=64, logits_processors=[f"{EXAMPLES}:NoRepeat"])
    reference = LLM(tiny_checkpoint, device=DEVICE, num_kv_blocks=64)
    batch = prompts(4)
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                              extra_args={"no_repeat": True}), use_tqdm=False)
    for prompt, out in zip(batch, outs):
        tokens = []
        for _ in range(16):
            bias = {tokens[-1]: -100.0} if tokens else None
            tokens += reference.generate([prompt + tokens], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                                                           logit_bias=bias),
                                         use_tqdm=False)[0].outputs[0].token_ids
        assert out.outputs[0].token_ids == tokens
        assert all(a != b for a, b in zip(tokens, tokens[1:]))


def test_an_argmax_invariant_processor_sees_the_logits_divided_by_temperature(tiny_checkpoint):
    """ScaledMinP filters the logits it is given as min_p filters the temperature's distribution:
    the same draws, seed for seed, as the engine's own min_p, only if it was given logits / T."""
    llm = LLM(tiny_checkpoint, device=DEVICE, num_kv_blocks=64, logits_processors=[f"{EXAMPLES}.ScaledMinP"])
    batch = prompts(6)
    for temperature in (0.5, 2.5):
        custom = llm.generate(batch, [SamplingParams(temperature=temperature, seed=i, max_tokens=20, ignore_eos=True,
                                                     extra_args={"scaled_min_p": 0.2}) for i in range(6)],
                              use_tqdm=False)
        builtin = llm.generate(batch, [SamplingParams(temperature=temperature, seed=i, max_tokens=20, ignore_eos=True,
                                                      min_p=0.2) for i in range(6)], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in custom] == [o.outputs[0].token_ids for o in builtin]


def test_per_request_callables_through_the_adapter(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device=DEVICE, num_kv_blocks=64, logits_processors=[CountUp, TargetToken])
    batch = prompts(3)
    outs = llm.generate(batch, [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, extra_args=extra)
                                for extra in ({"count_up": 10}, {"count_up": 3, "with_prompt": True},
                                              {"target_token": 9})], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == list(range(10, 18))
    start = 3 + len(batch[1])
    assert outs[1].outputs[0].token_ids == list(range(start, start + 8))
    assert outs[2].outputs[0].token_ids == [9] * 8


def test_a_request_the_processor_refuses_is_refused_alone(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device=DEVICE, num_kv_blocks=64, logits_processors=[TargetToken])
    with pytest.raises(ValueError, match="target_token must be a token id"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, extra_args={"target_token": "seven"}), use_tqdm=False)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True, extra_args={"target_token": 7}),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == [7] * 4
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


class Crashes(TargetToken):
    @classmethod
    def validate_params(cls, params):
        return params.extra_args["needed"]


def test_a_validate_params_crash_is_the_requests_error(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device=DEVICE, num_kv_blocks=64, logits_processors=[Crashes])
    with pytest.raises(ValueError, match="logits processor Crashes: TypeError"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)


class Incomplete(TargetToken.__mro__[1]):      # LogitsProcessor with apply and the rest missing
    def __init__(self, config, device, is_pin_memory):
        pass


@pytest.mark.parametrize("processors, message", [
    (["tests.logits_processor_examples:Nowhere"], "cannot be loaded"),
    (["no_such_module.Processor"], "cannot be loaded"),
    (["Processor"], "package.module:Class"),
    ([SamplingParams], "not a subclass"),
    ([Incomplete], "does not define apply, is_argmax_invariant, update_state"),
    (TargetToken, "a list of classes"),
])
def test_a_bad_processor_is_refused_at_start(tiny_checkpoint, processors, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(tiny_checkpoint, logits_processors=processors)


@pytest.mark.parametrize("options, message", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative decoding"),
    (dict(tensor_parallel_size=2, device="cpu"), "tensor parallelism"),
])
def test_what_processors_cannot_run_with(tiny_checkpoint, options, message):
    with pytest.raises(ValueError, match=f"logits_processors: not with {message}"):
        EngineConfig(tiny_checkpoint, logits_processors=[TargetToken], **options)


class ExplodesOnJoin(TargetToken):
    """Raises in update_state when a request with extra_args {"explode": True} joins the batch."""

    def update_state(self, batch_update) -> None:
        if batch_update is not None and any((p.extra_args or {}).get("explode") for _, p, _, _ in batch_update.added):
            raise RuntimeError("boom")
        super().update_state(batch_update)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_request_update_state_fails_on_ends_alone(tiny_checkpoint, async_scheduling):
    """The processors are made afresh (TargetToken's rows kept right), the request they fail on
    ends "abort", and the others run on; the engine takes requests after it as before."""
    llm = LLM(tiny_checkpoint, device=DEVICE, num_kv_blocks=64, block_size=16, async_scheduling=async_scheduling,
              logits_processors=[TargetToken, ExplodesOnJoin])
    batch = prompts(6)
    extras = [{"target_token": 30}, None, {"explode": True}, {"target_token": 31}, None, {"target_token": 32}]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, extra_args=e) for e in extras]
    outs = llm.generate(batch, params, use_tqdm=False)
    plain = LLM(tiny_checkpoint, device=DEVICE, num_kv_blocks=64, block_size=16)
    want = plain.generate(batch, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for out, extra, w in zip(outs, extras, want):
        if extra and "explode" in extra:
            assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 10
        elif extra:
            assert out.outputs[0].token_ids == [extra["target_token"]] * 10      # both processors force it
        else:
            assert out.outputs[0].token_ids == w.outputs[0].token_ids
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
    again = llm.generate(batch[:2], params[:2], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [[30] * 10, want[1].outputs[0].token_ids]


def test_a_failing_apply_fails_the_step_and_the_engine_recovers(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device=DEVICE, num_kv_blocks=64, block_size=16, logits_processors=[FailsInApply])
    with pytest.raises(RuntimeError, match="apply failed"):
        llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=5, extra_args={"fail_apply": True}),
                                           SamplingParams(max_tokens=5)], use_tqdm=False)
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
    outs = llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=5, ignore_eos=True, extra_args={"target_token": 9}),
                                              SamplingParams(max_tokens=5, ignore_eos=True)], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [9] * 5 and len(outs[1].outputs[0].token_ids) == 5


def test_a_pooling_runner_refuses_processors(checkpoint_factory):
    with pytest.raises(ValueError, match="logits_processors: a pooling runner samples nothing"):
        EngineConfig(checkpoint_factory("tied-gqa2"), runner="pooling", logits_processors=[TargetToken])
