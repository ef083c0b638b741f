"""Prometheus metrics of the cluster, computed where the facts are: in the scheduler.

The scheduler sees every request (from the HTTP gateway and from ZeroMQ clients alike), so the
serving metrics live here, in a `CollectorRegistry` the scheduler owns. Names follow vLLM v1's
with the prefix ``zeroserve:`` and the label ``model_name``; the cluster-only ones (worker
groups by state, requeued requests, per-group KV usage and steps/s) come after them.

Small hooks feed it from the state code, all on the scheduler loop's thread:

* `admitted` (cluster.py, a request passed its checks): prompt tokens;
* `step` (cluster.py, a group's step result came in): queue time and prefix-cache queries
  (their prompt tokens) of the requests it started, iteration tokens, the group's step count;
* `output` (delivery.py, an Output leaves for the client): generation tokens, time to first
  token, inter-token latency;
* `finished` (cluster.py: every completion done, or aborted): success count by finish reason,
  end-to-end latency, prompt / generation length histograms; `forget` drops a request's timings;
* `requeued` (cluster.py, a group ended and its requests are routed again);
* `refresh` (the loop's timer, and before every MetricsRequest): gauges (running, waiting, KV
  usage, groups), prefix-cache hits and preemptions from each group's policy.

`text()` is the exposition text: the scheduler's ``--metrics-port`` serves the registry over
HTTP (prometheus_client's server, in a thread), and a `MetricsRequest` gets the same text in a
`MetricsReply`, which the gateway's ``/metrics`` serves. `summary()` holds the key figures for
`StatsReply` (and so `zeroserve status`). Imports neither torch nor any web framework.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no *_created series (vLLM has none either); this process's registries only

if TYPE_CHECKING:
    from zeroserve.services.scheduler.delivery import Delivery, Live, Seq

PREFIX = "zeroserve:"
MODEL = ["model_name"]
GROUP_STATES = ("joining", "probing", "ready", "draining")

# vLLM v1's buckets
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def tokens_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > max_value:
                return out
            out.append(float(v))
        exp += 1


@dataclass
class _Times:
    """What the metrics keep per live request (by its key)."""

    model: str
    arrival: float
    prompt_tokens: int
    scheduled: bool = False
    first_token: bool = False
    generated: int = 0
    last_token: dict[int, float] = field(default_factory=dict)  # completion index -> time of its last tokens


@dataclass
class _GroupSeen:
    """A group's policy counters at the last refresh (the policy is new each time it is READY)."""

    policy_id: int = 0
    hits: int = 0
    preemptions: int = 0
    steps_t: float = 0.0
    steps: int = 0
    spec: tuple = (0, 0, 0)  # drafts, draft tokens, accepted tokens
    spec_pos: list = field(default_factory=list)


