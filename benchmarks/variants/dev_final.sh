export PYTHONPATH=. MINI_ENGINE_GIT_COMMIT=$1
N0=$(wc -l < benchmarks/results.jsonl)
date; timeout 60 python benchmarks/variants/regs.py > $OUT/regs.log 2>&1; tail -25 $OUT/regs.log
python bench.py --label "$1 (row ids, tile 64), profiled" --profile $OUT/prof 2>&1 | tail -25 > $OUT/ab.log
for i in 1 2; do
  python benchmarks/variants/ab_engine.py old_pa "{}" --label "A/B old decode kernel (20de2ab), run $i" 2>&1 | tail -1 >> $OUT/ab.log
  python bench.py --label "$1 (row ids, tile 64), run $i" 2>&1 | tail -1 >> $OUT/ab.log
done
tail -n +$((N0+1)) benchmarks/results.jsonl > $OUT/results_new.jsonl
python -c "
import json
for l in open('$OUT/results_new.jsonl'):
    d=json.loads(l); print(d['label'], round(d['wall_s'],3), round(d['output_tok_s']), round(d['floor_fraction'],3))"
date; timeout 170 python -m pytest -q tests/kernels tests/runner tests/engine 2>&1 | tail -4 > $OUT/pytest_gpu.log; cat $OUT/pytest_gpu.log
date; timeout 280 python benchmarks/gpu_correctness.py > $OUT/gpu_correctness.log 2>&1; tail -5 $OUT/gpu_correctness.log; grep -c PASS $OUT/gpu_correctness.log
date
