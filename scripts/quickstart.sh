#!/usr/bin/env bash
# Fresh machine to a real answer: set up, start a local mesh (redis, router, 1 prefill,
# 1 decode and the OpenAI API as separate processes), ask it one question through the router
# (gRPC) and one through the OpenAI API, then shut it down. PORT=0 picks a free HTTP port.
# Each stage prints one line; the installer's and the mesh's output is kept in a log and shown
# only when something fails.
set -euo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
mesh=""
cleanup() {
  if [ -n "$mesh" ]; then kill -TERM "$mesh" 2>/dev/null || true; wait "$mesh" 2>/dev/null || true; fi
  rm -f "$log"
}
trap cleanup EXIT
stage() { printf '==> %s\n' "$*"; }
fail() { echo "quickstart: $1; its output:" >&2; cat "$log" >&2; exit 1; }

stage "installing (a virtualenv in .venv; a few minutes the first time)"
bash scripts/setup.sh >"$log" 2>&1 || fail "setup failed"
stage "converting the model (SmolLM2-135M-Instruct, once)"
.venv/bin/pdmesh model path smollm2 >"$log" 2>&1 || fail "the model conversion failed"
stage "starting the mesh (redis, router, 1 prefill, 1 decode, OpenAI API)"
.venv/bin/pdmesh serve smollm2 --port "${PORT:-${GATEWAY_PORT:-8000}}" --kv-cache-memory 512MiB \
  --local-prefill-threshold 0 >"$log" 2>&1 &
mesh=$!
# Wait for the mesh's ready line (bounded: 5 minutes).
for _ in $(seq 600); do
  grep -q '^ready ' "$log" && break
  kill -0 "$mesh" 2>/dev/null || fail "the mesh exited"
  sleep 0.5
done
grep -q '^ready ' "$log" || fail "the mesh did not start within 5 minutes"
router=$(awk '/^ready /{print $2; exit}' "$log")
url=$(grep -o 'gateway=[^ ]*' "$log" | head -1 | cut -d= -f2)
stage "asking (router gRPC at $router, OpenAI API at $url)"
question="What is the capital of France? Answer in one sentence."
echo "Q: $question"
printf 'A: '
.venv/bin/pdmesh ask --router "$router" --max-tokens 48 "$question"
echo
echo "POST $url/chat/completions"
curl -sS "$url/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "smollm2", "max_tokens": 48, "temperature": 0,
  "messages": [{"role": "user", "content": "Name three primary colors."}]}'
echo
stage "done; stopping the mesh"
