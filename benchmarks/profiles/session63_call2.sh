#!/bin/bash
# session 63 call 2: old (d508c79, the host reads the drafts before the verifying step) against new (HEAD, the verifying step
# reads them on the device), alternating, on a self-drafting engine: 1 and 4 requests, and the device's gaps under the profiler.
cd ab_s63/tree
mkdir -p $OUT/logs
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
for round in 1 2; do
  PYTHONPATH=../old step old_$round 120 python3 -u benchmarks/spec_decode_timeline.py
  PYTHONPATH=. step new_$round 120 python3 -u benchmarks/spec_decode_timeline.py
done
PYTHONPATH=. step weight_update 110 python3 -u benchmarks/weight_update_check.py --out $OUT/logs
cat $OUT/logs/steps.txt
for f in old_1 new_1 old_2 new_2; do echo "== $f"; grep -E "request\(s\)|profiled" $OUT/logs/$f.log | cut -c1-400; done
echo "== new_2 full"; grep -v Loading $OUT/logs/new_2.log | tail -n 60 | cut -c1-200
echo "== old_2 full"; grep -v Loading $OUT/logs/old_2.log | tail -n 60 | cut -c1-200
tail -n 1 $OUT/logs/weight_update.log | cut -c1-3000
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
