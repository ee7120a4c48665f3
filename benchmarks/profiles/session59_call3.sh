#!/bin/bash
# session 59 call 3: the final tree (cb610e5): default runs (issue 4), LoRA runs with the expand kernel, one profiled, lora_check.
cd ab_s59/tree
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=cb610e5
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/steps.txt; }
step bench_bf16 100 python3 bench.py --label "session 59: cb610e5 default" --results $OUT/results.jsonl
step bench_bf16_2 100 python3 bench.py --label "session 59: cb610e5 default, run 2" --results $OUT/results.jsonl
step bench_lora1 100 python3 bench.py --random-loras 1 --max-lora-rank 16 --label "session 59: cb610e5 --random-loras 1 r16" --results $OUT/results.jsonl
step bench_lora4 100 python3 bench.py --random-loras 4 --max-lora-rank 16 --label "session 59: cb610e5 --random-loras 4 r16" --results $OUT/results.jsonl
step profile_lora1 100 python3 bench.py --random-loras 1 --max-lora-rank 16 --profile $OUT/prof_lora1 --label "session 59: cb610e5 profiled --random-loras 1 r16" --results $OUT/results.jsonl
step lora_check 120 python3 benchmarks/lora_check.py
tail -n 3 $OUT/lora_check.log
