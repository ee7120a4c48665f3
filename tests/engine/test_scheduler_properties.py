"""The scheduler and block manager over random request streams, with a stand-in for the model
that checks every row it is handed and answers with deterministic tokens."""
from hypothesis import given, settings, strategies as st

from mini_engine.config import EngineConfig, ModelConfig
from mini_engine.engine.engine import LLMEngine
from mini_engine.sampling_params import SamplingParams

MODEL = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=1, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6,
                    rope_theta=1e4, max_position_embeddings=256, tie_word_embeddings=True,
                    attention_bias=False, eos_token_ids=(0,))


class FakeRunner:
    def __init__(self, num_kv_blocks, config, check):
        self.num_kv_blocks, self.config, self.check = num_kv_blocks, config, check
        self.steps = []

    def execute(self, rows):
        self.check(rows)
        self.steps.append(rows)
        return [(r.start_position + len(r.token_ids)) % 61 + 1 for r in rows if r.sample]


def make_engine(num_blocks, block_size, max_num_seqs, budget, prefix_caching=True):
    config = EngineConfig("unused", device="cpu", block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget, max_model_len=256, enable_prefix_caching=prefix_caching,
                          model_config=MODEL)
    engine = LLMEngine.__new__(LLMEngine)

    def check(rows):
        assert sum(len(r.token_ids) for r in rows) <= budget
        assert len(rows) <= max_num_seqs
        assert len(engine.scheduler.running) <= max_num_seqs
        lengths = [len(r.token_ids) for r in rows]
        assert lengths == sorted(lengths, key=lambda n: n != 1), "single-token rows must come first"
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
       arrival_gap=st.integers(0, 3))
def test_random_streams_finish_exactly_and_free_everything(requests, num_blocks, block_size, max_num_seqs,
                                                           budget, prefix_caching, arrival_gap):
    engine = make_engine(num_blocks, block_size, max_num_seqs, budget, prefix_caching)
    pending = list(enumerate(requests))
    seqs = {}
    for step in range(10_000):
        # Requests arrive over time, a few steps apart, as a server would see them.
        while pending and (arrival_gap == 0 or step % arrival_gap == 0):
            i, (prompt, max_tokens) = pending.pop(0)
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            try:
                seqs[i] = engine.add_request(prompt, params)
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
    assert engine.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)
