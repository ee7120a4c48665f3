"""benchmarks/spec_decode_check.py's pure parts: the seeded judge's CDF gap and the deepened target."""
import json
import os

import pytest
import torch

from benchmarks.spec_decode_check import cdf_gap, deepened_checkpoint
from mini_engine import LLM, SamplingParams


def test_cdf_gap_is_the_mass_between_two_tokens_in_vocabulary_order():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    logits = probs.log()
    assert cdf_gap(logits, 1, 3) == pytest.approx(0.5)      # columns 1 and 2
    assert cdf_gap(logits, 3, 1) == pytest.approx(0.5)
    assert cdf_gap(logits, 2, 2) == 0.0


def test_a_deepened_checkpoint_computes_what_its_source_does(tiny_checkpoint, tmp_path):
    deep = deepened_checkpoint(tiny_checkpoint, str(tmp_path / "deep"), 3)
    with open(os.path.join(tiny_checkpoint, "config.json")) as f, open(os.path.join(deep, "config.json")) as g:
        assert json.load(g)["num_hidden_layers"] == 3 * json.load(f)["num_hidden_layers"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 50))]
    outputs = [[o.outputs[0].token_ids for o in LLM(path, device="cpu", num_kv_blocks=64).generate(
        prompts, greedy, use_tqdm=False)] for path in (tiny_checkpoint, deep)]
    assert outputs[0] == outputs[1]
