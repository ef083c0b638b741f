"""Every setting of every process, each defined once.

Settings ("knobs") are fields of small dataclass groups: `ModelArgs`, `DeviceArgs`, `CacheArgs`,
`ParallelArgs`, `SchedulerArgs`, `LivenessArgs`, ... Each field made with `knob()` carries its
help text and, where the command line spells it differently from the field, its flag. The configs
the processes use are compositions of groups (dataclass inheritance keeps them flat, vLLM's
names): `EngineArgs` (the in-process engine and a worker's engine), `SchedulerConfig`,
`WorkerArgs`, `DetokenizerArgs`. From the fields come:

* `add_cli_args(parser, cls, only=, skip=)`: one flag per knob (`--max-num-seqs`), defaulting
  to `$ZEROSERVE_MAX_NUM_SEQS` when that is set, in help sections named after the groups; a
  bool that is on by default is `--no-...`; the namespace attribute is named after the flag;
* `from_cli_args(cls, namespace)`: the parsed namespace back into a dataclass;
* `to_cli_args(obj)`: the argv that gives a child process the same values (`zeroserve up`).

So adding a knob means adding one field here (to the group of every process that needs it);
services/cli.py says which configs each command takes. Fields made with plain `field()` are
internal (code and tests set them; no flag). This module imports neither torch nor zmq: the
scheduler and the detokenizer start without them.
"""

from __future__ import annotations

import argparse
import os
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from zeroserve.common.errors import InvalidRequest

# auto = triton on CUDA, cpu elsewhere; cpu = the torch twins plus compiled CPU kernels where
# they build (kernels/cpu_ops.py); torch = the twins alone (the reference)
ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch")
# auto = a GGUF's Q8_0/Q4_0/Q4_1/Q4_K weights stay packed; none = dequantize all; int8/int4 at load
# (mirrors services/worker/model/quantize.py, which needs torch)
QUANTIZATIONS = ("auto", "none", "int8", "int4")
DEFAULT_PORT = 7000  # the scheduler's client port; backend +1, steps +2, events +3
DEFAULT_BACKEND = f"tcp://127.0.0.1:{DEFAULT_PORT + 1}"


def knob(default: Any = None, help: str = "", *, flag: str | None = None, env: bool = True,
         choices: tuple[str, ...] | None = None, metavar: str | None = None, factory: Any = None) -> Any:
    """A dataclass field that is also a command-line flag (``--<name>`` unless ``flag`` says
    otherwise) and, unless ``env=False``, an environment variable ``ZEROSERVE_<FLAG>``."""
    md = {"help": help, "flag": flag, "env": env, "choices": choices, "metavar": metavar}
    if factory is not None:
        return field(default_factory=factory, metadata=md)
    return field(default=default, metadata=md)


# --------------------------------------------------------------------------------------------
# Knobs -> flags, environment, argv
# --------------------------------------------------------------------------------------------

ENV_PREFIX = "ZEROSERVE_"
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Knob:
    """One field of a config as the command line sees it."""

    name: str  # the dataclass field
    flag: str  # --max-num-seqs
    env: str | None  # ZEROSERVE_MAX_NUM_SEQS
    kind: type  # int, float, str, bool or list (of str)
    default: Any
    help: str
    choices: tuple[str, ...] | None
    metavar: str | None
    title: str  # the help section: the first docstring line of the group that defines it

    @property
    def dest(self) -> str:
        """The namespace attribute: named after the flag (``--no-prefix-caching`` -> no_prefix_caching)."""
        return self.flag[2:].replace("-", "_")

    @property
    def negated(self) -> bool:
        """A bool that is on by default: the flag turns it off."""
        return self.kind is bool and self.default is True


