#!/usr/bin/env bash
# The test suite (CPU; Triton kernels run through Triton's interpreter when there is no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
python3 -m pytest -q "$@"
