#!/bin/bash
# session 63 call 1: the verifying step reads the drafts on the device (a56d2ac): spec_decode_check --draft-model self
# (correctness and speed), weight_update_check with a draft model asleep and awake, the default benchmark.
cd ab_s63/tree
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/logs/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step bench_default 100 python3 bench.py --label "session 63: $1 default" --results $OUT/logs/results.jsonl
step spec_draft_self 290 python3 -u benchmarks/spec_decode_check.py --draft-model self --out $OUT/logs
step weight_update 110 python3 -u benchmarks/weight_update_check.py --out $OUT/logs
cat $OUT/logs/steps.txt; tail -n 30 $OUT/logs/spec_draft_self.log | tr '\r' '\n' | grep -v Loading | tail -n 20 | cut -c1-600; tail -n 3 $OUT/logs/weight_update.log | cut -c1-2500
grep -h '"wall_s"' $OUT/logs/results.jsonl | python3 -c "import sys,json;[print(d['label'],round(d['wall_s'],3),round(d['wall_s']/d['floor_s'],4)) for d in map(json.loads,sys.stdin)]"
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
