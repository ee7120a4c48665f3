"""AsyncLLM (vLLM's asyncio entry, mini_engine/async_llm.py): concurrent generate() calls share the
engine process's batches and give the offline engine's outputs; CUMULATIVE, DELTA and FINAL_ONLY
outputs; n completions; stop strings and logprobs; a caller that stops iterating, or abort(),
ends its request and frees its blocks; bad requests refused before anything runs."""
import asyncio
import logging
import os
import re
import time

import pytest

from mini_engine import LLM, SamplingParams
from mini_engine.async_llm import AsyncLLM
from mini_engine.sampling_params import RequestOutputKind

pytest.importorskip("prometheus_client")
NUM_KV_BLOCKS = 64


@pytest.fixture(scope="module")
def served(tokenized_model):
    """One AsyncLLM and the event loop it serves, for the module."""
    loop = asyncio.new_event_loop()
    llm = AsyncLLM(tokenized_model, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=256)
    yield llm, loop
    llm.shutdown()
    loop.close()


@pytest.fixture(scope="module")
def offline(tokenized_model):
    return LLM(tokenized_model, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=256)


def run(served, coro):
    return served[1].run_until_complete(coro)


async def collect(llm, prompt, params, request_id=None, **kwargs) -> list:
    """Every output, its lists copied as it came (a CUMULATIVE output's grow with the request)."""
    outputs = []
    async for output in llm.generate(prompt, params, request_id, **kwargs):
        for c in output.outputs:
            c.token_ids, c.logprobs = list(c.token_ids), None if c.logprobs is None else list(c.logprobs)
        outputs.append(output)
    return outputs


def metric(llm, pattern: str) -> float:
    found = re.search(rf"^mini_engine:{pattern}\{{[^}}]*\}} (\S+)$", llm.metrics_text(), re.M)
    return float(found.group(1)) if found else 0.0


def blocks_used(llm) -> float:
    return metric(llm, "kv_cache_blocks_used")


def aborted(llm) -> float:
    """Requests the engine ended as aborted."""
    found = re.search(r'^mini_engine:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$',
                      llm.metrics_text(), re.M)
    return float(found.group(1)) if found else 0.0


async def wait_blocks_free(llm, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while blocks_used(llm) != 0:
        assert time.monotonic() < deadline, "KV blocks still in use"
        await asyncio.sleep(0.05)


PROMPTS = ["The quick brown fox", "Hello there", [5, 6, 7, 8, 9], {"prompt_token_ids": [11, 12, 13]}]


def test_concurrent_requests_give_the_offline_outputs(served, offline):
    llm = served[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def all_of_them():
        return await asyncio.gather(*(collect(llm, p, params, f"c{i}") for i, p in enumerate(PROMPTS)))

    streamed = run(served, all_of_them())
    want = offline.generate(PROMPTS, params, use_tqdm=False)
    for outputs, w in zip(streamed, want):
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        tokens = [o.outputs[0].token_ids for o in outputs]
        assert all(a == b[:len(a)] and len(a) < len(b) for a, b in zip(tokens, tokens[1:]))    # cumulative
        last = outputs[-1].outputs[0]
        assert last.token_ids == w.outputs[0].token_ids and last.text == w.outputs[0].text
        assert last.finish_reason == "length" and outputs[-1].prompt_token_ids == w.prompt_token_ids
    assert streamed[0][-1].prompt == "The quick brown fox" and streamed[2][-1].prompt is None


def test_delta_and_final_only_outputs(served):
    llm = served[0]

    def params(kind):
        return SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True, logprobs=2, output_kind=kind)

    async def three():
        return await asyncio.gather(collect(llm, "Hello", params(RequestOutputKind.CUMULATIVE)),
                                    collect(llm, "Hello", params(RequestOutputKind.DELTA)),
                                    collect(llm, "Hello", params(RequestOutputKind.FINAL_ONLY)))

    cumulative, delta, final = run(served, three())
    whole = cumulative[-1].outputs[0]
    assert "".join(o.outputs[0].text for o in delta) == whole.text
    assert sum((o.outputs[0].token_ids for o in delta), []) == whole.token_ids
    pieces = sum((o.outputs[0].logprobs for o in delta), [])      # (the same draws; values within fp32 noise)
    assert len(pieces) == len(whole.logprobs) == 16
    assert [lp.logprob for lp in pieces] == pytest.approx([lp.logprob for lp in whole.logprobs], abs=1e-5)
    assert all(o.outputs[0].token_ids for o in delta) and delta[-1].finished
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == whole.token_ids
    assert whole.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in whole.logprobs))


