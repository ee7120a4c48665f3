#!/bin/bash
# session 69 call 2: piecewise CUDA graphs (FULL_AND_PIECEWISE, the new default): GPU tests; the default bench and FULL_DECODE_ONLY; bench at a 512-token step budget (every prefill step mixed and small) both ways; gpu_correctness.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/logs/gpu.txt 2>&1
R=$OUT/logs/results.jsonl
timeout 240 python3 -m pytest -q -p no:xdist -p no:cacheprovider -x tests/runner/test_piecewise_graph.py tests/runner/test_cuda_graph.py tests/test_compilation_config.py tests/kernels/test_rotary_kv.py tests/engine/test_speculative.py tests/engine/test_prompt_logprobs.py tests/engine/test_weight_updates.py > $OUT/logs/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -2 $OUT/logs/gpu_tests.log; grep -E "^FAILED|^ERROR|Error" $OUT/logs/gpu_tests.log | head -8
FDO='{"cudagraph_mode": "FULL_DECODE_ONLY"}'
b() { timeout 120 python3 bench.py --label "session 69 call 2: $1" "${@:2}" --results $R > $OUT/logs/bench_$1.log 2>&1; echo "$1 rc=$? $(grep -E '^wall' $OUT/logs/bench_$1.log) $(grep -oE 'achieved [0-9.]+%' $OUT/logs/bench_$1.log) | $(grep -iE '^CUDA graphs|warn|Error' $OUT/logs/bench_$1.log | head -3)"; }
b default
b full_decode_only --compilation-config "$FDO"
b mnbt512_pieces --max-num-batched-tokens 512
b mnbt512_full_decode_only --max-num-batched-tokens 512 --compilation-config "$FDO"
timeout 200 python3 benchmarks/gpu_correctness.py --out $OUT/logs/correctness > $OUT/logs/gpu_correctness.log 2>&1
echo "gpu_correctness rc=$?"; grep -iE "graphs vs|ALL PASSED|FAIL" $OUT/logs/gpu_correctness.log | cut -c1-200 | head -14
cat $OUT/logs/gpu.txt
tar -czf $OUT/logs.tgz -C $OUT logs
