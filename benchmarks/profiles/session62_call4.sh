#!/bin/bash
# session 62 call 4: the final draft-model tree (max_num_seqs-bound catch-up, one engine at a time in the speed runs): GPU tests,
# the deepened target's speed again and the draft's CUDA graph pool.
cd ab_s62/tree
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/logs/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step draft_tests 60 python3 -m pytest -q tests/engine/test_draft_model.py
step spec_deep 150 python3 -u benchmarks/spec_decode_check.py --draft-model self --speed-only --deep-only --out $OUT/logs
cat $OUT/logs/steps.txt; tail -n 2 $OUT/logs/draft_tests.log; tail -n 6 $OUT/logs/spec_deep.log | tr '\r' '\n' | grep -v Loading | cut -c1-700
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
