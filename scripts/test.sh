#!/usr/bin/env bash
# Set up (idempotent), then lint, check the generated gRPC stubs are current, and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python protos/generate.py --check
exec .venv/bin/pytest -q "$@"
