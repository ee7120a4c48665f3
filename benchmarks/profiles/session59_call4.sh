#!/bin/bash
# session 59 call 4: A/B on one machine, default runs: 002bb89 (session 58's tree) against cb610e5 (this session's), interleaved.
export PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $OUT/gpu.txt 2>&1
for i in 1 2; do
  for t in old:002bb89 tree:cb610e5; do
    dir=${t%%:*}; rev=${t##*:}
    (cd ab_s59/$dir && MINI_ENGINE_GIT_COMMIT=$rev timeout 100 python3 bench.py --label "A/B session 59: $rev default, run $i" --results $OUT/results.jsonl > $OUT/bench_${rev}_$i.log 2>&1; echo "$rev run $i rc=$?")
  done
done
