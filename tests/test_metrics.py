"""Prometheus metrics: computed in the scheduler, served on its --metrics-port and by the gateway's
/metrics; the counters must agree with what was served (through the gateway and a ZeroMQ client)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from zeroserve.common.transport import free_port_block
from tests.cluster import REPO, no_leftover_processes  # noqa: F401 (fixture)
from tests.test_gateway import cluster_with_gateway

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

VLLM_NAMES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
              "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "request_success",
              "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens",
              "iteration_tokens_total", "worker_groups", "requests_requeued", "requests_reattached",
              "group_kv_cache_usage_perc",
              "group_steps", "group_steps_per_second"]


@pytest.fixture(scope="module")
def env():
    mport = free_port_block(1)
    with cluster_with_gateway(["--metrics-port", str(mport)]) as (c, url):
        yield c, url, f"http://127.0.0.1:{mport}/metrics"


def samples(text: str) -> dict[tuple, float]:
    """(sample name, frozenset of labels) -> value."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(ss: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in ss.items() if n == name and want <= lab)


def test_counters_agree_with_what_was_served(env):
    c, url, scheduler_url = env
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    model = oai.models.list().data[0].id
    before = samples(httpx.get(url + "/metrics").text)
    assert total(before, "zeroserve:request_success_total") == 0
    assert total(before, "zeroserve:worker_groups", state="ready") == 1
    P = "zeroserve:"
    for name in VLLM_NAMES:
        assert any(n.startswith(P + name) for n, _ in before), name

    served, prompt_tokens, requests, seqs = 0, 0, 0, 0
    for i in range(3):
        r = oai.completions.create(model=model, prompt=f"request number {i}", max_tokens=7, temperature=0,
                                   extra_body={"ignore_eos": True})
        served += r.usage.completion_tokens
        prompt_tokens += r.usage.prompt_tokens
        requests += 1
        seqs += 1
    chunks = list(oai.completions.create(model=model, prompt="streamed", max_tokens=5, n=2, seed=4, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    served += chunks[-1].usage.completion_tokens
    prompt_tokens += chunks[-1].usage.prompt_tokens
    requests += 1
    seqs += 2
    repeated = list(range(10, 58))  # 48 tokens: 3 full blocks, the second time from the prefix cache
    for _ in range(2):
        r = oai.completions.create(model=model, prompt=repeated, max_tokens=2, temperature=0,
                                   extra_body={"ignore_eos": True})
        served += r.usage.completion_tokens
        prompt_tokens += r.usage.prompt_tokens
        requests += 1
        seqs += 1
    with c.client(timeout_s=10.0) as zc:  # a ZeroMQ client, which never touches the gateway
        from zeroserve import SamplingParams

        out = zc.generate([3, 4, 5, 6], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        served += len(out.outputs[0].token_ids)
        prompt_tokens += 4
        requests += 1
        seqs += 1
    assert served == 3 * 7 + 10 + 4 + 4

    text = httpx.get(url + "/metrics").text
    ss = samples(text)
    assert total(ss, P + "generation_tokens_total", model_name=model) == served
    assert total(ss, P + "prompt_tokens_total") == prompt_tokens
    assert total(ss, P + "request_success_total") == requests
    assert total(ss, P + "request_success_total", finished_reason="length") == requests
    assert total(ss, P + "time_to_first_token_seconds_count") == requests
    assert total(ss, P + "e2e_request_latency_seconds_count") == requests
    assert total(ss, P + "request_queue_time_seconds_count") == requests
    assert total(ss, P + "inter_token_latency_seconds_count") == served - seqs
    assert total(ss, P + "request_generation_tokens_sum") == served
    assert total(ss, P + "request_prompt_tokens_sum") == prompt_tokens
    assert total(ss, P + "iteration_tokens_total_count") >= 1
    assert total(ss, P + "prefix_cache_hits_total") >= 32  # the repeated prompt's first 2-3 blocks
    assert total(ss, P + "prefix_cache_queries_total") == prompt_tokens
    assert total(ss, P + "num_requests_running") == 0 and total(ss, P + "kv_cache_usage_perc") == 0
    assert total(ss, P + "group_steps_total", group="g0") >= 1
    assert total(ss, P + "num_preemptions_total") == 0
    # the gateway's own counters ride along
    assert total(ss, P + "gateway_http_requests_total", endpoint="/v1/completions", status="200") == requests - 1

    # the scheduler serves the same registry on its --metrics-port
    direct = samples(httpx.get(scheduler_url).text)
    assert total(direct, P + "generation_tokens_total") == served
    assert total(direct, P + "request_success_total") == requests

    # and `zeroserve status` shows the key figures (from StatsReply)
    st = c.stats()["metrics"]
    assert st["requests_finished"] == requests and st["generation_tokens"] == served
    assert st["ttft_mean_s"] > 0 and st["prefix_cache_hits"] >= 32
    r = subprocess.run([sys.executable, "-m", "zeroserve.services.cli", "status", "--address", c.address], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"served {requests} " in r.stdout and f"generated {served}" in r.stdout, r.stdout


def test_an_aborted_stream_counts_as_abort(env):
    c, url, _ = env
    before = samples(httpx.get(url + "/metrics").text)
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "abandon me", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30.0) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
    deadline = time.monotonic() + 20
    while True:
        ss = samples(httpx.get(url + "/metrics").text)
        aborted = total(ss, "zeroserve:request_success_total", finished_reason="abort")
        if aborted == total(before, "zeroserve:request_success_total", finished_reason="abort") + 1:
            break
        assert time.monotonic() < deadline, "the abandoned stream was not counted as aborted"
        time.sleep(0.2)
    assert total(ss, "zeroserve:num_requests_running") == 0
