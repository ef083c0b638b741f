#!/usr/bin/env bash
# End-to-end check of the Compose stack serving a GGUF model, as a user runs it:
#   build, up, one chat request over HTTP and one through the Python client, scale to 2 workers,
#   kill one worker under load (every request must finish with all its tokens), scale back to 2,
#   scale down to 1 under load (the stopped worker drains: every request finishes), down.
#
#   compose/smoke.sh /path/to/SmolLM2-135M-Instruct.Q4_1.gguf
#
# Settings (environment): every ZEROSERVE_* build variable of docker-compose.yml (ZEROSERVE_BASE_IMAGE,
# ZEROSERVE_PIP_INDEX_URL, ZEROSERVE_CA_BUNDLE...) reaches the build. Also:
#   SMOKE_WHEELS=DIR   serve the wheels in DIR (e.g. a local torch) to the build as a package index
#                      on the docker bridge, as ZEROSERVE_TORCH_INDEX_URL (see compose/README.md)
#   SMOKE_NO_BUILD=1   use the image as built; SMOKE_KEEP=1 leave the stack up at the end
#   SMOKE_PROJECT      the Compose project name (zeroserve-smoke)
# Needs docker and Compose (v2 `docker compose` or v1 `docker-compose`), curl, python3 (for JSON).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
gguf="${1:?usage: compose/smoke.sh MODEL.gguf}"
[ -f "$gguf" ] || { echo "no such file: $gguf" >&2; exit 2; }
project="${SMOKE_PROJECT:-zeroserve-smoke}"
http_port="${ZEROSERVE_HTTP_PORT:-8000}"
work="$(mktemp -d /tmp/zeroserve-smoke.XXXXXX)"
. "$here/smoke-lib.sh"

if docker compose version >/dev/null 2>&1; then compose=(docker compose); else compose=(docker-compose); fi
files=(-f "$here/docker-compose.yml" -f "$here/docker-compose.model.yml")
dc() { "${compose[@]}" -p "$project" "${files[@]}" "$@"; }

# the model: a copy in a host folder behind the models volume (docker-compose.model.yml)
mkdir -p "$work/models"
cp "$gguf" "$work/models/"
chown -R 10001:10001 "$work/models" 2>/dev/null || chmod -R a+rwX "$work/models"
export ZEROSERVE_MODELS_DIR="$work/models" ZEROSERVE_MODEL="/models/$(basename "$gguf")"
model_name="$(basename "$gguf" .gguf)"

cleanup() {
  rc=$?
  stop_wheel_index
  if [ "${SMOKE_KEEP:-0}" != 1 ]; then
    step "down"
    dc down -v --timeout 80 || true
    rm -rf "$work"
  fi
  [ $rc = 0 ] && echo "SMOKE PASSED" || echo "SMOKE FAILED (rc=$rc)"
}
trap cleanup EXIT

step "compose: ${compose[*]} ($("${compose[@]}" version --short 2>/dev/null || "${compose[@]}" version | head -1)); model $ZEROSERVE_MODEL"
dc down -v --timeout 10 >/dev/null 2>&1 || true        # a volume left from an earlier run keeps old settings
if [ "${SMOKE_NO_BUILD:-0}" != 1 ]; then
  start_wheel_index
  step "build"
  dc build model-init                                   # one image for every service
  stop_wheel_index
fi

step "up (1 worker)"
dc up -d --scale worker=1
wait_for "model-init exited 0" 300 model_init_done
wait_for "gateway /health 200 (a READY group)" 600 http_ok "http://127.0.0.1:$http_port/health"
dc ps

step "HTTP: /v1/models and one chat completion"
curl -fsS "http://127.0.0.1:$http_port/v1/models"; echo
curl -fsS "http://127.0.0.1:$http_port/v1/chat/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$model_name\", \"messages\": [{\"role\": \"user\", \"content\": \"Name one colour of the rainbow.\"}], \"max_tokens\": 24, \"temperature\": 0}" \
  | tee "$work/chat.json"; echo
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); c=d["choices"][0]["message"]["content"]; assert c.strip(), d; print("HTTP chat answer:", repr(c))' "$work/chat.json"

step "Python client: one chat request (inside the gateway container)"
client gateway chat

step "scale to 2 workers"
dc up -d --no-recreate --scale worker=2
wait_for "2 READY groups" 600 ready_groups 2

step "kill one worker under load"
client gateway load 16 > "$work/load.out" 2>&1 &
load_pid=$!
wait_for "requests running on both groups" 120 running_on_groups 2
victim="$(dc ps -q worker | head -1)"
echo "docker kill ${victim:0:12} (a worker container)"
docker kill "$victim" >/dev/null
wait "$load_pid" || { cat "$work/load.out"; fail "the load did not finish"; }
cat "$work/load.out"
requeued
# `docker kill` counts as a manual stop: restart policies leave the container down (a crash or
# an OOM kill would be restarted). Bring it back as a user would.
step "back to 2 workers"
dc up -d --no-recreate --scale worker=2
wait_for "2 READY groups again" 600 ready_groups 2

# scaling down sends SIGTERM: the worker drains its running requests before it exits 0
step "scale down to 1 worker under load"
client gateway load 16 > "$work/load2.out" 2>&1 &
load_pid=$!
wait_for "requests running on both groups" 120 running_on_groups 2
dc up -d --no-recreate --scale worker=1
wait "$load_pid" || { cat "$work/load2.out"; fail "the load did not finish"; }
cat "$work/load2.out"
requeued
dc ps
