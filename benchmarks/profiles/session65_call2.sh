#!/bin/bash
# session 65 call 2 (H200): the server's packages from carried wheels; the batch runner on bench.py's
# workload beside bench.py on the same machine; the new server tests on the GPU; the self-draft speed rows.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/logs/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step bench 100 python3 bench.py --label "session 65: $1 default, beside run_batch" --results $OUT/logs/results.jsonl
python3 benchmarks/batch_workload.py /tmp/bench_batch.jsonl
for i in 1 2; do
step run_batch_$i 150 python3 -m mini_engine.run_batch -i /tmp/bench_batch.jsonl -o /tmp/bench_results.jsonl --max-model-len 2048 --max-num-seqs 256 --log-level warning
python3 - >> $OUT/logs/run_batch_check.txt <<'PY'
import json
rows = [json.loads(l) for l in open("/tmp/bench_results.jsonl")]
ok = [r for r in rows if r["response"]["status_code"] == 200]
print(len(rows), "lines,", len(ok), "status 200,", sum(r["response"]["body"]["usage"]["completion_tokens"] for r in ok), "completion tokens")
PY
done
step gpu_tests 300 python3 -m pytest -q -p no:cacheprovider tests/server/test_run_batch.py tests/server/test_data_parallel.py
step spec_speed 150 python3 -u benchmarks/spec_decode_check.py --draft-model self --speed-only --deep-only --out $OUT/logs
cat $OUT/logs/gpu.txt $OUT/logs/steps.txt $OUT/logs/run_batch_check.txt
grep -h "requests (" $OUT/logs/run_batch_*.log
tail -n 8 $OUT/logs/gpu_tests.log
tail -n 12 $OUT/logs/spec_speed.log | tr '\r' '\n' | grep -E "speed|FAIL|ALL|Error|ahead|x " | cut -c1-600
grep -h '"wall_s"' $OUT/logs/results.jsonl | python3 -c "import sys,json;[print(d['label'],round(d['wall_s'],3),round(d['wall_s']/d['floor_s'],4), round(d['output_tok_s'])) for d in map(json.loads,sys.stdin)]"
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
