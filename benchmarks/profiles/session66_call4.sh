#!/bin/bash
# session 66 call 4: the final tree: bench.py twice and profiled (the numbers and step table);
# bench_serving --launch with its new default (4 load generators), saturated and at Poisson 16 requests/s.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export MINI_ENGINE_GIT_COMMIT=$1 PYTHONPATH=/tmp/site:.
L=$OUT/logs; mkdir -p $L/profile
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $L/gpu.txt 2>&1
for i in 1 2; do timeout 100 python3 bench.py --label "session 66: $1 final tree" --results $L/results.jsonl > $L/bench_$i.log 2>&1; done
timeout 120 python3 bench.py --label "session 66: $1 --profile" --profile $L/profile --results $L/results.jsonl > $L/bench_profile.log 2>&1
grep -h '"wall_s"' $L/results.jsonl | python3 -c "import sys,json;[print(d['label'],round(d['wall_s'],3),round(d['wall_s']/d['floor_s'],4), round(d['output_tok_s']), round(d['floor_s'],3)) for d in map(json.loads,sys.stdin)]"
tail -n 25 $L/bench_profile.log
timeout 150 python3 bench_serving.py --launch --label "session 66: $1 saturated, default clients" --results $L/results.jsonl > $L/serving_saturated.log 2>&1
tail -n 10 $L/serving_saturated.log
timeout 150 python3 bench_serving.py --launch --request-rate 16 --label "session 66: $1 Poisson 16/s, default clients" --results $L/results.jsonl > $L/serving_poisson.log 2>&1
tail -n 10 $L/serving_poisson.log
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
