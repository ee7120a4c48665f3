#!/bin/bash
# session 62 call 3: fp8_check --moe-layers 4 with the margin spread (engine_judge); the draft-model tests on the GPU after 48a6d86.
cd ab_s62/tree
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/logs/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step draft_tests 90 python3 -m pytest -q tests/engine/test_draft_model.py tests/test_spec_decode_check.py
step fp8_moe_check 340 python3 -u benchmarks/fp8_check.py --moe-layers 4 --out $OUT/logs
cat $OUT/logs/steps.txt; tail -n 2 $OUT/logs/draft_tests.log; tail -n 40 $OUT/logs/fp8_moe_check.log | tr '\r' '\n' | grep -v Loading | tail -n 25 | cut -c1-600
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
