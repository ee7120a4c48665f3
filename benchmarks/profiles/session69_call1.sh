#!/bin/bash
# session 69 call 1 (4b8da8e): the d165ef5 changes not yet run on the H200: padded-size split count, the graphs' reserve; GPU tests; default x2; no graphs from a fresh cache.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/logs/gpu.txt 2>&1
R=$OUT/logs/results.jsonl
b() { timeout 150 python3 bench.py --label "session 69 call 1: $1" "${@:2}" --results $R > $OUT/logs/bench_$1.log 2>&1; echo "$1 rc=$? $(grep -E '^wall' $OUT/logs/bench_$1.log) $(grep -oE 'achieved [0-9.]+%' $OUT/logs/bench_$1.log) | $(grep -iE '^CUDA graphs|warn' $OUT/logs/bench_$1.log | head -3)"; }
b default
b default2
timeout 200 python3 benchmarks/gpu_correctness.py --out $OUT/logs/correctness > $OUT/logs/gpu_correctness.log 2>&1
echo "gpu_correctness rc=$?"; grep -iE "graphs vs|ALL PASSED|FAIL" $OUT/logs/gpu_correctness.log | head -12
timeout 240 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/runner/test_cuda_graph.py tests/test_compilation_config.py tests/engine/test_speculative.py tests/engine/test_draft_model.py tests/kernels/test_paged_attention.py > $OUT/logs/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -2 $OUT/logs/gpu_tests.log; grep -E "^FAILED|^ERROR" $OUT/logs/gpu_tests.log | head
TRITON_CACHE_DIR=/tmp/triton_fresh timeout 150 python3 benchmarks/host_stalls.py --slow-step-ms 30 --compilation-config '{"cudagraph_mode": "NONE"}' --label "session 69 call 1: no graphs, host_stalls, fresh Triton cache" --results $R > $OUT/logs/stalls_no_graphs.log 2>&1
echo "stalls rc=$?"; grep -E "^wall" $OUT/logs/stalls_no_graphs.log; grep "compiled" $OUT/logs/stalls_no_graphs.log | awk '{print $3}' | sort | uniq -c
cat $OUT/logs/gpu.txt
tar -czf $OUT/logs.tgz -C $OUT logs
