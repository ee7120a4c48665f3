#!/bin/bash
# session 61 call 4: AWQ kernel tests on the final kernels; gpu_correctness.py (not finished since session 58).
cd ab_s61/tree
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/logs/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step awq_kernel_tests 70 python3 -m pytest -q tests/kernels/test_awq_linear.py
step gpu_correctness 290 python3 -u benchmarks/gpu_correctness.py --out $OUT/logs
cat $OUT/logs/steps.txt; tail -n 2 $OUT/logs/awq_kernel_tests.log; tail -n 8 $OUT/logs/gpu_correctness.log
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
