#!/bin/bash
# session 61 call 1: Qwen3-MoE on the H200 after session 60 (fp8 experts never run on a GPU; the bf16 kernel's slot_block refactor):
# kernel tests, fp8_check --moe-layers 4, 8-layer benches (bf16, fp8), moe_check (bf16), moe_sweep --fp8.
cd ab_s61/tree
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/logs/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step moe_kernel_tests 70 python3 -m pytest -q tests/kernels/test_fp8_fused_moe.py tests/kernels/test_fused_moe.py tests/kernels/test_moe_router.py
step fp8_moe_check 150 python3 -u benchmarks/fp8_check.py --moe-layers 4 --out $OUT/logs
step bench_moe8_fp8 75 python3 bench.py --random-moe-layers 8 --quantization fp8 --label "session 61: $1 8 layers of Qwen3-30B-A3B, fp8" --results $OUT/logs/results.jsonl
step bench_moe8_bf16 70 python3 bench.py --random-moe-layers 8 --label "session 61: $1 8 layers of Qwen3-30B-A3B, bf16" --results $OUT/logs/results.jsonl
step moe_check 120 python3 -u benchmarks/moe_check.py --out $OUT/logs
step moe_sweep_fp8 70 python3 -u benchmarks/moe_sweep.py --fp8 --tokens 1 8 64 256 --prefill-tokens 16384
cat $OUT/logs/steps.txt; tail -n 4 $OUT/logs/moe_kernel_tests.log $OUT/logs/fp8_moe_check.log $OUT/logs/moe_check.log; grep -h '"wall_s"' $OUT/logs/results.jsonl | python3 -c "import sys,json;[print(d['label'],round(d['wall_s'],3),round(d['wall_s']/d['floor_s'],4)) for d in map(json.loads,sys.stdin)]"
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
