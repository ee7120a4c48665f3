#!/bin/bash
# session 66 call 2: the saturated server, 70def66 (old) against this tree (new), alternating, with and
# without a Qwen-sized tokenizer; the new tree's bench_serving.py (its SSE fix) drives both; loop probe on.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/loops $OUT/logs
python3 -c "import tokenizers, sys; print('tokenizers', tokenizers.__version__, sys.version)"
REPO=$PWD
PYTHONPATH=/tmp/site:. timeout 200 python3 bench.py --num-seqs 1 --results /tmp/discard.jsonl > $OUT/logs/make_checkpoint.log 2>&1
CK=/root/.cache/mini_engine/qwen3-0.6b-random
TK=/tmp/qwen3-0.6b-random-tok; mkdir -p $TK; for f in $CK/*; do ln -sf $f $TK/; done
python3 ab_s66/qwen_sized_tokenizer.py $TK/tokenizer.json
serve() {   # tree-dir name model
  (cd $1 && LOOP_PROBE_DIR=$OUT/loops PYTHONPATH=/tmp/site:. python3 $REPO/ab_s66/probe_serve.py --model $3 --host 127.0.0.1 --port 8000 --max-model-len 2048 --max-num-seqs 256 --log-level warning > $OUT/logs/serve_$2.log 2>&1) &
  SP=$!
  PYTHONPATH=/tmp/site:. python3 ab_s66/wait_health.py http://127.0.0.1:8000/health 240 || { echo "server $2 not healthy"; tail -20 $OUT/logs/serve_$2.log; pkill -9 -f probe_serve.py; return; }
  SPID=$(pgrep -f "probe_serve.py --model" | head -1)
  python3 ab_s66/cpu_times.py $SPID > $OUT/logs/cpu_$2.txt
  { time PYTHONPATH=/tmp/site:. timeout 150 python3 bench_serving.py --port 8000 --label "session 66 call 2: serving $2" --results $OUT/logs/results.jsonl > $OUT/logs/bench_serving_$2.log 2>&1 ; } 2>> $OUT/logs/cpu_$2.txt
  python3 ab_s66/cpu_times.py $SPID >> $OUT/logs/cpu_$2.txt
  kill -INT $SPID; for i in $(seq 30); do kill -0 $SPID 2>/dev/null || break; sleep 1; done; kill -9 $SPID 2>/dev/null
  wait $SP; sleep 1
  for f in $OUT/loops/loop_*.json; do mv $f $OUT/loops/$2_$(basename $f); done
  echo "== $2: $(grep -h 'throughput' $OUT/logs/bench_serving_$2.log) | TPOT $(grep -h 'TPOT' $OUT/logs/bench_serving_$2.log) | TTFT $(grep -h 'TTFT' $OUT/logs/bench_serving_$2.log)"
  cat $OUT/logs/cpu_$2.txt
}
TIMEFORMAT="client cpu %U user %S sys %R wall"
TREE=ab_s66/old
TIMEFORMAT="client cpu %U user %S sys %R wall"
serve ab_s66/old old_plain_1 $CK
serve . new_plain_1 $CK
serve ab_s66/old old_tok_1 $TK
serve . new_tok_1 $TK
serve . new_plain_2 $CK
serve ab_s66/old old_plain_2 $CK
serve . new_tok_2 $TK
serve ab_s66/old old_tok_2 $TK
python3 ab_s66/loop_summary.py $OUT/loops/*.json
tar -czf $OUT/loops.tgz -C $OUT loops && rm -rf $OUT/loops
