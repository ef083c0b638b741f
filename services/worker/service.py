"""The worker process: one shard of a worker group, serving steps from the scheduler.

Start-up: load the model and size the KV cache, say HELLO (model, device, capacity), get
WELCOME with the step PUB address (and, for tensor parallelism, rank 0's torch.distributed
address), subscribe to the group's topic and acknowledge the scheduler's probe. Then every
`Step` on the topic is applied to the runner's per-request state and computed; one shard answers
with the sampled tokens: tp rank 0 of the last pipeline stage (`answers`; with one stage, shard 0).
A stage before the last takes its next step without waiting for the last stage's tokens
(services/worker/pipeline.py: several steps in flight). Joining, heartbeats (from a thread
with its own socket, so a long step never looks like death) and noticing a restarted scheduler
are `zeroserve.services.backend_peer`'s; on a rejoin the shard drops its state and joins again (a tensor- or pipeline-parallel shard exits
EXIT_RESYNC: its group's collectives are gone); after a scheduler restart a one-shard worker's
HELLO lists the sequences whose KV its cache still holds (services/worker/kept.py), for the new
scheduler to reuse. SIGTERM drains: the group takes no new work, finishes what
it runs, and the shard exits 0.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import uuid

import psutil
import torch
import zmq

from zeroserve.common import messages as P
from zeroserve.common.codec import ProtocolError, group_topic
from zeroserve.common.config import EngineArgs, WorkerArgs, from_cli_args
from zeroserve.common.curve import curve_client_keys
from zeroserve.common.errors import ZeroserveError
from zeroserve.common.log import get_logger, setup_logging
from zeroserve.common.memory import freeze_startup_heap
from zeroserve.common.model_config import ModelConfig
from zeroserve.common.transport import Channel, free_port, make_socket
from zeroserve.services.backend_peer import BackendPeer, Refused
from zeroserve.services.worker import netif, pipeline
from zeroserve.services.worker.kept import Kept
from zeroserve.services.worker.model_runner import ModelRunner

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
    """The scheduler no longer knows this shard (it restarted, or gave the group up); the
    message says which when a Shutdown, not a heartbeat's answer, told us."""


DRAINED_WAIT_S = 1.0  # after a Shutdown we did not ask for: how long a "drained" WELCOME may lag it


def shard_hello(runner: ModelRunner, args: EngineArgs, model_cfg: ModelConfig, **who) -> P.Hello:
    """A shard's HELLO: its model and capacity (KV blocks, lookahead, length cap, memory, LoRA
    slots) from its runner, and `who` it is (worker_id, group, ranks, device, host, pid, dist_init_addr;
    after a scheduler restart, the KV it `kept`). The worker process sends it; the in-process
    engine hands it to the same state."""
    mem = P.ShardMemory(rss_bytes=psutil.Process().memory_info().rss, param_bytes=runner.param_bytes(),
                        kv_bytes=runner.kv_bytes_per_block() * runner.num_blocks)
    return P.Hello(role="worker", model=model_cfg.name, num_kv_blocks=runner.num_blocks,
                   block_size=runner.block_size, num_lookahead_tokens=runner.num_lookahead_tokens,
                   numeric_mode=runner.numeric_mode,
                   max_loras=runner.lora.num_slots if runner.lora is not None else 0,
                   max_model_len=args.max_model_len or model_cfg.max_position_embeddings, memory=mem, **who)


