set -u
export PYTHONPATH=.
n=0
for P in 1 0 0 1 0 1; do
  n=$((n+1))
  MINI_ENGINE_PDL=$P MINI_ENGINE_GIT_COMMIT=$COMMIT timeout 100 python bench.py --label "A/B MINI_ENGINE_PDL=$P, balanced order (1 0 0 1 0 1), run $n" --results $OUT/results_new.jsonl >> $OUT/bench.log 2>&1; echo "PDL=$P run $n rc=$? $(grep -o 'wall [0-9.]* s' $OUT/bench.log | tail -1)"
done
