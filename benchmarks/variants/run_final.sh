#!/bin/bash
# Session 42's last device call: the CUDA default block size 64 (+ the prefill kernel's unspecialised
# table stride) against HEAD, fresh Triton caches so that a compile inside the timed run shows; then
# gpu_correctness and the GPU tests on the new tree.
export PYTHONPATH=.
ROOT=$PWD
H=$(git rev-parse --short HEAD)
NEWC=$(mktemp -d); OLD64C=$(mktemp -d); OLDC=$(mktemp -d)
run() {  # tree tag cache [bench args]
  local tree=$1 tag=$2 cache=$3; shift 3
  if [ $tree = new ]; then dir=.; commit="$H+block64"; else dir=ab_s42/old; commit=$H; fi
  echo "=== $tag" >> $OUT/ab_runs.log
  (cd $dir && TRITON_CACHE_DIR=$cache MINI_ENGINE_GIT_COMMIT=$commit PYTHONPATH=. timeout 150 \
      python $ROOT/ab_s42/clock_watch.py "$@" --results $OUT/results_new.jsonl --label "A/B session 42: $tag" 2>&1 \
      | grep -v -i warn >> $OUT/ab_runs.log)
  echo "$tag: $(grep -E '^wall' $OUT/ab_runs.log | tail -1 | cut -c1-50) | $(grep -E 'Triton cache entries' $OUT/ab_runs.log | tail -1 | cut -c1-250)"
}
run new "block 64 default (new), fresh cache" $NEWC
run old "HEAD at --block-size 64, fresh cache" $OLD64C --block-size 64
run old "HEAD (block 16), fresh cache" $OLDC
run old "HEAD (block 16)" $OLDC
run new "block 64 default (new)" $NEWC
python -c "
import json
for l in open('$OUT/results_new.jsonl'):
    r=json.loads(l); print(round(r['wall_s'],3), round(r['output_tok_s']), round(r['floor_s'],3), round(r['wall_s']/r['floor_s'],4), r['git_commit'], r['label'])"
mkdir -p $OUT/gc
TRITON_CACHE_DIR=$NEWC timeout 150 python benchmarks/gpu_correctness.py --out $OUT/gc > $OUT/gpu_correctness.log 2>&1
grep -v "^ *$" $OUT/gpu_correctness.log | grep -v -i warn | tail -5 | cut -c1-200
TRITON_CACHE_DIR=$NEWC timeout 115 python -m pytest -q tests/kernels/test_paged_attention.py tests/runner \
    > $OUT/pytest_gpu.log 2>&1
tail -2 $OUT/pytest_gpu.log; grep FAILED $OUT/pytest_gpu.log | head -5