def _kind(hint: Any) -> type:
    if typing.get_origin(hint) is list:
        return list
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def knobs(cls: type, only: typing.Iterable[str] | None = None, skip: typing.Iterable[str] = ()) -> list[Knob]:
    """The knobs of a config class (all, those named in ``only``, minus ``skip``): its own
    first, then its groups' in the order of its bases."""
    hints = typing.get_type_hints(cls)
    only, skip = (None if only is None else set(only)), set(skip)
    order = {b: i for i, b in enumerate(cls.__mro__)}
    out = []
    for f in fields(cls):
        if "help" not in f.metadata or f.name in skip or (only is not None and f.name not in only):
            continue
        kind = _kind(hints[f.name])
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        flag = f.metadata["flag"] or ("--no-" if kind is bool and default is True else "--") + f.name.replace("_", "-")
        env = ENV_PREFIX + flag[2:].replace("-", "_").upper() if f.metadata["env"] else None
        owner = next(b for b in cls.__mro__ if f.name in b.__dict__.get("__annotations__", {}))
        title = (owner.__doc__ or "").strip().split("\n")[0]
        out.append((order[owner], Knob(f.name, flag, env, kind, default, f.metadata["help"], f.metadata["choices"],
                                       f.metadata["metavar"], title)))
    out.sort(key=lambda t: t[0])  # stable: field order within a group
    return [k for _, k in out]


def knob_names(*classes: type) -> tuple[str, ...]:
    return tuple(k.name for cls in classes for k in knobs(cls))


class _EnvValue(str):
    """A default that came from the environment: conversion errors name the variable."""

    env = ""


def _converter(kind: type) -> Any:
    def convert(value: str) -> Any:
        try:
            return kind(value)
        except ValueError:
            where = f" (from ${value.env})" if isinstance(value, _EnvValue) else ""
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {str(value)!r}{where}") from None

    convert.__name__ = kind.__name__
    return convert


class _Append(argparse.Action):
    """A repeatable flag; its first use replaces the default (which came from the environment)."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        cur = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*(cur if cur is not None and cur is not self.default else []), value])


def add_cli_args(parser: argparse.ArgumentParser, cls: type, only: typing.Iterable[str] | None = None,
                 skip: typing.Iterable[str] = ()) -> None:
    """One flag per knob of ``cls``; a knob's environment variable, when set, is its default."""
    sections: dict[str, Any] = {}
    for k in knobs(cls, only, skip):
        if k.title not in sections:
            sections[k.title] = parser.add_argument_group(k.title or None)
        g = sections[k.title]
        env = os.environ.get(k.env) if k.env else None
        help = k.help.replace("%", "%%") + (f" [env {k.env}]" if k.env else "")
        if k.kind is bool:  # the namespace says whether the flag was given
            g.add_argument(k.flag, action="store_true", default=bool(env) and env.lower() in _TRUE, help=help)
        elif k.kind is list:
            g.add_argument(k.flag, action=_Append, metavar=k.metavar, help=help,
                           default=[v for v in env.split(",") if v] if env else None)
        else:  # argparse converts a string default (from the environment) with `type`
            default = k.default
            if env:
                default = _EnvValue(env)
                default.env = k.env
            g.add_argument(k.flag, type=_converter(k.kind), default=default, choices=k.choices, metavar=k.metavar,
                           help=help)


def from_cli_args(cls: type, namespace: argparse.Namespace, **overrides: Any) -> Any:
    """An instance of ``cls`` from a namespace ``add_cli_args`` filled; knobs it lacks keep their defaults."""
    kw: dict[str, Any] = {}
    for k in knobs(cls):
        if not hasattr(namespace, k.dest):
            continue
        v = getattr(namespace, k.dest)
        if k.kind is bool:
            v = not v if k.negated else bool(v)
        elif k.kind is list and not isinstance(v, list):  # unset, or another knob's (`up --model` is one dir)
            continue
        kw[k.name] = v
    kw.update(overrides)
    return cls(**kw)