def test_n_completions_are_the_offline_ones(served, offline):
    params = SamplingParams(temperature=0.9, seed=7, n=3, max_tokens=10, ignore_eos=True)
    outputs = run(served, collect(served[0], "Hello there", params, "n3"))
    want = offline.generate("Hello there", params, use_tqdm=False)[0]
    last = outputs[-1]
    assert [c.index for c in last.outputs] == [0, 1, 2] and last.finished and last.request_id == "n3"
    assert [c.token_ids for c in last.outputs] == [c.token_ids for c in want.outputs]
    assert len({tuple(c.token_ids) for c in last.outputs}) > 1


def test_stop_strings_end_the_text_as_offline(served, offline):
    plain = offline.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].text
    stop = plain[len(plain) // 2:len(plain) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    outputs = run(served, collect(served[0], "The quick brown fox", params))
    want = offline.generate("The quick brown fox", params, use_tqdm=False)[0].outputs[0]
    assert outputs[-1].outputs[0].text == want.text and outputs[-1].outputs[0].finish_reason == "stop"
    assert stop not in want.text


def test_a_caller_that_stops_listening_ends_its_request(served):
    llm = served[0]

    async def leave_early():
        before = aborted(llm)
        async for output in llm.generate([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True), "leaver"):
            if len(output.outputs[0].token_ids) >= 2:
                break
        await wait_blocks_free(llm)
        return aborted(llm) - before, llm.engine.streams, llm.children

    assert run(served, leave_early()) == (1, {}, {})        # ended by the engine as aborted, not run to 200


def test_abort_ends_the_request_with_abort(served, caplog):
    llm = served[0]

    async def abort_midway():
        outputs = []
        async for output in llm.generate([4, 5, 6], SamplingParams(max_tokens=200, ignore_eos=True), "aborted"):
            outputs.append(output)
            if len(outputs) == 2:
                await llm.abort("aborted")
        await wait_blocks_free(llm)
        return outputs

    outputs = run(served, abort_midway())
    with caplog.at_level(logging.INFO, logger="mini_engine.server"):
        run(served, served[0].do_log_stats())
    assert re.search(r"Engine 000: Avg prompt throughput: [0-9.]+ tokens/s, Avg generation throughput: [0-9.]+ tokens/s",
                     caplog.text)
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs[-1].outputs[0].token_ids) < 200


