"""LLM.beam_search (vLLM's) against a beam search written plainly here over transformers'
Qwen3ForCausalLM in fp32: each beam's whole sequence through the model every step, no cache, no
engine. The engine's runs its beams as one-token requests over the paged KV cache and the prefix
cache, so the two share nothing but the definition they follow:

  each step every live beam offers its 2 x beam_width likeliest next tokens (log-softmax of the
  raw logits); a child that ends on EOS (unless ignore_eos) is set aside as completed, and the
  best beam_width of the rest go on, ranked by cum_logprob / seq_len ** length_penalty, where
  seq_len counts the prompt's tokens and the generated ones, less the EOS that ended it. After
  max_tokens steps the completed and the live beams are ranked together, best beam_width returned.
"""
import collections

import pytest
import torch

from mini_engine import LLM, BeamSearchParams, SamplingParams
from tests.hf_reference import hf_greedy, hf_logits

PROMPTS = ["Hello", "The quick brown"]
MAX_TOKENS = 6
NUM_KV_BLOCKS = 64


def reference_beam_search(path: str, prompt_ids: list[int], beam_width: int, max_tokens: int, eos: int,
                          ignore_eos: bool = False, length_penalty: float = 1.0) -> list[dict]:
    def score(beam):
        seq_len = len(beam["tokens"]) - (beam["finish"] == "stop")
        return beam["cum"] / seq_len ** length_penalty

    live = [{"tokens": list(prompt_ids), "cum": 0.0, "logprobs": [], "finish": None}]
    completed = []
    for _ in range(max_tokens):
        children = []
        for beam in live:
            logprobs = torch.log_softmax(hf_logits(path, beam["tokens"])[-1], dim=-1)
            values, ids = logprobs.topk(2 * beam_width)
            for value, token in zip(values.tolist(), ids.tolist()):
                child = {"tokens": beam["tokens"] + [token], "cum": beam["cum"] + value,
                         "logprobs": beam["logprobs"] + [value], "finish": None}
                if token == eos and not ignore_eos:
                    completed.append(child | {"finish": "stop"})
                else:
                    children.append(child)
        live = sorted(children, key=score, reverse=True)[:beam_width]
    live = [beam | {"finish": "length"} for beam in live]
    return sorted(completed + live, key=score, reverse=True)[:beam_width]


@pytest.fixture(scope="module")
def eos(tokenized_model) -> int:
    """An EOS that the random model writes often enough for beams to end on it: the token most
    often among the likeliest few (but not the likeliest) along the prompts' greedy paths. The
    checkpoint's own, <|im_end|>, is never near the top."""
    from mini_engine.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(tokenized_model)
    counts = collections.Counter()
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt).ids
        path = ids + hf_greedy(tokenized_model, ids, MAX_TOKENS)
        logits = hf_logits(tokenized_model, path)[len(ids) - 1:-1]
        counts.update(token for row in logits.topk(6).indices.tolist() for token in row[1:])
    return counts.most_common(1)[0][0]


@pytest.fixture(scope="module")
def llm(tokenized_model, eos):
    return LLM(tokenized_model, device="cpu", num_kv_blocks=NUM_KV_BLOCKS, hf_overrides={"eos_token_id": eos})


def assert_idle(llm: LLM) -> None:
    """Every step's requests ended, and every KV block is free again (cached blocks count as free)."""
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_blocks == NUM_KV_BLOCKS, "KV blocks leaked"


def assert_matches_reference(llm, path, outputs, params, eos):
    for prompt, output in zip(PROMPTS, outputs):
        ids = llm.engine.tokenize(prompt)
        expected = reference_beam_search(path, ids, params.beam_width, params.max_tokens, eos, params.ignore_eos,
                                         params.length_penalty)
        assert [s.tokens for s in output.sequences] == [b["tokens"] for b in expected]
        for seq, beam in zip(output.sequences, expected):
            assert seq.cum_logprob == pytest.approx(beam["cum"], abs=1e-4)
            assert [lp.logprob for lp in seq.logprobs] == pytest.approx(beam["logprobs"], abs=1e-4)
            assert seq.finish_reason == beam["finish"]
            assert seq.stop_reason == (eos if beam["finish"] == "stop" else None)