def to_cli_args(obj: Any, only: typing.Iterable[str] | None = None, skip: typing.Iterable[str] = ()) -> list[str]:
    """The flags that set ``obj``'s knobs in a child process. Every value is spelled out, so an
    environment variable the child inherits cannot override it; left out are None (unset) and
    bools at their default, which the child reads from the same environment as its parent."""
    out: list[str] = []
    for k in knobs(type(obj), only, skip):
        v = getattr(obj, k.name)
        if k.kind is bool:
            if bool(v) != k.default:
                out.append(k.flag)
        elif k.kind is list:
            for item in v:
                out += [k.flag, str(item)]
        elif v is not None:
            out += [k.flag, str(v)]
    return out


# --------------------------------------------------------------------------------------------
# Groups
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ModelArgs:
    """model"""

    model: str | None = knob(None, "HF model directory or .gguf file (default: the built-in tiny model)")
    dtype: str = knob("auto", "auto | float32 | bfloat16 | float16; on a CPU float32 = exact against HF fp32, "
                              "bfloat16 = the bf16 matmul regime with the linears' weights held in bf16, auto = "
                              "bfloat16 where the CPU multiplies bf16 natively and the checkpoint is not fp32, "
                              "else float32 (docs/models.md)")
    matmul_dtype: str = knob("auto", "CPU: every linear's arithmetic at any batch size; float32 (exact) or bfloat16 "
                                     "(x and w rounded to bf16, fp32 sums, batch-invariant); auto = what --dtype "
                                     "decides; never measured",
                             choices=("auto", "float32", "bfloat16"))
    quantization: str = knob("auto", "weight quantization: auto = keep a GGUF's Q8_0/Q4_0/Q4_1/Q4_K weights packed "
                                     "(other types dequantized; safetensors as floats); none = dequantize everything "
                                     "at load; int8 / int4 = quantize every linear at load (group-wise, weight-only)",
                             choices=QUANTIZATIONS)


@dataclass(kw_only=True)
class DeviceArgs:
    """device"""

    device: str = knob("cpu", "cpu | cuda | cuda:N")
    attention_backend: str = knob("auto", "attention kernels: auto = triton on CUDA, cpu elsewhere; torch = the "
                                          "reference twins", choices=ATTENTION_BACKENDS)


@dataclass(kw_only=True)
class CacheArgs:
    """KV cache"""

    block_size: int = knob(16, "tokens per KV block (a multiple of 16, up to 256)")
    num_kv_blocks: int | None = knob(None, "KV blocks per worker (default: from the memory budget)")
    kv_cache_memory_bytes: int | None = knob(None, "KV budget on CPU (default 1 GiB)")
    kv_cache_dtype: str = knob("auto", "auto = the compute dtype; bfloat16 = half the bytes of an fp32 cache",
                               choices=("auto", "float32", "bfloat16"))
    gpu_memory_utilization: float = knob(0.9, "fraction of the GPU's memory this worker may use (weights + KV)")


@dataclass(kw_only=True)
class ParallelArgs:
    """tensor and pipeline parallelism"""

    tp_size: int = knob(1, "tensor-parallel shards in this worker's group (per pipeline stage)")
    pp_size: int = knob(1, "pipeline stages in this worker's group: each holds a contiguous range of layers "
                           "(the group is tp_size x pp_size shards)")
    enable_expert_parallel: bool = knob(False, "MoE models: split the experts over the group's shards (each holds "
                                               "E/tp whole experts) instead of slicing every expert")


SPECULATIVE_METHODS = ("none", "ngram", "draft")


