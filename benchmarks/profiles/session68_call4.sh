#!/bin/bash
# session 68 call 4 (6538be0): bench default x2 (the graphs' reserve measured at the largest size); a no-graphs run from a fresh Triton cache; GPU tests; gpu_correctness.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/logs/gpu.txt 2>&1
R=$OUT/logs/results.jsonl
b() { timeout 150 python3 bench.py --label "session 68 call 4: $1" "${@:2}" --results $R > $OUT/logs/bench_$1.log 2>&1; echo "$1 rc=$? $(grep -E '^wall' $OUT/logs/bench_$1.log) $(grep -oE 'achieved [0-9.]+%' $OUT/logs/bench_$1.log) | $(grep -E '^CUDA graphs' $OUT/logs/bench_$1.log)"; }
b default_1
b default_2
TRITON_CACHE_DIR=/tmp/triton_fresh timeout 200 python3 benchmarks/host_stalls.py --slow-step-ms 30 --compilation-config '{"cudagraph_mode": "NONE"}' --label "session 68 call 4: no graphs, host_stalls, fresh Triton cache" --results $R > $OUT/logs/stalls_no_graphs.log 2>&1
echo "stalls rc=$?"; grep -E "^wall" $OUT/logs/stalls_no_graphs.log; grep "compiled" $OUT/logs/stalls_no_graphs.log | awk '{print $3}' | sort | uniq -c | grep -i decode
timeout 300 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/runner/test_cuda_graph.py tests/test_compilation_config.py tests/engine/test_speculative.py tests/engine/test_draft_model.py tests/kernels/test_paged_attention.py > $OUT/logs/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -3 $OUT/logs/gpu_tests.log; grep -E "^FAILED|^ERROR" $OUT/logs/gpu_tests.log | head
timeout 240 python3 benchmarks/gpu_correctness.py --out $OUT/logs/correctness > $OUT/logs/gpu_correctness.log 2>&1
echo "gpu_correctness rc=$?"; tail -4 $OUT/logs/gpu_correctness.log
cat $OUT/logs/gpu.txt
tar -czf $OUT/logs.tgz -C $OUT logs
