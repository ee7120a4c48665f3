#!/bin/bash
# session 69 call 4: the FULL_DECODE_ONLY side of call 3's serving A/B (its flag was mis-passed), then the pieces side again.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
R=$OUT/logs/results.jsonl
s() { timeout 150 python3 -u bench_serving.py --launch --request-rate 16 --label "session 69 call 4: $1" "${@:2}" --results $R > $OUT/logs/serve_$1.log 2>&1; echo "$1 rc=$?"; grep -E "TTFT|TPOT|E2E|throughput" $OUT/logs/serve_$1.log; }
s poisson16_full_decode_only --server-args=-cc.cudagraph_mode=FULL_DECODE_ONLY
s poisson16_pieces
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/logs/gpu.txt 2>&1
tar -czf $OUT/logs.tgz -C $OUT logs