@dataclass(kw_only=True)
class SpeculativeArgs:
    """speculative decoding (services/worker/spec_decode.py)"""

    speculative_method: str = knob("none", "propose tokens the model verifies in one step: ngram = copy what followed "
                                           "the latest earlier occurrence of the last tokens (prompt lookup); draft = "
                                           "a smaller model with the same tokenizer (--speculative-model)",
                                   choices=SPECULATIVE_METHODS)
    speculative_model: str | None = knob(None, "the draft model (HF directory or .gguf) for --speculative-method draft",
                                         metavar="PATH")
    num_speculative_tokens: int = knob(4, "tokens proposed per request per step (1-16)", metavar="K")
    prompt_lookup_min: int = knob(2, "ngram: the shortest suffix of the sequence looked up")
    prompt_lookup_max: int = knob(4, "ngram: the longest suffix of the sequence looked up (tried first)")


@dataclass(kw_only=True)
class LoRAArgs:
    """LoRA adapters (vLLM's flags)"""

    enable_lora: bool = knob(False, "serve LoRA adapters (on by itself when --lora-modules names any)")
    lora_modules: list[str] = knob(help="an adapter to serve, NAME=PATH (a PEFT adapter directory); a request picks "
                                        "it by model=NAME (repeatable)", metavar="NAME=PATH", factory=list)
    max_loras: int = knob(4, "adapters resident on a worker at once (slots; least recently used ones make room)")
    max_loras_per_batch: int | None = knob(None, "different adapters in one step (default: --max-loras)")
    max_lora_rank: int = knob(16, "the highest adapter rank served (every slot is this wide)")

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    def validate_lora(self, bad) -> None:
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(f"{name} must be a positive integer, got {v!r}")
        per = self.max_loras_per_batch
        if per is not None and (not isinstance(per, int) or isinstance(per, bool) or not 1 <= per <= self.max_loras):
            raise bad(f"max_loras_per_batch must be an integer in 1..max_loras ({self.max_loras}), got {per!r}")
        from zeroserve.common.lora import parse_lora_modules

        parse_lora_modules(self.lora_modules)

    @property
    def loras_per_batch(self) -> int:
        return self.max_loras_per_batch or self.max_loras


@dataclass(kw_only=True)
class SchedulerArgs:
    """scheduling (the policy of each worker group)"""

    max_num_seqs: int = knob(256, "sequences a worker group runs at once")
    max_num_batched_tokens: int = knob(2048, "tokens per step (chunked prefill splits longer prompts)")
    # 512: a 16-prompt burst of 256-token prompts gets its median first token 27% sooner (p90 16%)
    # than with the whole step budget, at +6% tok/s and +4% TPOT (benchmarks/ttft_load.py --cpu-time)
    max_num_prefill_tokens: int | None = knob(512, "prompt tokens per step, of max_num_batched_tokens: a burst "
                                                   "of arrivals is prefilled a few per step alongside the decodes "
                                                   "(TTFT under load)")
    max_model_len: int | None = knob(None, "longest prompt + output (default: the model's max_position_embeddings)")
    enable_prefix_caching: bool = knob(True, "turn the prefix cache off", flag="--no-prefix-caching")
    max_queue_len: int = knob(4096, "requests admitted and not finished before new ones get Overloaded")


@dataclass(kw_only=True)
class LivenessArgs:
    """failure detection (scheduler)"""

    heartbeat_timeout_s: float = knob(5.0, "seconds without a heartbeat before a worker (its group) is given up",
                                      flag="--heartbeat-timeout")
    step_timeout_s: float = knob(120.0, "seconds a step may take before its group is given up", flag="--step-timeout")
    client_timeout_s: float = knob(10.0, "seconds a silent client keeps its requests", flag="--client-timeout")
    drain_timeout_s: float = knob(60.0, "seconds a draining group may finish its requests", flag="--drain-timeout")
    max_failovers: int = knob(3, "times a request may lose its worker group before it ends with an error "
                                 "(instead of crash-looping the next group)")


