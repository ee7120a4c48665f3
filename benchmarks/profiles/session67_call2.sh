#!/bin/bash
# session 67 call 2: GPU tests of logits processors and AsyncLLM; bench default / processor loaded / mini-async; the step table.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/logs/gpu.txt 2>&1
python3 -c "import prometheus_client" 2>&1 | tail -1
R=$OUT/logs/results.jsonl
b() { timeout 150 python3 bench.py --label "session 67 call 2: $1" "${@:2}" --results $R > $OUT/logs/bench_$1.log 2>&1; echo "$1 rc=$? $(grep -E '^wall' $OUT/logs/bench_$1.log) $(grep -oE 'achieved [0-9.]+%' $OUT/logs/bench_$1.log)"; }
b default_1
b processor_1 --logits-processors tests.logits_processor_examples:TargetToken
b async_final_1 --engine mini-async
b default_2
b processor_2 --logits-processors tests.logits_processor_examples:TargetToken
b async_final_2 --engine mini-async
b async_cumulative --engine mini-async --output-kind cumulative
b profile --profile $OUT/logs/profile
grep -A16 "step kind" $OUT/logs/bench_profile.log | head -20
timeout 240 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/engine/test_logits_processors.py tests/engine/test_async_llm.py tests/server/test_logits_processors_api.py tests/engine/test_sampling_end_to_end.py > $OUT/logs/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -3 $OUT/logs/gpu_tests.log; grep -E "^FAILED|^ERROR" $OUT/logs/gpu_tests.log | head
cat $OUT/logs/gpu.txt
tar -czf $OUT/logs.tgz -C $OUT logs
