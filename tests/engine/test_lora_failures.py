"""A LoRA adapter that can no longer be read when a step needs it again: its folder deleted or
damaged after its requests were added, and evicted from host memory (max_cpu_loras) in between,
so that the engine must read it again. Its requests end "abort", with a warning that names it,
and nothing else changes: the other requests' greedy tokens are those of a run they had to
themselves, every KV block comes back, no prefix-cache block is left hashed without its K and V,
and the engine goes on serving, on tensor-parallel ranks too."""
import logging
import os
import pickle
import shutil

import pytest
import torch

from mini_engine import LLM, LoRARequest, SamplingParams
from mini_engine.config import EngineConfig
from mini_engine.lora import AdapterCache, LoRAAdapter, write_random_adapter
from mini_engine.runner.batch import BatchRow
from mini_engine.runner.tensor_parallel_workers import StepEncoder, WorkerAdapters, take_adapters

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# One adapter in a slot and one in host memory: every other adapter is read again when it runs.
OPTIONS = dict(device="cpu", enable_lora=True, max_loras=1, max_cpu_loras=1, num_kv_blocks=64, block_size=4)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17], [5, 6, 7, 8, 9, 20, 21, 22, 23], [30, 31, 32, 33, 34],
           [12, 13, 14, 15, 40], [50, 51, 52, 53, 54, 55, 56, 57, 58], [5, 6, 7, 8, 60]]


@pytest.fixture(scope="module")
def base(checkpoint_factory) -> str:
    return checkpoint_factory("tied-gqa2")


def write_adapters(base: str, root) -> dict[str, LoRARequest]:
    """Adapters a, b and c (ids 1-3); random pairs large enough to move greedy tokens."""
    mc = EngineConfig(base, device="cpu").model_config
    return {name: LoRARequest(name, i + 1, write_random_adapter(str(root / name), mc, rank=4, seed=i,
                                                                 dtype=torch.float32, std=0.3))
            for i, name in enumerate("abc")}


def requests_of(loras: dict[str, LoRARequest]) -> list[tuple[str, list[int], LoRARequest | None]]:
    """(request id, prompt, adapter): added in this order, so that with max_cpu_loras 1 only c
    is in host memory at the end; a, then b and c, must be read again when they run."""
    names = ["a", None, "a", "c", None, "b", "c"]
    return [(str(i), prompt, None if name is None else loras[name])
            for i, (prompt, name) in enumerate(zip(PROMPTS, names))]


def run(engine, requests, after_step=None) -> dict[str, tuple[str, list[int]]]:
    """Adds the requests, then steps until all are done (after_step(n) after step n): each
    request's finish reason and output tokens."""
    for request_id, prompt, lora in requests:
        engine.add_request(prompt, GREEDY, request_id=request_id, lora_request=lora)
    results, n = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.seq.request_id] = (out.seq.finish_reason, out.seq.output_token_ids)
        n += 1
        if after_step is not None:
            after_step(n)
    return results


def reference(base: str, requests) -> dict[str, tuple[str, list[int]]]:
    return run(LLM(base, **OPTIONS).engine, requests)


