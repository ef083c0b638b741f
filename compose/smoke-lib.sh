# Helpers shared by compose/smoke.sh and compose/swarm-smoke.sh (sourced; they set $work).
trap 'exit 143' TERM INT   # a stopped run fails (the EXIT trap still cleans up)
step() { printf '\n=== %s  [%s]\n' "$*" "$(date -u +%H:%M:%S)"; }
fail() { echo "FAIL: $*" >&2; exit 1; }

# wait_for DESCRIPTION TIMEOUT_S COMMAND...: poll COMMAND every 3 s until it succeeds
wait_for() {
  local what="$1" timeout="$2"; shift 2
  local t0=$SECONDS
  until "$@" >/dev/null 2>&1; do
    (( SECONDS - t0 < timeout )) || fail "$what: not within ${timeout}s"
    sleep 3
  done
  echo "ok: $what ($((SECONDS - t0)) s)"
}

http_ok() { curl -fsS -m 5 -o /dev/null "$1"; }

# a container of SERVICE (compose: a service name; swarm: a task's container)
container_of() { if [ -n "${SWARM_STACK:-}" ]; then docker ps -q -f "label=com.docker.swarm.service.name=${SWARM_STACK}_$1" | head -1; else dc ps -q "$1" | head -1; fi; }

# client SERVICE ARGS...: compose/smoke_client.py inside a container of SERVICE, against the scheduler
client() { local svc="$1"; shift; docker exec -i "$(container_of "$svc")" python - tcp://scheduler:7000 "$@" < "$here/smoke_client.py"; }

# the scheduler's stats as JSON (zeroserve status --json inside the gateway container)
stats() { docker exec "$(container_of gateway)" zeroserve status --address tcp://scheduler:7000 --json; }

ready_groups() {
  stats | python3 -c 'import json,sys; s=json.load(sys.stdin); sys.exit(sum(g["state"]=="ready" for g in s["groups"]) < int(sys.argv[1]))' "$1"
}

# every one of N ready groups has requests running (the kill then hits a group with work)
running_on_groups() {
  stats | python3 -c '
import json, sys
s = json.load(sys.stdin)
busy = [g for g in s["groups"] if g["state"] == "ready" and (g.get("running") or g.get("num_running") or 0) > 0]
sys.exit(len(busy) < int(sys.argv[1]))' "$1"
}

# requests routed again after their group ended, and the groups now (scheduler metrics, via the gateway)
requeued() {
  curl -fsS "http://127.0.0.1:$http_port/metrics" | grep -E '^zeroserve:requests_requeued_total' || echo "requeued: 0"
  stats | python3 -c 'import json,sys; s=json.load(sys.stdin); print("groups:", [(g["name"], g["state"]) for g in s["groups"]])'
}

model_init_done() {
  local c; c="$(docker ps -aq -f "label=com.docker.compose.project=$project" -f "label=com.docker.compose.service=model-init" | head -1)"
  [ -n "$c" ] || return 1
  [ "$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$c")" = "exited 0" ] && return 0
  [ "$(docker inspect -f '{{.State.Status}}' "$c")" = exited ] && { docker logs "$c" >&2; fail "model-init failed"; }
  return 1
}

# SMOKE_WHEELS: a PEP 503 index of a folder of wheels, served on the docker bridge for the build
wheel_pid=""
start_wheel_index() {
  [ -n "${SMOKE_WHEELS:-}" ] || return 0
  local gw; gw="$(docker network inspect bridge -f '{{(index .IPAM.Config 0).Gateway}}')"
  mkdir -p "$work/index"
  python3 - "$SMOKE_WHEELS" "$work/index" <<'PY'
import os, re, sys
src, out = sys.argv[1:]
for f in sorted(os.listdir(src)):
    if f.endswith(".whl"):
        name = re.sub(r"[-_.]+", "-", f.split("-")[0]).lower()
        os.makedirs(f"{out}/{name}", exist_ok=True)
        os.symlink(os.path.join(os.path.abspath(src), f), f"{out}/{name}/{f}")
        with open(f"{out}/{name}/index.html", "a") as h:
            h.write(f'<a href="{f.replace("+", "%2B")}">{f}</a>\n')
PY
  local port="${SMOKE_WHEELS_PORT:-8765}"   # fixed: the URL is a build argument, part of the layer cache key
  (cd "$work/index" && exec python3 -m http.server "$port" --bind "$gw" >"$work/index.log" 2>&1) &
  wheel_pid=$!
  export ZEROSERVE_TORCH_INDEX_URL="http://$gw:$port/" ZEROSERVE_PIP_TRUSTED_HOST="$gw"
  local first; first="$(ls "$work/index" | head -1)"
  # pip would quietly take torch from PyPI instead (a CUDA build, gigabytes): the index must answer
  wait_for "the wheel index answers" 15 curl -fsS -o /dev/null "$ZEROSERVE_TORCH_INDEX_URL$first/"
  echo "local wheel index for the build: $ZEROSERVE_TORCH_INDEX_URL ($(ls "$work/index" | tr '\n' ' '))"
}
stop_wheel_index() { [ -z "$wheel_pid" ] || { kill "$wheel_pid" 2>/dev/null || true; wait "$wheel_pid" 2>/dev/null || true; wheel_pid=""; }; }
