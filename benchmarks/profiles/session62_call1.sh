#!/bin/bash
# session 62 call 1: the meta-device start-up (77137db) under the default run; draft-model speculative decoding (never on a GPU); awq_check.
cd ab_s62/tree
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/logs/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step bench_default 75 python3 benchmarks/run_watch.py --label "session 62: $1 default" --results $OUT/logs/results.jsonl
step spec_draft_self 240 python3 -u benchmarks/spec_decode_check.py --draft-model self --out $OUT/logs
step awq_check 110 python3 -u benchmarks/awq_check.py --out $OUT/logs
step model_tests 120 python3 -m pytest -q tests/engine/test_draft_model.py tests/model/test_qwen3_vs_transformers.py -k "meta or materialize or draft or Draft"
cat $OUT/logs/steps.txt; tail -n 30 $OUT/logs/spec_draft_self.log | tr '\r' '\n' | grep -v Loading | tail -n 25; tail -n 2 $OUT/logs/awq_check.log $OUT/logs/model_tests.log; grep -h '"wall_s"' $OUT/logs/results.jsonl | python3 -c "import sys,json;[print(d['label'],round(d['wall_s'],3),round(d['wall_s']/d['floor_s'],4)) for d in map(json.loads,sys.stdin)]"
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
