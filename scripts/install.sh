#!/usr/bin/env bash
# Installs what mini_engine needs, skipping what is already importable (the GPU machine has its own
# CUDA torch and no network). Usage: install.sh [engine|test]; test adds the test suite's needs.
# torch is pinned: an unpinned torch pulls a multi-GB CUDA build. On this project's CPU machines the
# pin resolves to a CPU wheel kept on the machine (pip's find-links); see the README for elsewhere.
set -euo pipefail
specs=(triton safetensors tqdm numpy)
if [[ "${1:-engine}" == test ]]; then
    specs+=(pytest hypothesis transformers fastapi uvicorn jinja2 prometheus_client:prometheus-client
            openai httpx matplotlib xgrammar xdist:pytest-xdist peft)
fi
need=()
python3 -c "import torch" 2>/dev/null || need+=("torch==2.13.0")
# The detokenizer streams with DecodeStream, new in tokenizers 0.21.
python3 -c "from tokenizers.decoders import DecodeStream" 2>/dev/null || need+=("tokenizers>=0.21")
for spec in "${specs[@]}"; do
    module=${spec%%:*}; package=${spec##*:}
    python3 -c "import $module" 2>/dev/null || need+=("$package")
done
if ((${#need[@]})); then
    python3 -m pip install --quiet --disable-pip-version-check "${need[@]}"
fi