def assert_all_blocks_free(engine) -> None:
    assert engine.num_free_blocks == engine.block_manager.num_blocks, "KV blocks leaked"


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_a_deleted_adapter_ends_only_its_requests(base, tmp_path, caplog, tensor_parallel_size):
    loras = write_adapters(base, tmp_path)
    requests = requests_of(loras)
    good = [r for r in requests if r[2] is not loras["a"]]
    want = reference(base, good)
    llm = LLM(base, tensor_parallel_size=tensor_parallel_size, **OPTIONS)
    try:
        engine = llm.engine
        for request_id, prompt, lora in requests:
            engine.add_request(prompt, GREEDY, request_id=request_id, lora_request=lora)
        assert engine.runner.lora.cache.resident(1) is None        # a is to be read again when it runs
        shutil.rmtree(loras["a"].lora_path)
        with caplog.at_level(logging.WARNING, logger="mini_engine.engine"):
            got = run(engine, [])
        assert {i for i, _, lora in requests if lora is loras["a"]} == {i for i, (reason, _) in got.items()
                                                                     if reason == "abort"} == {"0", "2"}
        assert {i: got[i] for i, _, _ in good} == want
        assert "LoRA adapter 'a' (id 1" in caplog.text and "is not a folder" in caplog.text
        assert_all_blocks_free(engine)
        # The engine serves on: a good adapter's request, and a's own again once its folder is back,
        # whose prompts the failed step had hashed: they must be computed, not found in the cache.
        again = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=loras["b"])
        assert again[0].outputs[0].token_ids == reference(base, [("0", PROMPTS[0], loras["b"])])["0"][1]
        with pytest.raises(ValueError, match="is not a folder"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=loras["a"])
        write_adapters(base, tmp_path)
        a_requests = [r for r in requests if r[2] is loras["a"]]
        outputs = llm.generate([p for _, p, _ in a_requests], GREEDY, use_tqdm=False, lora_request=loras["a"])
        a_want = reference(base, a_requests)
        assert [o.outputs[0].token_ids for o in outputs] == [a_want[i][1] for i, _, _ in a_requests]
        assert_all_blocks_free(engine)
    finally:
        llm.shutdown()


def test_an_adapter_damaged_while_its_requests_wait(base, tmp_path):
    """c's weights are overwritten with garbage after the first step, while c's requests wait
    behind a and b (max_loras 1): they end "abort"; a's and b's tokens are those of a run without c."""
    loras = write_adapters(base, tmp_path)
    requests = requests_of(loras)
    good = [r for r in requests if r[2] is not loras["c"]]
    want = reference(base, good)
    engine = LLM(base, **OPTIONS).engine

    def damage(step: int) -> None:
        if step == 1:
            with open(os.path.join(loras["c"].lora_path, "adapter_model.safetensors"), "wb") as f:
                f.write(b"\x10\x00garbage")
    got = run(engine, requests, damage)
    assert {i for i, (reason, _) in got.items() if reason == "abort"} == {"3", "6"}
    assert {i: got[i] for i, _, _ in good} == want
    assert_all_blocks_free(engine)
    assert engine.runner.lora.held == [2] or engine.runner.lora.held == [1]     # a or b: never c


def test_a_running_request_whose_adapter_cannot_be_read_again(base, tmp_path):
    """a's requests are running, a token of theirs in flight, when a leaves its slot and host
    memory (as a preemption's slot and max_cpu_loras may take it) and its folder goes: they end
    "abort" with the tokens they had (none still in flight), and the base model's request beside
    them runs on unchanged."""
    loras = write_adapters(base, tmp_path)
    requests = [("0", PROMPTS[0], loras["a"]), ("1", PROMPTS[1], None), ("2", PROMPTS[5], loras["a"])]
    want = reference(base, requests)
    engine = LLM(base, **OPTIONS).engine
    lora = engine.runner.lora

    def lose_a(step: int) -> None:
        if step == 3:
            assert engine.in_flight is not None
            lora.held[lora.slot_of.pop(1)] = None
            lora.cache.drop(1)
            shutil.rmtree(loras["a"].lora_path)
    got = run(engine, requests, lose_a)
    assert got["1"] == want["1"]
    for i in ("0", "2"):
        reason, tokens = got[i]
        assert reason == "abort" and 0 < len(tokens) < GREEDY.max_tokens
        assert tokens == want[i][1][:len(tokens)]        # a's own tokens so far, no placeholder
    assert_all_blocks_free(engine)


def test_an_adapter_evicted_while_its_requests_wait_is_read_again(base, tmp_path):
    """Adapters checked between steps (the server's run-time loads) evict the waiting requests'
    adapter from host memory: it is read again when it runs (vLLM's LRU), to the same tokens."""
    loras = write_adapters(base, tmp_path)
    requests = requests_of(loras)
    options = OPTIONS | dict(max_loras=2, max_cpu_loras=2)
    want = run(LLM(base, **options).engine, requests)
    engine = LLM(base, **options).engine
    cache = engine.runner.lora.cache

    def check_others(step: int) -> None:
        if step == 1:
            engine.check_lora(LoRARequest("c2", 9, loras["c"].lora_path))
            engine.check_lora(LoRARequest("c3", 10, loras["c"].lora_path))
            assert cache.resident(2) is None              # b, whose requests wait
    assert run(engine, requests, check_others) == want
    assert cache.resident(2) is not None                  # read again
    assert_all_blocks_free(engine)


