#!/bin/bash
# For the next session's first device call (written in session 70, which had no device time): the
# session-69 mends and session 70's KV offloading on the H200. Arg 1: the tree's commit hash.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/logs/gpu.txt 2>&1
R=$OUT/logs/results.jsonl
timeout 200 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/runner/test_move_kv.py tests/runner/test_piecewise_graph.py tests/runner/test_cuda_graph.py tests/test_compilation_config.py tests/engine/test_draft_model.py tests/engine/test_speculative.py > $OUT/logs/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -2 $OUT/logs/gpu_tests.log; grep -E "^FAILED|^ERROR" $OUT/logs/gpu_tests.log | head -8
timeout 100 python3 bench.py --label "default" --results $R > $OUT/logs/bench_default.log 2>&1
echo "bench rc=$? $(grep -E '^wall' $OUT/logs/bench_default.log)"
timeout 150 python3 benchmarks/kv_offloading_check.py --out $OUT/logs > $OUT/logs/kv_offloading_check.log 2>&1
echo "offloading rc=$?"; tail -30 $OUT/logs/kv_offloading_check.log
timeout 150 python3 benchmarks/gpu_correctness.py > $OUT/logs/gpu_correctness.log 2>&1
echo "correctness rc=$?"; grep -iE "fail|mismatch" $OUT/logs/gpu_correctness.log | head -5
cat $OUT/logs/gpu.txt
tar -czf $OUT/logs.tgz -C $OUT logs
