#!/bin/bash
# session 68 call 3: eager decode's split counts rounded; compiles in a no-graphs run from a fresh Triton cache; GPU tests.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/logs/gpu.txt 2>&1
R=$OUT/logs/results.jsonl
TRITON_CACHE_DIR=/tmp/triton_fresh timeout 200 python3 benchmarks/host_stalls.py --slow-step-ms 30 --compilation-config '{"cudagraph_mode": "NONE"}' --label "session 68 call 3: no graphs, host_stalls, fresh Triton cache" --results $R > $OUT/logs/stalls_no_graphs.log 2>&1
echo "stalls rc=$?"; grep -E "^wall" $OUT/logs/stalls_no_graphs.log; grep "compiled" $OUT/logs/stalls_no_graphs.log | awk '{print $3}' | sort | uniq -c
b() { timeout 150 python3 bench.py --label "session 68 call 3: $1" "${@:2}" --results $R > $OUT/logs/bench_$1.log 2>&1; echo "$1 rc=$? $(grep -E '^wall' $OUT/logs/bench_$1.log) $(grep -oE 'achieved [0-9.]+%' $OUT/logs/bench_$1.log) | $(grep -E '^CUDA graphs' $OUT/logs/bench_$1.log)"; }
b default_1
TRITON_CACHE_DIR=/tmp/triton_fresh2 b max_capture_128 --compilation-config '{"max_cudagraph_capture_size": 128}'
b no_graphs --compilation-config '{"cudagraph_mode": "NONE"}'
timeout 300 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/kernels/test_paged_attention.py tests/runner/test_cuda_graph.py tests/runner/test_pdl.py > $OUT/logs/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -3 $OUT/logs/gpu_tests.log; grep -E "^FAILED|^ERROR" $OUT/logs/gpu_tests.log | head
cat $OUT/logs/gpu.txt
tar -czf $OUT/logs.tgz -C $OUT logs