CASES = [  # beam_width, ignore_eos, length_penalty
    (1, False, 1.0), (2, False, 1.0), (3, False, 1.0), (3, True, 1.0), (3, False, 0.0), (2, False, 0.5),
    (3, False, 2.0), (2, True, 2.0),
]


@pytest.mark.parametrize("beam_width, ignore_eos, length_penalty", CASES)
def test_beam_search_matches_a_plain_search_over_transformers(llm, tokenized_model, eos, beam_width, ignore_eos,
                                                              length_penalty):
    params = BeamSearchParams(beam_width=beam_width, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos,
                              length_penalty=length_penalty)
    outputs = llm.beam_search(PROMPTS, params)
    assert [len(o.sequences) for o in outputs] == [beam_width] * len(PROMPTS)
    assert_matches_reference(llm, tokenized_model, outputs, params, eos)
    assert_idle(llm)


def test_eos_ends_beams_and_the_length_penalty_reorders_them(llm, eos):
    """The cases above are not vacuous: EOS ends some of the returned beams, and the length penalty
    changes which are returned (a short completed beam against the longer live ones)."""
    def run(length_penalty):
        params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, length_penalty=length_penalty)
        return [s for o in llm.beam_search(PROMPTS, params) for s in o.sequences]
    unnormalised, favouring_long = run(0.0), run(2.0)
    assert "stop" in [s.finish_reason for s in unnormalised + favouring_long]
    assert [s.tokens for s in unnormalised] != [s.tokens for s in favouring_long]
    assert_idle(llm)


def test_beam_width_one_with_ignore_eos_is_greedy(llm, eos):
    """One beam that never ends early keeps the likeliest token every step: greedy decoding, even
    where that token is EOS (vLLM's score left any final EOS out of the length, which ranked such a
    child below its sibling)."""
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0),
                          use_tqdm=False)
    assert any(eos in g.outputs[0].token_ids for g in greedy), "EOS is never the likeliest: the case is untested"
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS, ignore_eos=True))
    for g, b in zip(greedy, beams):
        (seq,) = b.sequences
        assert seq.tokens == g.prompt_token_ids + g.outputs[0].token_ids
        assert seq.cum_logprob == pytest.approx(g.outputs[0].cumulative_logprob, abs=1e-4)
    assert_idle(llm)


def test_prompt_forms_and_text(llm, eos):
    """Text, token ids and vLLM's prompt dicts give the same beams; each text is the tokens' (prompt
    included, as vLLM's), less the EOS that ended it unless include_stop_str_in_output."""
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, length_penalty=0.0)
    ids = [llm.engine.tokenize(p) for p in PROMPTS]
    plain = llm.beam_search(PROMPTS, params)
    for other in (ids, [{"prompt": p} for p in PROMPTS], [{"prompt_token_ids": i} for i in ids]):
        assert [[s.tokens for s in o.sequences] for o in llm.beam_search(other, params)] == \
            [[s.tokens for s in o.sequences] for o in plain]
    alone = llm.beam_search(PROMPTS[1], params)
    assert [s.tokens for s in alone[0].sequences] == [s.tokens for s in plain[1].sequences]
    tokenizer = llm.engine.tokenizer
    kept = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, length_penalty=0.0,
                                                     include_stop_str_in_output=True))
    stopped = 0
    for out, out_kept in zip(plain, kept):
        for seq, seq_kept in zip(out.sequences, out_kept.sequences):
            assert seq.tokens == seq_kept.tokens
            ended = seq.finish_reason == "stop"
            stopped += ended
            assert seq.text == tokenizer.decode(seq.tokens[:-1] if ended else seq.tokens, skip_special_tokens=False)
            assert seq_kept.text == tokenizer.decode(seq.tokens, skip_special_tokens=False)
            assert seq.text.startswith(PROMPTS[plain.index(out)])
    assert stopped, "no beam ended on EOS: the EOS text is untested"
    assert_idle(llm)


