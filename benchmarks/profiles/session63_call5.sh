#!/bin/bash
# session 63 call 5: sleep-mode memory with the cache emptied before the step buffers; default bench new/old/new.
cd ab_s63/tree
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step sleep_frag_draft 60 python3 ../sleep_frag.py draft
step sleep_frag_plain 40 python3 ../sleep_frag.py plain
step weight_update 50 python3 -u benchmarks/weight_update_check.py --out $OUT/logs
step bench_new_1 80 python3 bench.py --label "session 63: $1 default (A/B 1)" --results $OUT/logs/results.jsonl
(cd ../old && MINI_ENGINE_GIT_COMMIT=d508c79 step bench_old 50 python3 bench.py --label "session 63: d508c79 default (A/B 2)" --results $OUT/logs/results.jsonl)
step bench_new_2 50 python3 bench.py --label "session 63: $1 default (A/B 3)" --results $OUT/logs/results.jsonl
cat $OUT/logs/steps.txt; grep -v Loading $OUT/logs/sleep_frag_draft.log | tail -n 12; grep -v Loading $OUT/logs/sleep_frag_plain.log | tail -n 8
tail -n 1 $OUT/logs/weight_update.log | cut -c1-3000
grep -h '"wall_s"' $OUT/logs/results.jsonl | python3 -c "import sys,json;[print(d['label'],round(d['wall_s'],3),round(d['wall_s']/d['floor_s'],4)) for d in map(json.loads,sys.stdin)]"
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
