"""vLLM's "priority" scheduling policy: waiting requests are admitted by (priority, arrival), a
lower value first, and a pool that runs short preempts the least urgent running request, not the
newest; the outputs are what first-come-first-served gives them. Under FCFS a priority is refused."""
import pytest

from mini_engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def start_order(engine) -> list[str]:
    """Steps the engine to the end; the request ids in the order they first ran."""
    started = []
    while engine.has_unfinished_requests():
        engine.step()
        started += [s.request_id for s in engine.scheduler.running if s.request_id not in started]
    return started


def test_waiting_requests_run_by_priority_then_arrival(tiny_checkpoint):
    engine = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_num_seqs=1, scheduling_policy="priority").engine
    for request_id, priority in [("a", 3), ("b", 1), ("c", 2), ("d", 1), ("e", -5)]:
        engine.add_request([5, 6, 7], GREEDY, request_id, priority=priority)
    assert start_order(engine) == ["e", "b", "d", "c", "a"]
    fcfs = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_num_seqs=1).engine
    for request_id in "abcde":
        fcfs.add_request([5, 6, 7], GREEDY, request_id)
    assert start_order(fcfs) == list("abcde")


def test_an_urgent_arrival_waits_for_room_but_goes_first(tiny_checkpoint):
    """vLLM v1's rule: a waiting request does not preempt a running one; it is the next admitted."""
    engine = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_num_seqs=2, scheduling_policy="priority").engine
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), "short", priority=5)
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), "long", priority=5)
    engine.step()
    engine.add_request([8, 9], GREEDY, "late", priority=9)
    engine.add_request([8, 9], GREEDY, "urgent", priority=0)
    assert start_order(engine) == ["short", "long", "urgent", "late"]
    assert engine.num_preemptions == 0


def test_a_short_pool_preempts_the_least_urgent(tiny_checkpoint):
    """Three long requests in a pool that holds two, the least urgent one running first: under
    FCFS the newest is preempted; by priority, the least urgent, here the oldest. The outputs are
    those of a roomy pool."""
    prompts = [[(7 * i + j) % 250 + 3 for j in range(30)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(tiny_checkpoint, device="cpu", dtype="float32", num_kv_blocks=64)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    for policy, priority, victim in [("fcfs", [0, 0, 0], "2"), ("priority", [9, 0, 1], "0")]:
        engine = LLM(tiny_checkpoint, device="cpu", dtype="float32", num_kv_blocks=10,
                     scheduling_policy=policy).engine
        seqs = [engine.add_request(prompts[0], params, "0", priority=priority[0])]
        engine.step()
        seqs += [engine.add_request(p, params, str(i), priority=priority[i]) for i, p in enumerate(prompts) if i]
        first_preempted = None
        while engine.has_unfinished_requests():
            engine.step()
            preempted = [s.request_id for s in seqs if s.num_preemptions]
            first_preempted = first_preempted or (preempted[0] if preempted else None)
        assert first_preempted == victim, policy
        assert [s.output_token_ids for s in seqs] == expected
        assert engine.num_free_blocks == engine.block_manager.num_blocks


def test_generate_takes_a_priority_for_each_prompt(tiny_checkpoint):
    """The prompts reach the engine by priority (all arrive at once, and it takes them as the
    scheduler admits them: entry 37 of benchmarks/NOTES.md), the outputs come back in the prompts'
    order, each the one FCFS gives it."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    added, add_request = [], llm.engine.add_request
    llm.engine.add_request = lambda ids, *args, **kwargs: added.append(list(ids)) or add_request(ids, *args, **kwargs)
    got = llm.generate(prompts, GREEDY, use_tqdm=False, priority=[2, 0, 1])
    assert added == [prompts[1], prompts[2], prompts[0]]
    ids = [int(o.request_id) for o in got]
    assert ids == sorted(ids), "request ids are drawn in the prompts' order, as vLLM's"
    want = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.prompt_token_ids for o in got] == prompts
    with pytest.raises(ValueError, match="3 prompts but 2 priorities"):
        llm.generate(prompts, GREEDY, use_tqdm=False, priority=[0, 1])


def test_under_fcfs_a_priority_is_refused(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=16)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        llm.engine.add_request([5, 6, 7], GREEDY, priority=2)
    with pytest.raises(ValueError, match="must be an integer"):
        llm.engine.add_request([5, 6, 7], GREEDY, priority=1.5)
    assert not llm.engine.has_unfinished_requests() and llm.engine.num_free_blocks == 16
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, priority=[0])[0].finished
    with pytest.raises(ValueError, match="scheduling_policy must be"):
        LLM(tiny_checkpoint, device="cpu", num_kv_blocks=16, scheduling_policy="lifo")


def test_a_preempted_request_goes_back_before_later_arrivals_of_its_priority(tiny_checkpoint):
    """All of one priority: the pool runs short, the newest running request is preempted, and it
    is admitted again before the request that arrived after it and has waited since."""
    prompts = [[(7 * i + j) % 250 + 3 for j in range(30)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=10, max_num_seqs=2, scheduling_policy="priority").engine
    seqs = [engine.add_request(p, params, str(i), priority=4) for i, p in enumerate(prompts)]
    admitted, running = [], set()
    while engine.has_unfinished_requests():
        engine.step()
        now = {s.request_id for s in engine.scheduler.running}
        admitted += sorted(now - running)
        running = now
    assert seqs[1].num_preemptions and admitted[:2] == ["0", "1"]
    assert admitted.index("1", 2) < admitted.index("2"), admitted


def test_numpy_priorities_are_taken(tiny_checkpoint):
    import numpy as np
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=64, scheduling_policy="priority")
    outputs = llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False, priority=np.array([1, 0]))
    assert all(o.finished for o in outputs)
