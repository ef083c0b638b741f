#!/usr/bin/env bash
# End-to-end check of the stack on Docker Swarm (a single-node swarm will do: `docker swarm init`):
#   deploy serving a GGUF model, one chat request over HTTP and one through the Python client,
#   `docker service scale zeroserve_worker=3`, kill a worker task under load (every request must
#   finish with all its tokens), scale down to 2 under load (the stopped task drains and exits 0,
#   as on a drained node), `docker stack rm`.
#
#   compose/swarm-smoke.sh /path/to/SmolLM2-135M-Instruct.Q4_1.gguf
#
# The image (ZEROSERVE_IMAGE, zeroserve:cpu) must exist on the node: build it first
# (compose/smoke.sh builds it, or `docker-compose -f compose/docker-compose.yml build`).
# Settings: SMOKE_STACK (zeroserve-smoke), SMOKE_MESH=1 to use the routing mesh even where this
# kernel lacks IPVS (by default it is used only where /proc/net/ip_vs exists), SMOKE_KEEP=1,
# SMOKE_CURVE=1 to run it all with CURVE: fresh keys (`zeroserve keys`, run in the image) deployed
# as Docker secrets (docker-stack.curve.yml).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
gguf="${1:?usage: compose/swarm-smoke.sh MODEL.gguf}"
[ -f "$gguf" ] || { echo "no such file: $gguf" >&2; exit 2; }
export SWARM_STACK="${SMOKE_STACK:-zeroserve-smoke}"
http_port="${ZEROSERVE_HTTP_PORT:-8000}"
work="$(mktemp -d /tmp/zeroserve-swarm.XXXXXX)"
. "$here/smoke-lib.sh"

[ "$(docker info -f '{{.Swarm.LocalNodeState}}')" = active ] || fail "this engine is not in a swarm (docker swarm init)"
files=(-c "$here/docker-compose.yml" -c "$here/docker-stack.yml" -c "$here/docker-compose.model.yml")
if [ "${SMOKE_MESH:-0}" != 1 ] && [ ! -e /proc/net/ip_vs ]; then
  files+=(-c "$here/docker-stack.host-ports.yml")
  mesh="no IPVS in this kernel: DNS round robin and host-mode ports (docker-stack.host-ports.yml)"
else
  mesh="routing mesh (ingress) and service VIPs"
fi

if [ "${SMOKE_CURVE:-0}" = 1 ]; then
  mkdir -p "$work/keys" && chown 10001:10001 "$work/keys"
  docker run --rm -v "$work/keys:/out" "${ZEROSERVE_IMAGE:-zeroserve:cpu}" keys /out/k >/dev/null
  export ZEROSERVE_CURVE_KEYS_DIR="$work/keys/k"
  files+=(-c "$here/docker-stack.curve.yml")
  mesh="$mesh; CURVE keys as Docker secrets"
fi

mkdir -p "$work/models"
cp "$gguf" "$work/models/"
chown -R 10001:10001 "$work/models" 2>/dev/null || chmod -R a+rwX "$work/models"
export ZEROSERVE_MODELS_DIR="$work/models" ZEROSERVE_MODEL="/models/$(basename "$gguf")" ZEROSERVE_WORKERS=1
model_name="$(basename "$gguf" .gguf)"

# a worker task that Swarm stopped since $1 (a unix time) exited 0: it drained. Swarm removes the
# container of a task that scaling down removes, so the engine's event log is what remains.
drained_task() {
  docker events --since "$1" --until "$(date +%s)" --filter event=die \
      --filter "label=com.docker.swarm.service.name=${SWARM_STACK}_worker" --format '{{.Actor.Attributes.exitCode}}' \
    | grep -qx 0
}

cleanup() {
  rc=$?
  if [ "${SMOKE_KEEP:-0}" != 1 ]; then
    step "docker stack rm $SWARM_STACK"
    docker stack rm "$SWARM_STACK" || true
    for _ in $(seq 1 60); do   # tasks drain (stop_grace_period), then the network and volume go
      [ -z "$(docker ps -aq -f "label=com.docker.stack.namespace=$SWARM_STACK")" ] && break
      sleep 2
    done
    docker ps -a -f "label=com.docker.stack.namespace=$SWARM_STACK"
    docker volume rm "${SWARM_STACK}_models" >/dev/null 2>&1 || true
    docker secret ls -q -f "label=com.docker.stack.namespace=$SWARM_STACK" | xargs -r docker secret rm >/dev/null
    rm -rf "$work"
  fi
  [ $rc = 0 ] && echo "SWARM SMOKE PASSED" || echo "SWARM SMOKE FAILED (rc=$rc)"
}
trap cleanup EXIT

step "docker stack deploy ${files[*]} $SWARM_STACK   [$mesh; model $ZEROSERVE_MODEL]"
docker stack deploy --resolve-image never "${files[@]}" "$SWARM_STACK"
wait_for "gateway /health 200 (a READY group)" 600 http_ok "http://127.0.0.1:$http_port/health"
docker stack ps "$SWARM_STACK" --format '{{.Name}} {{.CurrentState}} {{.Node}}'

step "HTTP: one chat completion"
curl -fsS "http://127.0.0.1:$http_port/v1/chat/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$model_name\", \"messages\": [{\"role\": \"user\", \"content\": \"Name one colour of the rainbow.\"}], \"max_tokens\": 24, \"temperature\": 0}" \
  | tee "$work/chat.json"; echo
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); c=d["choices"][0]["message"]["content"]; assert c.strip(), d; print("HTTP chat answer:", repr(c))' "$work/chat.json"

step "Python client: one chat request (inside the gateway task)"
client gateway chat

step "docker service scale ${SWARM_STACK}_worker=3"
docker service scale --detach "${SWARM_STACK}_worker=3"
wait_for "3 READY groups" 600 ready_groups 3

step "kill a worker task under load"
client gateway load 24 > "$work/load.out" 2>&1 &
load_pid=$!
wait_for "requests running on 3 groups" 120 running_on_groups 3
victim="$(container_of worker)"
echo "docker kill ${victim:0:12} (a task of ${SWARM_STACK}_worker)"
docker kill "$victim" >/dev/null
wait "$load_pid" || { cat "$work/load.out"; fail "the load did not finish"; }
cat "$work/load.out"
requeued
wait_for "3 READY groups again (Swarm replaced the task)" 600 ready_groups 3
docker service ps "${SWARM_STACK}_worker" --format '{{.Name}} {{.CurrentState}} {{.Error}}'

# what a drained node does to its tasks: SIGTERM, the worker drains its requests, exits 0
step "scale down to 2 under load (SIGTERM, as on a drained node)"
client gateway load 24 > "$work/load2.out" 2>&1 &
load_pid=$!
wait_for "requests running on 3 groups" 120 running_on_groups 3
scaled_at="$(date +%s)"
docker service scale --detach "${SWARM_STACK}_worker=2"
wait "$load_pid" || { cat "$work/load2.out"; fail "the load did not finish"; }
cat "$work/load2.out"
requeued
wait_for "the stopped task exited 0 (drained)" 120 drained_task "$scaled_at"
docker events --since "$scaled_at" --until "$(date +%s)" --filter event=die \
  --filter "label=com.docker.swarm.service.name=${SWARM_STACK}_worker" --format '{{.Actor.Attributes.name}} died, exit code {{.Actor.Attributes.exitCode}}' 
docker service ps "${SWARM_STACK}_worker" --format '{{.Name}} {{.DesiredState}} {{.CurrentState}} {{.Error}}'