@dataclass(kw_only=True)
class StandbyArgs:
    """hot standby (services/scheduler/standby.py)"""

    standby_of: str | None = knob(None, "run as the hot standby of the scheduler at this client address (tcp://HOST:PORT): "
                                        "follow it, take over when its lease lapses; give each of two schedulers the "
                                        "other's address", metavar="ADDR")
    standby_lease_s: float = knob(1.0, "seconds without an answer from the active scheduler before a standby takes "
                                       "over (it pings every 0.1 s; a dead one's dropped connection is noticed in "
                                       "0.2 s)", flag="--standby-lease")

    def __post_init__(self) -> None:
        if self.standby_of is not None:
            check_connect_address(self.standby_of, "--standby-of")
        if not 0.2 <= self.standby_lease_s <= 60:
            raise InvalidRequest(f"--standby-lease {self.standby_lease_s}: use 0.2..60 seconds")


@dataclass(kw_only=True)
class ServeArgs:
    """addresses"""

    host: str = knob("127.0.0.1", "bind host (anything but loopback: use CURVE)")
    port: int = knob(DEFAULT_PORT, "client port; workers use port+1, steps port+2, events port+3")


@dataclass(kw_only=True)
class AdvertiseArgs:
    """advertised address"""

    advertise_host: str | None = knob(None, "the host other processes reach this one at (scheduler bound to "
                                            "0.0.0.0: its step address; TP rank 0: its torch.distributed address)")


@dataclass(kw_only=True)
class TokenizerArgs:
    """tokenizers"""

    models: list[str] = knob(help="model directory whose tokenizer this process serves (repeatable; default: the "
                                  "built-in model)", flag="--model", factory=list)


@dataclass(kw_only=True)
class CatalogArgs:
    """model pool catalog (models loaded on demand by pool workers: common/catalog.py)"""

    models_dir: str | None = knob(None, "a folder whose .gguf files and HF model folders are all served, loaded on "
                                        "demand by pool workers (worker --pool)", metavar="DIR")
    models_config: str | None = knob(None, "a TOML file: models by name (path, pinned, keep_alive, max_groups) "
                                           "and defaults (docs/deployment.md, Model pool)", metavar="FILE")


@dataclass(kw_only=True)
class PoolArgs(CatalogArgs):
    """model pool"""

    keep_alive: str = knob("5m", "how long a catalog model stays loaded after its last request (30s, 5m, 1h; "
                                 "0 = unload when idle; negative = never)")


@dataclass(kw_only=True)
class GenerationArgs:
    """sampling defaults"""

    generation_config: str = knob("auto", "defaults for the sampling fields a request leaves unset (temperature, "
                                          "top_p, top_k, min_p, repetition_penalty, max_tokens): auto = the model's "
                                          "generation_config.json (a GGUF's general.sampling.*), none = "
                                          "SamplingParams' own, or a generation_config.json FILE",
                                  metavar="auto|none|FILE")
    pooling: str = knob("auto", "how embedding requests pool the final hidden states over the prompt: last "
                                "(the last token's), mean, or auto = mean where the model directory has a "
                                "sentence-transformers 1_Pooling/config.json saying so, else last",
                        choices=("auto", "last", "mean"))


@dataclass(kw_only=True)
class ChatArgs:
    """chat"""

    chat_template: str | None = knob(None, "a Jinja chat template file to use instead of the model's own",
                                     metavar="FILE")
    tool_call_parser: str = knob("auto", "how a model writes tool calls, parsed for tool_choice auto: auto = "
                                         "recognised from its chat template, or hermes, llama3_json, mistral, json",
                                 metavar="NAME")


@dataclass(kw_only=True)
class CurveArgs:
    """CURVE (authenticated, encrypted ZeroMQ)"""

    curve_keys: str | None = knob(None, "CURVE key directory made by `zeroserve keys DIR` (default: plain)",
                                  metavar="DIR")


@dataclass(kw_only=True)
class CurveClientArgs(CurveArgs):
    """CURVE (authenticated, encrypted ZeroMQ)"""

    curve_client: str | None = knob(None, "which key of this process's role to use: DIR/clients/NAME.key_secret "
                                    "(clients, gateway), DIR/workers/NAME.key_secret (worker), "
                                    "DIR/detokenizers/NAME.key_secret (detokenizer); default: the role's name",
                                    metavar="NAME")


