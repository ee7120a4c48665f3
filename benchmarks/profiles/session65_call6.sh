#!/bin/bash
# session 65 call 6 (H200): the final tree's default benchmark, twice.
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/logs/gpu.txt 2>&1
for i in 1 2; do timeout 100 python3 bench.py --label "session 65: $1 final tree" --results $OUT/logs/results.jsonl > $OUT/logs/bench_$i.log 2>&1; done
grep -h '"wall_s"' $OUT/logs/results.jsonl | python3 -c "import sys,json;[print(d['label'],round(d['wall_s'],3),round(d['wall_s']/d['floor_s'],4), round(d['output_tok_s']), round(d['floor_s'],3)) for d in map(json.loads,sys.stdin)]"
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
