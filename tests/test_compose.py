"""compose/: the Compose stack, checked without Docker.

The static tests parse compose/docker-compose.yml (and the GPU override, the Dockerfile, the
.env.example) and check their structure. The stack test then runs each service exactly as
Compose would start it, as local processes: the service's entrypoint and command (the image's
ENTRYPOINT `zeroserve` becomes `python -m zeroserve.services.cli`), the image's ENV plus the service's
`environment`, `${VAR:-default}` interpolation done here, the service hostnames and the bind host
mapped to 127.0.0.1, the container ports remapped to a block of free loopback ports, and the
`models` volume mapped to a temporary directory. It starts services in `depends_on` order,
restarts what exits as `restart: unless-stopped` does, starts `worker` twice (`--scale worker=2`),
runs the healthchecks, serves requests and stops everything
the way `docker compose down` does (SIGTERM in reverse dependency order, SIGKILL after the grace
period).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import yaml

from zeroserve.common.transport import free_port_block
from zeroserve.services.launcher import _die_with_parent
from tests.cluster import SESSION_ENV, SESSION_TAG, no_leftover_processes  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "compose"
BASE_FILE = COMPOSE / "docker-compose.yml"
GPU_FILE = COMPOSE / "docker-compose.gpu.yml"
TP_FILE = COMPOSE / "docker-compose.tp.yml"
PP_FILE = COMPOSE / "docker-compose.pp.yml"
TP_GPU_FILE = COMPOSE / "docker-compose.tp-gpu.yml"
MONITORING_FILE = COMPOSE / "docker-compose.monitoring.yml"
POOL_FILE = COMPOSE / "docker-compose.pool.yml"
STANDBY_FILE = COMPOSE / "docker-compose.standby.yml"
SCALE = 2
DEFAULT_SERVICES = {"model-init", "scheduler", "detokenizer", "worker", "gateway"}
LONG_RUNNING = {"scheduler", "detokenizer", "worker", "gateway"}
MONITORING = {"prometheus", "grafana"}  # docker-compose.monitoring.yml: third-party images, not run here

# What the stack test sets, as a user would in compose/.env: one torch thread per worker on this
# small shared box, and a small KV budget. Everything else takes the compose file's defaults.
TEST_VARS = {"ZEROSERVE_THREADS": "1", "ZEROSERVE_KV_CACHE_MEMORY_BYTES": str(32 << 20)}


# ---- Compose semantics (the parts these files use) -----------------------------------------
_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value, env: dict[str, str]):
    """Compose's variable substitution: $$, $VAR, ${VAR}, ${VAR:-d}, ${VAR-d}, ${VAR:?e}, ${VAR?e}."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m[1]:
            return "$"
        name, op, arg = m[2] or m[5], m[3], m[4]
        v = env.get(name)
        if op == ":-":
            return v if v else arg
        if op == "-":
            return v if v is not None else arg
        if op in (":?", "?") and (v is None or (op == ":?" and not v)):
            raise ValueError(f"required variable {name} is missing: {arg}")
        return v or ""

    return _VAR.sub(sub, value)


def variables(value, out: dict[str, str | None] | None = None) -> dict[str, str | None]:
    """Every ${VAR...} used, with its :- default (None when it has none)."""
    out = {} if out is None else out
    if isinstance(value, dict):
        for v in value.values():
            variables(v, out)
    elif isinstance(value, list):
        for v in value:
            variables(v, out)
    elif isinstance(value, str):
        for m in _VAR.finditer(value):
            if not m[1]:
                out[m[2] or m[5]] = m[4] if m[3] == ":-" else None
    return out


def duration_s(v) -> float:
    """Compose durations: 75s, 1m30s, 500ms, 2h."""
    if isinstance(v, (int, float)):
        return float(v)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", v)
    assert parts and "".join(n + u for n, u in parts) == v, f"bad duration {v!r}"
    return sum(float(n) * units[u] for n, u in parts)


def env_map(env) -> dict[str, str]:
    if env is None:
        return {}
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def depends(svc: dict) -> dict[str, str]:
    d = svc.get("depends_on") or {}
    if isinstance(d, list):
        return {name: "service_started" for name in d}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in d.items()}


def published(svc: dict) -> list[tuple[str, str, str]]:
    """(host_ip, published, target) for every published port."""
    out = []
    for p in svc.get("ports") or []:
        if isinstance(p, dict):
            out.append((p.get("host_ip", ""), str(p.get("published", "")), str(p["target"])))
            continue
        parts = str(p).split("/")[0].split(":")
        parts = [""] * (3 - len(parts)) + parts
        out.append((parts[0], parts[1], parts[2]))
    return out


