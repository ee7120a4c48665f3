#!/bin/bash
# session 61 call 3: AWQ's FMA product and the magic-float A/B; awq_check; one request on 8 layers of 8B; GPTQ; the default run.
cd ab_s61/tree
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/logs/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step bench_default 75 python3 benchmarks/run_watch.py --label "session 61: $1 default" --results $OUT/logs/results.jsonl
step awq_kernel_tests 50 python3 -m pytest -q tests/kernels/test_awq_linear.py
step magic_sweep 80 python3 -u benchmarks/awq_sweep.py --gemv
step bench_8b8_bf16_1 35 python3 bench.py --random-8b-layers 8 --num-seqs 1 --label "session 61: $1 8 layers of Qwen3-8B, bf16, first request" --results $OUT/logs/results.jsonl
step bench_8b8_awq_1 35 python3 bench.py --random-8b-layers 8 --awq --num-seqs 1 --label "session 61: $1 8 layers of Qwen3-8B, AWQ, first request" --results $OUT/logs/results.jsonl
step awq_check 110 python3 -u benchmarks/awq_check.py --out $OUT/logs
step gptq_tests 50 python3 -m pytest -q -x tests/model/test_qwen3_gptq.py
step bench_gptq 60 python3 bench.py --gptq --label "session 61: $1 --gptq (0.6B)" --results $OUT/logs/results.jsonl
step bench_awq 60 python3 bench.py --awq --label "session 61: $1 --awq (0.6B)" --results $OUT/logs/results.jsonl
cat $OUT/logs/steps.txt; tail -n 2 $OUT/logs/awq_kernel_tests.log $OUT/logs/awq_check.log $OUT/logs/gptq_tests.log; grep -h '"wall_s"' $OUT/logs/results.jsonl | python3 -c "import sys,json;[print(d['label'],round(d['wall_s'],3),round(d['wall_s']/d['floor_s'],4)) for d in map(json.loads,sys.stdin)]"
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
