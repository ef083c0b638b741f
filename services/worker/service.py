"""The worker process: one shard of a worker group, serving steps from the scheduler.

Start-up: load the model and size the KV cache, say HELLO (model, device, capacity), get
WELCOME with the step PUB address (and, for tensor parallelism, rank 0's torch.distributed
address), subscribe to the group's topic and acknowledge the scheduler's probe. Then every
`Step` on the topic is applied to the runner's per-request state and computed; shard 0 answers
with the sampled tokens. A heartbeat thread with its own socket reports stats every second and
notices a restarted scheduler (it answers an unknown worker with a refusal), upon which the
shard drops its state and joins again. SIGTERM drains: the group takes no new work, finishes
what it runs, and the shard exits 0.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid

import psutil
import torch
import zmq

from common import protocol as P
from common.config import EngineArgs
from common.errors import ZeroserveError
from common.log import get_logger, setup_logging
from common.model_config import ModelConfig
from common.step import from_message
from common.transport import curve_client_keys, free_port, make_socket
from services.worker.model_runner import ModelRunner

log = get_logger("worker")

EXIT_OK, EXIT_REFUSED, EXIT_RESYNC = 0, 2, 3


def reachable(addr: str, scheduler_addr: str) -> str:
    """A scheduler bound to 0.0.0.0 advertises that; dial the host we reached it at instead."""
    host = addr.split("//", 1)[-1].rsplit(":", 1)[0]
    if host in ("0.0.0.0", "*", "[::]", "::"):
        sched_host = scheduler_addr.split("//", 1)[-1].rsplit(":", 1)[0]
        return addr.replace(host, sched_host, 1)
    return addr


class Rejoin(Exception):
    """The scheduler no longer knows this shard (it restarted, or gave the group up)."""


class WorkerService:
    def __init__(self, args: EngineArgs, scheduler_addr: str, group: str | None = None, tp_rank: int = 0,
                 worker_id: str | None = None, heartbeat_interval_s: float = 1.0,
                 dist_init_addr: str | None = None, advertise_host: str | None = None,
                 curve_keys: str | None = None, curve_client: str | None = None) -> None:
        self.args = args
        # CURVE: every socket to the scheduler (dealer, heartbeat dealer, step SUB) uses this key
        self.curve = curve_client_keys(curve_keys, curve_client)
        self.curve_kw = self.curve.socket_kwargs() if self.curve else {}
        self.scheduler_addr = scheduler_addr
        self.tp_rank, self.tp_size = tp_rank, args.tp_size
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.group = group or (f"g-{self.worker_id}" if self.tp_size == 1 else None)
        if self.group is None:
            raise ValueError("a tensor-parallel shard needs --group (the same name on every shard of the group)")
        self.hb_interval = heartbeat_interval_s
        self.host = advertise_host or os.environ.get("ZEROSERVE_ADVERTISE_HOST") or "127.0.0.1"
        self.dist_init_addr = dist_init_addr
        if self.tp_size > 1 and self.tp_rank == 0 and not self.dist_init_addr:
            self.dist_init_addr = f"tcp://{self.host}:{free_port()}"
        self.device = self._device()
        self.model_cfg = ModelConfig.from_dir(args.model)
        self._dist_ready = False
        self.ctx = zmq.Context()
        self.drain_requested = threading.Event()  # SIGTERM: finish what runs, then leave
        self.stopped = threading.Event()  # the process is ending: background threads stop
        self.rejoin = threading.Event()
        self.joined = threading.Event()  # refusals before our first WELCOME mean nothing
        self.joined_at = 0.0
        self.rejoin_seen = threading.Event()
        self.steps_done = 0
        self.tokens_done = 0
        self.busy_s = 0.0  # total time spent computing steps
        self.step_times: list[float] = []
        self.runner: ModelRunner | None = None

    def _device(self) -> str:
        dev = self.args.device
        if dev == "cuda" and self.tp_size > 1:
            dev = f"cuda:{self.tp_rank % max(torch.cuda.device_count(), 1)}"
        return dev

    # ------------------------------------------------------------------ setup
    def _init_distributed(self, addr: str | None) -> None:
        if self.tp_size == 1 or self._dist_ready:
            return
        import datetime

        import torch.distributed as dist

        if not addr:
            raise ZeroserveError("the scheduler gave no torch.distributed address for this tensor-parallel group")
        backend = "nccl" if self.device.startswith("cuda") else "gloo"
        log.info("joining tensor-parallel group", addr=addr, rank=self.tp_rank, world=self.tp_size, backend=backend)
        dist.init_process_group(backend, init_method=addr, rank=self.tp_rank, world_size=self.tp_size,
                                timeout=datetime.timedelta(seconds=120))
        self._dist_ready = True

    def _hello(self) -> P.Hello:
        r = self.runner
        mem = {"rss_bytes": psutil.Process().memory_info().rss, "param_bytes": r.param_bytes(),
               "kv_bytes": r.kv_bytes_per_block() * r.num_blocks}
        if self.dist_init_addr and self.tp_rank == 0:
            mem["dist_init_addr"] = self.dist_init_addr
        return P.Hello(role="worker", worker_id=self.worker_id, group=self.group, tp_rank=self.tp_rank,
                       tp_size=self.tp_size, model=self.model_cfg.name, device=self.device,
                       host=socket.gethostname(), pid=os.getpid(), num_kv_blocks=r.num_blocks,
                       block_size=r.block_size, max_model_len=self.args.max_model_len or
                       self.model_cfg.max_position_embeddings, memory=mem)

    def _join(self) -> zmq.Socket:
        """HELLO until WELCOME; returns the subscribed step socket once the probe was acked."""
        while not self.drain_requested.is_set():
            try:  # NOBLOCK: with no connection to queue on (a CURVE refusal drops it) a send would hang
                self.dealer.send_multipart(P.encode(self._hello()), zmq.NOBLOCK)
            except zmq.Again:
                pass
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and not self.drain_requested.is_set():
                if not self.dealer.poll(200):
                    continue
                msg = P.decode(self.dealer.recv_multipart())
                if isinstance(msg, P.Welcome):
                    if not msg.accepted:
                        raise SystemExit(self._refused(msg.reason))
                    self._init_distributed(msg.dist_init_addr or self.dist_init_addr)
                    step_addr = reachable(msg.step_addr, self.scheduler_addr)
                    sub = make_socket(self.ctx, zmq.SUB, connect=step_addr, subscribe=P.group_topic(self.group),
                                      **self.curve_kw)
                    log.info("welcomed", group=self.group, step_addr=step_addr, scheduler=msg.scheduler_id)
                    self.rejoin.clear()
                    self.joined_at = time.monotonic()
                    self.joined.set()
                    return sub
            if self.curve:
                log.info("no answer from the scheduler yet; saying hello again (CURVE: is this worker's key "
                         "allowed, and server.key the scheduler's?)", scheduler=self.scheduler_addr,
                         curve_client=self.curve.name)
            else:
                log.info("no answer from the scheduler yet; saying hello again (does the scheduler use CURVE? "
                         "then pass --curve-keys)", scheduler=self.scheduler_addr)
        raise SystemExit(EXIT_OK)

    def _refused(self, reason: str) -> int:
        log.error("the scheduler refused this worker", reason=reason)
        print(f"zeroserve worker: refused by the scheduler: {reason}", flush=True)
        return EXIT_REFUSED

    # ------------------------------------------------------------------ heartbeats
    def _heartbeat_loop(self) -> None:
        # IMMEDIATE: no heartbeats pile up while the scheduler is away (each would be refused later)
        hb = make_socket(self.ctx, zmq.DEALER, connect=self.scheduler_addr, identity=f"{self.worker_id}-hb",
                         immediate=True, **self.curve_kw)
        try:
            while not self.stopped.is_set():
                try:
                    hb.send_multipart(P.encode(P.Heartbeat(worker_id=self.worker_id, stats=self._stats())),
                                      zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                if hb.poll(int(self.hb_interval * 1000)):
                    try:
                        msg = P.decode(hb.recv_multipart())
                    except P.ProtocolError:
                        continue
                    stale = time.monotonic() - self.joined_at < 3 * self.hb_interval  # sent before we joined
                    if isinstance(msg, P.Welcome) and not msg.accepted and self.joined.is_set() and not stale:
                        self.joined.clear()
                        self.rejoin.set()
                        # a shard stuck in a collective never sees the flag: leave so a supervisor restarts us
                        if not self.rejoin_seen.wait(10.0) and not self.stopped.is_set():
                            log.error("stuck while the scheduler asked us to rejoin; exiting")
                            os._exit(EXIT_RESYNC)
                        self.rejoin_seen.clear()
        finally:
            hb.close(linger=0)

    def _stats(self) -> dict:
        r = self.runner
        recent = self.step_times[-50:]
        s = {"steps": self.steps_done, "tokens": self.tokens_done, "running": len(r.reqs) if r else 0,
             "busy_s": round(self.busy_s, 4),
             "rss_bytes": psutil.Process().memory_info().rss,
             "step_ms": round(1000 * sum(recent) / len(recent), 3) if recent else 0.0}
        if self.device.startswith("cuda"):
            s["cuda_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
        return s

    # ------------------------------------------------------------------ serving
    def run(self) -> int:
        log.info("loading model", model=self.args.model, device=self.device, rank=self.tp_rank, tp=self.tp_size)
        self.runner = ModelRunner(self.args, self.model_cfg, tp_rank=self.tp_rank, tp_size=self.tp_size,
                                  device=self.device)
        log.info("model loaded", kv_blocks=self.runner.num_blocks, block_size=self.runner.block_size,
                 param_bytes=self.runner.param_bytes())
        self.dealer = make_socket(self.ctx, zmq.DEALER, connect=self.scheduler_addr, identity=self.worker_id,
                                  **self.curve_kw)
        hb_thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb_thread.start()
        code = EXIT_OK
        try:
            while True:
                try:
                    sub = self._join()
                    code = self._serve(sub)
                    break
                except Rejoin:
                    log.warning("the scheduler does not know us (restarted?); joining again")
                    self.runner.reqs.clear()
                    self.rejoin.clear()
                    self.rejoin_seen.set()
                    if self.tp_size > 1:  # the group's collectives are gone with it: restart cleanly
                        code = EXIT_RESYNC
                        break
        except SystemExit as e:
            code = int(e.code or 0)
        finally:
            self.stopped.set()
            hb_thread.join(timeout=2)
            self.dealer.close(linger=0)
            self.ctx.term()
        return code

    def _serve(self, sub: zmq.Socket) -> int:
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(self.dealer, zmq.POLLIN)
        expected_seq = None
        drain_sent = False
        try:
            while True:
                if self.rejoin.is_set():
                    raise Rejoin()
                if self.drain_requested.is_set() and not drain_sent:
                    log.info("draining: finishing running requests before leaving")
                    self.dealer.send_multipart(P.encode(P.Drain(worker_id=self.worker_id)))
                    drain_sent = True
                events = dict(poller.poll(200))
                if self.dealer in events:
                    msg = self._recv(self.dealer)
                    if isinstance(msg, P.Welcome) and not msg.accepted:
                        if msg.reason == "drained":
                            self._goodbye("drained")
                            return EXIT_OK
                        raise Rejoin()
                if sub not in events:
                    continue
                try:
                    _topic, msg = P.decode_pub(sub.recv_multipart(copy=False))
                except P.ProtocolError as e:
                    log.warning("bad step message dropped", reason=e.reason)
                    continue
                if isinstance(msg, P.Probe):
                    self.dealer.send_multipart(P.encode(P.ProbeAck(worker_id=self.worker_id, probe_id=msg.probe_id)))
                elif isinstance(msg, P.Shutdown):
                    log.info("the scheduler ended this group", reason=msg.reason)
                    if drain_sent or msg.reason == "drained":
                        self._goodbye("drained")
                        return EXIT_OK
                    raise Rejoin()
                elif isinstance(msg, P.Step):
                    if expected_seq is not None and msg.seq != expected_seq:
                        reason = f"missed step {expected_seq} (got {msg.seq})"
                        log.error("step sequence gap; leaving to resynchronize", reason=reason)
                        self._goodbye(reason)
                        return EXIT_RESYNC
                    expected_seq = msg.seq + 1
                    self._step(msg)
        finally:
            sub.close(linger=0)

    def _recv(self, sock: zmq.Socket):
        try:
            return P.decode(sock.recv_multipart())
        except P.ProtocolError as e:
            log.warning("bad message dropped", reason=e.reason)
            return None

    def _step(self, msg: P.Step) -> None:
        try:
            so = from_message(msg)
            out = self.runner.execute(so)
        except Exception as e:  # report, then leave: our state may no longer match the scheduler's
            log.exception("step failed", seq=msg.seq)
            self.dealer.send_multipart(P.encode(P.WorkerError(worker_id=self.worker_id, seq=msg.seq,
                                                              message=f"{type(e).__name__}: {e}")))
            raise SystemExit(EXIT_RESYNC) from e
        self.steps_done += 1
        self.tokens_done += out.num_tokens
        self.busy_s += out.step_time_s
        self.step_times.append(out.step_time_s)
        del self.step_times[:-100]
        if self.tp_rank == 0:
            self.dealer.send_multipart(P.encode(P.StepResult(
                seq=msg.seq, worker_id=self.worker_id, req_ids=out.req_ids, sampled_token_ids=out.sampled_token_ids,
                logprob_token_ids=out.logprob_token_ids, logprobs=out.logprobs, ranks=out.ranks,
                step_time_s=out.step_time_s)), copy=False)

    def _goodbye(self, reason: str) -> None:
        try:
            self.dealer.send_multipart(P.encode(P.Goodbye(worker_id=self.worker_id, reason=reason)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass


def main(args) -> int:
    setup_logging(service="worker")
    if args.threads:
        torch.set_num_threads(args.threads)
    from services.engine import default_model_dir

    model = args.model or str(default_model_dir())
    eargs = EngineArgs(model=model, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
                       block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                       kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                       gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                       tp_size=args.tp_size)
    svc = WorkerService(eargs, args.scheduler, group=args.group, tp_rank=args.tp_rank, worker_id=args.worker_id,
                        dist_init_addr=args.dist_init_addr, advertise_host=args.advertise_host,
                        curve_keys=getattr(args, "curve_keys", None), curve_client=getattr(args, "curve_client", None))
    signal.signal(signal.SIGTERM, lambda *_: svc.drain_requested.set())
    signal.signal(signal.SIGINT, lambda *_: svc.drain_requested.set())
    return svc.run()
