export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
N0=$(wc -l < benchmarks/results.jsonl)
date; timeout 150 python benchmarks/variants/sweep_persistent.py 96 > $OUT/sweep.log 2>&1
grep -A12 "run totals" $OUT/sweep.log; grep "kernel {" $OUT/sweep.log; tail -1 $OUT/sweep.log
CFG=$(python -c "
import json; d=json.load(open('$OUT/persistent_sweep.json')); g=d['totals']['cur']-d['totals'][d['best']]
print(json.dumps(d['config']) if g>0.03 else '')")
echo "CFG=$CFG"
if [ -n "$CFG" ]; then
  for i in 1 2 3; do
    python benchmarks/variants/ab_engine.py "" "{}" --label "A/B engine kernel ($1), run $i" 2>&1 | tail -1
    python benchmarks/variants/ab_engine.py persistent_rows_pa "$CFG" --label "A/B persistent $CFG, run $i" 2>&1 | tail -1
  done
fi
tail -n +$((N0+1)) benchmarks/results.jsonl > $OUT/results_new.jsonl
python -c "
import json
for l in open('$OUT/results_new.jsonl'):
    d=json.loads(l); print(d['label'], round(d['wall_s'],3), round(d['output_tok_s']), round(d['floor_fraction'],3))"
date