class SchedulerMetrics:
    def __init__(self, max_model_len: int = 1 << 17, models: tuple[str, ...] | list[str] = ()) -> None:
        r = self.registry = CollectorRegistry()
        p = PREFIX

        def counter(name: str, doc: str, labels: list[str] = MODEL) -> Counter:
            return Counter(p + name, doc, labels, registry=r)

        def gauge(name: str, doc: str, labels: list[str] = MODEL) -> Gauge:
            return Gauge(p + name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(p + name, doc, MODEL, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                                                              "tokens.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.success = counter("request_success", "Count of successfully processed requests.",
                               [*MODEL, "finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Histogram of time spent waiting in the queue "
                                                                  "(arrival to first scheduled step) in seconds.",
                                    LATENCY_BUCKETS)
        tb = tokens_buckets(max_model_len)
        self.req_prompt = histogram("request_prompt_tokens", "Number of prefill tokens processed.", tb)
        self.req_generation = histogram("request_generation_tokens", "Number of generation tokens processed.", tb)
        self.iteration = histogram("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                   ITERATION_BUCKETS)
        # speculative decoding (the policies' SpecStats)
        self.spec_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.spec_accepted_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                         "Accepted tokens per draft position.", [*MODEL, "position"])
        # cluster-only
        self.groups = Gauge(p + "worker_groups", "Worker groups by state.", [*MODEL, "state"], registry=r)
        self.requeued_total = counter("requests_requeued", "Requests routed again after their worker group ended "
                                                     "(failovers).")
        self.group_kv = gauge("group_kv_cache_usage_perc", "KV-cache usage of one worker group (1 = 100 percent).",
                              [*MODEL, "group"])
        self.group_steps = counter("group_steps", "Steps a worker group completed.", [*MODEL, "group"])
        self.group_steps_rate = gauge("group_steps_per_second", "Steps per second of one worker group (over the "
                                                                "last seconds).", [*MODEL, "group"])
        for m in models:  # every series of a served model exists from the start (at 0)
            for metric in (self.running, self.waiting, self.kv_usage, self.prefix_queries, self.prefix_hits,
                           self.preemptions, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl,
                           self.e2e, self.queue_time, self.req_prompt, self.req_generation, self.iteration,
                           self.requeued_total, self.spec_drafts, self.spec_draft_tokens, self.spec_accepted):
                metric.labels(m)
            for st in GROUP_STATES:
                self.groups.labels(m, st)
            for reason in ("stop", "length", "abort"):
                self.success.labels(m, reason)
        self._req: dict[str, _Times] = {}
        self._seen: dict[str, _GroupSeen] = {}
        self._group_labels: set[tuple[str, str]] = set()
        self._models: set[str] = set()
        # plain totals for summary() (StatsReply, `zeroserve status`)
        self.totals = {"requests_finished": 0, "requests_aborted": 0, "prompt_tokens": 0, "generation_tokens": 0,
                       "requeued": 0, "preemptions": 0, "prefix_cache_hits": 0, "prefix_cache_queries": 0,
                       "refused": 0, "spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                       "spec_decode_num_accepted_tokens": 0}
        self._sums = {"ttft": [0.0, 0], "itl": [0.0, 0], "e2e": [0.0, 0], "queue": [0.0, 0]}
        self._children: dict[tuple, Any] = {}

    def _at(self, metric: Any, *labels: str) -> Any:
        """metric.labels(*labels), kept: prometheus_client's lookup costs ~20 us, and the paths
        below run it per output, every step (a tenth of the scheduler's time per step at 64
        requests). Only series nothing removes come here (refresh() removes gone groups' gauges)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _obs(self, name: str, hist: Histogram, model: str, v: float) -> None:
        v = max(0.0, v)
        self._at(hist, model).observe(v)
        s = self._sums[name]
        s[0] += v
        s[1] += 1

    # ================================================================ hooks
    def admitted(self, live: Live) -> None:
        n = len(live.prompt_ids)
        self._req[live.key] = _Times(live.model, live.created, n)
        self._at(self.prompt_tokens, live.model).inc(n)
        self.totals["prompt_tokens"] += n

    def step(self, g: Any, step: Any, sent_at: float, delivery: Delivery) -> None:
        """A group's step came back: its new requests were scheduled at `sent_at`."""
        self._at(self.iteration, g.model).observe(step.total_tokens)
        self._at(self.group_steps, g.model, g.name).inc()
        for nr in step.new_reqs:
            ref = delivery.get(nr.req_id)
            t = self._req.get(ref.live.key) if ref is not None else None
            if t is not None and not t.scheduled:
                t.scheduled = True
                self._obs("queue", self.queue_time, t.model, sent_at - t.arrival)
                # a request's prompt is looked up in the prefix cache when it is first scheduled
                self._at(self.prefix_queries, t.model).inc(t.prompt_tokens)
                self.totals["prefix_cache_queries"] += t.prompt_tokens

    def output(self, live: Live, s: Seq, num_tokens: int, now: float) -> None:
        """An Output with `num_tokens` new tokens of completion `s` leaves for the client."""
        t = self._req.get(live.key)
        if t is None or num_tokens <= 0:
            return
        self._at(self.generation_tokens, t.model).inc(num_tokens)
        self.totals["generation_tokens"] += num_tokens
        t.generated += num_tokens
        if not t.first_token:
            t.first_token = True
            self._obs("ttft", self.ttft, t.model, now - t.arrival)
        last = t.last_token.get(s.req.index)
        if last is not None:
            gap = (now - last) / num_tokens
            for _ in range(num_tokens):
                self._obs("itl", self.itl, t.model, gap)
        t.last_token[s.req.index] = now

    def finished(self, live: Live, now: float, reason: str | None = None) -> None:
        """The request ended (every completion done, or aborted): counted once."""
        t = self._req.pop(live.key, None)
        if t is None:
            return
        if reason is None:
            reason = next((s.req.finish_reason for s in live.seqs if s.req.finish_reason), None) or "stop"
        self._at(self.success, t.model, reason).inc()
        self.totals["requests_aborted" if reason == "abort" else "requests_finished"] += 1
        self._obs("e2e", self.e2e, t.model, now - t.arrival)
        self._at(self.req_prompt, t.model).observe(t.prompt_tokens)
        self._at(self.req_generation, t.model).observe(t.generated)

    def forget(self, key: str) -> None:
        """A request that failed (an error reply): no success, no latency."""
        self._req.pop(key, None)

    def refused(self) -> None:
        """A request turned away at admission (the cluster is full: the client gets Overloaded)."""
        self.totals["refused"] += 1

    def requeued(self, model: str, n: int = 1) -> None:
        self.requeued_total.labels(model).inc(n)
        self.totals["requeued"] += n

    # ================================================================ gauges and policy counters
    def refresh(self, cluster: Any, now: float) -> None:
        models = set(cluster.models)
        running = dict.fromkeys(models, 0)
        waiting = dict.fromkeys(models, 0)
        used = dict.fromkeys(models, 0)
        total = dict.fromkeys(models, 0)
        states = {(m, st): 0 for m in models for st in GROUP_STATES}
        labels = set()
        for g in cluster.groups.values():
            state = g.state.value
            if state == "gone":
                continue
            states[(g.model, state)] = states.get((g.model, state), 0) + 1
            pol = g.policy
            if pol is None:
                continue
            bm = pol.bm
            running[g.model] = running.get(g.model, 0) + len(pol.running)
            waiting[g.model] = waiting.get(g.model, 0) + len(pol.waiting)
            used[g.model] = used.get(g.model, 0) + bm.num_used_blocks
            total[g.model] = total.get(g.model, 0) + bm.num_blocks
            labels.add((g.model, g.name))
            self.group_kv.labels(g.model, g.name).set(bm.usage())
            self.group_steps.labels(g.model, g.name)  # the series exists before the first step
            self.group_steps_rate.labels(g.model, g.name)
            seen = self._seen.get(g.name)
            if seen is None or seen.policy_id != id(pol):
                seen = self._seen[g.name] = _GroupSeen(id(pol), steps_t=now, steps=g.steps)
            for attr, cur, ctr, tot in (("hits", bm.hits, self.prefix_hits, "prefix_cache_hits"),
                                        ("preemptions", pol.num_preemptions, self.preemptions, "preemptions")):
                prev = getattr(seen, attr)
                delta = cur - prev if cur >= prev else cur  # the block manager was reset
                if delta:
                    ctr.labels(g.model).inc(delta)
                    self.totals[tot] += delta
                setattr(seen, attr, cur)
            self._spec(g.model, pol.spec, seen)
            if now - seen.steps_t >= 1.0:
                self.group_steps_rate.labels(g.model, g.name).set((g.steps - seen.steps) / (now - seen.steps_t))
                seen.steps_t, seen.steps = now, g.steps
        for live in cluster.pending:  # admitted, no group yet
            waiting[live.model] = waiting.get(live.model, 0) + sum(1 for s in live.seqs if not s.done)
        for m in set(running) | set(waiting):
            self.running.labels(m).set(running.get(m, 0))
            self.waiting.labels(m).set(waiting.get(m, 0))
            self.kv_usage.labels(m).set(used.get(m, 0) / total[m] if total.get(m) else 0.0)
        for (m, st), n in states.items():
            self.groups.labels(m, st).set(n)
        for m, name in self._group_labels - labels:
            for metric in (self.group_kv, self.group_steps_rate):
                try:
                    metric.remove(m, name)
                except KeyError:
                    pass
            self._seen.pop(name, None)
        self._group_labels = labels

    def _spec(self, model: str, spec: Any, seen: _GroupSeen) -> None:
        """The policy's speculative-decoding counters since the last refresh."""
        cur = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
        for ctr, tot, c, p in zip((self.spec_drafts, self.spec_draft_tokens, self.spec_accepted),
                                  ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                   "spec_decode_num_accepted_tokens"), cur, seen.spec):
            if c > p:
                ctr.labels(model).inc(c - p)
                self.totals[tot] += c - p
        seen.spec = cur
        for pos, c in enumerate(spec.accepted_per_pos):
            p = seen.spec_pos[pos] if pos < len(seen.spec_pos) else 0
            if c > p or pos >= len(seen.spec_pos):
                self.spec_accepted_pos.labels(model, str(pos)).inc(max(0, c - p))
        seen.spec_pos = list(spec.accepted_per_pos)

    # ================================================================ out
    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def summary(self) -> dict[str, Any]:
        """Key figures for StatsReply: totals and mean latencies (seconds)."""
        out: dict[str, Any] = dict(self.totals)
        for name, (s, n) in self._sums.items():
            out[f"{name}_mean_s"] = round(s / n, 6) if n else None
            # the sums and counts too: a poller (the web console) takes the mean over its own window
            out[f"{name}_sum_s"], out[f"{name}_count"] = round(s, 6), n
        q = self.totals["prefix_cache_queries"]
        out["prefix_cache_hit_rate"] = round(self.totals["prefix_cache_hits"] / q, 4) if q else None
        d = self.totals["spec_decode_num_draft_tokens"]
        out["spec_decode_acceptance_rate"] = round(self.totals["spec_decode_num_accepted_tokens"] / d, 4) if d else None
        return out


def serve_http(metrics: SchedulerMetrics, host: str, port: int):
    """prometheus_client's HTTP server for the registry, in a daemon thread -> (server, thread)."""
    from prometheus_client import start_http_server

    return start_http_server(port, addr=host, registry=metrics.registry)


__all__ = ["PREFIX", "SchedulerMetrics", "serve_http"]
