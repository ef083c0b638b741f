"""A fake cluster around the scheduler's state objects, for tests/test_scheduler_state.py.

Fake workers run a deterministic "model" (the next token is a function of the sequence so far,
so a sequence recomputed elsewhere continues the same way), a fake detokenizer turns token k
into the text "<k>", and `Net` carries outboxes to them and their answers back, one loop turn
at a time, on a fake clock.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from zeroserve.common import messages as P
from zeroserve.common.config import SchedulerConfig
from zeroserve.common.model_config import ModelConfig
from zeroserve.common.sampling_params import SamplingParams
from zeroserve.services.scheduler.cluster import Cluster, ModelInfo
from zeroserve.services.scheduler.groups import GroupState
from zeroserve.services.scheduler.outbox import BACKEND, CLIENT, STEPS, Outbox

MODEL = "tiny-test"
VOCAB = 512
CLIENT_ID = b"client-1"


def next_token(tokens: list[int]) -> int:
    """The fake model: never the EOS id (2)."""
    return 3 + (sum(tokens) * 31 + len(tokens) * 7) % (VOCAB - 3)


def reference(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


def text_of(toks) -> str:
    return "".join(f"<{int(t)}>" for t in toks)


def make_cluster(**over) -> Cluster:
    kw = {"heartbeat_timeout_s": 1.0, "step_timeout_s": 2.0, "drain_timeout_s": 3.0, "client_timeout_s": 1000.0,
          "no_worker_timeout_s": 5.0, "probe_interval_s": 0.1, "stats_interval_s": 1e9}
    kw.update(over)
    mc = ModelConfig(architecture="LlamaForCausalLM", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2,
                     head_dim=32, intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=2048,
                     eos_token_ids=[2], name=MODEL)
    return Cluster(SchedulerConfig(**kw), {MODEL: ModelInfo(MODEL, mc, None)}, "sched-test", "tcp://sched:7002",
                   {}, now=100.0)


class FakeWorker:
    """Rank 0 of a group: keeps per-request tokens from the steps, as a real worker does."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.ident = worker_id.encode()
        self.reqs: dict[str, list] = {}  # req_id -> [tokens, computed]
        self.seen_new: list[P.NewRequest] = []
        self.finished: list[str] = []
        self.pooling: dict[str, str | None] = {}  # embedding requests: pooled instead of sampled

    def run(self, step: P.Step) -> P.StepResult:
        for rid in step.finished_req_ids:
            self.reqs.pop(rid, None)
            self.finished.append(rid)
        for n in step.new_reqs:
            self.seen_new.append(n)
            self.reqs[n.req_id] = [n.token_ids.tolist(), n.num_computed_tokens]
            self.pooling[n.req_id] = n.pooling
        ids, sampled, embeds = [], [], {}
        for rid, k in step.num_scheduled().items():
            st = self.reqs[rid]
            st[1] += k
            tok = -1
            if st[1] == len(st[0]) and self.pooling.get(rid):
                embeds[rid] = fake_embedding(st[0], self.pooling[rid])
            elif st[1] == len(st[0]):
                tok = next_token(st[0])
                st[0].append(tok)
            ids.append(rid)
            sampled.append(tok)
        out = P.StepResult(seq=step.seq, worker_id=self.worker_id, req_ids=ids,
                           sampled_token_ids=np.asarray(sampled, np.int32))
        if embeds:
            out.embed_req_ids, out.embeddings = list(embeds), np.stack(list(embeds.values()))
        return out


def fake_embedding(tokens: list[int], pooling: str) -> np.ndarray:
    """What the fake worker pools: the last token (or the mean of all) in every one of 64 components."""
    return np.full(64, tokens[-1] if pooling == "last" else float(np.mean(tokens)), np.float32)


class FakeDetok:
    def __init__(self, name: str, stop_after: dict[str, int] | None = None) -> None:
        self.worker_id = name
        self.ident = name.encode()
        self.new: list[P.DetokRequest] = []
        self.tokens: dict[str, list[int]] = defaultdict(list)  # req_id -> tokens fed (replayed ones too)
        self.stop_after = stop_after or {}  # req_id -> "STOP" once it has this many tokens

    def handle(self, m) -> P.DetokOutputs | None:
        if isinstance(m, P.DetokNew):
            for it in m.items:
                assert it.text_offset == len(text_of(it.output_token_ids)), "replayed text offset"
                self.new.append(it)
                self.tokens[it.req_id] = it.output_token_ids.tolist()
            return None
        if not isinstance(m, P.DetokTokens):
            return None
        deltas, stops, kept = [], [], []
        for rid, toks in zip(m.req_ids, m.per_request()):
            self.tokens[rid] += toks.tolist()
            limit = self.stop_after.get(rid)
            if limit is not None and len(self.tokens[rid]) >= limit:
                keep = len(toks) - (len(self.tokens[rid]) - limit)
                deltas.append(text_of(toks[:keep]))
                stops.append("STOP")
                kept.append(keep)
            else:
                deltas.append(text_of(toks))
                stops.append(None)
                kept.append(-1)
        return P.DetokOutputs(seq=m.seq, req_ids=list(m.req_ids), text_deltas=deltas, stop_strs=stops,
                              stop_tokens=kept)


