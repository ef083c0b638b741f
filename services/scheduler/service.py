"""The scheduler process: admission, routing, continuous batching per worker group, output routing.

One thread runs the loop (sockets, timers, steps); prompts are tokenized in a small thread pool
so a long prompt never delays a step. Each worker group has its own policy (block manager and
running set) and at most one step in flight; the next step of a group is scheduled and sent as
soon as its previous result is in, before the result's outputs are routed to the detokenizer
and clients, so message handling overlaps the workers' compute. Socket map and message flow:
docs/architecture.md.
"""

from __future__ import annotations

import enum
import itertools
import queue
import random
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import zmq

from common import protocol as P
from common.errors import InvalidRequest, Overloaded, RequestTimeout, ZeroserveError
from common.log import get_logger
from common.model_config import ModelConfig
from common.sampling_params import SamplingParams
from common.step import to_message
from common.tokenizer import load_tokenizer
from common.transport import curve_server_keys, is_loopback, make_socket, start_authenticator
from services.scheduler.admission import check_params_for_model, check_token_ids, child_seed
from services.scheduler.block_manager import BlockManager
from services.scheduler.policy import Scheduler as Policy
from services.scheduler.policy import TokenEvent
from services.scheduler.request import Request

log = get_logger("scheduler")


@dataclass
class SchedulerConfig:
    host: str = "127.0.0.1"
    port: int = 7000  # client ROUTER; backend = port+1, steps PUB = port+2, events PUB = port+3
    advertise_host: str | None = None  # what workers dial for the step PUB (bind host if unset)
    models: list[str] = field(default_factory=list)  # model dirs whose tokenizers we serve
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    max_queue_len: int = 4096
    heartbeat_timeout_s: float = 5.0
    step_timeout_s: float = 120.0
    client_timeout_s: float = 10.0
    no_worker_timeout_s: float = 300.0
    drain_timeout_s: float = 60.0
    probe_interval_s: float = 0.1
    stats_interval_s: float = 1.0
    seed: int = 0
    curve_keys: str | None = None  # CURVE key directory (`zeroserve keys`); None = plain sockets

    def addresses(self) -> dict[str, str]:
        h, p = self.host, self.port
        return {"client": f"tcp://{h}:{p}", "backend": f"tcp://{h}:{p + 1}", "steps": f"tcp://{h}:{p + 2}",
                "events": f"tcp://{h}:{p + 3}"}


class GroupState(enum.Enum):
    JOINING = "joining"  # waiting for all TP shards to say HELLO
    PROBING = "probing"  # every shard connected; waiting for each SUB to see the topic
    READY = "ready"
    DRAINING = "draining"  # finishing what it runs, takes nothing new
    GONE = "gone"


@dataclass
class Shard:
    hello: P.Hello
    identity: bytes
    last_seen: float
    stats: dict = field(default_factory=dict)
    probe_acked: bool = False
    welcomed: bool = False


@dataclass
class Group:
    name: str
    model: str
    tp_size: int
    shards: dict[int, Shard] = field(default_factory=dict)
    state: GroupState = GroupState.JOINING
    policy: Policy | None = None
    seq: int = 0
    in_flight: tuple | None = None  # (seq, SchedulerOutput, sent_at)
    probe_id: str = ""
    last_probe: float = 0.0
    dist_init_addr: str | None = None
    drain_started: float = 0.0
    steps: int = 0
    tokens: int = 0
    pending_welcome: list = field(default_factory=list)  # (identity, hello) of ranks > 0 waiting for rank 0

    def load(self) -> int:
        return self.policy.num_unfinished if self.policy else 0


@dataclass
class Seq:
    """One completion of a live request, as the scheduler tracks its delivery."""

    req: Request
    sent: int = 0  # output tokens handed to the detokenizer
    delivered: int = 0  # output tokens delivered to the client
    lp: list = field(default_factory=list)  # logprob rows of accepted tokens, (ids, lps, rank)
    chars: int = 0  # text characters delivered
    finish_reason: str | None = None  # set when the policy ended it; final Output pending
    hide_last: bool = False  # it ended on a stop token whose text stays out of the output
    done: bool = False  # final Output sent


@dataclass
class Live:
    key: str
    request_id: str
    client: bytes
    model: str
    params: SamplingParams
    prompt_ids: list[int]
    seqs: list[Seq]
    group: str | None = None
    deadline: float | None = None
    created: float = 0.0
    sent_first: bool = False
    num_cached_tokens: int = 0


@dataclass
class ModelInfo:
    name: str
    cfg: ModelConfig
    tokenizer: object


