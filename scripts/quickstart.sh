#!/usr/bin/env bash
# Fresh machine to a real answer: set up, start a local mesh (redis, router, 1 prefill,
# 1 decode and the OpenAI gateway as separate processes), ask it one question through the router
# (gRPC) and one through the OpenAI API, then shut it down. GATEWAY_PORT=0 picks a free port.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
log=$(mktemp)
.venv/bin/pdmesh serve --port 0 --gateway-port "${GATEWAY_PORT:-8000}" --kv-cache-memory 512MiB \
  --local-prefill-threshold 0 >"$log" 2>&1 &
mesh=$!
trap 'kill -TERM "$mesh" 2>/dev/null; wait "$mesh" 2>/dev/null || true; rm -f "$log"' EXIT
# Wait for the mesh's ready line (bounded: 5 minutes).
for _ in $(seq 600); do
  grep -q '^ready ' "$log" && break
  kill -0 "$mesh" 2>/dev/null || { cat "$log"; echo "quickstart: the mesh exited" >&2; exit 1; }
  sleep 0.5
done
grep -q '^ready ' "$log" || { cat "$log"; echo "quickstart: the mesh did not start" >&2; exit 1; }
router=$(awk '/^ready /{print $2; exit}' "$log")
grep -v '^ready ' "$log" || true
question="What is the capital of France? Answer in one sentence."
echo "Q: $question"
printf 'A: '
.venv/bin/pdmesh ask --router "$router" --max-tokens 48 "$question"
url=$(grep -o 'gateway=[^ ]*' "$log" | head -1 | cut -d= -f2)
echo
echo "POST $url/chat/completions"
curl -sS "$url/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "smollm2", "max_tokens": 48, "temperature": 0,
  "messages": [{"role": "user", "content": "Name three primary colors."}]}'
echo
