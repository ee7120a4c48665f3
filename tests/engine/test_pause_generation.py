"""vLLM's pause_generation / resume_generation (AsyncLLM, and the server's /pause, /resume,
/is_paused): an RL trainer pauses the engine, loads new weights and resumes. "keep" freezes the
running requests, which go on under the new weights (with clear_cache, recomputing their prompt
and output first); "abort" ends them; "wait" lets them finish first. Requests sent while paused
wait for resume."""
import asyncio

import pytest
import torch
from safetensors.torch import load_file

from mini_engine import LLM, SamplingParams
from mini_engine.async_llm import AsyncLLM
from mini_engine.model.random_checkpoint import write_random_checkpoint
from tests.conftest import tiny_config

pytest.importorskip("prometheus_client")
NUM_KV_BLOCKS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [3, 4, 5]


def greedy_tokens(path: str, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return LLM(path, num_kv_blocks=NUM_KV_BLOCKS).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


class Follow:
    """A generate() consumed in a task of its own: its latest output, as it comes."""

    def __init__(self, llm: AsyncLLM, prompt, params: SamplingParams, request_id: str):
        self.latest = None
        self.task = asyncio.ensure_future(self.read(llm.generate(prompt, params, request_id)))

    async def read(self, outputs):
        async for output in outputs:
            self.latest = output
        return self.latest

    @property
    def tokens(self) -> list[int]:
        return [] if self.latest is None else list(self.latest.outputs[0].token_ids)

    async def started(self, timeout: float = 30.0) -> None:
        for _ in range(int(timeout / 0.01)):
            if self.tokens:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("no token came")


@pytest.fixture(scope="module")
def other_weights(checkpoint_factory, tmp_path_factory):
    other = write_random_checkpoint(str(tmp_path_factory.mktemp("other")), tiny_config("tied-gqa2"),
                                    dtype=torch.float32, seed=5, std=0.3)
    return other, load_file(f"{other}/model.safetensors")


def test_keep_freezes_a_request_that_goes_on_under_new_weights(tiny_checkpoint, other_weights):
    """The trainer's cycle: pause (keep, clear_cache) mid-request, load new weights, resume. The
    request's tokens before the pause are the old model's; after it, the new model's greedy
    continuation of the prompt and those tokens (its K and V recomputed under the new weights).
    A request sent while paused waits, and then runs on the new weights."""
    other, new_weights = other_weights
    llm = AsyncLLM(tiny_checkpoint, num_kv_blocks=NUM_KV_BLOCKS)
    long = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)

    async def cycle():
        running = Follow(llm, PROMPT, long, "running")
        await running.started()
        await llm.pause_generation(mode="keep", clear_cache=True)
        assert await llm.is_paused()
        await asyncio.sleep(0.05)                       # the deltas sent before the answer, read
        frozen = running.tokens
        late = Follow(llm, [7, 8, 9], GREEDY, "late")
        await asyncio.sleep(0.3)
        assert running.tokens == frozen and late.tokens == [], "a step ran while paused"
        assert await llm.load_weights(new_weights) == len(new_weights)
        await llm.resume_generation()
        assert not await llm.is_paused()
        return frozen, await running.task, await late.task

    try:
        frozen, final, late = asyncio.run(cycle())
    finally:
        llm.shutdown()
    tokens = list(final.outputs[0].token_ids)
    assert 0 < len(frozen) < 150 and tokens[:len(frozen)] == frozen
    assert frozen == greedy_tokens(tiny_checkpoint, PROMPT, 150)[:len(frozen)]
    assert tokens[len(frozen):] == greedy_tokens(other, PROMPT + frozen, 150 - len(frozen))
    assert final.outputs[0].finish_reason == "length"
    assert list(late.outputs[0].token_ids) == greedy_tokens(other, [7, 8, 9], 8)


def test_abort_ends_the_running_and_wait_lets_them_finish(tiny_checkpoint):
    """abort: the unfinished request ends now, as aborted, with what it had; wait: the call returns
    once the request has run to its end. A request sent while paused waits for resume, and its
    output is the engine's as ever. A mode vLLM does not know is refused."""
    llm = AsyncLLM(tiny_checkpoint, num_kv_blocks=NUM_KV_BLOCKS)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    want = greedy_tokens(tiny_checkpoint, [7, 8, 9], 8)

    async def cycles():
        with pytest.raises(ValueError, match="pause mode must be one of"):
            await llm.pause_generation(mode="drain")
        running = Follow(llm, PROMPT, long, "a")
        await running.started()
        await llm.pause_generation(mode="abort")
        aborted = await running.task
        late = Follow(llm, [7, 8, 9], GREEDY, "late")
        await asyncio.sleep(0.2)
        assert late.tokens == []
        await llm.resume_generation()
        first_late = await late.task

        waited = Follow(llm, PROMPT, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), "b")
        await waited.started()
        await llm.pause_generation(mode="wait")
        await asyncio.sleep(0.05)                       # its last delta, sent before the answer, read
        done_at_pause = waited.task.done()
        finished = await waited.task
        await llm.resume_generation()
        return aborted, first_late, done_at_pause, finished

    try:
        aborted, first_late, done_at_pause, finished = asyncio.run(cycles())
    finally:
        llm.shutdown()
    assert aborted.outputs[0].finish_reason == "abort" and 0 < len(aborted.outputs[0].token_ids) < 200
    assert list(first_late.outputs[0].token_ids) == want
    assert done_at_pause and finished.outputs[0].finish_reason == "length"
    assert len(finished.outputs[0].token_ids) == 60


