"""A pool member: a worker that starts with no model and loads what the scheduler asks.

It says HELLO with model "" and its memory budget (`--pool`, `--memory-budget`). On `Load` it
reports `LoadStatus` "loading", builds the model runner (weights + KV cache) from the catalog's
path, reports "loaded" (or "failed" with the reason, and stays empty) and says HELLO again for
the model: from there it is an ordinary one-shard group (services/worker/service.py serves its
steps). On `Unload` (or its group's Shutdown saying "unload") it drops the runner, collects and
trims the heap, reports "unloaded" with its RSS, and says HELLO as an empty member again.

Memory: the weights and the KV cache are tensors only the runner references, so dropping it and
running the collector frees them; `trim()` hands glibc's freed arenas back to the OS, which is
what brings RSS back to the empty member's baseline (benchmarks/model_pool.py measures it over
20 cycles). The start-up heap is frozen once, before any model: a model loaded later must stay
collectable. A budget, when given, sizes the KV cache as what the weights leave of it.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import socket
import time

import psutil
import torch

from zeroserve.common import messages as P
from zeroserve.common.catalog import weight_bytes_on_disk
from zeroserve.common.config import EngineArgs, from_cli_args
from zeroserve.common.errors import ModelLoadError
from zeroserve.common.log import get_logger
from zeroserve.common.memory import freeze_startup_heap, trim
from zeroserve.common.model_config import ModelConfig
from zeroserve.services.worker.model_runner import ModelRunner
from zeroserve.services.worker.service import EXIT_OK, Rejoin, WorkerService, serve, setup

log = get_logger("worker")


class Unloaded(Exception):
    """The scheduler unloaded our model (Unload on our socket, or our group's Shutdown)."""


class PoolWorker(WorkerService):
    def __init__(self, args: EngineArgs, scheduler_addr: str, memory_budget_bytes: int | None = None,
                 **kw) -> None:
        if args.tp_size != 1:
            raise ModelLoadError("a pool member is one shard: start it without --tp-size")
        super().__init__(args, scheduler_addr, **kw)
        self.base_args = args
        self.budget = memory_budget_bytes or 0
        self.model_name = ""  # the catalog's name for what we hold ("" while empty)
        self.load_id = ""

    # ------------------------------------------------------------------ HELLO
    def _hello(self) -> P.Hello:
        if self.runner is None:
            return P.Hello(role="worker", worker_id=self.worker_id, device=self.device, host=socket.gethostname(),
                           pid=os.getpid(), pool=True, memory_budget_bytes=self.budget,
                           memory=P.ShardMemory(rss_bytes=psutil.Process().memory_info().rss))
        h = super()._hello()
        h.model, h.pool, h.memory_budget_bytes = self.model_name, True, self.budget
        return h

    def _status(self, phase: str, t0: float, error: str = "") -> None:
        r = self.runner
        mem = P.ShardMemory(rss_bytes=psutil.Process().memory_info().rss,
                            param_bytes=r.param_bytes() if r else 0,
                            kv_bytes=r.kv_bytes_per_block() * r.num_blocks if r else 0)
        self.dealer_ch.send(P.LoadStatus(worker_id=self.worker_id, load_id=self.load_id, phase=phase,
                                         model=self.model_name, error=error[:8192],
                                         elapsed_s=time.monotonic() - t0, memory=mem))

    # ------------------------------------------------------------------ the loop
    def _load_first(self) -> None:
        freeze_startup_heap()  # before any model: what loads later stays collectable
        log.info("pool member starting", budget=self.budget, rss=psutil.Process().memory_info().rss)

    def _sessions(self) -> int:
        while True:
            welcome = self.peer.join(self._hello, self.drain_requested, on_message=self._while_joining)
            if welcome is None:
                return EXIT_OK
            if self.runner is None:
                try:
                    load = self._wait_for_load()
                except Rejoin:
                    self._log_rejoin("")
                    continue
                if load is None:  # SIGTERM while empty
                    self._goodbye("drained")
                    return EXIT_OK
                self._load(load)
                continue  # HELLO again: for the model, or empty after a failure
            try:
                return self._serve(self._subscribe(welcome))
            except Unloaded:
                self._unload()
            except Rejoin as e:  # the scheduler restarted or dropped our group: keep the model
                self._log_rejoin(str(e))
                self.runner.reqs.clear()
                self.peer.rejoin.clear()

    def _wait_for_load(self) -> P.Load | None:
        """Empty and welcomed: wait for a Load (None: SIGTERM). Raises Rejoin when the scheduler
        no longer knows us (it restarted)."""
        while not self.drain_requested.is_set():
            if self.peer.rejoin.is_set():
                self.peer.rejoin.clear()
                raise Rejoin()
            if not self.dealer_ch.poll(0.2):
                continue
            msg = self._recv(self.dealer_ch)
            if isinstance(msg, P.Load):
                return msg
            if not isinstance(msg, P.Unload):  # an Unload for a model we no longer hold: nothing to do
                self.peer.note(msg)
        return None

    # ------------------------------------------------------------------ load / unload
    def _load(self, msg: P.Load) -> None:
        t0 = time.monotonic()
        self.load_id, self.model_name = msg.load_id, msg.model
        log.info("loading model", model=msg.model, path=msg.path)
        self._status("loading", t0)
        try:
            cfg = ModelConfig.from_dir(msg.path)
            args = dataclasses.replace(self.base_args, model=msg.path, **self._kv_budget(msg.path))
            runner = ModelRunner(args, cfg, device=self.device)
        except Exception as e:  # noqa: BLE001 - any failure fails this load only, in words
            log.error("model load failed", model=msg.model, reason=f"{type(e).__name__}: {e}")
            self._free()
            self._status("failed", t0, f"{type(e).__name__}: {e}")
            self.model_name = ""
            return
        self.runner, self.model_cfg, self.args = runner, cfg, args
        log.info("model loaded", model=msg.model, seconds=round(time.monotonic() - t0, 2), kv_blocks=runner.num_blocks,
                 param_bytes=runner.param_bytes(), numeric_mode=runner.numeric_mode,
                 rss=psutil.Process().memory_info().rss)
        self._status("loaded", t0)

    def _kv_budget(self, path: str) -> dict:
        """The KV cache's share of the budget: what the weights leave (none given: the flags')."""
        if not self.budget or self.base_args.num_kv_blocks is not None:
            return {}
        weights = weight_bytes_on_disk(path)
        left = self.budget - weights
        if left <= 0:
            raise ModelLoadError(f"its weights take {weights} bytes on disk; this pool member's --memory-budget is "
                                 f"{self.budget}: give a larger budget or load it on a larger member")
        return {"kv_cache_memory_bytes": left}

    def _unload(self) -> None:
        t0 = time.monotonic()
        name = self.model_name
        self._free()
        self._status("unloaded", t0)
        log.info("model unloaded", model=name, rss=psutil.Process().memory_info().rss)
        self.model_name = ""

    def _free(self) -> None:
        """Drop the weights and the KV cache, and give the memory back to the OS."""
        self.runner = None
        self.model_cfg = None
        self.args = self.base_args
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        trim()

    def _while_joining(self, msg) -> None:
        """An Unload that answers our HELLO for a model (the scheduler gave the load up, e.g. it
        took longer than --model-load-timeout): free it; the next HELLO says we are empty."""
        if isinstance(msg, P.Unload) and self.runner is not None:
            self.load_id = msg.load_id
            self._unload()

    # ------------------------------------------------------------------ hooks of the serving loop
    def _on_dealer(self, msg) -> bool:
        if isinstance(msg, P.Unload):
            self.load_id = msg.load_id
            raise Unloaded(msg.reason)
        return super()._on_dealer(msg)

    def _on_shutdown(self, msg: P.Shutdown) -> None:
        if msg.reason.startswith(P.UNLOAD_SHUTDOWN):
            raise Unloaded(msg.reason)


def main(args) -> int:
    """`zeroserve worker --pool`: a member with no model at start."""
    wargs = setup(args)
    return serve(PoolWorker(from_cli_args(EngineArgs, args, model=None), wargs.scheduler,
                            memory_budget_bytes=wargs.memory_budget_bytes, worker_id=wargs.worker_id,
                            heartbeat_interval_s=wargs.heartbeat_interval_s, advertise_host=wargs.advertise_host,
                            curve_keys=wargs.curve_keys, curve_client=wargs.curve_client))
