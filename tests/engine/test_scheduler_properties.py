"""The scheduler and block manager over random request streams, with a stand-in for the model
that checks every row it is handed and answers with deterministic tokens."""
from hypothesis import assume, given, settings, strategies as st

from mini_engine.config import EngineConfig, ModelConfig
from mini_engine.engine.engine import LLMEngine
from mini_engine.engine.sequence import PENDING_TOKEN
from mini_engine.runner.batch import StepHandle
from mini_engine.sampling_params import SamplingParams

MODEL = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=1, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6,
                    rope_theta=1e4, max_position_embeddings=256, tie_word_embeddings=True,
                    attention_bias=False, eos_token_ids=(0,))


class FakeRunner:
    def __init__(self, num_kv_blocks, config, check):
        self.num_kv_blocks, self.config, self.check = num_kv_blocks, config, check
        self.steps, self.prev = [], []

    def launch(self, rows):
        self.check(rows)
        self.steps.append(rows)
        # A row's input token may still be "on the device" (pending): the runner takes it from
        # the previous launch's samples, here a plain list.
        for r in rows:
            if r.prev_token_index >= 0:
                assert r.token_ids == [PENDING_TOKEN]
                assert self.prev[r.prev_token_index] is not None
            else:
                assert PENDING_TOKEN not in r.token_ids
        self.prev = [(r.start_position + len(r.token_ids)) % 61 + 1 for r in rows if r.sample]
        return StepHandle.done(list(self.prev), None)


def make_engine(num_blocks, block_size, max_num_seqs, budget, prefix_caching=True, async_scheduling=True,
                policy="fcfs"):
    config = EngineConfig("unused", device="cpu", block_size=block_size, num_kv_blocks=num_blocks, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget, max_model_len=256, enable_prefix_caching=prefix_caching,
                          async_scheduling=async_scheduling, model_config=MODEL, scheduling_policy=policy)
    engine = LLMEngine.__new__(LLMEngine)

    def check(rows):
        assert sum(len(r.token_ids) for r in rows) <= budget
        assert len(rows) <= max_num_seqs
        assert len(engine.scheduler.running) <= max_num_seqs
        if policy == "priority":       # running and waiting in (priority, arrival) order
            for queue in (engine.scheduler.running, engine.scheduler.waiting):
                keys = [seq.scheduling_key() for seq in queue]
                assert keys == sorted(keys)
        lengths = [len(r.token_ids) for r in rows]
        assert lengths == sorted(lengths, key=lambda n: n != 1), "single-token rows must come first"
        contexts = [r.start_position for r in rows if len(r.token_ids) == 1]
        assert contexts == sorted(contexts, reverse=True), "single-token rows go longest context first"
        for r in rows:
            assert len(r.block_table) * block_size >= r.start_position + len(r.token_ids)
            assert len(set(r.block_table)) == len(r.block_table)
        # Blocks written this step belong to one sequence only (shared blocks are full, cached ones).
        written = [r.block_table[p // block_size] for r in rows
                   for p in range(r.start_position, r.start_position + len(r.token_ids))]
        owners = {}
        for r in rows:
            for p in range(r.start_position, r.start_position + len(r.token_ids)):
                owners.setdefault(r.block_table[p // block_size], set()).add(id(r))
        assert all(len(o) == 1 for o in owners.values()), written

    LLMEngine.__init__(engine, config, runner=FakeRunner(num_blocks, config, check))
    return engine


requests = st.lists(
    st.tuples(st.lists(st.integers(1, 9), min_size=1, max_size=60),   # few distinct tokens: prefixes repeat
              st.integers(1, 30)),
    min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(requests=requests, num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 2, 4, 16]),
       max_num_seqs=st.integers(1, 6), budget=st.integers(1, 64), prefix_caching=st.booleans(),
       arrival_gap=st.integers(0, 3), async_scheduling=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]),
       priorities=st.lists(st.integers(-2, 2), min_size=12, max_size=12))
def test_random_streams_finish_exactly_and_free_everything(requests, num_blocks, block_size, max_num_seqs,
                                                           budget, prefix_caching, arrival_gap, async_scheduling,
                                                           policy, priorities):
    engine = make_engine(num_blocks, block_size, max_num_seqs, budget, prefix_caching, async_scheduling, policy)
    pending = list(enumerate(requests))
    seqs = {}
    for step in range(10_000):
        # Requests arrive over time, a few steps apart, as a server would see them.
        while pending and (arrival_gap == 0 or step % arrival_gap == 0):
            i, (prompt, max_tokens) = pending.pop(0)
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            try:
                seqs[i] = engine.add_request(prompt, params, priority=priorities[i] if policy == "priority" else 0)
            except ValueError:
                assert engine.block_manager.blocks_for(len(prompt) + max_tokens - 1) > num_blocks
            if arrival_gap:
                break
        if not pending and not engine.has_unfinished_requests():
            break
        engine.step()
    else:
        raise AssertionError("the engine did not finish")
    for i, seq in seqs.items():
        assert seq.num_output_tokens == requests[i][1]
        assert seq.finish_reason == "length"
        assert PENDING_TOKEN not in seq.token_ids
    assert engine.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def add_greedy_requests(engine, requests) -> list:
    """Adds each (prompt, max_tokens, stop token ids) greedily: (sequence, prompt, max_tokens, stops)
    for each one the engine takes; one it refuses must be larger than the pool."""
    seqs = []
    for prompt, max_tokens, stops in requests:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stops)
        try:
            seqs.append((engine.add_request(prompt, params), prompt, max_tokens, stops))
        except ValueError:
            assert engine.block_manager.blocks_for(len(prompt) + max_tokens - 1) > engine.block_manager.num_blocks
    return seqs


@settings(max_examples=40, deadline=None)
@given(requests=st.lists(st.tuples(st.lists(st.integers(1, 9), min_size=1, max_size=40), st.integers(1, 25),
                                   st.lists(st.integers(1, 61), max_size=3)), min_size=1, max_size=8),
       num_blocks=st.integers(10, 40), block_size=st.sampled_from([1, 4, 16]), budget=st.integers(4, 64),
       async_scheduling=st.booleans())
def test_stop_tokens_end_requests_exactly(requests, num_blocks, block_size, budget, async_scheduling):
    """The stand-in samples token (p % 61) + 1 after position p - 1, so each request's output is
    known in advance: it must stop at its first stop token, inclusive, even when the engine had
    already scheduled the next step (async scheduling drops the token computed past the stop)."""
    engine = make_engine(num_blocks, block_size, 4, budget, True, async_scheduling)
    seqs = add_greedy_requests(engine, requests)
    assume(seqs)                  # an example whose every request the pool refuses checks nothing
    for _ in range(5_000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    for seq, prompt, max_tokens, stops in seqs:
        expected = []
        for j in range(max_tokens):
            expected.append((len(prompt) + j) % 61 + 1)
            if expected[-1] in stops:
                break
        assert seq.output_token_ids == expected
        assert seq.finish_reason == ("stop" if expected[-1] in stops else "length")
    assert engine.num_free_blocks == num_blocks
