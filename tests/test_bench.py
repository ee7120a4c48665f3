"""bench.py: the workload is nano-vllm's to the token, the floor arithmetic is what NOTES.md says,
and the CPU smoke path runs end to end and logs a complete JSON line."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from bench import REPO, WORKLOADS, make_workload
from benchmarks.floor import (checkpoint_num_params, context_tokens_read, experts_touched, floor_report,
                              kv_bytes_per_token, workload_floor)
from mini_engine.model.random_checkpoint import QWEN3_0_6B, QWEN3_30B_A3B, qwen3_tensor_shapes


def test_workload_is_nano_vllms():
    prompts, max_tokens = make_workload(256)
    assert len(prompts) == len(max_tokens) == 256
    assert sum(map(len, prompts)) == 142_827
    assert sum(max_tokens) == 133_966
    assert max(max_tokens) == 1024 and min(max_tokens) >= 100
    assert all(100 <= len(p) <= 1024 and all(0 <= t <= 10000 for t in p) for p in prompts)
    assert max(len(p) + m for p, m in zip(prompts, max_tokens)) <= 2048      # fits max_model_len
    assert make_workload(None) == (prompts, max_tokens)


def test_num_seqs_takes_the_first_requests():
    prompts, max_tokens = make_workload(256)
    assert make_workload(10) == (prompts[:10], max_tokens[:10])
    assert make_workload(1) == (prompts[:1], max_tokens[:1])
    with pytest.raises(ValueError):
        make_workload(257)
    with pytest.raises(ValueError):
        make_workload(0)


def test_floor_arithmetic_by_hand():
    # A 2-token prompt making 3 tokens reads contexts 2, 3, 4; a 1-token prompt making 1 reads 1.
    assert context_tokens_read([2, 1], [3, 1]) == 2 + 3 + 4 + 1
    floor = workload_floor([2, 1], [3, 1], weight_bytes=100, kv_bytes_per_tok=7)
    assert floor["decode_steps"] == 3
    assert floor["kv_read_bytes"] == 7 * 10
    assert floor["weight_read_bytes"] == 100 * 3
    assert floor["floor_bytes"] == 370
    report = floor_report(floor, bandwidth_bytes_s=370.0, wall_s=2.0)
    assert report["floor_s"] == pytest.approx(1.0)
    assert report["floor_fraction"] == pytest.approx(0.5)
    assert report["achieved_GBps"] == pytest.approx(185 / 1e9)


def test_floor_of_the_real_workload():
    assert kv_bytes_per_token(QWEN3_0_6B, 2) == 28 * 2 * 8 * 128 * 2 == 114_688
    weight_bytes = 2 * sum(math.prod(s) for s in qwen3_tensor_shapes(QWEN3_0_6B).values())
    assert weight_bytes == pytest.approx(1.19e9, rel=0.01)
    prompts, max_tokens = make_workload(256)
    floor = workload_floor([len(p) for p in prompts], max_tokens, weight_bytes, 114_688)
    assert floor["kv_read_bytes"] == pytest.approx(13.87e12, rel=1e-3)
    assert floor["weight_read_bytes"] == pytest.approx(1.22e12, rel=1e-2)
    assert floor["floor_bytes"] / 4.2e12 == pytest.approx(3.6, abs=0.05)   # at ~4.2 TB/s


def test_moe_floor_reads_the_experts_a_step_touches():
    """A Qwen3-MoE step reads the experts its tokens pick: all of them at 256 requests, top_k's
    share at one, as the tail of the run has; uniform routing, counted by hand."""
    assert experts_touched(128, 8, 1) == pytest.approx(8)
    assert experts_touched(128, 8, 2) == pytest.approx(8 + 8 * 120 / 128)
    assert experts_touched(128, 8, 256) == pytest.approx(128, abs=1e-5)
    # requests of 3 and 1 tokens: step 0 runs both, steps 1 and 2 the first alone
    floor = workload_floor([2, 1], [3, 1], weight_bytes=1000, kv_bytes_per_tok=7, experts=(800, 4, 1))
    assert floor["weight_read_bytes"] == round((200 + 800 * (1 - 0.75 ** 2)) + 2 * (200 + 800 / 4))
    shapes = qwen3_tensor_shapes(QWEN3_30B_A3B)
    expert_params = sum(math.prod(s) for name, s in shapes.items() if ".experts." in name)
    assert sum(math.prod(s) for s in shapes.values()) == pytest.approx(30.5e9, rel=0.01)
    assert expert_params == 48 * 128 * 3 * 768 * 2048


def test_param_count_skips_a_stored_tied_lm_head(tmp_path):
    embed = torch.zeros(10, 4)
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": embed.clone(),
               "model.norm.weight": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    assert checkpoint_num_params(str(tmp_path)) == 44
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    assert checkpoint_num_params(str(tmp_path)) == 84
    assert checkpoint_num_params(str(tmp_path), experts_only=True) == 0


def run_bench(*args, timeout=120):
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, os.path.join(REPO, "bench.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cpu_smoke_end_to_end(tmp_path):
    results = tmp_path / "results.jsonl"
    args = ["--num-seqs", "4", "--results", str(results), "--cache-dir", str(tmp_path / "cache"),
            "--label", "test run", "--kernels", "none", "--enforce-eager", "--no-prefix-caching",
            "--block-size", "8", "--max-num-batched-tokens", "512"]
    proc = run_bench(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "of the floor" in proc.stdout and "CPU smoke" in proc.stdout
    # appends, reuses the checkpoint; --profile times every step through the runner's hooks
    # and the penalties' path of the sampler runs under the bench's options too
    proc = run_bench(*args[:6], "--label", "second", "--profile", str(tmp_path / "profile"),
                     "--repetition-penalty", "1.2", "--presence-penalty", "0.5", "--min-p", "0.05",
                     "--kv-cache-dtype", "fp8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = (tmp_path / "profile" / "steps.jsonl").read_text().splitlines()
    assert len(steps) >= max(make_workload(4, **WORKLOADS["cpu-smoke"])[1])
    assert (tmp_path / "profile" / "profile.png").stat().st_size > 0
    lines = results.read_text().splitlines()
    assert len(lines) == 2
    record = json.loads(lines[0])
    prompts, max_tokens = make_workload(4, **WORKLOADS["cpu-smoke"])
    assert record["engine"] == "mini" and record["label"] == "test run"
    assert record["workload"] == "cpu-smoke" and record["cpu_smoke"] is True and record["device"] == "cpu"
    assert record["num_seqs"] == 4
    assert record["input_tokens"] == sum(map(len, prompts)) and record["output_tokens"] == sum(max_tokens)
    assert record["checks"] == {"exact_max_tokens": True, "kv_blocks_free": True}
    for key in ("git_commit", "torch", "triton", "time", "model"):
        assert key in record
    wall = record["wall_s"]
    assert wall > 0
    assert record["output_tok_s"] == pytest.approx(record["output_tokens"] / wall)
    assert record["total_tok_s"] == pytest.approx((record["input_tokens"] + record["output_tokens"]) / wall)
    assert record["copy_bandwidth_GBps"] > 0
    assert record["floor_s"] == pytest.approx(record["floor_bytes"] / (record["copy_bandwidth_GBps"] * 1e9))
    assert record["floor_fraction"] == pytest.approx(record["floor_s"] / wall)
    assert record["achieved_GBps"] == pytest.approx(record["floor_bytes"] / wall / 1e9)
    assert record["decode_steps"] == max(max_tokens)
    config = record["config"]
    assert config["enforce_eager"] is True and config["no_prefix_caching"] is True and config["kernels"] == "none"
    assert config["max_num_seqs"] == 256 and config["max_model_len"] == 2048
    engine = record["engine_config"]           # the options reached the engine
    assert engine["block_size"] == 8 and engine["max_num_batched_tokens"] == 512
    assert engine["enforce_eager"] is True and engine["enable_prefix_caching"] is False
    assert engine["kernels_resolved"] == [] and engine["max_model_len"] == 2048
    second = json.loads(lines[1])
    assert second["label"] == "second" and second["checks"] == {"exact_max_tokens": True, "kv_blocks_free": True}
    assert (second["config"]["repetition_penalty"], second["config"]["presence_penalty"],
            second["config"]["min_p"]) == (1.2, 0.5, 0.05)
    # an fp8 cache: the floor counts 1 byte a K/V element where the CPU's fp32 default counts 4
    assert second["engine_config"]["kv_cache_dtype_resolved"] == "float8_e4m3fn"
    assert engine["kv_cache_dtype_resolved"] == "float32"
    assert 4 * second["kv_bytes_per_token"] == record["kv_bytes_per_token"]
    assert second["kv_read_bytes"] < record["kv_read_bytes"] and second["weight_bytes"] == record["weight_bytes"]


@pytest.mark.parametrize("output_kind", ["delta"])        # (CUMULATIVE: tests/engine/test_async_llm.py)
def test_cpu_smoke_through_async_llm(tmp_path, output_kind):
    """--engine mini-async: the workload as concurrent AsyncLLM.generate() calls, each request its
    exact max_tokens (counted from the outputs of either kind) and every block free after."""
    pytest.importorskip("prometheus_client")
    results = tmp_path / "results.jsonl"
    proc = run_bench("--engine", "mini-async", "--output-kind", output_kind, "--num-seqs", "6", "--results",
                     str(results), "--cache-dir", str(tmp_path / "cache"), "--block-size", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(results.read_text())
    assert record["engine"] == "mini-async" and record["num_seqs"] == 6
    assert record["checks"] == {"exact_max_tokens": True, "kv_blocks_free": True}
    assert record["engine_config"]["block_size"] == 8 and record["engine_config"]["output_kind"] == output_kind


def test_help_and_missing_vllm():
    proc = run_bench("--help", timeout=60)
    assert proc.returncode == 0 and "--num-seqs" in proc.stdout and "--kernels" in proc.stdout
    try:
        import vllm  # noqa: F401
    except ImportError:
        proc = run_bench("--engine", "vllm", "--results", os.devnull, timeout=60)
        assert proc.returncode != 0 and "vllm is not installed" in proc.stderr
