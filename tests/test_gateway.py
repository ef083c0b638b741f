"""The OpenAI-compatible HTTP gateway against a real local cluster, driven by the `openai` SDK.

One cluster for the module (scheduler with a chat template and a small queue, detokenizer, one
worker) and three gateway processes: the main one (with the model's tokenizer), one with an API
key, a small body limit and a short request timeout, and one pointed at a port where no
scheduler listens. Greedy completions are checked against HF transformers; every error class
must arrive as the SDK's typed exception; an abandoned stream must free its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import httpx
import openai
import pytest

from zeroserve.common.transport import free_port_block
from tests.cluster import LocalCluster, no_leftover_processes  # noqa: F401 (fixture)
from tests.helpers import cached_model_dir, torch_single_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("no_leftover_processes", "torch_single_thread")

ARCH = "llama"
KV_BLOCKS = 256
MAX_QUEUE = 12
API_KEY = "sk-test-secret"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def start_gateway(cluster: LocalCluster, name: str, *args: str, scheduler: str | None = None) -> str:
    """Start a gateway process as one of the cluster's children (stopped with it) -> base URL."""
    port = free_port_block(1)
    cluster._start(name, cluster._cmd("gateway", "--scheduler", scheduler or cluster.address, "--port", str(port),
                                      *args), role="gateway")
    return f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def cluster_with_gateway(scheduler_args: list[str], model=None, gateway_args: tuple[str, ...] = (),
                         num_kv_blocks: int = 128):
    """A model (the tiny llama unless given) on one worker, a scheduler with `scheduler_args` and
    one gateway with `gateway_args`, all ready -> (cluster, the gateway's base URL); stopped on exit."""
    c = LocalCluster(model or cached_model_dir(ARCH), workers=1, num_kv_blocks=num_kv_blocks,
                     scheduler_args=scheduler_args)
    try:
        c.start()
        url = start_gateway(c, "gateway", *gateway_args)
        c.wait_ready(timeout=180)
        wait_http(url, c, "gateway")
        yield c, url
    finally:
        c.stop()


