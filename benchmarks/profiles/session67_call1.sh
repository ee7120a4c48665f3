#!/bin/bash
# session 67 call 1: custom logits processors on the H200 (GPU tests), the default bench twice and with a loaded processor.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/logs/gpu.txt 2>&1
R=$OUT/logs/results.jsonl
timeout 200 python3 bench.py --label "session 67 call 1: default path" --results $R > $OUT/logs/bench_default_1.log 2>&1
echo "default 1 rc=$?"; grep -E "^wall|achieved" $OUT/logs/bench_default_1.log
timeout 200 python3 bench.py --label "session 67 call 1: a logits processor loaded (TargetToken), no request opts in" --logits-processors tests.logits_processor_examples:TargetToken --results $R > $OUT/logs/bench_processor_1.log 2>&1
echo "processor 1 rc=$?"; grep -E "^wall|achieved" $OUT/logs/bench_processor_1.log
timeout 200 python3 bench.py --label "session 67 call 1: default path" --results $R > $OUT/logs/bench_default_2.log 2>&1
echo "default 2 rc=$?"; grep -E "^wall|achieved" $OUT/logs/bench_default_2.log
timeout 200 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/engine/test_logits_processors.py tests/server/test_logits_processors_api.py > $OUT/logs/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -3 $OUT/logs/gpu_tests.log
timeout 200 python3 bench.py --label "session 67 call 1: a logits processor loaded (TargetToken), no request opts in" --logits-processors tests.logits_processor_examples:TargetToken --results $R > $OUT/logs/bench_processor_2.log 2>&1
echo "processor 2 rc=$?"; grep -E "^wall|achieved" $OUT/logs/bench_processor_2.log
cat $OUT/logs/gpu.txt
tar -czf $OUT/logs.tgz -C $OUT logs
