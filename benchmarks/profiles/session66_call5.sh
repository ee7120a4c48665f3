#!/bin/bash
# session 66 call 5: the final tree's served path on the GPU: one server (dev mode), the benchmark's
# saturated run with 4 load generators twice (prefix cache reset between), then its /metrics' new series.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export MINI_ENGINE_GIT_COMMIT=$1 PYTHONPATH=/tmp/site:. VLLM_SERVER_DEV_MODE=1
L=$OUT/logs; mkdir -p $L
timeout 120 python3 bench.py --num-seqs 1 --results /tmp/discard.jsonl > $L/checkpoint.log 2>&1
CK=/root/.cache/mini_engine/qwen3-0.6b-random
python3 -m mini_engine.serve --model $CK --host 127.0.0.1 --port 8000 --max-model-len 2048 --max-num-seqs 256 --log-level warning > $L/serve.log 2>&1 &
SP=$!
python3 ab_s66/wait_health.py http://127.0.0.1:8000/health 240 || { echo "not healthy"; tail -30 $L/serve.log; exit 1; }
for k in 1 2; do
  python3 -c "import httpx; print('reset', httpx.post('http://127.0.0.1:8000/reset_prefix_cache', timeout=30).status_code)"
  timeout 150 python3 bench_serving.py --port 8000 --label "session 66 call 5: $1 saturated (run $k)" --results $L/results.jsonl > $L/bench_$k.log 2>&1
  tail -n 9 $L/bench_$k.log
done
python3 -c "
import httpx
from prometheus_client.parser import text_string_to_metric_families
for f in text_string_to_metric_families(httpx.get('http://127.0.0.1:8000/metrics').text):
    if any(k in f.name for k in ('request_', 'iteration_tokens', 'prefix_cache_q', 'prefix_cache_h', 'e2e')):
        s = {x.name: x.value for x in f.samples if not x.name.endswith('_bucket') and not x.name.endswith('_created')}
        print(f.name, f.type, s)
" > $L/metrics.txt 2>&1
cat $L/metrics.txt
kill -INT $SP; wait $SP
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
