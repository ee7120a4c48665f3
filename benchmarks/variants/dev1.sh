set -x
export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
N0=$(wc -l < benchmarks/results.jsonl)
date; timeout 180 python benchmarks/variants/sweep_swapped.py 96 > $OUT/sweep.log 2>&1
tail -25 $OUT/sweep.log
CFG=$(python -c "
import json; d=json.load(open('$OUT/swapped_sweep.json')); g=d['totals']['cur']-d['totals'][d['best']]
c={k:v for k,v in d['config'].items() if v is not None}; print(json.dumps(c) if g>0.02 else '')")
echo "CFG=$CFG"
if [ -n "$CFG" ]; then
  for i in 1 2; do
    timeout 130 python benchmarks/variants/ab_engine.py '{}' --label "A/B cur run $i" 2>&1 | tail -3 >> $OUT/ab.log
    timeout 130 python benchmarks/variants/ab_engine.py "$CFG" --label "A/B swapped $CFG run $i" 2>&1 | tail -3 >> $OUT/ab.log
  done
fi
date; cat $OUT/ab.log
tail -n +$((N0+1)) benchmarks/results.jsonl > $OUT/results_new.jsonl
