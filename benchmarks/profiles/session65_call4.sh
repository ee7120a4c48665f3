#!/bin/bash
# session 65 call 4 (H200): the server saturated after the metrics and routing changes; bench.py beside it;
# the batch-runner and data-parallel tests on the GPU machine.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/logs/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step bench 100 python3 bench.py --label "session 65: $1 default" --results $OUT/logs/results.jsonl
step serve_1 120 python3 -u bench_serving.py --launch --label "session 65: $1 saturated, one engine" --results $OUT/logs/results.jsonl
step serve_2 120 python3 -u bench_serving.py --launch --label "session 65: $1 saturated, one engine" --results $OUT/logs/results.jsonl
step gpu_tests 240 python3 -m pytest -q -p no:cacheprovider tests/server/test_run_batch.py tests/server/test_data_parallel.py tests/server/test_serving_flags.py
cat $OUT/logs/gpu.txt $OUT/logs/steps.txt
grep -h "throughput\|TPOT\|TTFT\|FAILED" $OUT/logs/serve_*.log
tail -n 4 $OUT/logs/gpu_tests.log
grep -h '"wall_s"' $OUT/logs/results.jsonl | python3 -c "import sys,json;[print(d['label'],round(d['wall_s'],3),round(d['wall_s']/d['floor_s'],4) if 'floor_s' in d else '', round(d['output_tok_s'])) for d in map(json.loads,sys.stdin)]"
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
