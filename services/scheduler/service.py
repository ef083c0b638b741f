"""The scheduler process: sockets, the tokenizer pool and the loop around `cluster.Cluster`.

One thread runs the loop and owns every socket; prompts are tokenized in a small thread pool
so a long prompt never delays a step. Each turn: handle waiting messages by type (each handler
returns an outbox, sent at once), run the timers, send groups their next steps, then flush the
turn's detokenizer batch and client outputs. A group's next step leaves as soon as its previous
result is in, before that result's outputs are routed, so message handling overlaps the
workers' compute. State and policy live in cluster.py and groups.py; socket map and message
flow: docs/architecture.md.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import zmq

from zeroserve.common import messages as P
from zeroserve.common.catalog import MAX_CATALOG_TOKENIZERS, BoundedCache, load_catalog, parse_keep_alive
from zeroserve.common.chat import load_chat_template
from zeroserve.common.tool_parsers import PARSERS, parser_for_template
from zeroserve.common.codec import ProtocolError, group_topic, v1_refusal
from zeroserve.common.config import SchedulerConfig, from_cli_args
from zeroserve.common.curve import curve_server_keys, start_authenticator
from zeroserve.common.errors import InvalidRequest, ZeroserveError
from zeroserve.common.failover import EXIT_DEPOSED, FOLLOW_PING_S
from zeroserve.common.log import LogBudget, get_logger
from zeroserve.common.memory import Trimmer, freeze_startup_heap
from zeroserve.common.transport import Channel, is_loopback, make_socket
from zeroserve.services.scheduler.cluster import Cluster
from zeroserve.services.scheduler.models import load_models
from zeroserve.services.scheduler.outbox import BACKEND, CLIENT, STEPS, Outbox, TokenizeJob
from zeroserve.services.scheduler.standby import Follower, standby_answer
from zeroserve.services.scheduler.structured import GrammarCompiler

log = get_logger("scheduler")

CLIENT_BATCH, BACKEND_BATCH = 256, 1024  # messages per socket per loop turn
MAX_SUBSCRIPTION_BYTES = 1024  # a group topic is <= 258 bytes; a SUB sending more is disconnected
BACKEND_ZMTP_HEARTBEAT_MS = 1000  # a dead backend connection is dropped after 3 of these

__all__ = ["SchedulerConfig", "SchedulerService", "load_models", "main"]  # SchedulerConfig: re-exported


class SchedulerService:
    def __init__(self, cfg: SchedulerConfig, ctx: zmq.Context | None = None) -> None:
        self.cfg = cfg
        self.chat_template = load_chat_template(cfg.chat_template)  # None: each model's own
        if cfg.tool_call_parser != "auto" and cfg.tool_call_parser not in PARSERS:
            raise InvalidRequest(f"--tool-call-parser {cfg.tool_call_parser!r}: use auto or one of {sorted(PARSERS)}")
        self.id = uuid.uuid4().hex[:12]
        self.ctx = ctx or zmq.Context.instance()
        catalog = load_catalog(cfg.models_dir, cfg.models_config, parse_keep_alive(cfg.keep_alive, "--keep-alive"))
        if catalog:
            log.info("model catalog", models={n: e.error or e.path for n, e in catalog.items()})
        models = load_models(cfg.models, cfg.generation_config, cfg.pooling, catalog)
        self.addrs = addrs = cfg.addresses()
        # CURVE: every bound socket is a CURVE server; the ZAP handler admits by socket (its ZAP
        # domain is its name): client keys on "client", worker and detokenizer keys on "backend"
        # and "steps", any role on "events" (common/curve.py, SOCKET_ROLES)
        curve = curve_server_keys(cfg.curve_keys)
        self.auth = start_authenticator(self.ctx, curve.allow_lists()) if curve else None
        kw = curve.socket_kwargs() if curve else {}
        socks = []
        try:
            for sock_type, name in ((zmq.ROUTER, "client"), (zmq.ROUTER, "backend"), (zmq.PUB, "steps"),
                                    (zmq.PUB, "events")):
                # backend: one live connection per identity (no handover: a second DEALER with a
                # worker's or the detokenizer's identity is never read); ZMTP heartbeats free the
                # identity of a peer that vanished without closing its connection
                extra = ({"router_handover": False, "heartbeat_ivl_ms": BACKEND_ZMTP_HEARTBEAT_MS}
                         if name == "backend" else {})
                if sock_type == zmq.PUB:  # all a PUB reads is subscriptions: a long topic costs a
                    extra["max_message_size"] = MAX_SUBSCRIPTION_BYTES  # trie node per byte

                socks.append(make_socket(self.ctx, sock_type, bind=addrs[name], zap_domain=name if curve else None,
                                         **kw, **extra))
        except BaseException:
            for s in socks:
                s.close(linger=0)
            if self.auth:
                self.auth.stop()
            raise
        self.client_sock, self.backend, self.steps_pub, self.events_pub = socks
        self.client_ch, self.backend_ch, self.steps_ch, self.events_ch = (Channel(s) for s in socks)
        if curve:
            log.info("CURVE on: each socket admits only its roles' allowed keys", allowed=str(curve.allowed_dir),
                     allowed_keys=curve.key_counts())
        elif not is_loopback(cfg.host):
            log.warning("bound to a non-loopback host without CURVE: traffic is unauthenticated and unencrypted; "
                        "whoever reaches these ports can submit requests, read prompts on the steps port or pose "
                        "as a worker. Fine on a private network; otherwise run `zeroserve keys DIR` and start every "
                        "process with --curve-keys DIR (env ZEROSERVE_CURVE_KEYS)", host=cfg.host)
        else:  # loopback is no boundary between local users: say so once
            log.warning("CURVE is off: any process that reaches these ports (on loopback: any local process or "
                        "user) can submit requests, read prompts on the steps port, or join as a worker or "
                        "detokenizer; to turn CURVE on, run `zeroserve keys DIR` and start every process with "
                        "--curve-keys DIR (env ZEROSERVE_CURVE_KEYS)", host=cfg.host)
        for s in (self.client_sock, self.backend):
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer fails instead of vanishing
        step_addr = f"tcp://{cfg.advertise_host or cfg.host}:{cfg.port + 2}"
        self.cluster = Cluster(cfg, models, self.id, step_addr, addrs, now=time.monotonic(), catalog=catalog)
        # tokenization off the loop: results come back through a queue, a PAIR socket wakes us
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        # tokenizers load first in the pool (FIFO): a prompt's job waits for its model's. Those
        # of --model models load now and stay; a catalog model's on its first request, and only
        # the MAX_CATALOG_TOKENIZERS most recently used stay (a catalog may hold hundreds)
        fixed = frozenset(n for n in models if n not in catalog)
        self.tokenizers = BoundedCache(self._start_tokenizer, MAX_CATALOG_TOKENIZERS, keep=fixed)
        # structured outputs: each model's compiler prepares its tokenizer on its first constraint
        self.grammars = BoundedCache(lambda name: GrammarCompiler(self.tokenizers.get(name).result,
                                                                  models[name].cfg.vocab_size,
                                                                  models[name].cfg.eos_token_ids),
                                     MAX_CATALOG_TOKENIZERS, keep=fixed)
        self.posted: queue.SimpleQueue = queue.SimpleQueue()  # pool -> loop: calls to run on the loop
        wake_addr = f"inproc://sched-wake-{self.id}"
        self.wake_rx = self.ctx.socket(zmq.PAIR)
        self.wake_rx.bind(wake_addr)
        self.wake_tx = self.ctx.socket(zmq.PAIR)
        self.wake_tx.connect(wake_addr)
        self.wake_lock = threading.Lock()
        for name in models:  # in --model order: the first model's tokenizer is the first ready
            if name in fixed:
                self.tokenizers.get(name)
        self.poller = zmq.Poller()
        for s in (self.client_sock, self.backend, self.wake_rx):
            self.poller.register(s, zmq.POLLIN)
        # a hot standby (standby.py): it follows its peer and serves nothing until it takes over;
        # every scheduler has a term (common/failover.py), 1 for one that starts active
        self.term, self.active, self.deposed = (0, False, False) if cfg.standby_of else (1, True, False)
        self.follower = None
        if cfg.standby_of:
            from zeroserve.common.curve import curve_client_keys

            ck = curve_client_keys(cfg.curve_keys, role="client") if curve else None
            self.follower = Follower(self.ctx, cfg.standby_of, self.id, cfg.standby_lease_s, time.monotonic(),
                                     ck.socket_kwargs() if ck else None)
            self.poller.register(self.follower.sock, zmq.POLLIN)
        self.client_table = self._table(self.cluster.client_handlers(), "client")
        self.backend_table = self._table(self.cluster.backend_handlers(), "worker")
        self._stop = False
        self.trimmer = Trimmer()  # what departed peers left on the heap goes back to the OS
        self.bad_log = LogBudget("bad message")  # a flood of garbage writes a few lines, not one per frame
        self.metrics_server = None
        if cfg.metrics_port:  # Prometheus over HTTP, in a thread of its own (services/scheduler/metrics.py)
            from zeroserve.services.scheduler.metrics import serve_http

            try:
                self.metrics_server, _ = serve_http(self.cluster.metrics, cfg.host, cfg.metrics_port)
            except OSError as e:
                self.close()
                raise InvalidRequest(f"cannot serve metrics on {cfg.host}:{cfg.metrics_port}: {e}") from None
            log.info("metrics served", url=f"http://{cfg.host}:{cfg.metrics_port}/metrics")

    # ================================================================ loop
    def run(self) -> int:
        """Serve until stopped; the exit code (EXIT_DEPOSED: a higher term took over)."""
        freeze_startup_heap()
        try:
            if not self.active:
                log.info("standby: following the active scheduler", **self.addrs, standby_of=self.cfg.standby_of,
                         lease_s=self.cfg.standby_lease_s, scheduler_id=self.id)
                self._follow()
                if self._stop:
                    return EXIT_DEPOSED if self.deposed else 0
            log.info("scheduler ready", **self.addrs, models=list(self.cluster.models), scheduler_id=self.id,
                     term=self.term)
            self._serve()
            return EXIT_DEPOSED if self.deposed else 0
        finally:
            self.close()

    def _follow(self) -> None:
        """The standby's loop: answer "standby", follow the peer, take over when its lease lapses."""
        f = self.follower
        f.start(time.monotonic())  # the lease runs from the first ping, not from a slow start-up
        while not self._stop:
            events = dict(self.poller.poll(int(FOLLOW_PING_S * 500)))
            now = time.monotonic()
            f.read(now)
            self.term = max(self.term, f.peer_term)
            for sock, ch in ((self.client_sock, self.client_ch), (self.backend, self.backend_ch)):
                if sock in events:
                    self._answer_standby(ch)
            if self.wake_rx in events:
                while self.wake_rx.poll(0):
                    self.wake_rx.recv()
                self._run_posted()
            if f.lapsed(now, self.id):
                self.term += 1
                self.active = True
                self.cluster.started = now
                log.warning("taking over: the active scheduler's lease lapsed", term=self.term,
                            was=f.peer_id or None, silent_s=round(now - f.active_at, 3))
                return
            f.ping(now, self.term)

    def _answer_standby(self, ch: Channel) -> None:
        for _ in range(CLIENT_BATCH):
            try:
                got = ch.recv_nowait()
            except ProtocolError:
                continue
            if got is None:
                return
            ident, msg = got
            self.term = max(self.term, getattr(msg, "term", 0))  # takes over above every term seen
            reply = standby_answer(msg, self.id, self.term, self.cfg.standby_of)
            if reply is not None:
                ch.try_send(reply, ident)

    def _outranked(self, msg, from_backend: bool) -> bool:
        """A message naming a higher term than ours. At a scheduler that has a standby peer: the
        other scheduler took over, step down (whichever peer says so first: the clients and
        workers that come back from the successor). A lone scheduler (no --standby-of) has no
        successor to yield to and never steps down (a fuzzed client Ping of term 12 once stopped
        one): a backend peer (a worker or the detokenizer, the peers CURVE admits to that port)
        that remembers a higher term met an earlier cluster's scheduler, so it takes that term
        (the peer then admits what it sends) and serves on; a client's claim changes nothing
        (a client that met another scheduler drops our lower-term replies by itself)."""
        term = getattr(msg, "term", 0)
        if term <= self.term:
            return False
        if not self.cfg.standby_of:
            if not from_backend:
                return False
            log.info("a peer knows a higher term and there is no other scheduler: taking it", old=self.term,
                     term=term)
            self.term = self.cluster.term = term
            return False
        self._step_down(f"a peer knows term {term}")
        return True

    def _step_down(self, why: str) -> None:
        if not self.deposed:
            log.warning("deposed: another scheduler is active with a higher term; stepping down", why=why,
                        term=self.term, exit_code=EXIT_DEPOSED)
        self.deposed = True
        self._stop = True

    def _serve(self) -> None:
        f = self.follower
        self.cluster.term = self.term
        while not self._stop:
            events = dict(self.poller.poll(50 if self.cluster.groups.probing() else 200))
            if f is not None:  # the peer, if it comes back active with a higher term, deposes us
                now = time.monotonic()
                f.read(now)
                if f.deposes(now, self.term, self.id):
                    self._step_down(f"the peer scheduler {f.peer_id} is active at term {f.peer_term}")
                    break
                f.ping(now, self.term)
            # clients first, a bounded batch: a flood of client frames must not keep the
            # workers' heartbeats unread until the tick below gives their group up
            if self.client_sock in events:
                self._dispatch(self.client_ch, self.client_table, CLIENT_BATCH)
            self._dispatch(self.backend_ch, self.backend_table, BACKEND_BATCH)
            if self.wake_rx in events:
                while self.wake_rx.poll(0):
                    self.wake_rx.recv()
                self._run_posted()
            now = time.monotonic()
            self._send(self.cluster.tick(now))
            self._send(self.cluster.dispatch(now))
            self._send(self.cluster.flush())
            self.trimmer.maybe(now)

    def stop(self) -> None:
        self._stop = True

    def close(self) -> None:
        if self.active and not self.deposed:  # a deposed one says nothing more: its peers follow another
            self._send(self.cluster.close())
        if self.follower is not None:
            self.follower.close()
            self.follower = None
        self.pool.shutdown(wait=False, cancel_futures=True)
        for s in (self.client_sock, self.backend, self.steps_pub, self.events_pub, self.wake_rx, self.wake_tx):
            s.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        if getattr(self, "metrics_server", None) is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
            self.metrics_server = None

    def stats(self) -> dict:
        return self.cluster.stats(time.monotonic())

    # ================================================================ messages in
    def _table(self, handlers: dict, side: str) -> dict:
        """Every message type -> a handler; types that do not belong on this socket are refused."""
        def refuse(_peer, msg) -> None:
            raise InvalidRequest(f"{type(msg).__name__} is not a {side} message")

        from_backend = side != "client"

        def run(fn):
            def handle(peer, msg):
                if not self._outranked(msg, from_backend):
                    self._send(fn(peer, msg, time.monotonic()))
            return handle

        table = {cls: refuse for cls in P.MESSAGE_TYPES.values()}
        table.update((cls, run(fn)) for cls, fn in handlers.items())
        return table

    def _dispatch(self, ch: Channel, table: dict, limit: int) -> None:
        def on_bad(e: ProtocolError) -> None:
            if e.identity is None:
                return
            if self.bad_log.allow(time.monotonic()):
                log.warning("bad message", peer=e.identity.hex()[:16], reason=e.reason)
            if e.peer_version == 1:  # a v1 peer reads only v1's WELCOME: refuse it in words it can read
                ch.try_send_frames([e.identity, *v1_refusal(f"protocol version mismatch: {e.reason}")])
            else:
                ch.try_send(P.Error(request_id=e.request_id, code=e.code, message=f"bad message: {e.reason}"),
                            e.identity)

        def on_error(ident: bytes, msg, e: Exception) -> None:
            rid = getattr(msg, "request_id", None)
            if isinstance(e, ZeroserveError):
                ch.try_send(P.Error.from_exception(e, rid), ident)
            else:  # a bug must not take the cluster down; tell the peer
                log.error("handler failed", msg=type(msg).__name__, exc_info=e)
                ch.try_send(P.Error(request_id=rid, code="internal",
                                    message=f"internal error: {type(e).__name__}: {e}"), ident)

        ch.dispatch(table, on_bad=on_bad, on_error=on_error, limit=limit)

    def _post(self, fn) -> None:
        """From a pool thread: run `fn` on the loop (which owns the state and the sockets)."""
        self.posted.put(fn)
        with self.wake_lock:
            self.wake_tx.send(b"", zmq.NOBLOCK)

    def _run_posted(self) -> None:
        while True:
            try:
                fn = self.posted.get_nowait()
            except queue.Empty:
                return
            fn()

    def _tokenizer_loaded(self, name: str, fut) -> None:  # a pool thread
        parser = self.cfg.tool_call_parser
        if parser == "auto":
            try:
                parser = parser_for_template(self.chat_template or getattr(fut.result(), "chat_template", None)) or ""
            except Exception:  # noqa: BLE001 - the load failure is logged where it happened
                parser = ""

        def record() -> None:
            self.cluster.models[name].tool_call_parser = parser
            log.info("tool calls", model=name, parser=parser or "none recognised")

        self._post(record)

    def _start_tokenizer(self, name: str):
        fut = self.pool.submit(self._load_tokenizer, name, self.cluster.models[name].cfg.model_dir)
        fut.add_done_callback(lambda f: self._tokenizer_loaded(name, f))
        return fut

    @staticmethod
    def _load_tokenizer(name: str, model_dir: str):
        from zeroserve.common.tokenizer import load_tokenizer

        try:
            tok = load_tokenizer(model_dir)
        except Exception as e:
            log.error("cannot load the tokenizer; text and chat requests for this model fail", model=name,
                      reason=str(e))
            raise
        log.info("tokenizer loaded", model=name)
        return tok

    def _tokenize(self, job: TokenizeJob) -> None:
        # the caches are the loop's: a catalog model's tokenizer (and compiler) start here
        loading = self.tokenizers.get(job.model)
        grammars = self.grammars.get(job.model) if job.constraint is not None else None

        def run():
            _text, ids, grammar = job.run(loading.result, self.chat_template, grammars)
            return ids, grammar

        self.pool.submit(run).add_done_callback(lambda f: self._tokenized(job.key, f))

    def _tokenized(self, key: str, fut) -> None:  # runs in a pool thread
        try:
            ids, grammar = fut.result()
            err = None
        except Exception as e:  # noqa: BLE001 - any tokenizer failure refuses the request, in words
            ids, grammar, err = None, None, e
        self._post(lambda: self._send(self.cluster.on_tokenized(key, ids, err, time.monotonic(), grammar)))

    # ================================================================ messages out
    def _send(self, ob: Outbox) -> None:
        """Send an outbox, never blocking: a ROUTER peer that refuses one message (gone, queue
        full) gets none of the rest, so what it does get keeps its order (the state's on_fail
        callbacks take the unsent ones back)."""
        failed: set[tuple[str, bytes]] = set()
        term = self.term
        for it in ob:
            if hasattr(it.msg, "term"):  # every message a scheduler sends carries its term (failover.py)
                it.msg.term = term
            if it.role == STEPS:  # a PUB drops rather than blocks
                self.steps_ch.send(it.msg, group_topic(it.to))
                continue
            if it.role not in (CLIENT, BACKEND):
                self.events_ch.try_send(it.msg, it.to)
                continue
            ch = self.client_ch if it.role == CLIENT else self.backend_ch
            if (it.role, it.to) in failed or not ch.try_send(it.msg, it.to):
                failed.add((it.role, it.to))
                if it.on_fail is not None:
                    it.on_fail()
        for job in ob.tokenize:
            self._tokenize(job)


def main(args) -> int:
    from zeroserve.common.log import setup_logging

    setup_logging(service="scheduler")
    cfg = from_cli_args(SchedulerConfig, args)
    svc = SchedulerService(cfg)
    signal.signal(signal.SIGTERM, lambda *_: svc.stop())
    signal.signal(signal.SIGINT, lambda *_: svc.stop())
    code = svc.run()
    if code == EXIT_DEPOSED:  # at once: a pool thread still tokenizing or compiling a grammar must not
        sys.stdout.flush()  # hold a deposed scheduler's exit (its supervisor restarts it as the standby)
        sys.stderr.flush()
        os._exit(code)
    return code
