#!/bin/bash
# max_num_batched_tokens A/B on one machine, each run under the NVML clock watch.
export PYTHONPATH=.
H=$(git rev-parse --short HEAD); export MINI_ENGINE_GIT_COMMIT=$H
i=0
for mbt in "$@"; do
  i=$((i+1))
  echo "=== max_num_batched_tokens $mbt"
  timeout 200 python ab_s42/clock_watch.py --max-num-batched-tokens $mbt --results $OUT/results_new.jsonl \
      --label "A/B session 42: max_num_batched_tokens $mbt ($H)" 2>&1 | grep -v -i warn > $OUT/clock_mbt_${i}_$mbt.log
  grep -E "^wall|^floor|^timed run|power W" $OUT/clock_mbt_${i}_$mbt.log | cut -c1-200
done
python -c "
import json
for l in open('$OUT/results_new.jsonl'):
    r=json.loads(l); print(round(r['wall_s'],3), round(r['output_tok_s']), round(r['floor_s'],3), round(r['wall_s']/r['floor_s'],4), r['label'])"
