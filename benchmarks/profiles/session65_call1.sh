#!/bin/bash
# session 65 call 1: the default benchmark twice and profiled; the batch runner on bench.py's workload;
# the new server tests on the H200.
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs/profile
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/logs/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step bench_1 100 python3 bench.py --label "session 65: $1 default" --results $OUT/logs/results.jsonl
step bench_2 100 python3 bench.py --label "session 65: $1 default" --results $OUT/logs/results.jsonl
step bench_profile 120 python3 bench.py --label "session 65: $1 --profile" --profile $OUT/logs/profile --results $OUT/logs/results.jsonl
python3 benchmarks/batch_workload.py $OUT/logs/bench_batch.jsonl
step run_batch 200 python3 -m mini_engine.run_batch -i $OUT/logs/bench_batch.jsonl -o $OUT/logs/bench_results.jsonl --max-model-len 2048 --max-num-seqs 256 --log-level warning
python3 - > $OUT/logs/run_batch_check.txt <<'PY'
import json, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/logs/bench_results.jsonl")]
ok = [r for r in rows if r["response"]["status_code"] == 200]
print(len(rows), "lines,", len(ok), "status 200,", sum(r["response"]["body"]["usage"]["completion_tokens"] for r in ok), "completion tokens")
PY
rm -f $OUT/logs/bench_batch.jsonl $OUT/logs/bench_results.jsonl
step gpu_tests 240 python3 -m pytest -q -p no:cacheprovider tests/server/test_run_batch.py tests/server/test_data_parallel.py
cat $OUT/logs/gpu.txt $OUT/logs/steps.txt $OUT/logs/run_batch_check.txt
tail -n 2 $OUT/logs/run_batch.log | tr '\r' '\n' | tail -n 2
tail -n 25 $OUT/logs/bench_profile.log
tail -n 5 $OUT/logs/gpu_tests.log
grep -h '"wall_s"' $OUT/logs/results.jsonl | python3 -c "import sys,json;[print(d['label'],round(d['wall_s'],3),round(d['wall_s']/d['floor_s'],4), round(d['output_tok_s'])) for d in map(json.loads,sys.stdin)]"
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