class SchedulerService:
    def __init__(self, cfg: SchedulerConfig, ctx: zmq.Context | None = None) -> None:
        self.cfg = cfg
        self.id = uuid.uuid4().hex[:12]
        self.ctx = ctx or zmq.Context.instance()
        self.models: dict[str, ModelInfo] = {}
        for d in cfg.models:
            mc = ModelConfig.from_dir(d)
            self.models[mc.name] = ModelInfo(mc.name, mc, load_tokenizer(d))
        self.default_model = next(iter(self.models), None)
        addrs = cfg.addresses()
        # CURVE: every bound socket is a CURVE server; the ZAP handler admits only allowed keys
        curve = curve_server_keys(cfg.curve_keys)
        self.auth = start_authenticator(self.ctx, curve.allowed_dir) if curve else None
        kw = curve.socket_kwargs() if curve else {}
        socks = []
        try:
            for sock_type, name in ((zmq.ROUTER, "client"), (zmq.ROUTER, "backend"), (zmq.PUB, "steps"),
                                    (zmq.PUB, "events")):
                socks.append(make_socket(self.ctx, sock_type, bind=addrs[name], **kw))
        except BaseException:
            for s in socks:
                s.close(linger=0)
            if self.auth:
                self.auth.stop()
            raise
        self.client_sock, self.backend, self.steps_pub, self.events_pub = socks
        if curve:
            log.info("CURVE on: peers must hold an allowed client key", allowed=str(curve.allowed_dir),
                     allowed_keys=len(list(curve.allowed_dir.glob("*.key"))))
        elif not is_loopback(cfg.host):
            log.warning("bound to a non-loopback host without CURVE: traffic is unauthenticated and unencrypted; "
                        "whoever reaches these ports can submit requests or pose as a worker. Fine on a private "
                        "network; otherwise run `zeroserve keys DIR` and start every process with --curve-keys DIR "
                        "(env ZEROSERVE_CURVE_KEYS)", host=cfg.host)
        for s in (self.client_sock, self.backend):
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.addrs = addrs
        adv = cfg.advertise_host or cfg.host
        self.step_addr_advertised = f"tcp://{adv}:{cfg.port + 2}"
        # tokenization off the loop: results come back through a queue, a PAIR socket wakes us
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.tok_results: queue.SimpleQueue = queue.SimpleQueue()
        wake_addr = f"inproc://sched-wake-{self.id}"
        self.wake_rx = self.ctx.socket(zmq.PAIR)
        self.wake_rx.bind(wake_addr)
        self.wake_tx = self.ctx.socket(zmq.PAIR)
        self.wake_tx.connect(wake_addr)
        self.wake_lock = threading.Lock()
        self.poller = zmq.Poller()
        for s in (self.client_sock, self.backend, self.wake_rx):
            self.poller.register(s, zmq.POLLIN)

        self.groups: dict[str, Group] = {}
        self.shard_of: dict[str, tuple[str, int]] = {}  # worker_id -> (group, rank)
        self.detok: bytes | None = None
        self.detok_id: str | None = None
        self.detok_last_seen = 0.0
        self.detok_seq = itertools.count(1)
        self.detok_inflight: dict[int, dict[str, tuple[int, str | None]]] = {}
        self.detok_new: list[P.DetokRequest] = []
        self.detok_tokens: dict[str, list] = {}  # seq id -> [count, finish_reason]
        self.live: dict[str, Live] = {}  # key -> Live
        self.by_client: dict[tuple[bytes, str], str] = {}  # (client, request_id) -> key
        self.seq_index: dict[str, tuple[Live, int]] = {}  # internal seq id -> (live, index)
        self.pending: list[Live] = []  # admitted, waiting for a group that serves their model
        self.client_seen: dict[bytes, float] = {}
        self.out_buf: dict[bytes, list[P.Output]] = {}
        self.keys = itertools.count()
        self.rng = random.Random(cfg.seed)
        self.started = time.monotonic()
        self.tokens_total = 0
        self.rate_window: list[tuple[float, int]] = []
        self.last_stats = 0.0
        self.last_checks = 0.0
        self._stop = False

    # ================================================================ loop
    def run(self) -> None:
        log.info("scheduler ready", **self.addrs, models=list(self.models), scheduler_id=self.id)
        try:
            while not self._stop:
                busy = any(g.state == GroupState.PROBING for g in self.groups.values())
                timeout = 50 if busy else 200
                events = dict(self.poller.poll(timeout))
                if self.backend in events:
                    self._drain(self.backend, self._on_backend)
                if self.client_sock in events:
                    self._drain(self.client_sock, self._on_client)
                if self.wake_rx in events:
                    while self.wake_rx.poll(0):
                        self.wake_rx.recv()
                    self._on_tokenized()
                self._timers()
                self._dispatch_all()
                self._flush()
        finally:
            self.close()

    def stop(self) -> None:
        self._stop = True

    def close(self) -> None:
        for g in self.groups.values():
            if g.state != GroupState.GONE:
                self._publish(g.name, P.Shutdown(reason="scheduler stopping"))
        self.pool.shutdown(wait=False, cancel_futures=True)
        for s in (self.client_sock, self.backend, self.steps_pub, self.events_pub, self.wake_rx, self.wake_tx):
            s.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None

    def _drain(self, sock: zmq.Socket, handler) -> None:
        for _ in range(10000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            ident = frames[0].bytes
            try:
                msg = P.decode(frames[1:])
            except P.ProtocolError as e:
                log.warning("bad message", peer=ident.hex()[:16], reason=e.reason)
                self._send(sock, ident, P.Error(code=e.code, message=f"bad message: {e.reason}"))
                continue
            try:
                handler(ident, msg)
            except ZeroserveError as e:
                self._send(sock, ident, P.Error.from_exception(e, getattr(msg, "request_id", None)))
            except Exception as e:  # a bug must not take the cluster down; tell the peer
                log.exception("handler failed", msg=type(msg).__name__)
                self._send(sock, ident, P.Error(request_id=getattr(msg, "request_id", None), code="internal",
                                                message=f"internal error: {type(e).__name__}: {e}"))

    def _send(self, sock: zmq.Socket, ident: bytes, msg) -> bool:
        try:
            sock.send_multipart([ident, *P.encode(msg)], zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError:  # peer gone (ROUTER_MANDATORY) or its queue is full
            return False

    def _publish(self, group: str, msg) -> None:
        self.steps_pub.send_multipart(P.encode_pub(P.group_topic(group), msg), copy=False)

    # ================================================================ clients
    def _on_client(self, ident: bytes, msg) -> None:
        now = time.monotonic()
        self.client_seen[ident] = now
        if isinstance(msg, P.Submit):
            self._on_submit(ident, msg, now)
        elif isinstance(msg, P.Abort):
            key = self.by_client.get((ident, msg.request_id))
            if key is not None:
                self._abort(self.live[key], "abort")
        elif isinstance(msg, P.Ping):
            self._send(self.client_sock, ident, P.Pong(nonce=msg.nonce, scheduler_id=self.id))
        elif isinstance(msg, P.StatsRequest):
            self._send(self.client_sock, ident, P.StatsReply(stats=self.stats()))
        elif isinstance(msg, P.ModelsRequest):
            self._send(self.client_sock, ident, P.ModelsReply(models=self._models_list()))
        else:
            raise InvalidRequest(f"{type(msg).__name__} is not a client message")

    def _on_submit(self, ident: bytes, m: P.Submit, now: float) -> None:
        if (ident, m.request_id) in self.by_client:
            raise InvalidRequest(f"request id {m.request_id!r} is already running on this client")
        params = SamplingParams.from_dict(m.params)
        model = params.model or self.default_model
        if model not in self.models:
            served = sorted(self.models)
            raise InvalidRequest(f"model {model!r} is not served by this cluster; served models: {served}"
                                 if served else "this scheduler serves no model; start it with --model DIR")
        if len(self.live) >= self.cfg.max_queue_len:
            raise Overloaded(f"the cluster holds {len(self.live)} requests (max_queue_len); retry later "
                             "or add workers")
        key = str(next(self.keys))
        live = Live(key, m.request_id, ident, model, params, [], [], created=now,
                    deadline=now + m.timeout_s if m.timeout_s else None)
        self.live[key] = live
        self.by_client[(ident, m.request_id)] = key
        info = self.models[model]
        if m.prompt_token_ids is not None:
            self.tok_results.put((key, m.prompt_token_ids.tolist(), None))
            self._wake()
        else:
            fut = self.pool.submit(info.tokenizer.encode, m.prompt)
            fut.add_done_callback(lambda f, key=key: self._tokenized(key, f))

    def _tokenized(self, key: str, fut) -> None:  # runs in a pool thread
        try:
            self.tok_results.put((key, fut.result(), None))
        except Exception as e:
            self.tok_results.put((key, None, e))
        self._wake()

    def _wake(self) -> None:
        with self.wake_lock:
            self.wake_tx.send(b"", zmq.NOBLOCK)

    def _on_tokenized(self) -> None:
        while True:
            try:
                key, ids, err = self.tok_results.get_nowait()
            except queue.Empty:
                return
            live = self.live.get(key)
            if live is None:
                continue  # aborted meanwhile
            try:
                if err is not None:
                    raise InvalidRequest(f"the prompt could not be tokenized: {err}")
                self._admit(live, ids)
            except ZeroserveError as e:
                self._fail(live, e)

    def _admit(self, live: Live, ids: list[int]) -> None:
        info = self.models[live.model]
        vocab = info.cfg.vocab_size
        if not ids:
            raise InvalidRequest("the prompt is empty; send some text or token ids")
        check_token_ids(ids, vocab, "prompt token ids")
        max_len = self._max_model_len(live.model)
        if len(ids) >= max_len:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens but model {live.model!r} serves at most "
                                 f"{max_len} tokens in total (max_model_len); shorten the prompt")
        check_params_for_model(live.params, vocab)
        live.prompt_ids = ids
        p = live.params
        seed = p.seed if p.seed is not None else self.rng.getrandbits(63)
        reqs = [Request(f"{live.key}#{i}", ids, p, child_seed(seed, i), max_len, client_id=live.key, index=i)
                for i in range(p.n)]
        for r in reqs:
            r.siblings = reqs if p.n > 1 else None
            self.seq_index[r.req_id] = (live, r.index)
        live.seqs = [Seq(r) for r in reqs]
        for s in live.seqs:
            self.detok_new.append(self._detok_request(live, s))
        self._route(live)

    def _max_model_len(self, model: str) -> int:
        m = self.models[model].cfg.max_position_embeddings
        if self.cfg.max_model_len:
            m = min(m, self.cfg.max_model_len)
        for g in self.groups.values():
            if g.model == model and g.policy is not None:
                m = min(m, g.policy.max_model_len)
        return m

    def _route(self, live: Live) -> None:
        """Pick the group for a request: prefix-cache hits first, then the least loaded."""
        best, best_key = None, None
        for g in self.groups.values():
            if g.state != GroupState.READY or g.model != live.model:
                continue
            hit = g.policy.bm.num_cached_prefix_tokens(live.prompt_ids) if live.prompt_ids else 0
            crowded = g.load() >= g.policy.max_num_seqs
            key = (not crowded and hit > 0, hit if not crowded else 0, -g.load(), g.policy.bm.num_free_blocks)
            if best_key is None or key > best_key:
                best, best_key = g, key
        if best is None:
            live.group = None
            self.pending.append(live)
            return
        live.group = best.name
        for s in live.seqs:
            if not s.req.finished:
                best.policy.add_request(s.req)

    def _fail(self, live: Live, err: ZeroserveError) -> None:
        self._send(self.client_sock, live.client, P.Error.from_exception(err, live.request_id))
        self._forget(live)

    def _abort(self, live: Live, reason: str) -> None:
        g = self.groups.get(live.group) if live.group else None
        free = []
        for s in live.seqs:
            if g is not None and g.policy is not None:
                g.policy.finish_request(s.req.req_id, reason)
            if not s.done:
                self._out(live, s, [], "", reason, None)
                s.done = True
                free.append(s.req.req_id)
        if free and self.detok is not None:
            self._send(self.backend, self.detok, P.DetokFree(req_ids=free))
        self._forget(live)

    def _forget(self, live: Live) -> None:
        self.live.pop(live.key, None)
        self.by_client.pop((live.client, live.request_id), None)
        for s in live.seqs:
            self.seq_index.pop(s.req.req_id, None)
            self.detok_tokens.pop(s.req.req_id, None)
        if live in self.pending:
            self.pending.remove(live)

    # ================================================================ workers and detokenizer
    def _on_backend(self, ident: bytes, msg) -> None:
        """Messages that name a worker count only from that worker's own connection."""
        now = time.monotonic()
        if isinstance(msg, P.Hello):
            return self._on_hello(ident, msg, now)
        if isinstance(msg, P.Error):
            return log.warning("peer reported an error", code=msg.code, message=msg.message)
        if isinstance(msg, P.DetokOutputs):
            if ident != self.detok:
                raise InvalidRequest("DetokOutputs comes from a connection that is not the detokenizer's")
            self.detok_last_seen = now
            return self._on_detok_outputs(msg)
        if not isinstance(msg, (P.StepResult, P.Heartbeat, P.ProbeAck, P.Drain, P.Goodbye, P.WorkerError)):
            raise InvalidRequest(f"{type(msg).__name__} is not a worker message")
        if msg.worker_id == self.detok_id and self.detok_id is not None:
            if ident != self.detok:
                raise InvalidRequest(f"{type(msg).__name__} for detokenizer {msg.worker_id!r} from another connection")
            self.detok_last_seen = now
            if isinstance(msg, P.Goodbye):
                self.detok, self.detok_id = None, None
            return
        shard = self._shard(msg.worker_id)
        if shard is None:
            if isinstance(msg, P.Heartbeat):  # we restarted, or gave its group up: it must join again
                self._send(self.backend, ident, P.Welcome(accepted=False, scheduler_id=self.id,
                                                          reason="unknown worker: say HELLO again"))
            return  # a late message from a worker we already let go
        own = ident == shard.identity or (isinstance(msg, P.Heartbeat) and ident == f"{msg.worker_id}-hb".encode())
        if not own:
            raise InvalidRequest(f"{type(msg).__name__} names worker {msg.worker_id!r} but comes from another connection")
        g = self._group_of(msg.worker_id)
        shard.last_seen = now
        if isinstance(msg, P.StepResult):
            self._on_step_result(msg)
        elif isinstance(msg, P.Heartbeat):
            shard.stats = msg.stats
        elif isinstance(msg, P.ProbeAck):
            if msg.probe_id == g.probe_id:
                shard.probe_acked = True
                if g.state == GroupState.PROBING and all(s.probe_acked for s in g.shards.values()):
                    self._group_ready(g)
        elif isinstance(msg, P.Drain):
            if g.state in (GroupState.READY, GroupState.PROBING, GroupState.JOINING):
                log.info("group draining", group=g.name, worker=msg.worker_id)
                g.state = GroupState.DRAINING
                g.drain_started = now
        elif isinstance(msg, P.Goodbye):
            self._group_gone(g, f"worker {msg.worker_id} left: {msg.reason}")
        elif isinstance(msg, P.WorkerError):
            log.error("worker error", worker=msg.worker_id, seq=msg.seq, message=msg.message)
            self._group_gone(g, f"worker {msg.worker_id} failed: {msg.message}")

    def _shard(self, worker_id: str) -> Shard | None:
        loc = self.shard_of.get(worker_id)
        if loc is None:
            return None
        g = self.groups.get(loc[0])
        return g.shards.get(loc[1]) if g else None

    def _group_of(self, worker_id: str) -> Group | None:
        loc = self.shard_of.get(worker_id)
        return self.groups.get(loc[0]) if loc else None

    def _refuse(self, ident: bytes, reason: str) -> None:
        log.warning("refused a peer", reason=reason)
        self._send(self.backend, ident, P.Welcome(accepted=False, reason=reason, scheduler_id=self.id))

    def _on_hello(self, ident: bytes, h: P.Hello, now: float) -> None:
        reason = P.check_version(h)
        if reason:
            return self._refuse(ident, reason)
        if h.role == "detokenizer":
            log.info("detokenizer joined", worker=h.worker_id, pid=h.pid)
            self.detok, self.detok_id, self.detok_last_seen = ident, h.worker_id, now
            self._send(self.backend, ident, P.Welcome(accepted=True, scheduler_id=self.id))
            self._replay_detok()
            return
        if h.model not in self.models:
            return self._refuse(ident, f"this scheduler has no tokenizer for model {h.model!r} (serves "
                                       f"{sorted(self.models)}); start the scheduler with --model for it")
        if h.block_size <= 0 or h.num_kv_blocks <= 0:
            return self._refuse(ident, "a worker must report its KV capacity (num_kv_blocks, block_size)")
        if h.worker_id in self.shard_of:
            old = self._group_of(h.worker_id)
            shard = self._shard(h.worker_id)
            if shard is not None and shard.identity != ident and old.state != GroupState.GONE:
                return self._refuse(ident, f"worker id {h.worker_id!r} is already connected from another "
                                           "connection; give each worker a unique --worker-id")
            if old is not None and old.state in (GroupState.JOINING, GroupState.PROBING) and shard is not None:
                shard.identity, shard.last_seen, shard.welcomed = ident, now, False  # a repeated HELLO
                self._welcome_ready(old)
                return
            if old is not None and old.state != GroupState.GONE:
                self._group_gone(old, f"worker {h.worker_id} reconnected")
        name = h.group or f"g-{h.worker_id}"
        g = self.groups.get(name)
        if g is not None and g.state == GroupState.GONE:
            g = None
        if g is None:
            g = self.groups[name] = Group(name, h.model, h.tp_size)
        if g.model != h.model or g.tp_size != h.tp_size:
            return self._refuse(ident, f"group {name!r} serves {g.model!r} with tp_size {g.tp_size}; this shard "
                                       f"says {h.model!r} / {h.tp_size}")
        if g.state != GroupState.JOINING or h.tp_rank in g.shards:
            return self._refuse(ident, f"rank {h.tp_rank} of group {name!r} is already connected")
        first = next(iter(g.shards.values()), None)
        if first is not None and first.hello.block_size != h.block_size:
            return self._refuse(ident, f"block_size {h.block_size} differs from the group's {first.hello.block_size}")
        g.shards[h.tp_rank] = Shard(h, ident, now)
        self.shard_of[h.worker_id] = (name, h.tp_rank)
        log.info("worker joined", group=name, worker=h.worker_id, rank=h.tp_rank, tp=h.tp_size, device=h.device,
                 kv_blocks=h.num_kv_blocks, pid=h.pid)
        if h.tp_rank == 0:
            g.dist_init_addr = h.memory.get("dist_init_addr") if isinstance(h.memory, dict) else None
        self._welcome_ready(g)
        if len(g.shards) == g.tp_size:
            g.state = GroupState.PROBING
            g.probe_id = uuid.uuid4().hex[:8]
            g.last_probe = 0.0

    def _welcome_ready(self, g: Group) -> None:
        """Answer shards; ranks > 0 need rank 0's torch.distributed address first."""
        if 0 not in g.shards:
            return
        for rank, s in g.shards.items():
            if not s.welcomed:
                self._send(self.backend, s.identity, P.Welcome(
                    accepted=True, group=g.name, dist_init_addr=g.dist_init_addr, scheduler_id=self.id,
                    step_addr=self.step_addr_advertised))
                s.welcomed = True

    def _group_ready(self, g: Group) -> None:
        blocks = min(s.hello.num_kv_blocks for s in g.shards.values())
        bs = g.shards[0].hello.block_size
        max_len = min(s.hello.max_model_len or 1 << 30 for s in g.shards.values())
        max_len = min(max_len, self.models[g.model].cfg.max_position_embeddings)
        if self.cfg.max_model_len:
            max_len = min(max_len, self.cfg.max_model_len)
        g.policy = Policy(BlockManager(blocks, bs, self.cfg.enable_prefix_caching), self.cfg.max_num_seqs,
                          self.cfg.max_num_batched_tokens, max_len, self.models[g.model].cfg.eos_token_ids)
        g.state = GroupState.READY
        g.seq = 0
        log.info("group ready", group=g.name, model=g.model, tp=g.tp_size, kv_blocks=blocks)
        pending, self.pending = self.pending, []
        for live in pending:
            self._route(live)

    def _group_gone(self, g: Group, reason: str) -> None:
        """A group died or left: its requests go back to routing with the tokens they have."""
        if g.state == GroupState.GONE:
            return
        log.warning("group gone; requeueing its requests", group=g.name, reason=reason)
        prev = g.state
        g.state = GroupState.GONE
        reqs = g.policy.drain_all() if g.policy is not None else []
        g.in_flight = None
        if prev != GroupState.JOINING:
            self._publish(g.name, P.Shutdown(reason=reason))
        for s in g.shards.values():
            self.shard_of.pop(s.hello.worker_id, None)
        lives = {}
        for r in reqs:
            entry = self.seq_index.get(r.req_id)
            if entry is not None:
                lives[entry[0].key] = entry[0]
        for live in lives.values():
            self._route(live)

    def _on_step_result(self, m: P.StepResult) -> None:
        g = self._group_of(m.worker_id)
        if g is None or g.in_flight is None or g.in_flight[0] != m.seq or g.policy is None:
            return  # a late answer from a group we gave up on
        if self.shard_of[m.worker_id][1] != 0:
            raise InvalidRequest("only rank 0 of a group answers steps")
        _, so, _sent_at = g.in_flight
        g.in_flight = None
        shard = self._shard(m.worker_id)
        if shard is not None:
            shard.last_seen = time.monotonic()
        lp = None
        if m.logprobs is not None:
            lp = list(zip(m.logprob_token_ids, m.logprobs, m.ranks if m.ranks is not None else
                          np.zeros(len(m.req_ids), np.int32)))
        events = g.policy.update(so, m.req_ids, m.sampled_token_ids.tolist(), lp)
        g.steps += 1
        g.tokens += so.total_tokens
        self._dispatch(g)  # overlap: the group computes the next step while we route outputs
        self._accept(events)

    def _accept(self, events: list[TokenEvent]) -> None:
        now = time.monotonic()
        n = 0
        for ev in events:
            entry = self.seq_index.get(ev.req.req_id)
            if entry is None:
                continue
            live, idx = entry
            s = live.seqs[idx]
            if live.params.logprobs is not None and ev.logprobs is not None:
                s.lp.append(ev.logprobs)
            if ev.finished:
                s.finish_reason = ev.req.finish_reason
                s.hide_last = ev.req.hides_stop_token_text
            t = self.detok_tokens.setdefault(ev.req.req_id, [0, None])
            t[0] += 1
            t[1] = s.finish_reason
            n += 1
        self.tokens_total += n
        self.rate_window.append((now, n))

    # ================================================================ detokenizer
    def _detok_request(self, live: Live, s: Seq, replay: bool = False) -> P.DetokRequest:
        out = s.req.output_token_ids[:s.delivered] if replay else []
        return P.DetokRequest(req_id=s.req.req_id, prompt_token_ids=np.asarray(live.prompt_ids, np.int32),
                              params=live.params.to_dict(), output_token_ids=np.asarray(out, np.int32),
                              text_offset=s.chars if replay else 0)

    def _replay_detok(self) -> None:
        """A (new) detokenizer: give it every live sequence's state, then what it has not seen."""
        self.detok_inflight.clear()
        self.detok_new = []
        self.detok_tokens.clear()
        for live in self.live.values():
            for s in live.seqs:
                if s.done or not live.prompt_ids:
                    continue
                self.detok_new.append(self._detok_request(live, s, replay=True))
                s.sent = s.delivered
                pending = s.req.num_output_tokens - s.delivered
                if pending or s.finish_reason:
                    self.detok_tokens[s.req.req_id] = [pending, s.finish_reason]

    def _flush_detok(self) -> None:
        if self.detok is None or not (self.detok_new or self.detok_tokens):
            return
        if self.detok_new:
            if not self._send(self.backend, self.detok, P.DetokNew(items=self.detok_new)):
                return
            self.detok_new = []
        if not self.detok_tokens:
            return
        seq = next(self.detok_seq)
        ids, toks, reasons, entry = [], [], [], {}
        for rid, (count, reason) in self.detok_tokens.items():
            live, idx = self.seq_index[rid]
            s = live.seqs[idx]
            out = s.req.output_token_ids
            new = out[s.sent:s.sent + count]
            ids.append(rid)
            toks.append(new[:-1] if s.hide_last and reason is not None and new else new)
            reasons.append(reason)
            entry[rid] = (len(new), reason)
            s.sent += len(new)
        if self._send(self.backend, self.detok, P.DetokTokens.build(seq, ids, toks, reasons)):
            self.detok_inflight[seq] = entry
            self.detok_tokens = {}
        else:
            for rid, (count, _) in entry.items():
                live, idx = self.seq_index[rid]
                live.seqs[idx].sent -= count

    def _on_detok_outputs(self, m: P.DetokOutputs) -> None:
        entry = self.detok_inflight.pop(m.seq, None)
        if entry is None:
            return
        for rid, text, stop in zip(m.req_ids, m.text_deltas, m.stop_strs):
            loc = self.seq_index.get(rid)
            if loc is None or rid not in entry:
                continue
            live, idx = loc
            s = live.seqs[idx]
            if s.done:
                continue
            count, reason = entry[rid]
            if stop is not None:
                g = self.groups.get(live.group) if live.group else None
                if g is not None and g.policy is not None and not s.req.finished:
                    g.policy.finish_request(rid, "stop", stop)
                reason = "stop"
                s.req.finish_reason, s.req.stop_reason = "stop", stop
            start = s.delivered
            toks = s.req.output_token_ids[start:start + count]
            s.delivered += len(toks)
            s.chars += len(text)
            self._out(live, s, toks, text, reason, s.req.stop_reason if reason == "stop" else None, start)
            if reason is not None:
                s.done = True
                self.detok_tokens.pop(rid, None)
        self._reap()

    def _reap(self) -> None:
        done = [lv for lv in self.live.values() if lv.seqs and all(s.done for s in lv.seqs)]
        for lv in done:
            self._forget(lv)

    def _out(self, live: Live, s: Seq, toks: list[int], text: str, reason: str | None, stop_reason,
             lp_start: int | None = None) -> None:
        o = P.Output(request_id=live.request_id, index=s.req.index, token_ids=np.asarray(toks, np.int32), text=text,
                     finish_reason=reason, stop_reason=stop_reason)
        if lp_start is not None and live.params.logprobs is not None and toks:
            rows = s.lp[lp_start:lp_start + len(toks)]
            if len(rows) == len(toks):
                k = 1 + live.params.logprobs
                o.logprob_token_ids = np.stack([r[0][:k] for r in rows]).astype(np.int32)
                o.logprobs = np.stack([r[1][:k] for r in rows]).astype(np.float32)
                o.ranks = np.asarray([r[2] for r in rows], np.int32)
        if not live.sent_first:
            live.sent_first = True
            o.prompt_token_ids = np.asarray(live.prompt_ids, np.int32)
            o.num_cached_tokens = max(s.req.num_cached_tokens for s in live.seqs)
        self.out_buf.setdefault(live.client, []).append(o)

    # ================================================================ steps
    def _dispatch_all(self) -> None:
        for g in self.groups.values():
            self._dispatch(g)

    def _dispatch(self, g: Group) -> None:
        if g.in_flight is not None or g.policy is None or g.state not in (GroupState.READY, GroupState.DRAINING):
            return
        if not g.policy.needs_step():
            return
        so = g.policy.schedule()
        if so.empty and not so.finished_req_ids:
            return
        g.seq += 1
        self._publish(g.name, to_message(g.seq, g.name, so))
        g.in_flight = (g.seq, so, time.monotonic())

    # ================================================================ timers
    def _timers(self) -> None:
        now = time.monotonic()
        for g in list(self.groups.values()):
            if g.state == GroupState.PROBING and now - g.last_probe >= self.cfg.probe_interval_s:
                g.last_probe = now
                self._publish(g.name, P.Probe(probe_id=g.probe_id))
        if now - self.last_checks < 0.25:
            return
        self.last_checks = now
        for g in list(self.groups.values()):
            if g.state == GroupState.GONE:
                continue
            stale = [s for s in g.shards.values() if now - s.last_seen > self.cfg.heartbeat_timeout_s]
            if stale:
                self._group_gone(g, f"no heartbeat from {stale[0].hello.worker_id} for "
                                    f"{now - stale[0].last_seen:.1f}s")
            elif g.in_flight is not None and now - g.in_flight[2] > self.cfg.step_timeout_s:
                self._group_gone(g, f"step {g.in_flight[0]} made no progress in {self.cfg.step_timeout_s}s")
            elif g.state == GroupState.DRAINING:
                if g.policy is None or not g.policy.has_work() or now - g.drain_started > self.cfg.drain_timeout_s:
                    if g.in_flight is None or now - g.drain_started > self.cfg.drain_timeout_s:
                        for s in g.shards.values():
                            self._send(self.backend, s.identity, P.Welcome(accepted=False, reason="drained",
                                                                            group=g.name, scheduler_id=self.id))
                        self._group_gone(g, "drained")
        if self.detok is not None and now - self.detok_last_seen > self.cfg.heartbeat_timeout_s:
            log.warning("detokenizer silent; waiting for it to come back", worker=self.detok_id)
            self.detok, self.detok_id = None, None
        for live in list(self.live.values()):
            if live.deadline is not None and now > live.deadline:
                self._send(self.client_sock, live.client, P.Error(
                    request_id=live.request_id, code="timeout",
                    message=f"request {live.request_id!r} did not finish within its timeout"))
                self._abort(live, "abort")
            elif now - self.client_seen.get(live.client, now) > self.cfg.client_timeout_s:
                log.info("client silent; aborting its request", request=live.request_id)
                self._abort(live, "abort")
            elif live.group is None and now - live.created > self.cfg.no_worker_timeout_s:
                self._fail(live, RequestTimeout(
                    f"no worker serving model {live.model!r} became available within "
                    f"{self.cfg.no_worker_timeout_s:.0f}s; start a worker for it"))
        silent = [c for c, t in self.client_seen.items() if now - t > 3 * self.cfg.client_timeout_s]
        for c in silent:
            del self.client_seen[c]
        if now - self.last_stats >= self.cfg.stats_interval_s:
            self.last_stats = now
            self.events_pub.send_multipart([b"stats", *P.encode(P.Event(kind="stats", ts=time.time(),
                                                                          data=self.stats()))])

    def _flush(self) -> None:
        self._flush_detok()
        if self.out_buf:
            for client, items in self.out_buf.items():
                self._send(self.client_sock, client, P.Outputs(items=items))
            self.out_buf = {}

    # ================================================================ introspection
    def _models_list(self) -> list[dict]:
        return [{"id": name, "max_model_len": self._max_model_len(name),
                 "groups": sum(1 for g in self.groups.values() if g.model == name and g.state == GroupState.READY)}
                for name in self.models]

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        self.rate_window = [(t, n) for t, n in self.rate_window if now - t <= 10.0]
        if not self.rate_window:
            return 0.0
        span = max(now - self.rate_window[0][0], 1.0)
        return sum(n for _, n in self.rate_window) / span

    def stats(self) -> dict:
        now = time.monotonic()
        groups = []
        for g in self.groups.values():
            if g.state == GroupState.GONE:
                continue
            ps = g.policy.stats() if g.policy else {}
            groups.append({
                "name": g.name, "model": g.model, "state": g.state.value, "tp_size": g.tp_size,
                "steps": g.steps, "tokens": g.tokens, **ps,
                "workers": [{
                    "worker_id": s.hello.worker_id, "rank": r, "pid": s.hello.pid, "host": s.hello.host,
                    "device": s.hello.device, "kv_blocks": s.hello.num_kv_blocks,
                    **{k: v for k, v in s.hello.memory.items() if isinstance(v, (int, float))},
                    "heartbeat_age_s": round(now - s.last_seen, 3), **{f"w_{k}": v for k, v in s.stats.items()},
                } for r, s in sorted(g.shards.items())],
            })
        return {
            "scheduler_id": self.id, "uptime_s": round(now - self.started, 3), "addresses": self.addrs,
            "models": list(self.models), "groups": groups, "requests": len(self.live), "queue": len(self.pending),
            "tokens_total": self.tokens_total, "tokens_per_s": round(self.tokens_per_s(), 2),
            "detokenizer": {"connected": self.detok is not None, "worker_id": self.detok_id},
        }


def main(args) -> int:
    from common.log import setup_logging

    setup_logging(service="scheduler")
    cfg = SchedulerConfig(host=args.host, port=args.port, advertise_host=args.advertise_host, models=args.model or [],
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                          max_queue_len=args.max_queue_len, heartbeat_timeout_s=args.heartbeat_timeout,
                          step_timeout_s=args.step_timeout, client_timeout_s=args.client_timeout,
                          drain_timeout_s=args.drain_timeout, curve_keys=getattr(args, "curve_keys", None))
    svc = SchedulerService(cfg)
    signal.signal(signal.SIGTERM, lambda *_: svc.stop())
    signal.signal(signal.SIGINT, lambda *_: svc.stop())
    svc.run()
    return 0
