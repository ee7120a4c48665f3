#!/usr/bin/env bash
# The test suite (CPU; Triton kernels run through Triton's interpreter when there is no GPU), in
# PYTEST_WORKERS processes (pytest-xdist; default 2, CI's cores), each taking whole files, so that
# a file's servers and checkpoints are made once. PYTEST_WORKERS=0 runs it in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
# One intra-op thread a process: the workers (and the servers the tests start) already fill the
# cores, and torch's spinning threads then fight over them (1,485 tests: 7.2 min with torch's
# default of a thread a core, 4.6 min with one; benchmarks/NOTES.md entry 60).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python3 -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
