#!/bin/bash
# session 61 call 2: the AWQ FMA product (GEMV) on the H200: kernel tests, its tile sweep; fp8_check --moe-layers 4 with a longer limit.
cd ab_s61/tree
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/logs/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step awq_kernel_tests 50 python3 -m pytest -q tests/kernels/test_awq_linear.py
step gemv_sweep 190 python3 -u benchmarks/awq_sweep.py --gemv
step fp8_moe_check 310 python3 -u benchmarks/fp8_check.py --moe-layers 4 --out $OUT/logs
cat $OUT/logs/steps.txt; tail -n 3 $OUT/logs/awq_kernel_tests.log; tail -n 30 $OUT/logs/fp8_moe_check.log | tr '\r' '\n' | grep -v Loading | tail -n 12
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
