#!/bin/bash
# session 69 call 3: piecewise CUDA graphs where mixed steps are many: served at Poisson 16 requests/s (FULL_AND_PIECEWISE, then FULL_DECODE_ONLY); bench at a 2048-token step budget both ways; GPU tests of the draft model and LoRA (pieces off there).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/logs/gpu.txt 2>&1
R=$OUT/logs/results.jsonl
s() { timeout 150 python3 -u bench_serving.py --launch --request-rate 16 --label "session 69 call 3: $1" "${@:2}" --results $R > $OUT/logs/serve_$1.log 2>&1; echo "$1 rc=$?"; grep -E "TTFT|TPOT|E2E|throughput" $OUT/logs/serve_$1.log; }
s poisson16_pieces
s poisson16_full_decode_only --server-args "-cc.cudagraph_mode=FULL_DECODE_ONLY"
FDO='{"cudagraph_mode": "FULL_DECODE_ONLY"}'
b() { timeout 120 python3 bench.py --label "session 69 call 3: $1" "${@:2}" --results $R > $OUT/logs/bench_$1.log 2>&1; echo "$1 rc=$? $(grep -E '^wall' $OUT/logs/bench_$1.log) | $(grep -iE '^CUDA graphs|warn|Error' $OUT/logs/bench_$1.log | head -3)"; }
b mnbt2048_pieces --max-num-batched-tokens 2048
b mnbt2048_full_decode_only --max-num-batched-tokens 2048 --compilation-config "$FDO"
timeout 150 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/engine/test_draft_model.py tests/engine/test_lora.py tests/engine/test_sampling_end_to_end.py > $OUT/logs/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -2 $OUT/logs/gpu_tests.log; grep -E "^FAILED|^ERROR" $OUT/logs/gpu_tests.log | head -8
cat $OUT/logs/gpu.txt
tar -czf $OUT/logs.tgz -C $OUT logs