def wait_http(url: str, cluster: LocalCluster, name: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert cluster.children[name].proc.poll() is None, f"{name} exited\n{cluster.logs()}"
        try:
            httpx.get(url + "/metrics", timeout=2.0)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError(f"{name} not listening in {timeout}s\n{cluster.logs()}")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    model = cached_model_dir(ARCH)
    tmpl = tmp_path_factory.mktemp("gw") / "chat.jinja"
    tmpl.write_text(CHAT_TEMPLATE)
    c = LocalCluster(model, workers=1, num_kv_blocks=KV_BLOCKS,
                     scheduler_args=["--chat-template", str(tmpl), "--max-queue-len", str(MAX_QUEUE)])
    try:
        c.start()
        urls = {"main": start_gateway(c, "gateway", "--model", str(model)),
                "strict": start_gateway(c, "gateway-strict", "--api-key", API_KEY, "--max-body-bytes", "4000",
                                        "--request-timeout", "0.5", "--nice", str(STRICT_NICE)),
                "dead": start_gateway(c, "gateway-dead", "--timeout", "1",
                                      scheduler=f"tcp://127.0.0.1:{free_port_block(1)}")}
        c.wait_ready(timeout=180)
        for name, key in (("gateway", "main"), ("gateway-strict", "strict"), ("gateway-dead", "dead")):
            wait_http(urls[key], c, name)
        yield c, urls, model
    finally:
        c.stop()


STRICT_NICE = 3  # a nice value above 0 needs no privilege


def test_gateway_runs_at_the_nice_value_it_was_given(env):
    pids = env[0].pids()
    assert os.getpriority(os.PRIO_PROCESS, pids["gateway-strict"]) == STRICT_NICE
    assert os.getpriority(os.PRIO_PROCESS, pids["gateway"]) == os.getpriority(os.PRIO_PROCESS, 0)


def test_nice_values_are_checked_and_a_refusal_says_what_to_do(monkeypatch):
    from zeroserve.common.priority import set_nice

    for bad in (-21, 20, True, 1.5):
        with pytest.raises(ValueError, match=r"--nice must be an integer in \[-20, 19\]"):
            set_nice(bad, "zeroserve gateway")

    def refuse(*_):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    with pytest.raises(ValueError, match="needs root or CAP_SYS_NICE"):
        set_nice(-5, "zeroserve gateway")
    set_nice(os.getpriority(os.PRIO_PROCESS, 0), "zeroserve gateway")  # already so: nothing to set


def sdk(url: str, **kw) -> openai.OpenAI:
    kw.setdefault("api_key", "unused")
    return openai.OpenAI(base_url=url + "/v1", max_retries=0, timeout=60.0, **kw)


@pytest.fixture(scope="module")
def oai(env):
    return sdk(env[1]["main"])


@pytest.fixture(scope="module")
def model_id(oai):
    models = oai.models.list().data
    assert len(models) == 1
    return models[0].id


def wait_idle(cluster: LocalCluster, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = cluster.stats()
        g = s["groups"][0]
        if s["requests"] == 0 and g.get("kv_blocks_used", 0) == 0:
            return s
        assert time.monotonic() < deadline, f"not idle: requests {s['requests']}, kv {g.get('kv_blocks_used')}"
        time.sleep(0.2)


# ------------------------------------------------------------------------------ basics


def test_health_models_and_tokenize(env, oai, model_id):
    _c, urls, model = env
    r = httpx.get(urls["main"] + "/health")
    assert r.status_code == 200 and r.json()["groups_ready"] == 1
    assert model_id == model.name
    m = oai.models.retrieve(model_id)
    assert m.id == model_id
    t = httpx.post(urls["main"] + "/tokenize", json={"model": model_id, "prompt": "hello world"}, timeout=60).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] > 0
    d = httpx.post(urls["main"] + "/detokenize", json={"model": model_id, "tokens": t["tokens"]}).json()
    assert "hello world" in d["prompt"]


def test_greedy_completions_equal_hf_transformers(oai, model_id):
    from tests.hf_reference import hf_greedy

    prompts = [[5, 17, 33, 9, 120, 44], [300, 301, 7], list(range(40, 80))]
    r = oai.completions.create(model=model_id, prompt=prompts, max_tokens=12, temperature=0, logprobs=0,
                               extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    for p, ch in zip(prompts, r.choices):
        ids = [int(t.removeprefix("token_id:")) for t in ch.logprobs.tokens]
        assert ids == hf_greedy(ARCH, p, 12, "ignore"), f"prompt {p}"
        assert ch.finish_reason == "length" and len(ch.logprobs.token_logprobs) == 12
    assert r.usage.prompt_tokens == sum(map(len, prompts))
    assert r.usage.completion_tokens == 36 and r.usage.total_tokens == 36 + r.usage.prompt_tokens


def test_completion_n2_logprobs_stop_echo(oai, model_id):
    prompt = "The quick brown fox"
    r = oai.completions.create(model=model_id, prompt=prompt, max_tokens=8, n=2, temperature=1.0, seed=3,
                               logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == [0, 1]
    for ch in r.choices:
        lp = ch.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
        assert "".join(lp.tokens).replace("\ufffd", "") or ch.text == ""
    assert r.usage.completion_tokens == 16
    again = oai.completions.create(model=model_id, prompt=prompt, max_tokens=8, n=2, temperature=1.0, seed=3,
                                   extra_body={"ignore_eos": True})
    assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]  # seeded: repeatable

    # stop strings: cut a greedy text at a substring in its middle
    full = oai.completions.create(model=model_id, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    stop = next((full[k:k + 2] for k in range(len(full) // 3, len(full) - 2)
                 if full[k:k + 2].isascii() and full[k:k + 2].isprintable() and full.find(full[k:k + 2]) == k), None)
    if stop is not None:
        cut = oai.completions.create(model=model_id, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True}).choices[0]
        assert cut.finish_reason == "stop" and cut.text == full[:full.find(stop)]
    echoed = oai.completions.create(model=model_id, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True}).choices[0].text
    assert echoed.startswith(prompt) and echoed[len(prompt):] == full[:len(echoed) - len(prompt)]


def test_streaming_completions_sync_and_async(env, oai, model_id):
    args = {"model": model_id, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0,
                "extra_body": {"ignore_eos": True}}
    whole = oai.completions.create(**args)
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # continuous_usage_stats (vLLM's): usage so far in every chunk, counting up to the total
    running = list(oai.completions.create(stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": True}, **args))
    counts = [ch.usage.completion_tokens for ch in running if ch.choices]
    assert counts == sorted(counts) and counts[-1] == 16 and all(ch.usage is not None for ch in running)
    assert all(ch.usage.prompt_tokens == whole.usage.prompt_tokens for ch in running)

    async def run():
        ac = openai.AsyncOpenAI(base_url=env[1]["main"] + "/v1", api_key="unused", max_retries=0)
        try:
            outs = await asyncio.gather(*(ac.completions.create(stream=True, **args) for _ in range(4)))
            texts = []
            for s in outs:
                texts.append("".join([ch.choices[0].text async for ch in s if ch.choices]))
            plain = await ac.completions.create(**args)
            return texts, plain.choices[0].text
        finally:
            await ac.close()

    texts, plain = asyncio.run(run())
    assert texts == [whole.choices[0].text] * 4 and plain == whole.choices[0].text


def test_first_token_latency_reaches_stream_clients(env, model_id):
    """The cluster's own receipt-to-first-token time: a header on streamed HTTP responses and on
    AsyncClient's first delta, with the gateway's handler-to-first-token time beside it
    (benchmarks/serve.py subtracts them to see where the transport's share goes)."""
    body = {"model": model_id, "prompt": "Once upon a time", "max_tokens": 4, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", env[1]["main"] + "/v1/completions", json=body, timeout=60.0) as r:
        assert r.status_code == 200
        lat = float(r.headers["zeroserve-first-token-latency"])
        gw_lat = float(r.headers["zeroserve-gateway-first-token-latency"])  # the gateway's handler: holds the cluster's
        list(r.iter_lines())
    assert 0.0 < lat <= gw_lat < time.perf_counter() - t0

    async def direct():
        from zeroserve import AsyncClient, SamplingParams

        async with AsyncClient(env[0].address) as c:
            deltas = [d async for d in c.stream("Once upon a time", SamplingParams(max_tokens=4))]
            whole = await c.generate("Once upon a time", SamplingParams(max_tokens=4))
        return deltas, whole

    deltas, whole = asyncio.run(direct())
    assert deltas[0].first_token_latency is not None and deltas[0].first_token_latency > 0.0
    assert all(d.first_token_latency is None for d in deltas[1:])
    assert whole.first_token_latency is not None and whole.first_token_latency > 0.0


def test_chat_completions(oai, model_id):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = oai.chat.completions.create(model=model_id, messages=msgs, max_completion_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    ch = r.choices[0]
    assert ch.message.role == "assistant" and ch.finish_reason == "length"
    assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens > 0
    # max_tokens works too; the stream carries the same text
    chunks = list(oai.chat.completions.create(model=model_id, messages=msgs, max_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ch.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    # n=2 with logprobs and top_logprobs
    r2 = oai.chat.completions.create(model=model_id, messages=msgs, max_tokens=5, n=2, seed=1, logprobs=True,
                                     top_logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r2.choices) == [0, 1]
    for c in r2.choices:
        assert len(c.logprobs.content) == 5
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)
    assert r2.usage.completion_tokens == 10


# ------------------------------------------------------------------------------ errors


def test_errors_arrive_as_typed_sdk_exceptions(env, oai, model_id):
    c, urls, _ = env
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.completions.create(model=model_id, prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oai.completions.create(model=model_id, prompt="x", max_tokens="many")
    with pytest.raises(openai.BadRequestError, match="max_model_len"):  # the cluster's InvalidRequest, passed on
        oai.completions.create(model=model_id, prompt=[7] * 5000, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="messages"):
        oai.chat.completions.create(model=model_id, messages=[])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.completions.create(model="no-such-model", prompt="x")

    strict = sdk(urls["strict"], api_key=API_KEY)
    with pytest.raises(openai.AuthenticationError):
        sdk(urls["strict"], api_key="wrong").completions.create(model=model_id, prompt="x", max_tokens=1)
    assert httpx.post(urls["strict"] + "/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.get(urls["strict"] + "/health").status_code == 200  # health and metrics stay open
    assert strict.completions.create(model=model_id, prompt="x", max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(openai.APIStatusError) as big:
        strict.completions.create(model=model_id, prompt="y" * 5000, max_tokens=1)
    assert big.value.status_code == 413
    with pytest.raises(openai.APIStatusError) as slow:  # --request-timeout 0.5
        strict.completions.create(model=model_id, prompt="x", max_tokens=1500, extra_body={"ignore_eos": True})
    assert slow.value.status_code == 504

    dead = sdk(urls["dead"])
    assert httpx.get(urls["dead"] + "/health").status_code == 503
    with pytest.raises(openai.APIStatusError) as down:
        dead.completions.create(model=model_id, prompt="x", max_tokens=1)
    assert down.value.status_code == 503
    wait_idle(c)


def test_overload_is_a_rate_limit_error(env, model_id):
    c, urls, _ = env

    async def flood():
        ac = openai.AsyncOpenAI(base_url=urls["main"] + "/v1", api_key="unused", max_retries=0)
        try:
            res = await asyncio.gather(*(ac.completions.create(model=model_id, prompt=f"p{i}", max_tokens=1000,
                                                               stream=True, extra_body={"ignore_eos": True})
                                         for i in range(MAX_QUEUE + 6)), return_exceptions=True)
            for r in res:
                if not isinstance(r, BaseException):
                    await r.close()  # leave the stream: the request is aborted
            return res
        finally:
            await ac.close()

    res = asyncio.run(flood())
    limited = [r for r in res if isinstance(r, openai.RateLimitError)]
    assert limited, f"no 429 among {[type(r).__name__ for r in res]}"
    assert limited[0].response.headers.get("retry-after")
    assert not [r for r in res if isinstance(r, BaseException) and not isinstance(r, openai.RateLimitError)]
    wait_idle(c)


def test_abandoned_stream_frees_its_blocks(env, model_id):
    c, urls, _ = env
    wait_idle(c)
    body = {"model": model_id, "prompt": list(range(3, 103)), "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", urls["main"] + "/v1/completions", json=body, timeout=30.0) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a dropped iterator closes the connection (that would be the abort)
        seen = 0
        while seen < 3:
            line = next(lines)
            assert '"error"' not in line, line
            seen += line.startswith("data: {")
        busy = c.stats()
        assert busy["requests"] == 1 and busy["groups"][0]["kv_blocks_used"] > 0, busy
    # leaving the block closed the connection mid-stream
    s = wait_idle(c, timeout=30)  # the gateway saw the disconnect and aborted the request
    assert s["groups"][0]["kv_blocks_free"] == KV_BLOCKS
    assert s["tokens_total"] - busy["tokens_total"] < 1000


def test_streamed_prompt_lists_keep_their_indices(oai, model_id):
    """Several prompts in one streaming request: each index's events add up to its plain text."""
    prompts = [[5, 17, 33, 9], [300, 301, 7, 8, 9], list(range(40, 60))]
    args = {"model": model_id, "prompt": prompts, "max_tokens": 10, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    whole = {ch.index: ch.text for ch in oai.completions.create(**args).choices}
    texts, finishes = {}, {}
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    assert texts == whole and finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == 30


# ------------------------------------------------------------------------------ the lean path, fake cluster
# The gateway in-process (uvicorn in a thread) over a fake cluster client: what a real cluster
# cannot be made to do on cue (a burst of deltas for one stream, a first token that never comes).


class FakeStream:
    """Stands in for AsyncStream: `script` is a list of delta lists, each delivered at once
    after a short pause, as the real client queues deltas when its consumer is behind (the
    gateway asks `ready()` as it does an AsyncStream). An empty script never delivers.
    `aborted` is set when the gateway closes or cancels it before the end."""

    def __init__(self, script: list[list]) -> None:
        import collections
        from types import SimpleNamespace

        self._req = SimpleNamespace(queue=collections.deque())
        self.script = list(script)
        self.aborted = False
        self.finished = False

    def ready(self) -> bool:
        return bool(self._req.queue)

    def __aiter__(self):
        return self

    async def __anext__(self):
        while not self._req.queue:
            if self.finished or self.aborted:
                raise StopAsyncIteration
            if not self.script:  # an empty script: wait until cancelled
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    self.aborted = True
                    raise
            await asyncio.sleep(0.02)
            self._req.queue.extend(self.script.pop(0))
        d = self._req.queue.popleft()
        self.finished = d.finish_reason is not None and not self._req.queue and not self.script
        return d

    async def aclose(self):
        if not self.finished:
            self.aborted = True


class FakeClient:
    def __init__(self, scripts: list) -> None:
        self.scripts = scripts
        self.streams: list[FakeStream] = []
        self.generates: list[str] = []  # "cancelled" once a plain request's task is cancelled
        self.models_calls = 0
        self.models_delay = 0.05

    def stream(self, prompt, params, request_id=None, request_timeout_s=None, model_defaults=None, **tools):
        s = FakeStream(self.scripts.pop(0) if self.scripts else [])
        self.streams.append(s)
        return s

    stream_chat = stream

    async def generate(self, prompt, params, request_id=None, request_timeout_s=None, model_defaults=None):
        self.generates.append("running")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.generates[-1] = "cancelled"
            raise

    async def models(self):
        self.models_calls += 1
        await asyncio.sleep(self.models_delay)
        return [{"id": "fake", "max_model_len": 64}]

    async def close(self):
        pass


def _delta(text: str, finish: str | None = None, first: bool = False):
    from zeroserve._request import StreamDelta

    return StreamDelta("r", 0, text, [7], finish_reason=finish, prompt_token_ids=[1, 2, 3] if first else None)


@pytest.fixture
def fake_gateway():
    """-> (base url, the fake client, the body of every non-empty response body message)."""
    import threading

    import uvicorn

    from zeroserve.common.config import GatewayArgs
    from zeroserve.services.gateway.app import create_app

    holder: dict = {}
    writes: list[bytes] = []

    def factory():
        holder["client"] = FakeClient(holder.pop("scripts"))
        return holder["client"]

    app = create_app(GatewayArgs(), client_factory=factory)

    async def recording(scope, receive, send):
        async def rec(msg):
            if msg["type"] == "http.response.body" and msg.get("body"):
                writes.append(msg["body"])
            await send(msg)

        await app(scope, receive, rec)

    port = free_port_block(1)
    server = uvicorn.Server(uvicorn.Config(recording, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))

    thread = threading.Thread(target=server.run, daemon=True)

    def start(scripts: list) -> tuple[str, FakeClient]:
        holder["scripts"] = scripts
        thread.start()
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "the in-process gateway did not start"
            time.sleep(0.02)
        return f"http://127.0.0.1:{port}", holder["client"]

    yield start, writes
    server.should_exit = True
    if thread.is_alive():
        thread.join(timeout=10)
        assert not thread.is_alive(), "the in-process gateway did not stop"


def test_waiting_deltas_go_out_in_one_write_as_separate_events(fake_gateway):
    start, writes = fake_gateway
    burst = [_delta("b"), _delta("c"), _delta("d"), _delta("e", "length")]
    chat_burst = [_delta("x"), _delta("y", "stop")]
    url, _ = start([[[_delta("A", first=True)], burst], [[_delta("w", first=True)], chat_burst]])
    oai = sdk(url)
    chunks = list(oai.completions.create(model="fake", prompt="p", max_tokens=5, stream=True,
                                         stream_options={"include_usage": True}))
    assert [c.choices[0].text for c in chunks if c.choices] == ["A", "b", "c", "d", "e"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None] * 4 + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == 3
    # the first delta went out alone; the burst, the usage event and [DONE] in one write
    assert len(writes) == 2 and writes[1].count(b"data: ") == 6 and writes[1].endswith(b"data: [DONE]\n\n")

    writes.clear()
    chat = list(oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                            stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].delta.content for c in chat[1:]] == ["w", "x", "y"]
    assert chat[-1].choices[0].finish_reason == "stop"
    assert len(writes) == 2 and writes[1].count(b"data: ") == 3


def test_benchmark_client_reads_every_event_and_reuses_its_connection(fake_gateway):
    from benchmarks.serve import HTTPClient, Req, http_one

    start, _ = fake_gateway
    url, _ = start([[[_delta("A", first=True)], [_delta("b"), _delta("c", "length")]],
                    [[_delta("A", first=True)], [_delta("b", "length")]]])

    async def run():
        client = HTTPClient(url)
        try:
            one = await http_one(client, "fake", Req([1, 2, 3], 3))
            conn = client.idle[0]
            two = await http_one(client, "fake", Req([1, 2, 3], 2))
            assert client.idle == [conn]  # kept alive and reused
            return one, two
        finally:
            client.close()

    one, two = asyncio.run(run())
    assert one.ok and one.output_tokens == 3 and len(one.itl) == 2  # 3 content events
    assert two.ok and two.output_tokens == 2 and len(two.itl) == 1


def test_a_client_that_leaves_before_the_first_token_aborts(fake_gateway):
    start, _ = fake_gateway
    url, client = start([])
    for stream in (True, False):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "p", "stream": stream},
                       timeout=httpx.Timeout(5.0, read=0.3))
        deadline = time.monotonic() + 5
        while not (client.streams[-1].aborted if stream else client.generates[-1] == "cancelled"):
            assert time.monotonic() < deadline, "the request was not aborted after the client left"
            time.sleep(0.05)


def test_lean_path_errors_and_shared_model_refresh(fake_gateway, monkeypatch):
    import zeroserve.services.gateway.app as gw_app

    start, _ = fake_gateway
    url, client = start([])
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": [], "stream": True})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "p", "stream": True})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(url + "/v1/completions").status_code == 405
    # a stale model list: the request is answered from it while one (slow) refresh runs behind
    monkeypatch.setattr(gw_app, "MODELS_TTL_S", 0.0)
    client.scripts.append([[_delta("A", first=True)], [_delta("b", "length")]])
    client.models_delay, calls = 2.0, client.models_calls
    t0 = time.monotonic()
    chunks = list(sdk(url).completions.create(model="fake", prompt="p", max_tokens=2, stream=True))
    assert time.monotonic() - t0 < 1.5 and [c.choices[0].text for c in chunks] == ["A", "b"]
    assert client.models_calls == calls + 1
    # an unknown name refreshes the list first; requests in flight together share one refresh
    client.models_delay, calls = 0.3, client.models_calls

    async def many():
        async with httpx.AsyncClient(base_url=url, timeout=10.0) as ac:
            return await asyncio.gather(*(ac.post("/v1/completions", json={"model": "nope", "prompt": "p"})
                                          for _ in range(8)))

    assert all(r.status_code == 404 for r in asyncio.run(many()))
    assert client.models_calls - calls < 8
