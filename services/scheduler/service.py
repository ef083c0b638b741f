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

import queue
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import zmq

from zeroserve.common import messages as P
from zeroserve.common.chat import load_chat_template
from zeroserve.common.tool_parsers import PARSERS, parser_for_template
from zeroserve.common.codec import ProtocolError, group_topic, v1_refusal
from zeroserve.common.config import SchedulerConfig, from_cli_args
from zeroserve.common.curve import curve_server_keys, start_authenticator
from zeroserve.common.errors import InvalidRequest, ZeroserveError
from zeroserve.common.log import LogBudget, get_logger
from zeroserve.common.memory import Trimmer, freeze_startup_heap
from zeroserve.common.transport import Channel, is_loopback, make_socket
from zeroserve.services.scheduler.cluster import Cluster
from zeroserve.services.scheduler.models import load_models
from zeroserve.services.scheduler.outbox import BACKEND, CLIENT, STEPS, Outbox, TokenizeJob
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
        models = load_models(cfg.models, cfg.generation_config, cfg.pooling)
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
        self.cluster = Cluster(cfg, models, self.id, step_addr, addrs, now=time.monotonic())
        # tokenization off the loop: results come back through a queue, a PAIR socket wakes us
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        # tokenizers load first in the pool (FIFO): a prompt's job waits for its model's
        self.tokenizers = {name: self.pool.submit(self._load_tokenizer, name, info.cfg.model_dir)
                           for name, info in models.items()}
        # structured outputs: each model's compiler prepares its tokenizer on its first constraint
        self.grammars = {name: GrammarCompiler(fut.result, models[name].cfg.vocab_size,
                                               models[name].cfg.eos_token_ids)
                         for name, fut in self.tokenizers.items()}
        self.posted: queue.SimpleQueue = queue.SimpleQueue()  # pool -> loop: calls to run on the loop
        wake_addr = f"inproc://sched-wake-{self.id}"
        self.wake_rx = self.ctx.socket(zmq.PAIR)
        self.wake_rx.bind(wake_addr)
        self.wake_tx = self.ctx.socket(zmq.PAIR)
        self.wake_tx.connect(wake_addr)
        self.wake_lock = threading.Lock()
        for name, fut in self.tokenizers.items():
            fut.add_done_callback(lambda f, name=name: self._tokenizer_loaded(name, f))
        self.poller = zmq.Poller()
        for s in (self.client_sock, self.backend, self.wake_rx):
            self.poller.register(s, zmq.POLLIN)
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
    def run(self) -> None:
        freeze_startup_heap()
        log.info("scheduler ready", **self.addrs, models=list(self.cluster.models), scheduler_id=self.id)
        try:
            while not self._stop:
                events = dict(self.poller.poll(50 if self.cluster.groups.probing() else 200))
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
        finally:
            self.close()

    def stop(self) -> None:
        self._stop = True

    def close(self) -> None:
        self._send(self.cluster.close())
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

        def run(fn):
            return lambda peer, msg: self._send(fn(peer, msg, time.monotonic()))

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
        def run():
            _text, ids, grammar = job.run(self.tokenizers[job.model].result, self.chat_template,
                                          self.grammars[job.model])
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
        for it in ob:
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
    svc.run()
    return 0
