#!/usr/bin/env bash
# The test suite (CPU; Triton kernels run through Triton's interpreter when there is no GPU), in
# PYTEST_WORKERS processes (pytest-xdist; default 2, CI's cores), each taking whole files, so that
# a file's servers and checkpoints are made once. PYTEST_WORKERS=0 runs it in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
python3 -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
