#!/bin/bash
# session 58 call 1: LoRA on the H200 for the first time; bf16 default with the lora_slots column; GPU tests.
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=bed50a7
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/steps.txt; }
step lora_check 120 python3 benchmarks/lora_check.py
step bench_bf16 100 python3 bench.py --label "session 58: default run (lora_slots staged, LoRA off)" --results $OUT/results.jsonl
step bench_lora1 120 python3 bench.py --random-loras 1 --max-lora-rank 16 --label "session 58: --random-loras 1 r16 (every request on the adapter)" --results $OUT/results.jsonl
step bench_lora4 120 python3 bench.py --random-loras 4 --max-lora-rank 16 --label "session 58: --random-loras 4 r16 (request i on adapter i mod 4)" --results $OUT/results.jsonl
step gpu_tests 100 python3 -m pytest -q tests/runner tests/kernels/test_fp8_linear.py tests/kernels/test_compiles_for_hopper.py
tail -n 4 $OUT/*.log
