#!/bin/bash
# session 68 call 5 (HEAD): eager decode steps launched as their graph is; gpu_correctness; GPU tests; a no-graphs run from a fresh Triton cache.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/logs/gpu.txt 2>&1
R=$OUT/logs/results.jsonl
timeout 200 python3 benchmarks/gpu_correctness.py --out $OUT/logs/correctness > $OUT/logs/gpu_correctness.log 2>&1
echo "gpu_correctness rc=$?"; grep -iE "graphs vs|ALL PASSED|FAIL" $OUT/logs/gpu_correctness.log | head -12
timeout 200 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/runner/test_cuda_graph.py tests/test_compilation_config.py tests/engine/test_speculative.py tests/kernels/test_paged_attention.py > $OUT/logs/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -2 $OUT/logs/gpu_tests.log; grep -E "^FAILED|^ERROR" $OUT/logs/gpu_tests.log | head
TRITON_CACHE_DIR=/tmp/triton_fresh timeout 150 python3 benchmarks/host_stalls.py --slow-step-ms 30 --compilation-config '{"cudagraph_mode": "NONE"}' --label "session 68 call 5: no graphs, host_stalls, fresh Triton cache" --results $R > $OUT/logs/stalls_no_graphs.log 2>&1
echo "stalls rc=$?"; grep -E "^wall" $OUT/logs/stalls_no_graphs.log; grep "compiled" $OUT/logs/stalls_no_graphs.log | awk '{print $3}' | sort | uniq -c | grep -i decode
cat $OUT/logs/gpu.txt
tar -czf $OUT/logs.tgz -C $OUT logs
