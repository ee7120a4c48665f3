#!/bin/bash
# session 67 call 4: AsyncLLM's tests on the H200 (encode for a pooling model, the profile, CUDA IPC weight updates).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. MINI_ENGINE_GIT_COMMIT=$1
mkdir -p $OUT/logs
timeout 400 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/engine/test_async_llm.py tests/engine/test_long_prefill_threshold.py > $OUT/logs/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -3 $OUT/logs/gpu_tests.log; grep -E "^FAILED|^ERROR" $OUT/logs/gpu_tests.log | head
