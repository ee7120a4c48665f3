#!/bin/bash
# session 67 call 3: GPU tests of AsyncLLM (CUDA IPC weight updates), log lines, long_prefill_token_threshold; bench default twice.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/logs/gpu.txt 2>&1
timeout 300 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/engine/test_async_llm.py tests/server/test_stats_logging.py tests/engine/test_long_prefill_threshold.py tests/engine/test_logits_processors.py > $OUT/logs/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -3 $OUT/logs/gpu_tests.log; grep -E "^FAILED|^ERROR" $OUT/logs/gpu_tests.log | head
R=$OUT/logs/results.jsonl
b() { timeout 150 python3 bench.py --label "session 67 call 3: $1" "${@:2}" --results $R > $OUT/logs/bench_$1.log 2>&1; echo "$1 rc=$? $(grep -E '^wall' $OUT/logs/bench_$1.log) $(grep -oE 'achieved [0-9.]+%' $OUT/logs/bench_$1.log) $(grep -oE '^floor [0-9.]+ s' $OUT/logs/bench_$1.log)"; }
b default_1
b default_2
cat $OUT/logs/gpu.txt
tar -czf $OUT/logs.tgz -C $OUT logs
