#!/bin/bash
# session 62 call 2: draft-model speculative decoding after 48a6d86 (catch-up as decode rows, chained); the seeded CDF judge;
# a deepened target; gpu_correctness.py; a profiled default run (a fresh step table).
cd ab_s62/tree
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/logs/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step spec_draft_self 300 python3 -u benchmarks/spec_decode_check.py --draft-model self --out $OUT/logs
step profile_bf16 80 python3 bench.py --profile $OUT/logs/prof_bf16 --label "session 62: $1 profiled default" --results $OUT/logs/results.jsonl
step gpu_correctness 200 python3 -u benchmarks/gpu_correctness.py --out $OUT/logs
cat $OUT/logs/steps.txt; tail -n 30 $OUT/logs/spec_draft_self.log | tr '\r' '\n' | grep -v Loading | tail -n 20 | cut -c1-700; tail -n 6 $OUT/logs/gpu_correctness.log; grep -h '"wall_s"' $OUT/logs/results.jsonl | python3 -c "import sys,json;[print(d['label'],round(d['wall_s'],3),round(d['wall_s']/d['floor_s'],4)) for d in map(json.loads,sys.stdin)]"
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