def topo_order(services: dict[str, dict]) -> list[str]:
    order, seen = [], set()

    def visit(name: str, path: tuple = ()) -> None:
        assert name not in path, f"depends_on cycle: {path + (name,)}"
        if name in seen:
            return
        for dep in depends(services[name]):
            visit(dep, path + (name,))
        seen.add(name)
        order.append(name)

    for name in services:
        visit(name)
    return order


def load(path: Path, env: dict[str, str] | None = None) -> dict:
    doc = yaml.safe_load(path.read_text())
    return doc if env is None else interpolate(doc, env)


def default_services(doc: dict) -> dict[str, dict]:
    """The services `docker compose up` starts (no profile)."""
    return {n: s for n, s in doc["services"].items() if not s.get("profiles")}


# ---- the Dockerfile's final stage ----------------------------------------------------------
def dockerfile() -> dict:
    text = (COMPOSE / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    instrs = []
    for ln in "\n".join(lines).replace("\\\n", " ").splitlines():
        if ln.strip():
            op, _, rest = ln.strip().partition(" ")
            instrs.append((op.upper(), rest.strip()))
    last_from = max(i for i, (op, _) in enumerate(instrs) if op == "FROM")
    final = {"env": {}, "entrypoint": None, "cmd": None, "user": None, "volumes": [], "copy": [], "args": {},
             "froms": [rest for op, rest in instrs if op == "FROM"]}
    for op, rest in instrs:
        if op == "ARG":
            k, _, v = rest.partition("=")
            final["args"].setdefault(k, v)
    for op, rest in instrs[last_from:]:
        if op == "ENV":
            for tok in shlex.split(rest):
                k, _, v = tok.partition("=")
                final["env"][k] = v
        elif op in ("ENTRYPOINT", "CMD"):
            final[op.lower()] = json.loads(rest)
        elif op == "USER":
            final["user"] = rest
        elif op == "VOLUME":
            final["volumes"] += json.loads(rest) if rest.startswith("[") else rest.split()
        elif op == "COPY":
            final["copy"].append(shlex.split(rest)[:-1])
    return final


# ---- static checks -------------------------------------------------------------------------
def test_compose_structure():
    doc = load(BASE_FILE, {})
    services = doc["services"]
    assert set(services) == set(default_services(doc)) == DEFAULT_SERVICES

    # one image, built from the repository root with compose/Dockerfile
    for name, svc in services.items():
        assert svc["image"] == "zeroserve:cpu"
        assert (COMPOSE / svc["build"]["context"]).resolve() == REPO, name
        assert (COMPOSE / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == COMPOSE / "Dockerfile"
        assert svc["build"]["args"]["DEVICE"] == "cpu"
        assert svc.get("init") is True, name

    # the models volume: declared once, mounted everywhere at ZEROSERVE_CACHE
    assert "models" in doc["volumes"]
    for name, svc in services.items():
        env = env_map(svc.get("environment"))
        assert "models:/models" in svc["volumes"], name
        assert env["ZEROSERVE_CACHE"] == "/models", name
        assert env["ZEROSERVE_LOG_JSON"] == "1", name
        assert env["ZEROSERVE_MODEL"] == "/models/default-model", name

    # restart policies, healthchecks, grace periods
    assert services["model-init"]["restart"] == "no"
    for name in services:
        if name == "model-init":
            continue
        svc = services[name]
        assert svc["restart"] in ("unless-stopped", "always") or svc["restart"].startswith("on-failure"), name
        hc = svc["healthcheck"]
        assert hc["test"][0] == "CMD", name  # exec form: runs the same here and in the container
        for key in ("interval", "timeout", "start_period"):
            duration_s(hc[key])
        assert hc["retries"] >= 1
        assert "container_name" not in svc, name
    assert services["scheduler"]["healthcheck"]["test"][1:4] == ["zeroserve", "status", "--address"]
    assert duration_s(services["worker"]["stop_grace_period"]) >= 60  # the scheduler's drain timeout

    # start order only (docker stack deploy reads no conditions): each process waits by itself
    assert depends(services["scheduler"]) == {"model-init": "service_started"}
    for name in ("detokenizer", "worker", "gateway"):
        assert depends(services[name]) == {"scheduler": "service_started"}, name
    genv = env_map(services["gateway"]["environment"])
    assert genv["ZEROSERVE_SCHEDULER"] == "tcp://scheduler:7000" and genv["ZEROSERVE_HOST"] == "0.0.0.0"
    assert "http://127.0.0.1:8000/health" in services["gateway"]["healthcheck"]["test"][-1]

    # The scheduler binds every interface of its container and advertises its service name as
    # the step PUB host (WELCOME); its healthcheck runs inside the container, on loopback.
    senv = env_map(services["scheduler"]["environment"])
    assert senv["ZEROSERVE_HOST"] == "0.0.0.0"
    assert senv["ZEROSERVE_ADVERTISE_HOST"] == services["scheduler"]["hostname"] == "scheduler"
    assert "tcp://127.0.0.1:7000" in services["scheduler"]["healthcheck"]["test"]
    topo_order(services)

    # only the scheduler's client port and the gateway's HTTP port are published, on the host's loopback only
    for name, svc in services.items():
        ports = published(svc)
        if name == "scheduler":
            assert ports == [("127.0.0.1", "7000", "7000")]
        elif name == "gateway":
            assert ports == [("127.0.0.1", "8000", "8000")]
        else:
            assert ports == [], f"{name} must not publish ports (it is scaled / internal)"

    # scaling: a replica is its own group (no fixed group name, one shard) and finds the scheduler
    wenv = env_map(services["worker"]["environment"])
    assert "ZEROSERVE_GROUP" not in wenv and "--group" not in services["worker"]["command"]
    assert wenv["ZEROSERVE_TP_SIZE"] == "1"
    assert wenv["ZEROSERVE_SCHEDULER"] == "tcp://scheduler:7001"
    assert env_map(services["detokenizer"]["environment"])["ZEROSERVE_SCHEDULER"] == "tcp://scheduler:7001"

    # the tensor- and pipeline-parallel overrides: one group, ranks (stages) 0..n-1, each shard
    # advertises its own hostname and runs what a worker runs
    _check_group_override(services, TP_FILE, "ZEROSERVE_TP_SIZE", "ZEROSERVE_TP_RANK")
    _check_group_override(services, PP_FILE, "ZEROSERVE_PP_SIZE", "ZEROSERVE_PP_RANK")


def _check_group_override(services: dict, path: Path, size_var: str, rank_var: str) -> None:
    over = load(path, {})["services"]
    wenv = env_map(services["worker"]["environment"])
    same = lambda env: {k: v for k, v in env.items() if k in wenv and k != size_var}  # noqa: E731
    for name, svc in over.items():
        for key in ("image", "init", "volumes", "depends_on", "command", "restart", "stop_grace_period", "healthcheck"):
            assert svc[key] == services["worker"][key], (path.name, name, key)
        assert same(env_map(svc["environment"])) == same(wenv), (path.name, name)
    envs = [env_map(s["environment"]) for s in over.values()]
    assert len(over) >= 2 and len({e["ZEROSERVE_GROUP"] for e in envs}) == 1
    assert sorted(int(e[rank_var]) for e in envs) == list(range(len(over)))
    assert all(int(e[size_var]) == len(over) for e in envs)
    for name, svc in over.items():
        assert env_map(svc["environment"])["ZEROSERVE_ADVERTISE_HOST"] == svc["hostname"] == name


def test_monitoring_override():
    doc = {"services": {**load(BASE_FILE, {})["services"], **load(MONITORING_FILE, {})["services"]}}
    assert set(load(MONITORING_FILE, {})["services"]) == MONITORING
    for name in MONITORING:
        svc = doc["services"][name]
        assert all(h == "127.0.0.1" for h, _, _ in published(svc)), name
        for v in svc.get("volumes", []):
            assert (COMPOSE / v.split(":")[0]).exists(), v
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in prom["scrape_configs"]}
    senv = env_map(doc["services"]["scheduler"]["environment"])
    assert targets["zeroserve-scheduler"] == [f"scheduler:{senv['ZEROSERVE_METRICS_PORT']}"]
    assert targets["zeroserve-gateway"] == ["gateway:8000"]
    dash = json.loads((COMPOSE / "grafana" / "zeroserve-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for metric in ("generation_tokens_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "kv_cache_usage_perc", "num_requests_running", "num_requests_waiting", "worker_groups"):
        assert f"zeroserve:{metric}" in exprs, metric


def test_commands_parse_with_the_cli():
    """Every zeroserve command line in the compose file (services and healthchecks) is valid."""
    from zeroserve.services.cli import build_parser

    image = dockerfile()
    seen = 0
    for svc in [*load(BASE_FILE, {})["services"].values(), *load(TP_FILE, {})["services"].values(),
                *load(PP_FILE, {})["services"].values(), *load(STANDBY_FILE, {})["services"].values()]:
        entry = svc.get("entrypoint") or image["entrypoint"]
        if entry == ["zeroserve"]:
            build_parser().parse_args(svc.get("command") or image["cmd"])
            seen += 1
        hc = svc.get("healthcheck", {}).get("test", [])
        if hc[1:2] == ["zeroserve"]:
            build_parser().parse_args(hc[2:])
            seen += 1
    build_parser().parse_args(image["cmd"])
    assert seen >= 5


def test_standby_override():
    """docker-compose.standby.yml: a scheduler-standby beside the scheduler, each --standby-of the
    other, and both addresses (in the same order) wherever a service or a healthcheck dials one."""
    from zeroserve.common.config import SchedulerConfig

    base, sb = load(BASE_FILE, {}), load(STANDBY_FILE, {})
    assert set(sb["services"]) - set(base["services"]) == {"scheduler-standby"}
    new = sb["services"]["scheduler-standby"]
    env = env_map(new["environment"])
    assert env["ZEROSERVE_STANDBY_OF"] == "tcp://scheduler:7000" and new["hostname"] == "scheduler-standby"
    assert env["ZEROSERVE_ADVERTISE_HOST"] == "scheduler-standby" and env["ZEROSERVE_PORT"] == "7000"
    assert env_map(sb["services"]["scheduler"]["environment"])["ZEROSERVE_STANDBY_OF"] == \
        "tcp://scheduler-standby:7000"
    assert all(h == "127.0.0.1" for h, _, _ in published(new))
    base_env = env_map(base["services"]["scheduler"]["environment"])
    for k in ("ZEROSERVE_HOST", "ZEROSERVE_MAX_NUM_SEQS", "ZEROSERVE_MAX_NUM_BATCHED_TOKENS", "ZEROSERVE_METRICS_PORT"):
        assert env[k] == base_env[k], k  # the standby serves as the scheduler does once it takes over
    for name, port in (("detokenizer", 7001), ("worker", 7001), ("gateway", 7000)):
        want = f"tcp://scheduler:{port},tcp://scheduler-standby:{port}"
        assert env_map(sb["services"][name]["environment"])["ZEROSERVE_SCHEDULER"] == want, name
        hc = " ".join(sb["services"][name].get("healthcheck", {}).get("test", []))
        assert "tcp://scheduler:7000\"" not in hc, f"{name}'s healthcheck dials one scheduler only"
    SchedulerConfig(standby_of=env["ZEROSERVE_STANDBY_OF"])


def test_gpu_override():
    base = load(BASE_FILE, {})
    gpu = load(GPU_FILE, {})
    assert set(gpu["services"]) == set(base["services"])
    for name, svc in gpu["services"].items():
        assert svc["build"]["args"]["DEVICE"] == "cuda", name
        assert svc["image"] == "zeroserve:cuda", name
    tp_gpu = load(TP_GPU_FILE, {})
    assert set(tp_gpu["services"]) == set(load(TP_FILE, {})["services"])
    gpu["services"].update(tp_gpu["services"])
    for name in ("worker", "worker-tp-rank0", "worker-tp-rank1"):
        svc = gpu["services"][name]
        assert env_map(svc["environment"])["ZEROSERVE_DEVICE"] == "cuda"
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
        assert devices[0].get("count") == 1 or devices[0].get("device_ids")
    # the two tensor-parallel shards must not land on the same GPU
    ids = [gpu["services"][n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
           for n in ("worker-tp-rank0", "worker-tp-rank1")]
    assert ids[0] != ids[1]
    for name in ("scheduler", "detokenizer", "model-init"):
        assert "deploy" not in gpu["services"][name]


def test_every_variable_has_a_default_and_is_documented():
    example = {}
    for ln in (COMPOSE / ".env.example").read_text().splitlines():
        if ln.strip() and not ln.lstrip().startswith("#"):
            k, _, v = ln.partition("=")
            example[k.strip()] = v.strip()
    used = {}
    for f in [BASE_FILE, GPU_FILE, TP_FILE, TP_GPU_FILE, PP_FILE, MONITORING_FILE, STANDBY_FILE,
              *COMPOSE.glob("docker-stack*.yml")]:
        used.update(variables(load(f)))
    for name, default in used.items():
        assert default is not None, f"${{{name}}} needs a :- default so the stack starts without a .env"
        assert name in example, f"{name} is not documented in compose/.env.example"
        assert example[name] == default, f"{name}: .env.example says {example[name]!r}, compose {default!r}"
    # docker-compose.model.yml's one required variable (no default: the host folder of your model)
    assert "# ZEROSERVE_MODELS_DIR=" in (COMPOSE / ".env.example").read_text()


def test_pool_override_makes_the_folder_a_catalog_and_the_workers_pool_members(tmp_path):
    """docker-compose.pool.yml over the base file: scheduler, detokenizer and model-init read the
    models folder as a catalog (no single model), workers join as pool members, the worker's
    healthcheck counts a pool member, and its variables have the documented defaults; model-init's
    command checks every model of the folder (a broken one reported, not fatal)."""
    from unittest import mock

    from zeroserve.common.config import DetokenizerArgs, SchedulerConfig, WorkerArgs, from_cli_args
    from zeroserve.services.cli import build_parser

    base, pool = load(BASE_FILE, {}), load(POOL_FILE, {})
    example = (COMPOSE / ".env.example").read_text()
    for name, default in variables(pool).items():
        assert default is not None and f"\n{name}={default}\n" in example, name

    def parsed(name: str, extra: dict[str, str] | None = None):
        env = {**env_map(base["services"][name].get("environment")),
               **env_map(pool["services"][name].get("environment")), **(extra or {})}
        with mock.patch.dict(os.environ, env, clear=True):
            return build_parser().parse_args(base["services"][name]["command"])

    sched = from_cli_args(SchedulerConfig, parsed("scheduler"))
    assert (sched.models_dir, sched.models, sched.keep_alive) == ("/models", [], "5m")
    detok = from_cli_args(DetokenizerArgs, parsed("detokenizer", {"ZEROSERVE_SCHEDULER": "tcp://scheduler:7001"}))
    assert (detok.models_dir, detok.models) == ("/models", [])
    wns = parsed("worker")
    assert from_cli_args(WorkerArgs, wns).pool and wns.model is None
    assert "pool" in "".join(pool["services"]["worker"]["healthcheck"]["test"])
    assert parsed("gateway").model in (None, [])
    # model-init: `prepare-model` with ZEROSERVE_MODELS_DIR checks the folder's models
    from tests.helpers import cached_model_dir

    shutil.copytree(cached_model_dir("llama"), tmp_path / "tiny")
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 12)
    env = {**env_map(pool["services"]["model-init"]["environment"]), "ZEROSERVE_MODELS_DIR": str(tmp_path),
           "PYTHONPATH": str(REPO), "HOME": str(tmp_path), "PATH": os.environ["PATH"]}
    r = subprocess.run([sys.executable, "-m", "zeroserve.services.cli", *base["services"]["model-init"]["command"]],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "model ready:" in r.stdout and "'tiny'" in r.stdout and "model 'broken': FAILED" in r.stdout, r.stdout
    (tmp_path / "empty").mkdir()
    env["ZEROSERVE_MODELS_DIR"] = str(tmp_path / "empty")
    r = subprocess.run([sys.executable, "-m", "zeroserve.services.cli", "prepare-model"], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "holds no model" in r.stderr, r.stdout + r.stderr


def test_dockerfile():
    d = dockerfile()
    assert d["entrypoint"] == ["zeroserve"]
    assert d["user"] not in (None, "root", "0")
    assert "/models" in d["volumes"]
    assert d["env"]["ZEROSERVE_CACHE"] == "/models"
    assert d["env"]["ZEROSERVE_LOG_JSON"] == "1"
    assert d["args"]["DEVICE"] == "cpu"
    assert d["args"]["BASE_IMAGE"] == "python:3.11-slim"
    assert d["froms"] == ["${BASE_IMAGE}"]
    text = (COMPOSE / "Dockerfile").read_text()
    assert "download.pytorch.org/whl/cpu" in text and "download.pytorch.org/whl/cu" in text
    # what the image copies exists and is not dropped by the build's ignore file
    ignore = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    assert ignore[0] == "*"
    sources = [src for srcs in d["copy"] for src in srcs]
    assert {"pyproject.toml", "README.md", "common", "kernels", "services", "zeroserve"} <= set(sources)
    for src in sources:
        assert (REPO / src).exists(), src
        assert "!" + src.rstrip("/") in ignore, f"{src} is copied but excluded by .dockerignore"


# ---- the stack as local processes ----------------------------------------------------------
_TCP = re.compile(r"(tcp|http)://([A-Za-z0-9_.\-]+):(\d+)")
HOST_KEYS, HOST_FLAGS = {"ZEROSERVE_HOST", "ZEROSERVE_ADVERTISE_HOST"}, {"--host", "--advertise-host"}
PORT_KEYS, PORT_FLAGS = {"ZEROSERVE_PORT", "ZEROSERVE_METRICS_PORT"}, {"--port"}
EXTRA_PORTS = (8000, 7010)  # the gateway's HTTP port, the scheduler's metrics port


class Mapper:
    """Container names, ports and paths -> this machine's."""

    def __init__(self, doc: dict, base_port: int, tmp: Path) -> None:
        services = doc["services"]
        self.hosts = {"0.0.0.0"} | set(services) | {s["hostname"] for s in services.values() if "hostname" in s}
        container_port = int(env_map(services["scheduler"]["environment"]).get("ZEROSERVE_PORT", 7000))
        self.ports = {container_port + i: base_port + i for i in range(4)}
        self.ports.update((p, free_port_block(1)) for p in EXTRA_PORTS)
        self.mounts = {}
        for name, svc in services.items():
            if name in MONITORING:  # third-party images with bind mounts, not run here
                continue
            for v in svc.get("volumes") or []:
                src, target = v.split(":")[:2]
                assert src in doc["volumes"], f"only named volumes here, got {v}"
                self.mounts[target] = str(tmp / src)

    def host(self, h: str) -> str:
        return "127.0.0.1" if h in self.hosts else h

    def port(self, p) -> int:
        assert int(p) in self.ports, f"port {p} is none of the scheduler's ports {sorted(self.ports)}"
        return self.ports[int(p)]

    def value(self, s: str, key: str | None = None, flag: str | None = None) -> str:
        s = _TCP.sub(lambda m: f"{m[1]}://{self.host(m[2])}:{self.port(m[3])}", s)
        if key in HOST_KEYS or flag in HOST_FLAGS:
            s = self.host(s)
        if key in PORT_KEYS or flag in PORT_FLAGS:
            s = str(self.port(s))
        for target, local in self.mounts.items():
            if s == target or s.startswith(target + "/"):
                s = local + s[len(target):]
        return s

    def argv(self, args: list[str]) -> list[str]:
        out, prev = [], None
        for a in args:
            out.append(self.value(str(a), flag=prev))
            prev = str(a)
        exe, rest = out[0], out[1:]
        if exe == "zeroserve":
            return [sys.executable, "-m", "zeroserve.services.cli", *rest]
        if exe in ("python", "python3"):
            return [sys.executable, *rest]
        raise AssertionError(f"no local equivalent for {exe!r}")


class Stack:
    """The default services of the compose file as local processes."""

    def __init__(self, scale: int) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="zeroserve-compose-"))
        self.doc = load(BASE_FILE, TEST_VARS)
        self.services = default_services(self.doc)
        self.image = dockerfile()
        self.port = free_port_block(4)
        self.map = Mapper(self.doc, self.port, self.tmp)
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.scale = {name: scale if name == "worker" else 1 for name in self.services}
        self.procs: dict[str, list[subprocess.Popen]] = {}
        self.satisfied: set[tuple[str, str]] = set()
        self.restarts: dict[str, int] = {}
        self.exited_at: dict[tuple[str, int], float] = {}
        self._logs = []
        (self.tmp / "home").mkdir()
        for local in self.map.mounts.values():
            Path(local).mkdir(parents=True, exist_ok=True)

    # -- what Compose would run
    def env(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROSERVE_")}  # a container's env is its own
        env.update({"PYTHONPATH": str(REPO), "HOME": str(self.tmp / "home"), SESSION_ENV: SESSION_TAG})
        layers = [{k: v for k, v in self.image["env"].items() if "$" not in v and k not in ("HOME", "PATH")},
                  env_map(self.services[name].get("environment"))]
        for layer in layers:
            env.update({k: self.map.value(v, key=k) for k, v in layer.items()})
        return env

    def argv(self, name: str) -> list[str]:
        svc = self.services[name]
        if svc.get("entrypoint"):  # an entrypoint set in compose drops the image's CMD
            return self.map.argv([*svc["entrypoint"], *(svc.get("command") or [])])
        return self.map.argv([*self.image["entrypoint"], *(svc.get("command") or self.image["cmd"])])

    # -- processes
    def _spawn(self, name: str, i: int) -> subprocess.Popen:
        log = open(self.tmp / f"{name}-{i + 1}.log", "ab")  # noqa: SIM115 (closed in close())
        self._logs.append(log)
        # From the main thread only: PR_SET_PDEATHSIG follows the forking thread.
        return subprocess.Popen(self.argv(name), env=self.env(name), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent)  # noqa: PLW1509

    def start(self, name: str) -> None:
        self.procs[name] = [self._spawn(name, i) for i in range(self.scale[name])]

    def supervise(self) -> None:
        """Compose's `restart: unless-stopped`: a process that exited is started again. depends_on
        orders only the starts, so e.g. the scheduler may look for the built-in model before
        model-init has made it, exit, and come back (a few times at most)."""
        for name, procs in self.procs.items():
            if self.services[name].get("restart") not in ("unless-stopped", "always"):
                continue
            for i, p in enumerate(procs):
                if p.poll() is None:
                    continue
                # Docker's delay before the n-th restart: 100 ms, doubling, at most a minute
                n = self.restarts.get(name, 0)
                if time.monotonic() - self.exited_at.setdefault((name, i), time.monotonic()) < min(0.1 * 2 ** n, 60):
                    continue
                del self.exited_at[(name, i)]
                self.restarts[name] = n + 1
                assert n < 12, f"{name} keeps exiting ({p.returncode})\n{self.logs()}"
                procs[i] = self._spawn(name, i)

    def healthcheck(self, name: str) -> subprocess.CompletedProcess:
        hc = self.services[name]["healthcheck"]
        assert hc["test"][0] == "CMD"
        try:
            return subprocess.run(self.map.argv(hc["test"][1:]), env=self.env(name), cwd=REPO, capture_output=True,
                                  text=True, timeout=max(duration_s(hc["timeout"]), 20.0), check=False,
                                  preexec_fn=_die_with_parent)
        except subprocess.TimeoutExpired as e:
            return subprocess.CompletedProcess(e.cmd, -1, "", f"timed out after {e.timeout}s")

    def satisfy(self, dep: str, condition: str, timeout: float) -> None:
        if (dep, condition) in self.satisfied:
            return
        deadline = time.monotonic() + timeout
        if condition == "service_completed_successfully":
            for p in self.procs[dep]:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                assert rc == 0, f"{dep} exited {rc}\n{self.logs()}"
        elif condition == "service_healthy":
            last = None
            while True:
                self.supervise()
                last = self.healthcheck(dep)
                if last.returncode == 0:
                    break
                assert time.monotonic() < deadline, f"{dep} not healthy in {timeout}s: {last}\n{self.logs()}"
                time.sleep(1.0)
        else:
            assert condition == "service_started", condition
        self.satisfied.add((dep, condition))

    def up(self, timeout: float = 150.0) -> None:
        for name in topo_order(self.services):
            for dep, condition in depends(self.services[name]).items():
                self.satisfy(dep, condition, timeout)
            self.start(name)

    def stats(self) -> dict:
        from zeroserve import Client

        with Client(self.address, timeout_s=5.0) as c:
            return c.stats()

    def wait_ready(self, groups: int, timeout: float = 150.0) -> dict:
        from zeroserve import Client

        deadline, last = time.monotonic() + timeout, None
        with Client(self.address, timeout_s=3.0) as c:
            while time.monotonic() < deadline:
                self.supervise()
                try:
                    last = c.stats()
                    ready = [g for g in last["groups"] if g["state"] == "ready"]
                    if len(ready) >= groups and last["detokenizer"]["connected"]:
                        return last
                except Exception:  # noqa: BLE001, S110 (not up yet)
                    pass
                time.sleep(0.5)
        raise AssertionError(f"not ready in {timeout}s; last stats {last}\n{self.logs()}")

    def down(self, grace_cap: float = 30.0) -> dict[str, list[int]]:
        """Like `docker compose down`: dependents first, SIGTERM, SIGKILL after stop_grace_period."""
        codes: dict[str, list[int]] = {}
        for name in reversed(topo_order(self.services)):
            procs = self.procs.get(name, [])
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            grace = min(duration_s(self.services[name].get("stop_grace_period", "10s")), grace_cap)
            deadline = time.monotonic() + grace
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)
            codes[name] = [p.returncode for p in procs]
        return codes

    def kill_all(self) -> None:
        for procs in self.procs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)

    def close(self) -> None:
        for f in self._logs:
            f.close()

    def logs(self) -> str:
        return "\n".join(f"===== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.tmp.glob("*.log")))


@pytest.mark.timeout(240)
def test_compose_stack_runs_as_local_processes():
    from zeroserve import Client, SamplingParams

    stack = Stack(scale=SCALE)
    ok = False
    try:
        # what Compose would run, after the mapping
        wargv = stack.argv("worker")
        assert wargv[:4] == [sys.executable, "-m", "zeroserve.services.cli", "worker"]
        assert stack.env("worker")["ZEROSERVE_THREADS"] == "1"  # interpolated from TEST_VARS
        from unittest import mock

        from zeroserve.services.cli import build_parser

        with mock.patch.dict(os.environ, stack.env("worker"), clear=True):  # what the worker's CLI makes of it
            wargs = build_parser().parse_args(wargv[3:])
        assert wargs.threads == 1 and wargs.kv_cache_memory_bytes == 32 << 20 and wargs.tp_size == 1
        assert stack.argv("scheduler")[3] == "scheduler"
        senv = stack.env("scheduler")
        assert senv["ZEROSERVE_HOST"] == "127.0.0.1" and senv["ZEROSERVE_PORT"] == str(stack.port)
        assert stack.env("worker")["ZEROSERVE_SCHEDULER"] == f"tcp://127.0.0.1:{stack.port + 1}"
        assert stack.env("worker")["ZEROSERVE_CACHE"] == str(stack.tmp / "models")

        stack.up()
        s = stack.wait_ready(groups=SCALE)
        # model-init (or the first process to need it) created the built-in model in the (mapped) volume
        assert (stack.tmp / "models" / "default-model" / "config.json").is_file()
        assert stack.procs["model-init"][0].wait(timeout=120) == 0, stack.logs()
        print("restarts before ready (start order only):", stack.restarts)
        ready_restarts = dict(stack.restarts)
        groups = [g for g in s["groups"] if g["state"] == "ready"]
        assert len(groups) == SCALE and len({g["name"] for g in groups}) == SCALE
        assert all(g["tp_size"] == 1 and len(g["workers"]) == 1 for g in groups)
        assert s["detokenizer"]["connected"]
        assert s["addresses"]["client"] == stack.address

        # the healthchecks pass once the stack is up
        for name in ("scheduler", "detokenizer", "worker", "gateway"):
            r = stack.healthcheck(name)
            assert r.returncode == 0, f"{name} healthcheck: {r}"
        # the OpenAI API on the gateway's (mapped) published port, and the scheduler's metrics port
        import httpx

        http = f"http://127.0.0.1:{stack.map.port(8000)}"
        r = httpx.post(http + "/v1/completions", json={"prompt": "Compose says", "max_tokens": 4,
                                                        "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        m = httpx.get(f"http://127.0.0.1:{stack.map.port(7010)}/metrics", timeout=10).text
        assert "zeroserve:generation_tokens_total" in m

        prompts = [f"Compose request {i} says" for i in range(6)]
        params = SamplingParams(max_tokens=8, temperature=0.8, seed=7, ignore_eos=True)
        with Client(stack.address, timeout_s=10.0, request_timeout_s=90.0) as c, \
                ThreadPoolExecutor(len(prompts)) as ex:
            outs = list(ex.map(lambda p: c.generate(p, params), prompts))
        for p, out in zip(prompts, outs):
            assert out.finished and out.prompt == p
            o = out.outputs[0]
            assert len(o.token_ids) == 8 and o.finish_reason == "length", o
            assert isinstance(o.text, str)
        assert any(o.outputs[0].text.strip() for o in outs)
        served = {g["name"]: g["tokens"] for g in stack.stats()["groups"]}
        assert sum(served.values()) >= 8 * len(prompts), served
        assert all(t > 0 for t in served.values()), f"one replica got no work: {served}"

        stack.supervise()
        assert stack.restarts == ready_restarts, f"a process exited while serving: {stack.restarts}\n{stack.logs()}"
        # stop like `docker compose down`; nothing may be left behind
        tree = set()
        for procs in stack.procs.values():
            for p in procs:
                if p.poll() is None:
                    tree |= {c.pid for c in psutil.Process(p.pid).children(recursive=True)}
        pids = [p.pid for procs in stack.procs.values() for p in procs]
        codes = stack.down()
        assert codes["worker"] == [0] * SCALE, f"workers did not drain cleanly: {codes}\n{stack.logs()}"
        assert codes["scheduler"] == [0] and codes["detokenizer"] == [0] and codes["model-init"] == [0], codes
        assert codes["gateway"] == [0], codes
        for pid in pids:  # every process was its own process group (setpgrp): the groups are empty
            with pytest.raises(ProcessLookupError):
                os.killpg(pid, 0)
        for pid in tree:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
        ok = True
    finally:
        stack.kill_all()
        stack.close()
        if ok:
            shutil.rmtree(stack.tmp, ignore_errors=True)
        else:
            print(f"logs kept in {stack.tmp}")
