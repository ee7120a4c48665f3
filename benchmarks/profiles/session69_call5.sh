#!/bin/bash
# session 69 call 5 (5ffa7b6, the review mends): the piecewise and decode-graph GPU tests (the new reserve test for both pools); the default bench.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/logs/gpu.txt 2>&1
R=$OUT/logs/results.jsonl
timeout 150 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/runner/test_piecewise_graph.py tests/runner/test_cuda_graph.py tests/test_compilation_config.py > $OUT/logs/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -2 $OUT/logs/gpu_tests.log; grep -E "^FAILED|^ERROR" $OUT/logs/gpu_tests.log | head -8
timeout 100 python3 bench.py --label "session 69 call 5: default" --results $R > $OUT/logs/bench_default.log 2>&1
echo "bench rc=$? $(grep -E '^wall' $OUT/logs/bench_default.log) | $(grep -iE '^CUDA graphs|warn|Error' $OUT/logs/bench_default.log | head -3)"
cat $OUT/logs/gpu.txt
tar -czf $OUT/logs.tgz -C $OUT logs
