#!/bin/bash
# session 64 call 1: step buffers in their own pool (sleep memory with a draft), GPU tests of prompt
# embeddings and the profiler, the default benchmark, the self-draft check.
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/logs/gpu.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s.%N)
  timeout $limit "$@" > $OUT/logs/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(python3 -c "import time;print(round(time.time()-$t0,1))")s" | tee -a $OUT/logs/steps.txt; }
step weight_update 100 python3 -u benchmarks/weight_update_check.py --out $OUT/logs
step sleep_frag_draft 60 python3 ab_s64/sleep_frag.py draft
step gpu_tests 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_prompt_embeds.py tests/engine/test_offline_api.py -k "gpu"
step bench_default 100 python3 bench.py --label "session 64: $1 default" --results $OUT/logs/results.jsonl
step spec_draft_self 280 python3 -u benchmarks/spec_decode_check.py --draft-model self --out $OUT/logs
cat $OUT/logs/gpu.txt $OUT/logs/steps.txt
tail -n 1 $OUT/logs/weight_update.log | cut -c1-3000
grep -v Loading $OUT/logs/sleep_frag_draft.log | tail -n 12
tail -n 15 $OUT/logs/gpu_tests.log
tail -n 30 $OUT/logs/spec_draft_self.log | tr '\r' '\n' | grep -v Loading | tail -n 20 | cut -c1-600
grep -h '"wall_s"' $OUT/logs/results.jsonl | python3 -c "import sys,json;[print(d['label'],round(d['wall_s'],3),round(d['wall_s']/d['floor_s'],4)) for d in map(json.loads,sys.stdin)]"
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