def test_bad_requests_are_refused_before_they_run(served):
    llm = served[0]

    async def bad_then_good():
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(llm, [1] * 300, SamplingParams(max_tokens=4), "long")
        running = llm.generate([3, 4], SamplingParams(max_tokens=50, ignore_eos=True), "dup")
        await running.__anext__()
        with pytest.raises(ValueError, match="already running"):
            await collect(llm, [1, 2], SamplingParams(max_tokens=4), "dup")
        rest = [output async for output in running]        # the first one was not disturbed (lists: its own)
        good = await collect(llm, [1, 2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        await wait_blocks_free(llm)
        return rest, good

    rest, good = run(served, bad_then_good())
    assert rest[-1].finished and len(rest[-1].outputs[0].token_ids) == 50
    assert good[-1].finished and len(good[-1].outputs[0].token_ids) == 4


def test_another_event_loop_is_refused(served):
    async def one():
        await collect(served[0], [1, 2], SamplingParams(max_tokens=2))

    run(served, one())                          # the module's loop uses it first, whatever ran before
    with pytest.raises(RuntimeError, match="event loop that first used it"):
        asyncio.run(one())


def test_n_completions_streamed_as_deltas(served):
    """Each completion's DELTA pieces add up to FINAL_ONLY's (the same seeds); the prompt's
    log-probabilities come once."""
    def params(kind):
        return SamplingParams(temperature=0.9, seed=11, n=2, max_tokens=8, ignore_eos=True, logprobs=1,
                              prompt_logprobs=1, output_kind=kind)

    delta = run(served, collect(served[0], "Hello there", params(RequestOutputKind.DELTA)))
    final = run(served, collect(served[0], "Hello there", params(RequestOutputKind.FINAL_ONLY)))[-1]
    for k in range(2):
        pieces = [c for o in delta for c in o.outputs if c.index == k]
        assert sum((c.token_ids for c in pieces), []) == final.outputs[k].token_ids
        assert "".join(c.text for c in pieces) == final.outputs[k].text
    with_prompt = [o.prompt_logprobs for o in delta if o.prompt_logprobs is not None]
    assert len(with_prompt) == 1 and len(with_prompt[0]) == len(final.prompt_token_ids)
    assert [lp and lp.logprob for lp in with_prompt[0]] == pytest.approx(
        [lp and lp.logprob for lp in final.prompt_logprobs], abs=1e-5)


def test_health_a_failed_step_cancellation_and_shutdown(tokenized_model):
    """A fresh AsyncLLM reports healthy before any request; a step the engine fails (here a
    logits processor's apply) raises RuntimeError in the generate() of each request in it, and
    the engine runs the next ones; a cancelled caller's request ends; shutdown twice is fine."""
    llm = AsyncLLM(tokenized_model, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=256,
                   logits_processors=["tests.logits_processor_examples:FailsInApply"])
    assert llm.is_running

    async def body():
        await llm.check_health()
        assert await llm.reset_prefix_cache()
        with pytest.raises(RuntimeError, match="apply failed|failed"):
            await collect(llm, [4, 5], SamplingParams(max_tokens=5, extra_args={"fail_apply": True}))
        forced = await collect(llm, [1, 2], SamplingParams(max_tokens=4, ignore_eos=True, extra_args={"target_token": 9}))
        before = aborted(llm)
        started = asyncio.Event()

        async def listener():
            async for _ in llm.generate([6, 7], SamplingParams(max_tokens=200, ignore_eos=True), "gone"):
                started.set()           # running, its blocks held: then cancelled

        task = asyncio.ensure_future(listener())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_blocks_free(llm)
        return forced, aborted(llm) - before, llm.children

    try:
        forced, cancelled, children = asyncio.run(body())
    finally:
        llm.shutdown()
    llm.shutdown()
    assert forced[-1].outputs[0].token_ids == [9] * 4
    assert cancelled == 1 and children == {} and not llm.is_running


def test_a_lora_request_runs_its_adapter(tiny_checkpoint, tmp_path):
    from mini_engine import LoRARequest
    from tests.lora_reference import write_adapter
    lora = LoRARequest("adapter", 1, write_adapter(tiny_checkpoint, str(tmp_path / "adapter"), 5))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    offline = LLM(tiny_checkpoint, enable_lora=True, num_kv_blocks=NUM_KV_BLOCKS)
    want = [offline.generate([[3, 4, 5]], params, use_tqdm=False, lora_request=r)[0].outputs[0].token_ids
            for r in (lora, None)]
    assert want[0] != want[1]
    llm = AsyncLLM(tiny_checkpoint, enable_lora=True, num_kv_blocks=NUM_KV_BLOCKS)

    async def both():
        return await asyncio.gather(collect(llm, [3, 4, 5], params, lora_request=lora), collect(llm, [3, 4, 5], params))

    try:
        got = asyncio.run(both())
    finally:
        llm.shutdown()
    assert [g[-1].outputs[0].token_ids for g in got] == want


def test_weight_updates_between_rollouts(checkpoint_factory, tmp_path):
    """load_weights sends an RL trainer's new weights to the engine's process: the outputs after it
    are a fresh engine's on those weights; a bad name is refused with nothing written."""
    import torch
    from safetensors.torch import load_file

    from mini_engine.model.random_checkpoint import write_random_checkpoint
    from tests.conftest import tiny_config
    base = checkpoint_factory("tied-gqa2")
    other = write_random_checkpoint(str(tmp_path / "other"), tiny_config("tied-gqa2"), dtype=torch.float32, seed=5,
                                    std=0.3)
    # On a GPU the tensors cross by CUDA IPC, as a colocated trainer's would.
    new_weights = {name: t.to("cuda" if torch.cuda.is_available() else "cpu")
                   for name, t in load_file(f"{other}/model.safetensors").items()}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [LLM(path, num_kv_blocks=NUM_KV_BLOCKS).generate([[3, 4, 5]], params, use_tqdm=False)[0].outputs[0].token_ids
            for path in (base, other)]
    assert want[0] != want[1]
    llm = AsyncLLM(base, num_kv_blocks=NUM_KV_BLOCKS)

    async def rollouts():
        before = (await collect(llm, [3, 4, 5], params))[-1].outputs[0].token_ids
        with pytest.raises(ValueError, match="no_such"):
            await llm.load_weights({"model.no_such.weight": torch.zeros(2)})
        unchanged = (await collect(llm, [3, 4, 5], params))[-1].outputs[0].token_ids
        running = llm.generate([1, 2], SamplingParams(max_tokens=100, ignore_eos=True), "running")
        await running.__anext__()
        with pytest.raises(RuntimeError, match="unfinished"):
            await llm.load_weights(new_weights)
        await running.aclose()
        await wait_blocks_free(llm)
        # As a trainer's: tensors that require grad, made from others (not leaves).
        trained = {name: t.clone().requires_grad_() * 1.0 for name, t in new_weights.items()}
        written = await llm.load_weights(trained)
        after = (await collect(llm, [3, 4, 5], params))[-1].outputs[0].token_ids
        return before, unchanged, written, after

    try:
        before, unchanged, written, after = asyncio.run(rollouts())
    finally:
        llm.shutdown()
    assert before == unchanged == want[0] and after == want[1] and written == len(new_weights)


def test_encode_gives_llm_encodes_outputs(tokenized_model, tmp_path):
    """A pooling model's AsyncLLM.encode: one PoolingRequestOutput a prompt, LLM.encode's data
    (text with the tokenizer's special tokens, PoolingParams passed through); generate refused."""
    import torch
    from mini_engine import PoolingParams
    from tests.engine.test_embeddings import write_embedding_checkpoint
    model = write_embedding_checkpoint(tokenized_model, str(tmp_path / "embedding"))
    prompts = ["the cat sat on the mat", [5, 6, 7, 8], {"prompt_token_ids": [9, 10, 11]}]
    want = LLM(model, device="cpu", runner="pooling").encode(prompts, PoolingParams(normalize=False), use_tqdm=False)
    llm = AsyncLLM(model, device="cpu", runner="pooling")

    async def encode_all():
        async def one(i):
            return [o async for o in llm.encode(prompts[i], PoolingParams(normalize=False), f"e{i}")]
        got = await asyncio.gather(*(one(i) for i in range(3)))
        with pytest.raises(ValueError, match="encode"):
            await collect(llm, [1, 2], SamplingParams(max_tokens=2))
        await asyncio.sleep(0.2)       # the last report's stats
        # The stats line's prompt count: each pooled prompt, as its output came.
        prompt_tokens = llm.server_metrics.registry.get_sample_value(
            "mini_engine:iteration_tokens_total_sum", {"model_name": model, "engine": "0"})
        return got, prompt_tokens

    try:
        got, prompt_tokens = asyncio.run(encode_all())
    finally:
        llm.shutdown()
    assert prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    for outputs, w in zip(got, want):
        assert len(outputs) == 1 and outputs[0].finished and outputs[0].prompt_token_ids == w.prompt_token_ids
        torch.testing.assert_close(torch.tensor(outputs[0].outputs.data), torch.tensor(w.outputs.data),
                                   rtol=1e-4, atol=1e-5)


def test_a_profile_of_the_engines_process(served, tmp_path):
    llm = served[0]

    async def profiled():
        await llm.start_profile(str(tmp_path))
        await collect(llm, [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        return await llm.stop_profile()

    trace = run(served, profiled())
    assert trace.startswith(str(tmp_path)) and os.path.getsize(trace) > 0
