#!/bin/bash
# session 59 call 5: the joined [W; A] product (1a36c6a): cuBLAS at the joined shapes, checks, GPU tests, A/B against 15dbe9d with one adapter.
export PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/steps.txt; }
cd ab_s59/tree
step joined_sweep 150 python3 benchmarks/lora_sweep.py --only-joined
step lora_check 100 python3 benchmarks/lora_check.py
step gpu_tests 120 python3 -m pytest -q tests/kernels/test_lora_kernel.py tests/layers/test_lora_slots.py tests/model/test_lora_kernel_in_model.py tests/runner/test_cuda_graph.py
cd ../..
for i in 1 2; do
  for t in old:15dbe9d tree:1a36c6a; do
    dir=${t%%:*}; rev=${t##*:}
    (cd ab_s59/$dir && MINI_ENGINE_GIT_COMMIT=$rev timeout 100 python3 bench.py --random-loras 1 --max-lora-rank 16 --label "A/B session 59: $rev --random-loras 1 r16, run $i" --results $OUT/results.jsonl > $OUT/bench_${rev}_$i.log 2>&1; echo "$rev run $i rc=$?")
  done
done
(cd ab_s59/tree && MINI_ENGINE_GIT_COMMIT=1a36c6a timeout 100 python3 bench.py --random-loras 4 --max-lora-rank 16 --label "session 59: 1a36c6a --random-loras 4 r16" --results $OUT/results.jsonl > $OUT/bench_lora4.log 2>&1; echo "lora4 rc=$?")
tail -n 3 $OUT/lora_check.log $OUT/gpu_tests.log
