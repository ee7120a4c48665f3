#!/bin/bash
# Decode attention's energy by variant, then whole runs new (working tree) / old (HEAD) under the clock watch.
export PYTHONPATH=.
H=$(git rev-parse --short HEAD)
timeout 240 python ab_s42/attn_energy.py 256 128 2>&1 | grep -v -i warn | tee $OUT/attn_energy.log
run() {  # tree label
  if [ "$1" = new ]; then dir=.; commit="$H+padded-rows-masked"; else dir=ab_s42/old; commit=$H; fi
  (cd $dir && MINI_ENGINE_GIT_COMMIT=$commit PYTHONPATH=. timeout 200 python $OLDPWD/ab_s42/clock_watch.py \
      --results $OUT/results_new.jsonl --label "A/B session 42: $1 (padded decode rows masked: new)" 2>&1 \
      | grep -v -i warn > $OUT/clock_ab_$2.log)
  grep -E "^wall|^timed run:" $OUT/clock_ab_$2.log | cut -c1-220
}
run new 1; run old 2; run old 3; run new 4
python -c "
import json
for l in open('$OUT/results_new.jsonl'):
    r=json.loads(l); print(round(r['wall_s'],3), round(r['output_tok_s']), round(r['floor_s'],3), round(r['wall_s']/r['floor_s'],4), r['git_commit'], r['label'])"
