#!/bin/bash
# KV block size A/B on one machine (bench.py --block-size), HEAD's code.
export PYTHONPATH=.
H=$(git rev-parse --short HEAD); export MINI_ENGINE_GIT_COMMIT=$H
i=0
for bs in "$@"; do
  i=$((i+1))
  timeout 200 python bench.py --block-size $bs --results $OUT/results_new.jsonl \
      --label "A/B session 42: block_size $bs ($H)" > $OUT/bench_bs_${i}_$bs.log 2>&1
  echo "block_size $bs: $(grep -E '^wall' $OUT/bench_bs_${i}_$bs.log) $(grep -E '^checks' $OUT/bench_bs_${i}_$bs.log)"
done
python -c "
import json
for l in open('$OUT/results_new.jsonl'):
    r=json.loads(l); print(round(r['wall_s'],3), round(r['output_tok_s']), round(r['floor_s'],3), round(r['wall_s']/r['floor_s'],4), r['label'])"
