#!/usr/bin/env bash
# The benchmark of the origin document on the embedded default checkpoint (a scaled-down,
# labelled workload on a tiny model when there is no GPU). Extra arguments go to bench.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh engine
python3 bench.py "$@"
