#!/usr/bin/env bash
# Set up with the test tools (idempotent), then lint, check the generated gRPC stubs are current,
# and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/ruff check .
.venv/bin/python protos/generate.py --check
exec .venv/bin/pytest -q "$@"
