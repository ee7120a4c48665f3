export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
N0=$(wc -l < benchmarks/results.jsonl)
date; timeout 150 python benchmarks/variants/sweep_rowids.py 96 > $OUT/sweep.log 2>&1
tail -12 $OUT/sweep.log
CFG=$(python -c "
import json; d=json.load(open('$OUT/rowids_sweep.json')); g=d['totals']['cur']-d['totals'][d['best']]
c={k:v for k,v in d['config'].items() if v is not None}; print(json.dumps(c) if g>0.02 else '')")
echo "CFG=$CFG"
if [ -n "$CFG" ]; then
  for i in 1 2 3; do
    python benchmarks/variants/ab_engine.py "" "{}" --label "A/B engine kernel, run $i" 2>&1 | tail -2
    python benchmarks/variants/ab_engine.py rowids_pa "$CFG" --label "A/B rowids $CFG, run $i" 2>&1 | tail -2
  done
fi
date
tail -n +$((N0+1)) benchmarks/results.jsonl > $OUT/results_new.jsonl
