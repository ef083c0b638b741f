"""The `zeroserve` command: one entry point for every process and the user tools."""

from __future__ import annotations

import argparse
import json
import os
import sys

from common.config import ATTENTION_BACKENDS

DEFAULT_PORT = 7000


def _env_default(name: str, default):
    v = os.environ.get(name)
    return v if v not in (None, "") else default


def _opt(p: argparse.ArgumentParser, flag: str, type=str, default=None, **kw) -> None:
    """A flag whose default comes from ZEROSERVE_<FLAG> when set (compose, containers)."""
    env = "ZEROSERVE_" + flag.lstrip("-").replace("-", "_").upper()
    val = _env_default(env, default)
    if val is not None and type is not str:
        val = type(val)
    p.add_argument(flag, type=type, default=val, help=(kw.pop("help", "") + f" [env {env}]").strip(), **kw)


def _engine_flags(p: argparse.ArgumentParser) -> None:
    _opt(p, "--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    _opt(p, "--device", default="cpu", help="cpu | cuda | cuda:N")
    _opt(p, "--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS))
    _opt(p, "--block-size", int, 16)
    _opt(p, "--num-kv-blocks", int, None)
    _opt(p, "--kv-cache-memory-bytes", int, None, help="KV budget on CPU (default 1 GiB)")
    _opt(p, "--gpu-memory-utilization", float, 0.9)
    _opt(p, "--max-model-len", int, None)
    _opt(p, "--threads", int, None, help="torch CPU threads for this worker")


def _scheduler_flags(p: argparse.ArgumentParser) -> None:
    _opt(p, "--max-num-seqs", int, 256)
    _opt(p, "--max-num-batched-tokens", int, 2048)
    _opt(p, "--max-queue-len", int, 4096)
    p.add_argument("--no-prefix-caching", action="store_true",
                   default=_env_default("ZEROSERVE_NO_PREFIX_CACHING", "0") not in ("0", "false"))
    _opt(p, "--heartbeat-timeout", float, 5.0)
    _opt(p, "--step-timeout", float, 120.0)
    _opt(p, "--client-timeout", float, 10.0)
    _opt(p, "--drain-timeout", float, 60.0)


def _curve_flags(p: argparse.ArgumentParser, client: bool = True) -> None:
    """CURVE (authenticated, encrypted ZeroMQ): on when --curve-keys names a `zeroserve keys` directory."""
    _opt(p, "--curve-keys", metavar="DIR", help="CURVE key directory made by `zeroserve keys DIR` (default: plain)")
    if client:
        _opt(p, "--curve-client", default="client", metavar="NAME",
             help="whose CURVE key to use: DIR/clients/NAME.key_secret")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="zeroserve", description="An LLM serving engine built as a ZeroMQ cluster.")
    ap.add_argument("--log-json", action="store_true", help="JSON log lines (also ZEROSERVE_LOG_JSON=1)")
    ap.add_argument("--log-level", default=None, help="debug | info | warning | error")
    sub = ap.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start a local cluster: scheduler, detokenizer and workers")
    up.add_argument("--model", default=None, help="HF model directory (default: the built-in tiny model)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=DEFAULT_PORT)
    up.add_argument("--workers", type=int, default=1, help="worker groups to start")
    up.add_argument("--tp", type=int, default=1, help="tensor-parallel shards per worker group")
    up.add_argument("--demo", nargs="?", const="The cluster says", default=None, metavar="PROMPT",
                    help="send one request once ready, print the answer and stop")
    _engine_flags(up)
    _scheduler_flags(up)
    _curve_flags(up, client=False)

    sc = sub.add_parser("scheduler", help="run the scheduler process")
    sc.add_argument("--host", default=_env_default("ZEROSERVE_HOST", "127.0.0.1"))
    sc.add_argument("--port", type=int, default=int(_env_default("ZEROSERVE_PORT", DEFAULT_PORT)))
    sc.add_argument("--model", action="append", default=None,
                    help="model directory whose requests we serve (repeatable; default: $ZEROSERVE_MODEL or "
                         "the built-in model)")
    sc.add_argument("--advertise-host", default=_env_default("ZEROSERVE_ADVERTISE_HOST", None),
                    help="the host workers reach us at, when we bind 0.0.0.0 (default: the bind host)")
    _opt(sc, "--max-model-len", int, None)
    _scheduler_flags(sc)
    _curve_flags(sc, client=False)

    wk = sub.add_parser("worker", help="run one worker shard")
    wk.add_argument("--scheduler", default=_env_default("ZEROSERVE_SCHEDULER", f"tcp://127.0.0.1:{DEFAULT_PORT + 1}"),
                    help="the scheduler's backend address (its port + 1)")
    wk.add_argument("--model", default=_env_default("ZEROSERVE_MODEL", None))
    wk.add_argument("--group", default=_env_default("ZEROSERVE_GROUP", None),
                    help="worker group name (shards of one tensor-parallel group share it)")
    wk.add_argument("--tp-size", type=int, default=int(_env_default("ZEROSERVE_TP_SIZE", 1)))
    wk.add_argument("--tp-rank", type=int, default=int(_env_default("ZEROSERVE_TP_RANK", 0)))
    wk.add_argument("--worker-id", default=None)
    wk.add_argument("--dist-init-addr", default=None, help="torch.distributed address (rank 0 picks one if omitted)")
    wk.add_argument("--advertise-host", default=None, help="address other shards reach this one at")
    _engine_flags(wk)
    _curve_flags(wk)

    dt = sub.add_parser("detokenizer", help="run the detokenizer process")
    dt.add_argument("--scheduler", default=_env_default("ZEROSERVE_SCHEDULER", f"tcp://127.0.0.1:{DEFAULT_PORT + 1}"))
    dt.add_argument("--model", action="append", default=None, help="default: $ZEROSERVE_MODEL or the built-in model")
    dt.add_argument("--worker-id", default=None)
    _curve_flags(dt)

    st = sub.add_parser("status", help="show the cluster: workers, KV use, queue, tokens/s")
    st.add_argument("--address", default=_env_default("ZEROSERVE_ADDRESS", f"tcp://127.0.0.1:{DEFAULT_PORT}"))
    st.add_argument("--json", action="store_true")
    st.add_argument("--timeout", type=float, default=5.0)
    _curve_flags(st)

    gen = sub.add_parser("generate", help="send one request to a running cluster")
    gen.add_argument("prompt")
    gen.add_argument("--address", default=_env_default("ZEROSERVE_ADDRESS", f"tcp://127.0.0.1:{DEFAULT_PORT}"))
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stream", action="store_true")
    gen.add_argument("--timeout", type=float, default=30.0)
    _curve_flags(gen)

    ky = sub.add_parser("keys", help="create a CURVE key directory: scheduler key pair, client key pairs, allow-list")
    ky.add_argument("dir", help="the key directory (created if missing; existing keys are kept)")
    ky.add_argument("--client", action="append", default=None, metavar="NAME",
                    help="a client key pair to create and allow (repeatable; default: one named 'client')")

    bt = sub.add_parser("batch", help="offline batch generation in this process (no cluster), JSON lines out")
    bt.add_argument("input", help="a text file with one prompt per line ('-' = stdin)")
    bt.add_argument("--model", default=None, help="HF model directory (default: the built-in tiny model)")
    bt.add_argument("--max-tokens", type=int, default=32)
    bt.add_argument("--temperature", type=float, default=0.0)
    bt.add_argument("--seed", type=int, default=None)
    bt.add_argument("--no-progress", action="store_true")
    _engine_flags(bt)

    tm = sub.add_parser("make-tiny-model", help="write a small random-weight HF-format model")
    from services.tiny_model import add_cli_args

    add_cli_args(tm)
    return ap


def _status(args) -> int:
    from zeroserve import Client
    from common.errors import ZeroserveError

    try:
        with Client(args.address, timeout_s=args.timeout, curve_keys=args.curve_keys,
                    curve_client_name=args.curve_client) as c:
            s = c.stats()
    except ZeroserveError as e:
        print(f"zeroserve status: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(s, indent=2, default=str))
        return 0
    a = s.get("addresses", {})
    print(f"scheduler {s.get('scheduler_id')}  up {s.get('uptime_s', 0):.0f}s  client {a.get('client')}  "
          f"backend {a.get('backend')}")
    det = s.get("detokenizer", {})
    print(f"detokenizer: {'connected ' + str(det.get('worker_id')) if det.get('connected') else 'NOT connected'}")
    print(f"requests live {s.get('requests')}  unrouted queue {s.get('queue')}  tokens/s {s.get('tokens_per_s')}")
    for g in s.get("groups", []):
        print(f"group {g['name']} [{g['state']}] model {g['model']} tp {g['tp_size']}  running {g.get('running', 0)}  "
              f"waiting {g.get('waiting', 0)}  kv {g.get('kv_blocks_used', 0)}/{g.get('kv_blocks_total', 0)} blocks")
        for w in g.get("workers", []):
            print(f"  worker {w['worker_id']} rank {w['rank']} pid {w['pid']} host {w['host']} device {w['device']} "
                  f"steps {w.get('w_steps', 0)} step_ms {w.get('w_step_ms', 0)}")
    return 0


def _generate(args) -> int:
    from zeroserve import Client, SamplingParams
    from common.errors import ZeroserveError

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    try:
        with Client(args.address, request_timeout_s=args.timeout, curve_keys=args.curve_keys,
                    curve_client_name=args.curve_client) as c:
            if args.stream:
                for d in c.stream(args.prompt, params):
                    print(d.text, end="", flush=True)
                print()
            else:
                out = c.generate(args.prompt, params)
                o = out.outputs[0]
                print(o.text)
                print(f"[{len(o.token_ids)} tokens, finish_reason={o.finish_reason}]", file=sys.stderr)
    except ZeroserveError as e:
        print(f"zeroserve generate: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def _keys(args) -> int:
    """`zeroserve keys DIR`: make or complete a CURVE key directory and say which file goes where."""
    from common.transport import create_curve_keys

    kd = create_curve_keys(args.dir, args.client or ["client"])
    d = kd.directory

    def row(path, created: bool | None, what: str) -> None:
        state = "" if created is None else "created" if created else "kept"
        print(f"  {str(path.relative_to(d)) + ('/' if path.is_dir() else ''):<32} {state:<8} {what}")

    print(f"CURVE keys in {d}")
    row(kd.server_secret, kd.server_created, "scheduler secret key     -> the scheduler host only")
    row(kd.server_public, kd.server_created, "scheduler public key     -> every host")
    allowed = [n for n, ok in kd.clients_allowed.items() if ok]
    row(kd.allowed_dir, None, f"allow-list, read by the scheduler at start: {', '.join(allowed) or 'EMPTY'}")
    for name, created in kd.clients_created.items():
        row(kd.client_secret(name), created, f"secret key of client '{name}' -> the hosts that run it")
        row(kd.client_public(name), created, f"public key of client '{name}', " + (
            "allowed" if kd.clients_allowed[name] else "NOT allowed (revoked?): copy it into allowed/ to let it in"))
    print(f"""
On the scheduler host (needs server.key_secret and allowed/):
  zeroserve scheduler --host 0.0.0.0 --curve-keys {d}
On each worker, detokenizer and client host, copy server.key and clients/NAME.key_secret to the
same paths under a key folder there, then:
  zeroserve worker --scheduler tcp://SCHEDULER:7001 --curve-keys DIR --curve-client NAME
  zeroserve generate "hi" --address tcp://SCHEDULER:7000 --curve-keys DIR --curve-client NAME
  Client("tcp://SCHEDULER:7000", curve_keys="DIR", curve_client_name="NAME")
(or set ZEROSERVE_CURVE_KEYS / ZEROSERVE_CURVE_CLIENT). Keep the secret files private (mode 0600).
The scheduler reads allowed/ when it starts: restart it after adding a client; delete
allowed/NAME.key and restart it to revoke one.""")
    return 0


def _batch(args) -> int:
    from zeroserve import LLM, SamplingParams

    src = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    with src:
        prompts = [line.rstrip("\n") for line in src if line.strip()]
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
              block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_model_len=args.max_model_len)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for out in llm.generate(prompts, params, use_tqdm=not args.no_progress):
        o = out.outputs[0]
        print(json.dumps({"prompt": out.prompt, "text": o.text, "token_ids": o.token_ids,
                          "finish_reason": o.finish_reason}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from common.errors import CurveKeyError

    args = build_parser().parse_args(argv)
    if args.log_json:
        os.environ["ZEROSERVE_LOG_JSON"] = "1"
    if args.log_level:
        os.environ["ZEROSERVE_LOG_LEVEL"] = args.log_level
    try:
        return _run(args)
    except CurveKeyError as e:  # a missing or unreadable key file: the message says what to do
        print(f"zeroserve {args.cmd}: {e}", file=sys.stderr, flush=True)
        return 2


def _run(args) -> int:
    if args.cmd == "up":
        from services.launcher import main as up_main

        return up_main(args)
    if args.cmd == "scheduler":
        from services.engine import default_model_dir
        from services.scheduler.service import main as sched_main

        args.model = args.model or [_env_default("ZEROSERVE_MODEL", None) or str(default_model_dir())]
        return sched_main(args)
    if args.cmd == "worker":
        from services.worker.service import main as worker_main

        return worker_main(args)
    if args.cmd == "detokenizer":
        from services.detokenizer.service import main as detok_main

        if not args.model and _env_default("ZEROSERVE_MODEL", None):
            args.model = [os.environ["ZEROSERVE_MODEL"]]
        return detok_main(args)
    if args.cmd == "status":
        return _status(args)
    if args.cmd == "generate":
        return _generate(args)
    if args.cmd == "batch":
        return _batch(args)
    if args.cmd == "keys":
        return _keys(args)
    if args.cmd == "make-tiny-model":
        from services.tiny_model import run_cli

        return run_cli(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
