#!/bin/bash
# session 64 call 3: the whole next proposal launched ahead (9642c2d+): the self-draft check in full,
# the deepened pair's speed, bddc65b (catch-up ahead only) then new, on one machine; the default bench.
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs/new $OUT/logs/old_deep $OUT/logs/new_deep
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/logs/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step spec_self_new 280 python3 -u benchmarks/spec_decode_check.py --draft-model self --out $OUT/logs/new
(cd ab_s64/old && PYTHONPATH=. step deep_old 95 python3 -u benchmarks/spec_decode_check.py --draft-model self --speed-only --deep-only --out $OUT/logs/old_deep)
step deep_new 95 python3 -u benchmarks/spec_decode_check.py --draft-model self --speed-only --deep-only --out $OUT/logs/new_deep
step bench_default 70 python3 bench.py --label "session 64: $1 default" --results $OUT/logs/results.jsonl
cat $OUT/logs/gpu.txt $OUT/logs/steps.txt
tail -n 30 $OUT/logs/spec_self_new.log | tr '\r' '\n' | grep -v Loading | grep -E "FAIL|speed|ALL" | cut -c1-900
for f in deep_old deep_new; do echo "== $f"; tail -n 8 $OUT/logs/$f.log | tr '\r' '\n' | grep -E "speed|FAIL|Error" | cut -c1-900; done
grep -h '"wall_s"' $OUT/logs/results.jsonl | python3 -c "import sys,json;[print(d['label'],round(d['wall_s'],3),round(d['wall_s']/d['floor_s'],4)) for d in map(json.loads,sys.stdin)]"
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
