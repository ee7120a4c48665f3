#!/bin/bash
# session 66 call 1: where the saturated server's time goes against bench.py's (loop probe), with and without a Qwen-sized tokenizer.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=70def66 LOOP_PROBE_DIR=$OUT/loops
mkdir -p $OUT/loops $OUT/logs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/logs/gpu.txt 2>&1
lscpu > $OUT/logs/cpu.txt 2>&1; nproc >> $OUT/logs/cpu.txt
TIMEFORMAT="client cpu %U user %S sys %R wall"
timeout 240 python3 ab_s66/probe_bench.py --label "session 66 call 1: offline with the loop probe" --results $OUT/logs/results.jsonl > $OUT/logs/offline.log 2>&1
echo "offline rc=$?"; tail -6 $OUT/logs/offline.log
for f in $OUT/loops/loop_*.json; do mv $f $OUT/loops/offline_$(basename $f); done
CK=${CK:-/root/.cache/mini_engine/qwen3-0.6b-random}
TK=/tmp/qwen3-0.6b-random-tok; mkdir -p $TK; for f in $CK/*; do ln -sf $f $TK/; done
python3 ab_s66/qwen_sized_tokenizer.py $TK/tokenizer.json
serve() {
  python3 ab_s66/probe_serve.py --model $2 --host 127.0.0.1 --port 8000 --max-model-len 2048 --max-num-seqs 256 --log-level warning > $OUT/logs/serve_$1.log 2>&1 &
  SP=$!
  python3 ab_s66/wait_health.py http://127.0.0.1:8000/health 240 || { echo "server $1 not healthy"; tail -20 $OUT/logs/serve_$1.log; kill -9 $SP; return; }
  python3 ab_s66/cpu_times.py $SP > $OUT/logs/cpu_$1.txt
  { time timeout 150 python3 bench_serving.py --port 8000 --label "session 66 call 1: serving $1" --results $OUT/logs/results.jsonl > $OUT/logs/bench_serving_$1.log 2>&1 ; } 2>> $OUT/logs/cpu_$1.txt
  python3 ab_s66/cpu_times.py $SP >> $OUT/logs/cpu_$1.txt
  kill -INT $SP; for i in $(seq 30); do kill -0 $SP 2>/dev/null || break; sleep 1; done; kill -9 $SP 2>/dev/null
  sleep 1
  for f in $OUT/loops/loop_*.json; do mv $f $OUT/loops/serve_$1_$(basename $f); done
  echo "== serving $1"; tail -7 $OUT/logs/bench_serving_$1.log; cat $OUT/logs/cpu_$1.txt
}
serve plain $CK
serve tokenizer $TK
python3 ab_s66/loop_summary.py $OUT/loops/*.json