def test_a_slot_whose_load_fails_half_way_is_held_by_none(base, tmp_path, monkeypatch):
    """A load that fails after some projections took the adapter leaves the slot held by no
    adapter: no row maps to it, and the next load writes it whole."""
    from mini_engine.layers.lora import LoRASlots
    from mini_engine.runner.model_runner import ModelRunner
    loras = write_adapters(base, tmp_path)
    runner = ModelRunner(EngineConfig(base, **OPTIONS | dict(num_kv_blocks=16)))
    row = BatchRow([5, 6], 0, [0], True, GREEDY, lora_request=loras["a"])
    runner.lora.slots([row])
    assert runner.lora.held == [1]
    load, calls = LoRASlots.load, []

    def failing(self, slot, pairs):
        calls.append(slot)
        if len(calls) == 3:
            raise RuntimeError("device error")
        return load(self, slot, pairs)
    monkeypatch.setattr(LoRASlots, "load", failing)
    with pytest.raises(RuntimeError, match="device error"):
        runner.lora.slots([BatchRow([5, 6], 0, [0], True, GREEDY, lora_request=loras["b"])])
    assert runner.lora.held == [None] and runner.lora.slot_of == {}
    monkeypatch.setattr(LoRASlots, "load", load)
    assert runner.lora.slots([row]) == [0] and runner.lora.held == [1]


def fake_adapter(lora_id: int) -> LoRAAdapter:
    return LoRAAdapter(LoRARequest(f"x{lora_id}", lora_id, f"/nowhere/{lora_id}"), 1,
                       {"layers.0.self_attn.q_proj": (torch.full((1, 2), float(lora_id)), torch.ones(3, 1))})


def test_workers_take_rank_0s_copies_and_read_no_file(base):
    """WorkerAdapters: a worker is sent each adapter of a step it lacks, once, again after rank 0
    read it anew, and told to drop what rank 0's LRU would; its cache reads no file."""
    mc = EngineConfig(base, device="cpu").model_config
    rank0 = AdapterCache(mc, 8, capacity=2)
    worker = AdapterCache(mc, 8, capacity=None, reads_files=False)
    encoder = StepEncoder(max_params=8)
    encoder.adapters = WorkerAdapters(rank0, capacity=2)

    def step(*ids):
        rows = [BatchRow([5], 0, [0], True, GREEDY, lora_request=None if i is None else rank0.requests[i]) for i in ids]
        message = pickle.loads(pickle.dumps(encoder.encode(rows)))
        take_adapters(message, worker)
        return message[3]

    for i in (1, 2, 3):
        rank0.put(fake_adapter(i))                      # rank 0 holds 2 and 3
    sent = step(2, None, 3)
    assert sent[0] == [] and [a.request.lora_int_id for a in sent[1]] == [2, 3]
    assert step(3, 2) is None                          # the workers hold both: nothing crosses
    assert step(1) is None                             # in rank 0's slots alone, so in every rank's
    rank0.put(fake_adapter(1))                         # read again by rank 0
    dropped, taken = step(1)
    assert dropped == [3] and [a.request.lora_int_id for a in taken] == [1]    # 3: least recently run
    assert list(worker.adapters) == [2, 1]
    assert torch.equal(worker.get(rank0.requests[1]).pairs["layers.0.self_attn.q_proj"][0], torch.ones(1, 2))
    fresh = fake_adapter(3)
    rank0.put(fresh)
    dropped, taken = step(3)
    assert dropped == [2] and [a.request for a in taken] == [fresh.request]
    with pytest.raises(LookupError, match="rank 0 sends"):
        worker.get(rank0.requests[2])
