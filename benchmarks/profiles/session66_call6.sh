#!/bin/bash
# session 66 call 6: with a Qwen-sized tokenizer and 4 load generators (the client no longer the limit),
# 70def66 (old) against the final tree (new): one server each, two saturated runs, prefix cache reset between.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export MINI_ENGINE_GIT_COMMIT=$1 VLLM_SERVER_DEV_MODE=1
L=$OUT/logs; mkdir -p $L
REPO=$PWD
PYTHONPATH=/tmp/site:. timeout 120 python3 bench.py --num-seqs 1 --results /tmp/discard.jsonl > $L/checkpoint.log 2>&1
CK=/root/.cache/mini_engine/qwen3-0.6b-random
TK=/tmp/qwen3-0.6b-random-tok; mkdir -p $TK; for f in $CK/*; do ln -sf $f $TK/; done
python3 ab_s66/qwen_sized_tokenizer.py $TK/tokenizer.json > /dev/null
for tree in old new; do
  dir=$([ $tree = old ] && echo ab_s66/old || echo .)
  (cd $dir && PYTHONPATH=/tmp/site:. python3 -m mini_engine.serve --model $TK --host 127.0.0.1 --port 8000 --max-model-len 2048 --max-num-seqs 256 --log-level warning > $L/serve_$tree.log 2>&1) &
  PYTHONPATH=/tmp/site:. python3 ab_s66/wait_health.py http://127.0.0.1:8000/health 240 || { echo "$tree not healthy"; tail -20 $L/serve_$tree.log; continue; }
  for k in 1 2; do
    PYTHONPATH=/tmp/site:. python3 -c "import httpx; httpx.post('http://127.0.0.1:8000/reset_prefix_cache', timeout=30).raise_for_status()"
    PYTHONPATH=/tmp/site:. timeout 150 python3 bench_serving.py --port 8000 --clients 4 --label "session 66 call 6: $tree tree, Qwen-sized tokenizer, 4 clients (run $k)" --results $L/results.jsonl > $L/bench_${tree}_$k.log 2>&1
    echo "$tree run $k: $(grep -h throughput $L/bench_${tree}_$k.log | sed 's/  */ /g') | TTFT p50 $(grep TTFT $L/bench_${tree}_$k.log | awk '{print $4}') | TPOT p50 $(grep TPOT $L/bench_${tree}_$k.log | awk '{print $4}')"
  done
  pkill -INT -f "mini_engine.serve --model $TK"; sleep 3; pkill -9 -f "mini_engine.serve --model $TK"; sleep 1
done
tar -czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
