#!/bin/bash
# session 63 call 4: sleep-mode memory with the step buffers first; the default bench.
cd ab_s63/tree
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step sleep_frag_draft 90 python3 ../sleep_frag.py draft
step sleep_frag_plain 90 python3 ../sleep_frag.py plain
step weight_update 110 python3 -u benchmarks/weight_update_check.py --out $OUT/logs
step bench_default 100 python3 bench.py --label "session 63: $1 default" --results $OUT/logs/results.jsonl
cat $OUT/logs/steps.txt; grep -v Loading $OUT/logs/sleep_frag_draft.log | tail -n 12; grep -v Loading $OUT/logs/sleep_frag_plain.log | tail -n 8
tail -n 1 $OUT/logs/weight_update.log | cut -c1-3000
grep -h '"wall_s"' $OUT/logs/results.jsonl | python3 -c "import sys,json;[print(d['label'],round(d['wall_s'],3),round(d['wall_s']/d['floor_s'],4)) for d in map(json.loads,sys.stdin)]"
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
