#!/bin/bash
# session 58 call 2: the engine's GPU correctness checks after the LoRA change (the runner's staging, Linear.forward),
# fp8_check.py (session 57's refactors), and where LoRA's time goes (bench --profile).
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=bed50a7
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/steps.txt; }
step gpu_correctness 200 python3 benchmarks/gpu_correctness.py --out $OUT
step fp8_check 160 python3 benchmarks/fp8_check.py --out $OUT
step profile_bf16 90 python3 bench.py --profile $OUT/prof_bf16 --label "session 58: profiled default" --results $OUT/results.jsonl
step profile_lora1 90 python3 bench.py --random-loras 1 --max-lora-rank 16 --profile $OUT/prof_lora1 --label "session 58: profiled --random-loras 1 r16" --results $OUT/results.jsonl
tail -n 6 $OUT/gpu_correctness.log $OUT/fp8_check.log