@dataclass(kw_only=True)
class ThreadArgs:
    """CPU"""

    threads: int | None = knob(None, "torch CPU threads for this process")


def check_connect_addresses(addrs: str, flag: str) -> list[str]:
    """A comma-separated list of scheduler addresses (a hot standby's: common/failover.py), each checked."""
    from zeroserve.common.failover import split_addresses

    return [check_connect_address(a, flag) for a in split_addresses(addrs, flag)]


def check_connect_address(addr: str, flag: str) -> str:
    """A ZeroMQ address to dial (tcp://HOST:PORT, ipc://PATH), checked where it is given: a
    malformed one (`tcp://:7001`) would otherwise be retried forever without a word."""
    def bad(why: str) -> InvalidRequest:
        return InvalidRequest(f"{flag} {addr!r}: {why}; expected tcp://HOST:PORT (e.g. tcp://10.0.0.5:7001)")

    if not isinstance(addr, str) or "://" not in addr:
        raise bad("no transport")
    scheme, rest = addr.split("://", 1)
    if scheme in ("ipc", "inproc"):
        if not rest:
            raise bad("no path")
        return addr
    if scheme != "tcp":
        raise bad(f"unknown transport {scheme!r}")
    host, sep, port = rest.rpartition(":")
    if not sep:
        raise bad("no port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or host == "*" or any(c.isspace() for c in host):  # 0.0.0.0 dials this host: `up --host 0.0.0.0`
        raise bad(f"{host!r} is not a host to connect to" if host else "no host")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise bad(f"port {port!r} is not in 1..65535")
    return addr


@dataclass(kw_only=True)
class PeerArgs(CurveClientArgs):
    """connection to the scheduler"""

    scheduler: str = knob(DEFAULT_BACKEND, "the scheduler's backend address (its port + 1); with a hot standby "
                                           "both, comma-separated (tcp://a:7001,tcp://b:7005)")
    worker_id: str | None = knob(None, "this process's id at the scheduler (default: host-pid-random)", env=False)
    heartbeat_interval_s: float = knob(1.0, "seconds between heartbeats", flag="--heartbeat-interval")

    def __post_init__(self) -> None:
        check_connect_addresses(self.scheduler, "--scheduler")


@dataclass(kw_only=True)
class LaunchArgs:
    """cluster shape (zeroserve up)"""

    workers: int = knob(1, "worker groups to start")
    tp: int = knob(1, "tensor-parallel shards per worker group (per pipeline stage)")
    pp: int = knob(1, "pipeline stages per worker group (each a contiguous range of layers; a group is tp x pp "
                      "shards)")
    gateway: bool = knob(True, "do not start the OpenAI-compatible HTTP gateway", flag="--no-gateway")
    gateway_port: int = knob(8000, "the HTTP gateway's port")
    gateway_nice: int = knob(0, "the gateway's nice value (its --nice)")
    ui: bool = knob(True, "the gateway serves no web console (its --no-ui)", flag="--no-ui")
    standby: bool = knob(False, "start a hot standby scheduler on ports port+4..port+7 beside the active one and give "
                                "every worker, the detokenizer and the gateway both addresses (a killed scheduler's "
                                "streams pause ~0.5 s instead of its restart)")


@dataclass(kw_only=True)
class MetricsArgs:
    """metrics"""

    metrics_port: int = knob(0, "serve Prometheus metrics over HTTP on this port, on the scheduler's host (0 = off; "
                                "the gateway's /metrics serves them too)")


@dataclass(kw_only=True)
class GatewayArgs(CurveClientArgs, CatalogArgs):
    """HTTP gateway (OpenAI-compatible API)"""

    scheduler: str = knob(f"tcp://127.0.0.1:{DEFAULT_PORT}", "the scheduler's client address; with a hot standby "
                                                            "both, comma-separated")
    host: str = knob("127.0.0.1", "HTTP bind host")
    port: int = knob(8000, "HTTP port")
    models: list[str] = knob(help="model directory (or .gguf) whose tokenizer /tokenize, /detokenize and logprob "
                                  "token strings use, loaded on first use (repeatable; default: none)",
                             flag="--model", factory=list)
    api_key: str | None = knob(None, "require `Authorization: Bearer KEY` on /v1/* and /api/* (default: open)")
    ui: bool = knob(True, "do not serve the web console (/ the chat playground, /cluster the live view)",
                    flag="--no-ui")
    max_body_bytes: int = knob(4 << 20, "largest request body accepted (413 above)")
    timeout_s: float = knob(10.0, "seconds the scheduler may stay silent before requests get 503", flag="--timeout")
    request_timeout_s: float | None = knob(None, "limit on one request's total time (504 after it; default: none)",
                                           flag="--request-timeout")
    nice: int = knob(0, "this process's nice value, -20..19: on cores shared with the cluster and its clients a "
                        "negative one gets the gateway the CPU sooner (it needs root or CAP_SYS_NICE)")


@dataclass(kw_only=True)
class ClientArgs(CurveClientArgs):
    """cluster address"""

    address: str = knob(f"tcp://127.0.0.1:{DEFAULT_PORT}", "the scheduler's client address; with a hot standby "
                                                          "both, comma-separated")


# --------------------------------------------------------------------------------------------
# What each process is configured with
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class EngineArgs(ModelArgs, GenerationArgs, DeviceArgs, CacheArgs, ParallelArgs, SpeculativeArgs, LoRAArgs,
                 SchedulerArgs):
    """Engine arguments (vLLM's names), validated once at the boundary."""

    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequest:
            return InvalidRequest(f"engine args: {msg}")

        def pos_int(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(f"{name} must be a positive integer, got {v!r}")

        if self.block_size not in (16, 32, 48, 64, 80, 96, 112, 128, 256) or self.block_size % 16:
            raise bad(f"block_size must be a multiple of 16 (16..256), got {self.block_size!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tp_size", "pp_size", "max_queue_len"):
            pos_int(name)
        for name in ("num_kv_blocks", "kv_cache_memory_bytes", "max_model_len", "max_num_prefill_tokens"):
            pos_int(name, allow_none=True)
        if self.quantization not in QUANTIZATIONS:
            raise bad(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise bad(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if not (isinstance(self.device, str) and (self.device in ("cpu", "cuda") or self.device.startswith("cuda:"))):
            raise bad(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise bad(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise bad(f"generation_config must be auto, none or a file path, got {self.generation_config!r}")
        self._validate_speculative(bad)
        self.validate_lora(bad)

    def _validate_speculative(self, bad) -> None:
        m = self.speculative_method
        if m not in SPECULATIVE_METHODS:
            raise bad(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, got {m!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise bad(f"num_speculative_tokens must be an integer in 1..16, got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (lo, hi)) or lo > hi:
            raise bad(f"prompt_lookup_min / prompt_lookup_max must be integers with 1 <= min <= max, got {lo!r} / {hi!r}")
        if m == "draft" and not self.speculative_model:
            raise bad("speculative_method draft needs speculative_model (a smaller model with the same tokenizer)")
        if m != "draft" and self.speculative_model:
            raise bad(f"speculative_model is only used with speculative_method draft (it is {m!r})")
        if m != "none" and self.lora_enabled:
            # drafts would come from the base model (or none at all); unverified with adapters
            raise bad("speculative decoding is not supported with LoRA adapters: serve adapters with "
                      "speculative_method none")
        if m != "none" and self.tp_size > 1:
            # every shard would have to propose and accept alike; the draft model is not sharded
            raise bad("speculative decoding is not supported with tensor parallelism (tp_size > 1): run the group "
                      "with tp_size 1 or speculative_method none")
        if m != "none" and self.pp_size > 1:
            # drafts would be proposed on the first stage and verified on the last
            raise bad("speculative decoding is not supported with pipeline parallelism (pp_size > 1): run the "
                      "group with pp_size 1 or speculative_method none")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs: Any) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in kwargs if k not in known)
        if unknown:
            raise InvalidRequest(f"engine args: unknown argument(s) {unknown}; known: {sorted(known)}")
        return cls(model=model, **kwargs)


# the engine knobs a worker takes: the policy's limits are the scheduler's, except the length cap
WORKER_ENGINE_KNOBS = (*knob_names(ModelArgs, DeviceArgs, CacheArgs, ParallelArgs, SpeculativeArgs, LoRAArgs),
                       "max_model_len")


@dataclass(kw_only=True)
class SchedulerConfig(ServeArgs, AdvertiseArgs, TokenizerArgs, PoolArgs, GenerationArgs, ChatArgs, LoRAArgs, SchedulerArgs,
                      LivenessArgs, MetricsArgs, CurveArgs, StandbyArgs):
    """The scheduler process: where it listens, what it serves, its policy and its timeouts."""

    no_worker_timeout_s: float = 300.0  # a request waits this long for a group serving its model
    max_kv_blocks: int = knob(1 << 20, "most KV blocks one worker shard may announce (a HELLO claiming more is "
                                       "refused: the scheduler keeps block tables for what it is told)")
    probe_interval_s: float = 0.1
    stats_interval_s: float = 1.0
    seed: int = 0
    model_load_timeout_s: float = knob(600.0, "seconds a pool member may take to load a model before the load is "
                                              "given up (its requests wait for another member)",
                                       flag="--model-load-timeout")
    max_waiting_per_model: int = knob(256, "requests one catalog model may hold waiting for a load before new "
                                           "ones get Overloaded")
    pp_steps_in_flight: int | None = knob(None, "steps a group of several pipeline stages computes at once, each "
                                                "over its own requests (default: one per stage, so every stage "
                                                "works; 1: one step at a time)")

    def addresses(self) -> dict[str, str]:
        h, p = self.host, self.port
        return {"client": f"tcp://{h}:{p}", "backend": f"tcp://{h}:{p + 1}", "steps": f"tcp://{h}:{p + 2}",
                "events": f"tcp://{h}:{p + 3}"}


@dataclass(kw_only=True)
class WorkerArgs(PeerArgs, AdvertiseArgs, ThreadArgs):
    """worker shard"""

    pool: bool = knob(False, "join as a model-pool member: no model at start; load and unload the scheduler's "
                             "catalog models on its request (--model is ignored)")
    memory_budget_bytes: int | None = knob(None, "a pool member's bytes for one model's weights + KV cache (default: "
                                                 "--kv-cache-memory-bytes + the largest weights it is asked to load)",
                                           flag="--memory-budget")

    group: str | None = knob(None, "worker group name (shards of one tensor-parallel group share it; "
                                   "default: one group per worker)")
    tp_rank: int = knob(0, "this shard's tensor-parallel rank in its pipeline stage")
    pp_rank: int = knob(0, "this shard's pipeline stage in its group (0 = the embedding, pp_size - 1 = the LM head)")
    dist_init_addr: str | None = knob(None, "torch.distributed address (rank 0 picks one if omitted)")
    collective_ifname: str | None = knob(None, "network interface for tensor-parallel collectives (sets "
                                               "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME; default: the one "
                                               "carrying --advertise-host, else the route to the rendezvous)",
                                         metavar="IFNAME")


@dataclass(kw_only=True)
class DetokenizerArgs(PeerArgs, TokenizerArgs, CatalogArgs):
    """The detokenizer process."""
