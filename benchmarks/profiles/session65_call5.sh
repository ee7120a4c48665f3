#!/bin/bash
# session 65 call 5 (H200, warm): serving saturated, 9bf5e34 against 0a47762 on one machine, alternating.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p $OUT/logs
for round in 1 2; do
  (cd ab_s65/old && PYTHONPATH=/tmp/site:. timeout 120 python3 -u bench_serving.py --launch --label "session 65: 9bf5e34 saturated A/B round $round" --results $OUT/logs/results.jsonl > $OUT/logs/old_$round.log 2>&1)
  PYTHONPATH=/tmp/site:. timeout 120 python3 -u bench_serving.py --launch --label "session 65: 0a47762 saturated A/B round $round" --results $OUT/logs/results.jsonl > $OUT/logs/new_$round.log 2>&1
done
grep -h '"wall_s"' $OUT/logs/results.jsonl | python3 -c "import sys,json;[print(d['label'],round(d['wall_s'],3), round(d['output_tok_s']), d['tpot_ms']['p50']) for d in map(json.loads,sys.stdin)]"
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
