#!/usr/bin/env bash
# The GPU check (bench/README.md, "GPU check"): everything a lent GPU machine should run, in one
# command from the repository root, its outputs under $OUT.
#
#   bash bench/gpu_check.sh --prepare   # here, once, with a network: the wheels the GPU machine
#                                       # lacks and SmolLM2's tokenizer, into ignored folders
#   bash bench/gpu_check.sh             # there: install the wheels, assemble the pdmesh
#                                       # namespace, every CUDA test, `pdmesh selftest`,
#                                       # bench/gpu_throughput.py on a random-weight 8B shape
#
# The machine has torch, triton, transformers, protobuf (older than our stubs need), grpcio
# 1.84 (our stubs need >= 1.85.1), xxhash, pytest; not msgspec (the engine core's messages),
# pyzmq (its process), redis, pydantic, cryptography, fastapi (seen on an H100, 2026-11-28).
# The wheels for the tests' imports travel, fastapi's web stack does not (no CUDA test needs it). The wheels come from $PDMESH_WHEELS, else shared/wheels, else
# .cache/wheels; the tokenizer from $PDMESH_TOKENIZER, else .cache/smollm2-tokenizer (carry
# both folders). No SmolLM2 weights travel: every CUDA test builds random-weight models.
#
# Knobs: GPU_CHECK_STEPS (default "tests selftest bench"), GPU_CHECK_SHAPES (llama3-8b),
# per-step limits TESTS_TIMEOUT / SELFTEST_TIMEOUT / BENCH_TIMEOUT in seconds (the three
# defaults fit one 10-minute command), PDMESH_STRICT_SELFCHECK=1 to make an engine whose
# start-up self-check fails refuse to start.
set -uo pipefail
cd "$(dirname "$0")/.."

TOKENIZER=${PDMESH_TOKENIZER:-.cache/smollm2-tokenizer}
TOKENIZER_FILES="tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja"
WHEEL_PACKAGES="msgspec pyzmq protobuf redis xxhash pytest-timeout grpcio grpcio-health-checking grpcio-reflection pydantic pydantic_core annotated-types typing-inspection typing_extensions cryptography cffi pycparser"

wheel_dir() {
    if [ -n "${PDMESH_WHEELS:-}" ]; then echo "$PDMESH_WHEELS"
    elif [ -d shared/wheels ]; then echo shared/wheels
    else echo .cache/wheels; fi
}

prepare() {
    # The versions this tree's venv runs (its tests pass with them), for CPython 3.12 x86-64.
    local dir specs src
    dir=$(wheel_dir)
    mkdir -p "$dir" "$TOKENIZER"
    specs=$(.venv/bin/python -c "
import importlib.metadata as m
print(' '.join(f'{n}=={m.version(n)}' for n in '$WHEEL_PACKAGES'.split()))")
    .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$dir" $specs || return 1
    src=$(.venv/bin/pdmesh model path smollm2) || return 1
    for f in $TOKENIZER_FILES; do
        if [ -f "$src/$f" ]; then cp "$src/$f" "$TOKENIZER/"; fi
    done
    du -sh "$dir" "$TOKENIZER"
    echo "carry: [\"$dir\", \"$TOKENIZER\"]; command: bash bench/gpu_check.sh"
}

if [ "${1:-}" = "--prepare" ]; then
    prepare
    exit $?
fi

OUT=${OUT:-/tmp/gpu-check}
PY=${PYTHON:-python3}
STEPS=${GPU_CHECK_STEPS:-tests selftest bench}
SITE=/tmp/pdmesh-site
PKG=/tmp/pdmesh-pkg
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

summary() { echo "$*" | tee -a "$OUT/summary.txt"; }

install_wheels() {  # into a folder of their own, ahead of the machine's site-packages
    local wheels
    wheels=$(wheel_dir)
    compgen -G "$wheels/*.whl" >/dev/null || return 0
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$wheels"/*.whl
}

assemble_namespace() {  # pyproject's package-dir, as ../shared/GPU.md builds it
    rm -rf "$PKG" && mkdir -p "$PKG/pdmesh" && cp -r pdmesh/* "$PKG/pdmesh/" || return 1
    for d in engine kernels router prefill_svc decode_svc engine_svc kvstore gateway serve; do
        ln -sfn "$PWD/$d" "$PKG/pdmesh/$d"
    done
    ln -sfn "$PWD/protos/pdmesh/v1" "$PKG/pdmesh/v1"
    # The repository root last, for `tests`; python -P keeps its pdmesh/ from shadowing $PKG's,
    # and PYTHONSAFEPATH does the same for every child (`python -m pdmesh...`: engine cores,
    # tensor-parallel ranks, the KV self-check's receiver), which -P does not reach.
    export PYTHONPATH="$PKG:$SITE:$PWD"
    export PYTHONSAFEPATH=1
    export PDMESH_TEST_TOKENIZER="$PWD/$TOKENIZER"
    $PY -P -c "from pdmesh import LLM; import msgspec, zmq, google.protobuf as pb
print('imports ok; protobuf', pb.__version__)"
}

run_step() {  # name, limit in seconds, command...: its exit status goes to summary.txt
    local name=$1 limit=$2 rc started
    shift 2
    started=$(date +%s)
    timeout "$limit" "$@"
    rc=$?
    summary "$name: exit $rc in $(( $(date +%s) - started )) s"
    return "$rc"
}

cuda_tests() {  # every module that may hold a CUDA test; tests/cuda_selection.py keeps those
    local modules
    local modules per_test=()
    modules=$(grep -rlE "cuda\.is_available" tests --include="test_*.py" | sort)
    # A hung test costs its own minute, not the whole step's (pytest-timeout, if it travelled).
    if $PY -P -c "import pytest_timeout" 2>/dev/null; then
        per_test=(--timeout "${TEST_TIMEOUT_EACH:-90}")
    fi
    # shellcheck disable=SC2086
    run_step "cuda tests" "${TESTS_TIMEOUT:-220}" $PY -P -m pytest -p tests.cuda_selection \
        -p no:cacheprovider -q -rs --durations 15 --continue-on-collection-errors "${per_test[@]}" \
        --junitxml "$OUT/cuda_tests.xml" $modules
}

throughput() {
    local shape status=0
    for shape in ${GPU_CHECK_SHAPES:-llama3-8b}; do
        run_step "gpu_throughput $shape" "${BENCH_TIMEOUT:-240}" $PY -P bench/gpu_throughput.py \
            --tokenizer "$TOKENIZER" --shapes "$shape" \
            --json "$OUT/gpu_throughput_$shape.json" || status=1
    done
    return $status
}

check() {
    local step status=0
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    install_wheels || { summary "install: FAILED"; return 1; }
    assemble_namespace || { summary "imports: FAILED"; return 1; }
    for step in $STEPS; do
        case $step in
        tests) cuda_tests || status=1 ;;
        selftest) run_step "pdmesh selftest" "${SELFTEST_TIMEOUT:-100}" \
                      $PY -P -m pdmesh.cli selftest || status=1 ;;
        bench) throughput || status=1 ;;
        *) summary "unknown step $step"; status=1 ;;
        esac
    done
    return $status
}

check 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
