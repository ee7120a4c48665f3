#!/bin/bash
# session 59 call 1: the LoRA expand kernel (56d6621) on the H200: checks, tests, whole runs, then the tile sweep.
cd ab_s59/tree
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=7fade18
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/steps.txt; }
step lora_check 120 python3 benchmarks/lora_check.py
step bench_lora1 110 python3 bench.py --random-loras 1 --max-lora-rank 16 --label "session 59: --random-loras 1 r16, LoRA expand kernel" --results $OUT/results.jsonl
step bench_lora4 110 python3 bench.py --random-loras 4 --max-lora-rank 16 --label "session 59: --random-loras 4 r16, LoRA expand kernel" --results $OUT/results.jsonl
step bench_lora1_pt 110 python3 bench.py --random-loras 1 --max-lora-rank 16 --kernels attention,rms_norm,rope_kv,silu_and_mul,sampler,linear,prev_tokens,fused_moe,fp8_linear --label "session 59: --random-loras 1 r16, PyTorch LoRA path (A/B)" --results $OUT/results.jsonl
step gpu_tests 120 python3 -m pytest -q tests/kernels/test_lora_kernel.py tests/layers/test_lora_slots.py tests/model/test_lora_kernel_in_model.py tests/runner/test_cuda_graph.py
step lora_sweep 200 python3 benchmarks/lora_sweep.py
tail -n 4 $OUT/lora_check.log $OUT/gpu_tests.log; grep -h wall_s $OUT/bench_*.log | tail -4
