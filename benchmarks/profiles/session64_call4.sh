#!/bin/bash
# session 64 call 4: the final tree's speculative path on the GPU, speed rows only (the device time left).
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs/new
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step spec_speed 150 python3 -u benchmarks/spec_decode_check.py --draft-model self --speed-only --out $OUT/logs/new
cat $OUT/logs/steps.txt
tail -n 12 $OUT/logs/spec_speed.log | tr '\r' '\n' | grep -E "speed|FAIL|ALL|Error" | cut -c1-900
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
