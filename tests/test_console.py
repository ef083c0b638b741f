"""The web console at the HTTP level, against a real cluster started the way a user starts one.

One `zeroserve up` (tiny llama model, --max-queue-len 1 so that a second request is refused)
whose gateway serves the console, plus two more gateways on its scheduler: one with --api-key,
one with --no-ui. Checked: `up` prints the console's URL; the pages and their static files are
served with a strict CSP and reference nothing outside the gateway; /api/cluster holds what
the cluster page shows (groups, shards, KV, detokenizer, queue, refusals, failovers, TTFT sums);
the API key guards /api/* (the pages stay public: they hold no data); --no-ui serves none of it.
The browser-driven tests are in test_console_browser.py.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from html.parser import HTMLParser

import httpx
import pytest

from zeroserve.common.transport import free_port_block
from zeroserve.services.gateway.console import CSP
from tests.cluster import no_leftover_processes  # noqa: F401 (fixture)
from tests.helpers import cached_model_dir
from tests.test_cli_up import ROOT, Up, _common, _die_with_parent

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

API_KEY = "sk-console-test"
STATIC = ROOT / "services" / "gateway" / "static"


def _gateway(scheduler: str, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port_block(1)
    p = subprocess.Popen([sys.executable, "-m", "zeroserve.services.cli", "gateway", "--scheduler", scheduler, "--port",
                          str(port), *args], cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         preexec_fn=_die_with_parent)  # noqa: PLW1509 (prctl + setpgrp only)
    return p, f"http://127.0.0.1:{port}"


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the gateway for {url} exited ({proc.returncode})"
        try:
            httpx.get(url + "/health", timeout=2.0)
            return
        except httpx.HTTPError:
            time.sleep(0.3)
    raise TimeoutError(f"no gateway at {url} after {timeout}s")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("console")
    up = Up("console", ["--model", str(cached_model_dir("llama")), *_common(free_port_block(4)),
                        "--max-queue-len", "1"], tmp=tmp)
    gws: list[subprocess.Popen] = []
    try:
        url = up.wait_line(r"^console\s+(http://\S+)/\s").group(1)
        up.wait_line(r"^ready: ")
        keyed, keyed_url = _gateway(up.address, "--api-key", API_KEY)
        no_ui, no_ui_url = _gateway(up.address, "--no-ui")
        gws += [keyed, no_ui]
        _wait_http(url, up.proc)
        _wait_http(keyed_url, keyed)
        _wait_http(no_ui_url, no_ui)
        yield {"up": up, "main": url, "keyed": keyed_url, "no_ui": no_ui_url}
    finally:
        for p in gws:
            p.terminate()
        for p in gws:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        up.stop()


class _Refs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self.inline_scripts = 0
        self.inline_styles = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "script" and "src" in a:
            self.refs.append(a["src"])
        elif tag == "script":
            self.inline_scripts += 1
        if tag == "link" and a.get("rel") == "stylesheet":
            self.refs.append(a["href"])
        if "style" in a or any(k.startswith("on") for k in a):
            self.inline_styles += 1


def test_pages_and_their_files_are_served_with_a_strict_csp(env):
    for path, marker in (("/", "chat.js"), ("/cluster", "cluster.js")):
        r = httpx.get(env["main"] + path, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), (path, r.text[:200])
        csp = r.headers["content-security-policy"]
        assert csp == CSP and "unsafe" not in csp and "default-src 'none'" in csp
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert r.headers["x-content-type-options"] == "nosniff"
        refs = _Refs()
        refs.feed(r.text)
        assert marker in " ".join(refs.refs)
        # the CSP would block inline code: the pages must have none (or they would break)
        assert refs.inline_scripts == 0 and refs.inline_styles == 0, path
        for ref in refs.refs:
            assert ref.startswith("/static/"), f"{path} loads {ref} from elsewhere"
            f = httpx.get(env["main"] + ref, timeout=10)
            assert f.status_code == 200 and f.content, ref
            want = "text/javascript" if ref.endswith(".js") else "text/css"
            assert f.headers["content-type"].startswith(want), (ref, f.headers["content-type"])
    for bad in ("/static/nope.js", "/static/..%2Fconsole.py", "/static/%2E%2E/app.py"):
        assert httpx.get(env["main"] + bad, timeout=10).status_code == 404, bad


def test_static_files_are_small_and_fetch_nothing_from_outside():
    files = list(STATIC.iterdir())
    assert {"chat.html", "cluster.html", "console.css"} <= {f.name for f in files}
    assert sum(f.stat().st_size for f in files) < 80_000, "the console should stay tens of kB"
    for f in files:
        text = f.read_text()
        # no CDN, no web font, no remote image: clusters often have no internet
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|@import|url\(\s*["']?(https?:)?//""", text), f.name


def test_up_prints_the_console_url_and_no_ui_reaches_the_gateway():
    from argparse import Namespace

    from zeroserve.services.cli import build_parser
    from zeroserve.services.launcher import plan_children

    for flags, has in (([], False), (["--no-ui"], True)):
        args = build_parser().parse_args(["up", "--model", str(cached_model_dir("llama")), *flags])
        assert isinstance(args, Namespace)
        (gw,) = [c for c in plan_children(args, args.model, gateway=True) if c.role == "gateway"]
        assert ("--no-ui" in gw.argv) is has, gw.argv


def test_api_cluster_holds_what_the_cluster_page_shows(env):
    from zeroserve import AsyncClient, Overloaded
    from zeroserve import SamplingParams

    async def refused_once() -> None:  # --max-queue-len 1: a second request while one runs is refused
        async with AsyncClient(env["up"].address) as c:
            stream = c.stream("hello there", SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
            it = stream.__aiter__()
            await it.__anext__()
            with pytest.raises(Overloaded):
                await c.generate("again", SamplingParams(max_tokens=2))
            await stream.aclose()

    asyncio.run(refused_once())
    r = httpx.get(env["main"] + "/api/cluster", timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    assert abs(body["time"] - time.time()) < 60
    s = body["stats"]
    assert s["detokenizer"]["connected"] is True and isinstance(s["queue"], int)
    (g,) = s["groups"]
    assert g["state"] == "ready" and g["tp_size"] == 1 and g["model"] == s["models"][0]
    for k in ("kv_blocks_total", "kv_blocks_used", "running", "waiting", "steps", "tokens"):
        assert isinstance(g[k], int), k
    (w,) = g["workers"]
    assert w["host"] and w["worker_id"] == "g0-r0" and w["rank"] == 0
    m = s["metrics"]
    assert m["refused"] >= 1, m
    assert isinstance(m["requeued"], int)
    assert m["ttft_count"] >= 1 and m["ttft_sum_s"] > 0, m


def test_the_api_key_guards_the_cluster_api_not_the_pages(env):
    url = env["keyed"]
    assert httpx.get(url + "/", timeout=10).status_code == 200  # the page, which then asks for the key
    assert httpx.get(url + "/static/chat.js", timeout=10).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(url + "/api/cluster", headers=headers, timeout=10)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    ok = httpx.get(url + "/api/cluster", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert ok.status_code == 200 and ok.json()["stats"]["groups"]


def test_no_ui_serves_the_api_and_no_console(env):
    url = env["no_ui"]
    for path in ("/", "/cluster", "/static/chat.js", "/api/cluster"):
        assert httpx.get(url + path, timeout=10).status_code == 404, path
    assert httpx.get(url + "/v1/models", timeout=10).status_code == 200
