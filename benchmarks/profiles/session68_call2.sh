#!/bin/bash
# session 68 call 2: the GPU tests call 1 missed (wrong path); where an eager decode step's time goes (Triton compiles? host?).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/logs/gpu.txt 2>&1
timeout 300 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/runner/test_cuda_graph.py tests/test_compilation_config.py tests/engine/test_draft_model.py tests/runner/test_pdl.py > $OUT/logs/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -3 $OUT/logs/gpu_tests.log; grep -E "^FAILED|^ERROR" $OUT/logs/gpu_tests.log | head
R=$OUT/logs/results.jsonl
timeout 200 python3 benchmarks/host_stalls.py --slow-step-ms 30 --profile-step 600 --compilation-config '{"cudagraph_mode": "NONE"}' --label "session 68 call 2: no graphs, host_stalls" --results $R > $OUT/logs/stalls_no_graphs.log 2>&1
echo "stalls rc=$?"; grep -E "^wall" $OUT/logs/stalls_no_graphs.log; grep -c "compil" $OUT/logs/stalls_no_graphs.log
timeout 200 python3 bench.py --compilation-config '{"cudagraph_mode": "NONE"}' --profile $OUT/logs/prof_no_graphs --label "session 68 call 2: no graphs, profiled" --results $R > $OUT/logs/bench_no_graphs_profile.log 2>&1
echo "profile rc=$?"; grep -E "^wall" $OUT/logs/bench_no_graphs_profile.log; grep -A16 "step kind" $OUT/logs/bench_no_graphs_profile.log | head -20
cat $OUT/logs/gpu.txt
tar -czf $OUT/logs.tgz -C $OUT logs