class Net:
    """Carries outboxes to the fake peers and their answers back, one loop turn at a time."""

    def __init__(self, c: Cluster, dt: float = 0.01) -> None:
        self.c, self.now, self.dt = c, c.started, dt
        self.workers: dict[str, list[FakeWorker]] = {}  # group -> shards (rank order)
        self.steps: dict[str, list[P.Step]] = defaultdict(list)  # published, not answered yet
        self.published: list[tuple[str, P.Message]] = []
        self.backend: dict[bytes, list] = defaultdict(list)
        self.clients: dict[bytes, list] = defaultdict(list)
        self.detok: FakeDetok | None = None
        self.hung: set[str] = set()  # groups that stop answering steps
        # steps a group answers per loop turn (None: all it has); 1 keeps a pipeline's steps in flight
        self.answers_per_turn: int | None = None
        self.silent: set[str] = set()  # groups that stop heartbeating

    def send(self, ob: Outbox) -> Outbox:
        assert not ob.tokenize, "these tests submit token ids"
        for it in ob:
            if it.role == STEPS:
                self.published.append((it.to, it.msg))
                if isinstance(it.msg, P.Step):
                    self.steps[it.to].append(it.msg)
            elif it.role == BACKEND:
                self.backend[it.to].append(it.msg)
            elif it.role == CLIENT:
                self.clients[it.to].append(it.msg)
        return ob

    # -------------------------------------------------------------- peers
    def join(self, group: str, tp: int = 1, blocks: int = 64, max_loras: int = 0,
             kept: list[P.KeptSeq] | None = None, pp: int = 1) -> list[FakeWorker]:
        """A group of `tp` x `pp` shards (group rank order) joins and is probed ready; `kept`:
        rank 0's Hello.kept (the KV its cache held when the scheduler restarted)."""
        shards = [FakeWorker(f"{group}-r{r}") for r in range(tp * pp)]
        for r, w in enumerate(shards):
            h = P.Hello(role="worker", worker_id=w.worker_id, group=group, tp_rank=r % tp, tp_size=tp, model=MODEL,
                        pp_rank=r // tp, pp_size=pp,
                        num_kv_blocks=blocks, block_size=16, max_model_len=2048,
                        dist_init_addr="tcp://rank0:29500" if r == 0 else None, max_loras=max_loras,
                        kept=(kept or []) if r == 0 else [])
            self.send(self.c.on_hello(w.ident, h, self.now))
            assert self.backend[w.ident][-1].status == "accepted"
        self.now += 0.2
        self.send(self.c.tick(self.now))
        probe = [m for g, m in self.published if g == group and isinstance(m, P.Probe)][-1]
        for w in shards:
            self.send(self.c.on_probe_ack(w.ident, P.ProbeAck(worker_id=w.worker_id, probe_id=probe.probe_id),
                                          self.now))
        assert self.c.groups.get(group).state == GroupState.READY
        self.workers[group] = shards
        return shards

    def join_detok(self, name: str, **kw) -> FakeDetok:
        d = FakeDetok(name, **kw)
        self.send(self.c.on_hello(d.ident, P.Hello(role="detokenizer", worker_id=name), self.now))
        assert self.backend[d.ident][-1].status == "accepted"
        self.detok = d
        return d

    def submit(self, rid: str, prompt: list[int], max_tokens: int, client: bytes = CLIENT_ID, lora: str | None = None,
               **kw) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, lora=lora)
        self.send(self.c.on_submit(client, P.Submit(request_id=rid, prompt_token_ids=np.asarray(prompt, np.int32),
                                                    params=params, **kw), self.now))

    # -------------------------------------------------------------- the loop
    def turn(self, detok: bool = True) -> None:
        self.now += self.dt
        c = self.c
        for group, shards in self.workers.items():
            if group not in self.silent:
                for w in shards:
                    self.send(c.on_heartbeat(w.ident, P.Heartbeat(worker_id=w.worker_id), self.now))
            if group not in self.hung and self.steps[group]:
                k = self.answers_per_turn or len(self.steps[group])
                todo, self.steps[group] = self.steps[group][:k], self.steps[group][k:]
                g = c.groups.get(group)
                answer = g.answer_rank if g is not None else 0  # the last stage's tp rank 0
                for st in todo:
                    results = [w.run(st) for w in shards]  # every shard applies the step
                    self.send(c.on_step_result(shards[answer].ident, results[answer], self.now))
        if detok and self.detok is not None:
            self.send(c.on_heartbeat(self.detok.ident, P.Heartbeat(worker_id=self.detok.worker_id), self.now))
            inbox, self.backend[self.detok.ident] = self.backend[self.detok.ident], []
            for m in inbox:
                out = self.detok.handle(m)
                if out is not None:
                    self.send(c.on_detok_outputs(self.detok.ident, out, self.now))
        self.send(c.tick(self.now))
        self.send(c.dispatch(self.now))
        self.send(c.flush())

    def run(self, until, turns: int = 400, **kw) -> None:
        for _ in range(turns):
            if until():
                return
            self.turn(**kw)
        raise AssertionError("the cluster did not get there")

    # -------------------------------------------------------------- what clients got
    def got(self, rid: str, client: bytes = CLIENT_ID):
        """(tokens, text, finish reasons, errors) of one request."""
        toks, text, reasons, errors = [], "", [], []
        for m in self.clients[client]:
            if isinstance(m, P.Outputs):
                for o in m.items:
                    if o.request_id == rid:
                        toks += list(o.token_ids)
                        text += o.text
                        reasons += [o.finish_reason] if o.finish_reason else []
            elif isinstance(m, P.Error) and m.request_id == rid:
                errors.append(m)
        return [int(t) for t in toks], text, reasons, errors

    def done(self, rid: str) -> bool:
        return bool(self.got(rid)[2] or self.got(rid)[3])


def group_of(c: Cluster, rid: str) -> str | None:
    key = c.by_client[(CLIENT_ID, rid)]
    return c.live[key].group


def prompt(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, VOCAB, n).tolist()
