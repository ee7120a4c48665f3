#!/bin/bash
# session 65 call 3 (2 x H200): data parallelism. Greedy equality and GPU placement; the saturated
# serving benchmark with 1 and 2 engines; the batch runner with 2 engines.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/logs/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step dp_check 200 python3 -u benchmarks/data_parallel_check.py --data-parallel-size 2
step serve_dp1 120 python3 -u bench_serving.py --launch --label "session 65: $1 saturated, -dp 1" --results $OUT/logs/results.jsonl
step serve_dp2 120 python3 -u bench_serving.py --launch --server-args "--data-parallel-size 2" --label "session 65: $1 saturated, -dp 2" --results $OUT/logs/results.jsonl
python3 benchmarks/batch_workload.py /tmp/bench_batch.jsonl
step run_batch_dp2 150 python3 -m mini_engine.run_batch -i /tmp/bench_batch.jsonl -o /tmp/bench_results.jsonl --max-model-len 2048 --max-num-seqs 256 --log-level warning --data-parallel-size 2
cat $OUT/logs/gpu.txt $OUT/logs/steps.txt
tail -n 6 $OUT/logs/dp_check.log
grep -h "throughput\|TPOT\|TTFT\|requests  \|FAILED" $OUT/logs/serve_dp*.log
grep -h "requests (" $OUT/logs/run_batch_dp2.log; tail -n 3 $OUT/logs/run_batch_dp2.log | cut -c1-400
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