def test_paused_requests_let_weights_change_and_a_sleep_only_without_kv(tiny_checkpoint):
    """Under paused generation (the engine loop sets engine.paused once no step is in flight) new
    weights may come while requests wait; a sleep, which drops the pool's K and V, only once no
    request holds any (preempt_running, vLLM's reset_running_requests, gave them back)."""
    llm = LLM(tiny_checkpoint, num_kv_blocks=NUM_KV_BLOCKS, enable_sleep_mode=True)
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), "frozen")
    for _ in range(3):
        engine.step()
    engine.wait_in_flight()
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.load_weights(load_file(f"{tiny_checkpoint}/model.safetensors").items())
    engine.paused = True
    assert llm.load_weights(load_file(f"{tiny_checkpoint}/model.safetensors").items()) > 0
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.sleep()                             # the frozen request's K and V would go
    engine.preempt_running()
    assert engine.num_free_blocks == engine.block_manager.num_blocks and engine.num_preemptions == 1
    llm.sleep()
    llm.wake_up()
    engine.paused = False
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = [o for o in outputs if o.finished][0].seq
    assert final.output_token_ids == greedy_tokens(tiny_checkpoint, PROMPT, 40)


class Loop:
    """The engine process's EngineLoop in this process: commands applied one by one, and what it
    sends (deltas by request, and the calls' answers) read back."""

    def __init__(self, path: str, **options):
        import queue

        from mini_engine.server.engine_process import EngineLoop
        self.engine = LLM(path, num_kv_blocks=NUM_KV_BLOCKS, **options).engine
        self.sent = queue.Queue()
        self.loop = EngineLoop(self.engine, self.sent)
        self.tokens = iter(range(1000))

    def apply(self, *command) -> None:
        deltas = self.loop.apply(command)
        if deltas:
            self.loop.send(deltas)

    def add(self, request_id: str, max_tokens: int = 40) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.apply("add", request_id, PROMPT, params, 0, None, None, None)

    def call(self, name: str, *args) -> int:
        token = next(self.tokens)
        self.apply("call", token, name, args)
        return token

    def read(self) -> tuple[dict, dict]:
        """The finish reasons sent so far by request, and the answers by call token."""
        reasons, answers = {}, {}
        while not self.sent.empty():
            message = self.sent.get()
            if message[0] == "called":
                answers[message[1]] = message[2:]
            else:
                for delta in message[1]:
                    if delta[4] is not None:
                        reasons[delta[0]] = delta[4]
        return reasons, answers


def test_what_a_pause_holds_and_what_it_answers(tiny_checkpoint):
    loop = Loop(tiny_checkpoint)
    engine = loop.engine
    loop.add("frozen")
    engine.step()
    keep = loop.call("pause_generation", "keep", False)
    assert loop.read()[1] == {keep: (True, None)} and engine.paused
    loop.add("held")
    loop.add("gone")
    loop.apply("abort", "gone")                        # a client that left while paused
    again = loop.call("pause_generation", "abort", True)   # already paused: nothing is aborted
    assert loop.read() == ({"gone": "abort"}, {again: (True, None)})
    assert set(engine.requests) == {"frozen"}
    resume = loop.call("resume_generation")
    assert loop.read()[1] == {resume: (True, None)} and set(engine.requests) == {"frozen", "held"}

    # A pause of mode "wait" holds new requests at once, and answers once the running ones end;
    # a resume before then calls it off.
    wait = loop.call("pause_generation", "wait", True)
    loop.add("late")
    is_paused = loop.call("is_paused")
    assert loop.read()[1] == {is_paused: (True, None)} and not engine.paused
    resume = loop.call("resume_generation")
    _, answers = loop.read()
    assert answers[resume] == (True, None) and answers[wait][1][0] == "RuntimeError"
    assert not engine.paused and "late" in engine.requests


def test_clear_cache_resets_the_prefix_cache_and_a_failed_step_fails_its_requests(tiny_checkpoint, monkeypatch):
    loop = Loop(tiny_checkpoint, enable_sleep_mode=True)
    engine = loop.engine
    loop.add("done", max_tokens=20)
    while engine.has_unfinished_requests():
        loop.loop.send(*loop.loop.process(engine.step()))
    assert engine.block_manager.cached_blocks
    loop.call("pause_generation", "wait", False)
    assert engine.paused and engine.block_manager.cached_blocks
    engine.sleep()
    resume = loop.call("resume_generation")
    assert loop.read()[1][resume][1][0] == "RuntimeError" and engine.paused     # asleep: wake_up first
    engine.wake_up()
    loop.call("resume_generation")
    loop.call("pause_generation", "abort", True)
    assert engine.paused and not engine.block_manager.cached_blocks
    loop.call("resume_generation")

    loop.add("failing")
    engine.step()

    def fail():
        raise RuntimeError("the device is gone")
    monkeypatch.setattr(engine.in_flight.handle, "result", fail)    # the step in flight fails
    keep = loop.call("pause_generation", "keep", False)
    reasons, answers = loop.read()
    assert reasons["failing"] == "error" and answers[keep] == (True, None)
    assert not engine.has_unfinished_requests() and not loop.loop.states