class WorkerService:
    def __init__(self, args: EngineArgs, scheduler_addr: str, group: str | None = None, tp_rank: int = 0,
                 worker_id: str | None = None, heartbeat_interval_s: float = 1.0,
                 dist_init_addr: str | None = None, advertise_host: str | None = None,
                 curve_keys: str | None = None, curve_client: str | None = None,
                 collective_ifname: str | None = None, pp_rank: int = 0) -> None:
        self.args = args
        # CURVE: every socket to the scheduler (dealer, heartbeat dealer, step SUB) uses this key
        self.curve = curve_client_keys(curve_keys, curve_client, role="worker")  # DIR/workers/NAME.key_secret
        self.curve_kw = self.curve.socket_kwargs() if self.curve else {}
        self.scheduler_addr = scheduler_addr
        self.tp_rank, self.tp_size = tp_rank, args.tp_size
        # pipeline parallelism: the group is pp_size stages of tp_size shards (services/worker/pipeline.py)
        self.pp_rank, self.pp_size = pp_rank, args.pp_size
        if not 0 <= pp_rank < self.pp_size:
            raise ValueError(f"--pp-rank {pp_rank} is outside the group's {self.pp_size} pipeline stages")
        self.rank, self.world = P.group_rank(tp_rank, self.tp_size, pp_rank), self.tp_size * self.pp_size
        self.answers = self.rank == P.answering_rank(self.tp_size, self.pp_size)  # sends the step results
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.group = group or (f"g-{self.worker_id}" if self.world == 1 else None)
        if self.group is None:
            raise ValueError("a tensor- or pipeline-parallel shard needs --group (the same name on every shard of "
                             "the group)")
        self.hb_interval = heartbeat_interval_s
        self.advertise_host = advertise_host
        self.collective_ifname = collective_ifname  # None: the interface carrying our address
        self.host = advertise_host or "127.0.0.1"  # the CLI fills it from ZEROSERVE_ADVERTISE_HOST
        self.dist_init_addr = dist_init_addr
        if self.world > 1 and self.rank == 0 and not self.dist_init_addr:
            self.dist_init_addr = f"tcp://{self.host}:{free_port()}"
        self.device = self._device()
        self.model_cfg = ModelConfig.from_dir(args.model) if args.model else None  # None: a pool member, empty
        self._dist_ready = False
        self.ctx = zmq.Context()
        self.drain_requested = threading.Event()  # SIGTERM: finish what runs, then leave
        self.peer: BackendPeer | None = None  # the scheduler connection: joins, heartbeats, rejoins
        self.kept = Kept()  # after a scheduler restart: the KV our cache still holds, for its HELLO
        self.steps_done = 0
        self.tokens_done = 0
        self.busy_s = 0.0  # total time spent computing steps
        self.step_times: list[float] = []
        self.runner: ModelRunner | None = None

    def _device(self) -> str:
        dev = self.args.device
        if dev == "cuda" and self.world > 1:
            dev = f"cuda:{self.rank % max(torch.cuda.device_count(), 1)}"
        return dev

    # ------------------------------------------------------------------ setup
    def _init_distributed(self, addr: str | None) -> None:
        if self.world == 1 or self._dist_ready:
            return
        import datetime

        import torch.distributed as dist

        if not addr:
            raise ZeroserveError("the scheduler gave no torch.distributed address for this worker group")
        backend = "nccl" if self.device.startswith("cuda") else "gloo"
        link_host = self._bind_collectives(addr)
        log.info("joining the group's torch.distributed world", addr=addr, rank=self.rank, world=self.world,
                 tp_rank=self.tp_rank, pp_rank=self.pp_rank, backend=backend)
        dist.init_process_group(backend, init_method=addr, rank=self.rank, world_size=self.world,
                                timeout=datetime.timedelta(seconds=120))
        if self.pp_size > 1:
            pipeline.connect(self.runner, self.tp_rank, self.tp_size, host=link_host, pipelined=True)
        self._dist_ready = True

    def _bind_collectives(self, rendezvous: str) -> str:
        """gloo/NCCL on the interface the other shards reach us by (services/worker/netif.py);
        returns its address (where a pipeline stage's links listen)."""
        choice = netif.pick_interface(self.advertise_host, rendezvous)
        set_now = netif.bind_collectives(choice, self.collective_ifname)
        if self.collective_ifname:
            log.info("collectives bound", ifname=self.collective_ifname, why="--collective-ifname")
        elif set_now:
            log.info("collectives bound", ifname=choice.ifname, address=choice.address, why=choice.why)
        elif choice.ifname:
            log.info("collectives: keeping the interface set in the environment",
                     **{v: os.environ[v] for v in netif.IFNAME_VARS if os.environ.get(v)}, found=choice.ifname)
        else:
            log.warning("collectives: no interface found; gloo/NCCL choose by the host name", why=choice.why)
        return choice.address or self.host

    def _hello(self) -> P.Hello:
        return shard_hello(self.runner, self.args, self.model_cfg, worker_id=self.worker_id, group=self.group,
                           tp_rank=self.tp_rank, tp_size=self.tp_size, pp_rank=self.pp_rank, pp_size=self.pp_size,
                           device=self.device, host=socket.gethostname(), pid=os.getpid(),
                           dist_init_addr=self.dist_init_addr if self.rank == 0 else None,
                           kept=self.kept.report())

    def _subscribe(self, welcome: P.Welcome) -> zmq.Socket:
        """After WELCOME: the tensor-parallel group, then the step socket subscribed to our topic."""
        self._init_distributed(welcome.dist_init_addr or self.dist_init_addr)
        step_addr = reachable(welcome.step_addr, self.peer.scheduler_addr)  # the one that welcomed us
        sub = make_socket(self.ctx, zmq.SUB, connect=step_addr, subscribe=group_topic(self.group), **self.curve_kw)
        log.info("welcomed", group=self.group, step_addr=step_addr, scheduler=welcome.scheduler_id)
        return sub

    def _refused(self, reason: str) -> int:
        log.error("the scheduler refused this worker", reason=reason)
        print(f"zeroserve worker: refused by the scheduler: {reason}", flush=True)
        return EXIT_REFUSED

    # ------------------------------------------------------------------ heartbeats
    def _stats(self) -> dict:
        r = self.runner
        recent = self.step_times[-50:]
        s = {"steps": self.steps_done, "tokens": self.tokens_done, "running": len(r.reqs) if r else 0,
             "busy_s": round(self.busy_s, 4),
             "rss_bytes": psutil.Process().memory_info().rss,
             "step_ms": round(1000 * sum(recent) / len(recent), 3) if recent else 0.0}
        if self.device.startswith("cuda"):
            s["cuda_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
        if r is not None and r.link is not None:  # a pipeline stage: seconds it waited for its peers
            s["pp_wait_s"] = round(r.link.wait_s, 4)
        return s

    # ------------------------------------------------------------------ serving
    def run(self) -> int:
        self._load_first()
        self.peer = BackendPeer(self.ctx, self.scheduler_addr, self.worker_id, role="worker", curve=self.curve,
                                heartbeat_interval_s=self.hb_interval)
        self.dealer, self.dealer_ch = self.peer.sock, self.peer.ch
        self.peer.start_heartbeats(self._stats, stuck_exit=EXIT_RESYNC)
        try:
            return self._sessions()
        except Refused as e:
            return self._refused(e.detail)
        except SystemExit as e:
            return int(e.code or 0)
        finally:
            self.peer.close()
            self.ctx.term()

    def _load_first(self) -> None:
        """The model, before the first HELLO (a pool member loads later: services/worker/pool.py)."""
        log.info("loading model", model=self.args.model, device=self.device, rank=self.tp_rank, tp=self.tp_size,
                 pp_rank=self.pp_rank, pp=self.pp_size)
        self.runner = ModelRunner(self.args, self.model_cfg, tp_rank=self.tp_rank, tp_size=self.tp_size,
                                  device=self.device, pp_rank=self.pp_rank)
        layers = self.runner.model.stage.layers
        log.info("model loaded", kv_blocks=self.runner.num_blocks, block_size=self.runner.block_size,
                 param_bytes=self.runner.param_bytes(), layers=f"{layers.start}-{layers.stop - 1}")
        freeze_startup_heap()

    def _sessions(self) -> int:
        """Join, serve, and join again after a rejoin; the exit code."""
        code = EXIT_OK
        while True:
            welcome = self.peer.join(self._hello, self.drain_requested)
            self.kept.clear()  # the scheduler has it, or we are leaving
            if welcome is None:  # SIGTERM before we were welcomed, or our group was drained
                break
            try:
                code = self._serve(self._subscribe(welcome))
                break
            except Rejoin as e:
                self._log_rejoin(str(e))
                if self.peer.rejoin_reason()[0] and self.world == 1:  # a new scheduler: tell it our KV
                    self.kept.take(self.runner.reqs.values(), self.runner.block_size)
                self.runner.reqs.clear()
                self.peer.rejoin.clear()  # taken: the heartbeat thread's stuck check stands down
                if self.world > 1:  # the group's collectives are gone with it: restart cleanly
                    code = EXIT_RESYNC
                    break
        return code

    def _log_rejoin(self, ended: str) -> None:
        restarted, detail = self.peer.rejoin_reason()
        if ended:
            log.warning(f"{ended}; joining again")
        elif restarted and self.peer.gone:  # several addresses: we left it (failover.py)
            log.warning("the scheduler is gone; joining the next", why=detail, was=self.peer.scheduler_id,
                        next=self.peer.scheduler_addr)
        elif restarted:
            log.warning("the scheduler restarted; joining again", was=self.peer.scheduler_id,
                        now=self.peer.rejoin_welcome.scheduler_id)
        else:  # the same instance let us go (e.g. a partition outlasted its heartbeat timeout)
            log.warning("the scheduler gave our group up (it did not restart); joining again", detail=detail)

    def _serve(self, sub: zmq.Socket) -> int:
        sub_ch = Channel(sub)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(self.dealer, zmq.POLLIN)
        expected_seq = None
        drain_sent = False
        try:
            while True:
                if self.peer.drained.is_set():
                    self._goodbye("drained")
                    return EXIT_OK
                if self.peer.rejoin.is_set():
                    raise Rejoin()
                if self.drain_requested.is_set() and not drain_sent:
                    log.info("draining: finishing running requests before leaving")
                    self.dealer_ch.send(P.Drain(worker_id=self.worker_id))
                    drain_sent = True
                events = dict(poller.poll(200))
                link = getattr(self.runner, "link", None)  # a pipeline stage's links (None: one stage)
                if link is not None and link.owed and sub not in events:  # idle: take tokens already back
                    link.settle_ready()
                if self.dealer in events and self._on_dealer(self._recv(self.dealer_ch)):
                    continue  # drained, or asked to rejoin: handled at the top
                if sub not in events:
                    continue
                try:
                    _topic, msg = sub_ch.recv()
                except ProtocolError as e:
                    log.warning("bad step message dropped", reason=e.reason)
                    continue
                if isinstance(msg, P.Probe):
                    self.dealer_ch.send(P.ProbeAck(worker_id=self.worker_id, probe_id=msg.probe_id))
                elif isinstance(msg, P.Shutdown):
                    log.info("the scheduler ended this group", reason=msg.reason)
                    self._on_shutdown(msg)
                    # drained: we asked for it, or the scheduler says so on our own socket (it sends
                    # that WELCOME before this Shutdown, but on another socket: give it a moment)
                    if drain_sent or self.peer.wait_drained(DRAINED_WAIT_S):
                        self._goodbye("drained")
                        return EXIT_OK
                    raise Rejoin(f"the scheduler ended our group: {msg.reason}")
                elif isinstance(msg, P.Step):
                    if not self.peer.fence.admit(msg.term):  # a deposed scheduler's step: never run it
                        log.warning("dropped a step of a deposed scheduler", seq=msg.seq, term=msg.term,
                                    known=self.peer.fence.term)
                        continue
                    if expected_seq is not None and msg.seq != expected_seq:
                        reason = f"missed step {expected_seq} (got {msg.seq})"
                        log.error("step sequence gap; leaving to resynchronize", reason=reason)
                        self._goodbye(reason)
                        return EXIT_RESYNC
                    expected_seq = msg.seq + 1
                    self._step(msg)
        finally:
            sub.close(linger=0)

    def _on_dealer(self, msg) -> bool:
        """A message on our own socket while serving; True when the loop must look at its flags
        (a pool member also takes Unload here: services/worker/pool.py)."""
        return self.peer.note(msg)

    def _on_shutdown(self, msg: P.Shutdown) -> None:
        """Our group ended; a pool member's model may have been unloaded (it raises)."""

    def _recv(self, ch: Channel):
        try:
            return ch.recv()[1]
        except ProtocolError as e:
            log.warning("bad message dropped", reason=e.reason)
            return None

    def _step(self, msg: P.Step) -> None:
        bad = self.runner.check_step(msg)
        if bad is not None:  # refuse it before touching any state: the scheduler ends the group
            log.error("step refused", seq=msg.seq, reason=bad)
            self.dealer_ch.send(P.WorkerError(worker_id=self.worker_id, seq=msg.seq, message=f"step refused: {bad}"))
            return
        try:
            out = self.runner.execute(msg)
        except Exception as e:  # report, then leave: our state may no longer match the scheduler's
            log.exception("step failed", seq=msg.seq)
            self.dealer_ch.send(P.WorkerError(worker_id=self.worker_id, seq=msg.seq, message=f"{type(e).__name__}: {e}"))
            raise SystemExit(EXIT_RESYNC) from e
        self.steps_done += 1
        self.tokens_done += out.num_tokens
        self.busy_s += out.step_time_s
        self.step_times.append(out.step_time_s)
        del self.step_times[:-100]
        if self.answers:
            out.worker_id = self.worker_id
            self.dealer_ch.send(out)

    def _goodbye(self, reason: str) -> None:
        self.peer.goodbye(reason)


def setup(args) -> WorkerArgs:
    """A worker process's start, before its service is built: logging, torch's threads."""
    setup_logging(service="worker")
    wargs = from_cli_args(WorkerArgs, args)
    if wargs.threads:
        torch.set_num_threads(wargs.threads)
    return wargs


def serve(svc: WorkerService) -> int:
    """Run a worker process's service until it leaves; SIGTERM and SIGINT drain it."""
    signal.signal(signal.SIGTERM, lambda *_: svc.drain_requested.set())
    signal.signal(signal.SIGINT, lambda *_: svc.drain_requested.set())
    return svc.run()


def main(args) -> int:
    """`zeroserve worker` (a pool member, `--pool`, starts from services/worker/pool.py's main)."""
    wargs = setup(args)
    eargs = from_cli_args(EngineArgs, args, model=args.model)
    return serve(WorkerService(eargs, wargs.scheduler, group=wargs.group, tp_rank=wargs.tp_rank,
                               worker_id=wargs.worker_id, heartbeat_interval_s=wargs.heartbeat_interval_s,
                               dist_init_addr=wargs.dist_init_addr, advertise_host=wargs.advertise_host,
                               curve_keys=wargs.curve_keys, curve_client=wargs.curve_client,
                               collective_ifname=wargs.collective_ifname, pp_rank=wargs.pp_rank))