def test_steps_reuse_the_prefix_cache(llm):
    """A beam's step reads its prefix from the blocks its previous step computed."""
    before = llm.engine.prefix_cache_hit_tokens
    llm.beam_search([[7] * 40], BeamSearchParams(beam_width=2, max_tokens=4))
    # Each step after the first finds at least the prompt's two full blocks for each beam.
    assert llm.engine.prefix_cache_hit_tokens - before >= 3 * 2 * 32
    assert_idle(llm)


def test_a_small_pool_few_sequences_a_step_or_one_prompt_at_a_time_give_the_same_beams(tokenized_model, llm, eos):
    """Beams that do not fit one engine step (max_num_seqs 2, a pool of 8 blocks) wait for the
    next, and prompts searched one at a time (vLLM's concurrency_limit) search alike."""
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS)
    prompts = PROMPTS + [[9] * 33]
    small = LLM(tokenized_model, device="cpu", num_kv_blocks=8, max_num_seqs=2, hf_overrides={"eos_token_id": eos})
    want = [[s.tokens for s in o.sequences] for o in llm.beam_search(prompts, params)]
    assert [[s.tokens for s in o.sequences] for o in small.beam_search(prompts, params)] == want
    assert small.engine.num_free_blocks == 8 and not small.engine.has_unfinished_requests()
    one_at_a_time = llm.beam_search(prompts, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in one_at_a_time] == want
    assert_idle(llm)


def test_sampled_candidates_keep_the_raw_logprobs(llm, tokenized_model):
    """With a temperature the engine's sampled token joins the candidates (vLLM's logprobs dict
    holds it); every logprob is still the raw logits' log-softmax, which temperature leaves alone."""
    params = BeamSearchParams(beam_width=2, max_tokens=4, temperature=1.5, ignore_eos=True)
    (output,) = llm.beam_search(PROMPTS[:1], params)
    assert len(output.sequences) == 2
    prompt_len = len(llm.engine.tokenize(PROMPTS[0]))
    for seq in output.sequences:
        logprobs = torch.log_softmax(hf_logits(tokenized_model, seq.tokens[:-1]), dim=-1)
        expected = [logprobs[i - 1, seq.tokens[i]].item() for i in range(prompt_len, len(seq.tokens))]
        assert [lp.logprob for lp in seq.logprobs] == pytest.approx(expected, abs=1e-4)
        assert seq.cum_logprob == pytest.approx(sum(expected), abs=1e-4)
    scores = [s.cum_logprob / len(s.tokens) for s in output.sequences]
    assert scores == sorted(scores, reverse=True)
    assert_idle(llm)


def test_a_sampled_token_outside_the_top_ones_is_one_more_candidate():
    """As in vLLM's logprobs dict, which holds the sampled token and the top ones."""
    from mini_engine.beam_search import step_candidates
    from mini_engine.layers.sampler import SampleLogprobs
    from mini_engine.outputs import CompletionOutput
    top = [(4, -0.5), (9, -1.0)]
    assert step_candidates(CompletionOutput(0, "", [9], "length", [SampleLogprobs(-1.0, top)])) == top
    assert step_candidates(CompletionOutput(0, "", [7], "length", [SampleLogprobs(-6.0, top)])) == top + [(7, -6.0)]


@pytest.mark.parametrize("kwargs, match", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=True, max_tokens=4), "beam_width"),
    (dict(beam_width=2.0, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=-0.5), "temperature"),
    (dict(beam_width=2, max_tokens=4, temperature=float("inf")), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, ignore_eos=1), "ignore_eos"),
])
def test_bad_params_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_bad_requests_are_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="max_logprobs=20"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="prompt 1: .*max_model_len"):
        llm.beam_search(["Hello", [5] * 510], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match="prompt 0: .*prompt token ids"):
        llm.beam_search([[10 ** 6]], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=4), concurrency_limit=0)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search(PROMPTS, SamplingParams(max_tokens=4))
    from mini_engine import LoRARequest
    with pytest.raises(ValueError, match="enable_lora"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=4), lora_request=LoRARequest("a", 1, "/x"))
    assert_idle(llm)
