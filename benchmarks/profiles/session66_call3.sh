#!/bin/bash
# session 66 call 3: is bench_serving's one client process the saturated run's limit? One server (dev mode:
# the prefix cache reset between runs), runs with 1, 2 and 4 load-generator processes, alternating;
# then the same with a Qwen-sized tokenizer; bench.py once for the machine's offline figure.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export MINI_ENGINE_GIT_COMMIT=$1 PYTHONPATH=/tmp/site:. VLLM_SERVER_DEV_MODE=1
L=$OUT/logs; mkdir -p $L
timeout 200 python3 bench.py --label "session 66 call 3: offline reference" --results $L/results.jsonl > $L/offline.log 2>&1
grep -h "^wall\|achieved" $L/offline.log
CK=/root/.cache/mini_engine/qwen3-0.6b-random
TK=/tmp/qwen3-0.6b-random-tok; mkdir -p $TK; for f in $CK/*; do ln -sf $f $TK/; done
python3 ab_s66/qwen_sized_tokenizer.py $TK/tokenizer.json > /dev/null
reset() { python3 -c "import httpx; r = httpx.post('http://127.0.0.1:8000/reset_prefix_cache', timeout=30); print('reset', r.status_code)"; }
series() {   # name model clients...
  name=$1; model=$2; shift 2
  python3 -m mini_engine.serve --model $model --host 127.0.0.1 --port 8000 --max-model-len 2048 --max-num-seqs 256 --log-level warning > $L/serve_$name.log 2>&1 &
  SP=$!
  python3 ab_s66/wait_health.py http://127.0.0.1:8000/health 240 || { echo "server $name not healthy"; tail -20 $L/serve_$name.log; kill -9 $SP; return; }
  k=0
  for c in "$@"; do
    k=$((k+1)); reset
    timeout 150 python3 bench_serving.py --port 8000 --clients $c --label "session 66 call 3: $name, $c clients (run $k)" --results $L/results.jsonl > $L/bench_${name}_${k}_c$c.log 2>&1
    echo "$name run $k, $c clients: $(grep -h 'throughput' $L/bench_${name}_${k}_c$c.log | sed 's/  */ /g') | TTFT p50 $(grep TTFT $L/bench_${name}_${k}_c$c.log | awk '{print $4}') | TPOT p50 $(grep TPOT $L/bench_${name}_${k}_c$c.log | awk '{print $4}') | $(grep -h 'load generator' $L/bench_${name}_${k}_c$c.log | sed 's/  */ /g')"
  done
  kill -INT $SP; for i in $(seq 30); do kill -0 $SP 2>/dev/null || break; sleep 1; done; kill -9 $SP 2>/dev/null; wait $SP 2>/dev/null
}
series plain $CK 1 2 4 1 2 4
series tokenizer $TK 1 4 1 4
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
