"""Top-k sampling through the engine with the Triton sampler (on the GPU where there is one, else
through Triton's interpreter on CPU; in fp32 either way, so that a prefill's logits and a decode
step's agree on every top-k set). The rows with 1 <= top_k <= 64 are drawn by
kernels/top_k_sampling.py, in the eager sampler as in the CUDA graphs: here, what their tokens
are, and that a seeded row's do not depend on the rows beside it, whichever way those send the
step's other rows."""
import pytest
import torch

pytest.importorskip("triton")
from mini_engine import LLM, SamplingParams  # noqa: E402
from mini_engine.kernels import top_k_sampling  # noqa: E402
from mini_engine.kernels.sampling import apply_top_k_top_p_ref  # noqa: E402
from mini_engine.runner.batch import BatchRow  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = [5, 17, 33, 2, 9]
SEEDED = SamplingParams(temperature=0.8, top_k=3, top_p=0.9, max_tokens=6, seed=42, ignore_eos=True)


@pytest.fixture
def llm(tiny_checkpoint, monkeypatch):
    # 256-column chunks: the interpreter is slow at the module's 4,096 (the vocabulary is 256).
    monkeypatch.setattr(top_k_sampling, "CHUNK", 256)
    monkeypatch.setattr(top_k_sampling, "GROUP", 16)
    return LLM(tiny_checkpoint, device=DEVICE, dtype="float32", num_kv_blocks=128, kernels="sampler")


@torch.inference_mode()
def allowed_sets(llm, prompt: list[int], tokens: list[int], params: SamplingParams) -> list[set[int]]:
    """For each output position, the tokens the definition allows (apply_top_k_top_p_ref on the
    engine's own logits at the row's temperature), from a prefill of everything before it."""
    runner, sets = llm.engine.runner, []
    greedy = SamplingParams(temperature=0)
    for j in range(len(tokens)):
        seq = prompt + tokens[:j]
        blocks = list(range(-(-len(seq) // runner.block_size)))
        t, meta = runner.prepare_inputs([BatchRow(seq, 0, blocks, True, greedy)])
        hidden = runner.model(t.input_ids, t.positions, meta)[t.logits_indices]
        logits = runner.model.compute_logits(hidden).float().cpu()
        restricted = apply_top_k_top_p_ref(logits / params.temperature, torch.tensor([params.top_k]),
                                           torch.tensor([params.top_p]))
        sets.append(set(torch.nonzero(restricted[0] > float("-inf")).flatten().tolist()))
    return sets


def test_a_top_k_row_draws_within_its_sets(llm):
    """Every token is inside its position's top-k and nucleus sets, and the draws are not all the
    argmax (top_k 3 at temperature 0.8 over this model's flat logits)."""
    tokens = llm.generate([PROMPT], SEEDED, use_tqdm=False)[0].outputs[0].token_ids
    sets = allowed_sets(llm, PROMPT, tokens, SEEDED)
    assert all(token in allowed for token, allowed in zip(tokens, sets))
    argmax = allowed_sets(llm, PROMPT, tokens, SamplingParams(temperature=1.0, top_k=1))
    assert any(token not in best for token, best in zip(tokens, argmax))
    assert max(len(s) for s in sets) > 1


def test_a_seeded_top_k_row_draws_the_same_beside_any_row(llm):
    """Alone (the top-k rows' own path), beside a penalised row (the step's logits an fp32 copy),
    and beside rows that other restrictions send through apply_top_k_top_p (greedy with a top_k,
    top_p alone, a top_k above 64)."""
    alone = llm.generate([PROMPT], SEEDED, use_tqdm=False)[0].outputs[0].token_ids
    penalised = SamplingParams(temperature=1.0, repetition_penalty=1.3, max_tokens=5, ignore_eos=True)
    restricted = [SamplingParams(temperature=0, top_k=20, max_tokens=5, ignore_eos=True),
                  SamplingParams(temperature=1.0, top_p=0.5, max_tokens=5, ignore_eos=True),
                  SamplingParams(temperature=1.0, top_k=100, max_tokens=5, ignore_eos=True)]
    for others in ([penalised], restricted):
        outputs = llm.generate([[40 + i, 41] for i in range(len(others))] + [PROMPT], others + [SEEDED], use_tqdm=False)
        assert outputs[-1].outputs[0].token_ids == alone


@pytest.mark.parametrize("top_k", [20, -1])
def test_a_penalty_past_fp32s_range_draws_its_token(llm, top_k):
    """A repetition penalty as small as allowed divides token 5's biased logit past fp32's range:
    the eager sampler holds it at fp32's largest, so every sampler draws it (with +inf, inf - inf
    gave NaN weights and the plain sampler a negative token id)."""
    params = SamplingParams(temperature=1.0, top_k=top_k, repetition_penalty=1e-37, logit_bias={5: 100.0},
                            max_tokens=3, seed=0, ignore_eos=True)
    assert llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == [5, 5, 5]
