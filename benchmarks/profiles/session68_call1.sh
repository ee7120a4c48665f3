#!/bin/bash
# session 68 call 1: compilation_config's capture sizes on the H200: GPU tests; bench default x2; graphs up to 64 and 128 rows; cudagraph_mode NONE.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/logs/gpu.txt 2>&1
timeout 240 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/runner/test_cuda_graph.py tests/test_compilation_config.py tests/runner/test_draft_model.py tests/runner/test_pdl.py > $OUT/logs/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -3 $OUT/logs/gpu_tests.log; grep -E "^FAILED|^ERROR" $OUT/logs/gpu_tests.log | head
R=$OUT/logs/results.jsonl
b() { timeout 150 python3 bench.py --label "session 68 call 1: $1" "${@:2}" --results $R > $OUT/logs/bench_$1.log 2>&1; echo "$1 rc=$? $(grep -E '^wall' $OUT/logs/bench_$1.log) $(grep -oE 'achieved [0-9.]+%' $OUT/logs/bench_$1.log) | $(grep -E '^CUDA graphs' $OUT/logs/bench_$1.log)"; }
b default_1
b max_capture_128 --compilation-config '{"max_cudagraph_capture_size": 128}'
b max_capture_64 --compilation-config '{"max_cudagraph_capture_size": 64}'
b default_2
b no_graphs --compilation-config '{"cudagraph_mode": "NONE"}'
cat $OUT/logs/gpu.txt
tar -czf $OUT/logs.tgz -C $OUT logs
