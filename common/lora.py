"""LoRA adapters in PEFT's format, read and checked against a base model without torch.

An adapter is a directory with `adapter_config.json` (PEFT's LoraConfig: `r`, `lora_alpha`,
`use_rslora`, `target_modules`, ...) and `adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight` with A
`[r, in_features]` and B `[out_features, r]`. The delta a target adds is
`x @ A^T @ B^T * scaling`, scaling = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).

Or a llama.cpp adapter GGUF (convert_lora_to_gguf.py's output: `general.type` = adapter,
`adapter.type` = lora, `adapter.lora.alpha`; tensors `blk.{i}.{attn_q|...|ffn_down}.weight.lora_a`
/ `.lora_b`, the same A and B, scaling alpha / r as llama.cpp computes it, 1 when alpha is 0).
Its spec names the tensors as PEFT would (`shapes`), `file_keys` maps them to the file's; for the
architectures whose q/k rows llama.cpp permutes (llama, granite) B's rows of q_proj / k_proj are
permuted too (`permuted`), which the worker undoes on load.

This module is what the scheduler and the gateway need (no torch): the names and paths of
`--lora-modules`, and `check_adapter`, which reads only the config and the safetensors header
and raises InvalidRequest naming whatever does not fit the base model: an unsupported option, a
target we do not serve, a layer the model lacks, a shape, a rank above `--max-lora-rank`. The
worker reads the tensors themselves (services/worker/lora.py) after the same check.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroserve.common.errors import InvalidRequest
from zeroserve.common.model_config import ModelConfig

# the linears a LoRA may target, by PEFT's (HF's) module names
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTN_TARGETS + MLP_TARGETS
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_NAME = 256
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")
_HEADER_MAX = 100 << 20  # a safetensors header above this is not an adapter's
_FLOAT_DTYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter's files say: its rank, scaling and (layer, target) -> A and B shapes."""

    name: str
    path: str
    rank: int
    alpha: float
    use_rslora: bool
    base_model: str | None
    shapes: dict[str, tuple[int, ...]]  # tensor name (PEFT's) -> shape
    format: str = "peft"  # or "gguf": the file itself is `path`
    file_keys: dict[str, str] | None = None  # gguf: PEFT's name -> the file's tensor name
    permuted: bool = False  # gguf: q_proj / k_proj B rows in llama.cpp's rotary order

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank

    def targets(self) -> dict[tuple[int, str], tuple[str, str]]:
        """(layer, target) -> (A's tensor name, B's tensor name)."""
        out: dict[tuple[int, str], dict[str, str]] = {}
        for key in self.shapes:
            m = _KEY.match(key)
            out.setdefault((int(m[1]), m[3]), {})[m[4]] = key  # every key matched when read
        return {k: (v["A"], v["B"]) for k, v in out.items()}

    def target_names(self) -> list[str]:
        return sorted({t for _, t in self.targets()}, key=TARGETS.index)


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """`--lora-modules name=path ...` -> {name: path}; a malformed or repeated entry is an error."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = str(item).partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise InvalidRequest(f"--lora-modules: {item!r} is not NAME=PATH")
        check_name(name)
        if name in out:
            raise InvalidRequest(f"--lora-modules: adapter {name!r} is given twice")
        out[name] = path
    return out


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME or any(c.isspace() for c in name):
        raise InvalidRequest(f"a LoRA adapter's name must be 1 to {MAX_NAME} characters without spaces, got "
                             f"{name!r:.100}")
    return name


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise InvalidRequest(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > _HEADER_MAX:
            raise InvalidRequest(f"{path}: not a safetensors file (header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise InvalidRequest(f"{path}: safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise InvalidRequest(f"{path}: safetensors header is not a table of tensors")
    header.pop("__metadata__", None)
    return header


def read_adapter(name: str, path: str | Path) -> AdapterSpec:
    """Read `path`'s adapter_config.json and the safetensors header (not the tensors)."""
    check_name(name)
    d = Path(path)
    where = f"LoRA adapter {name!r} ({d})"
    if d.suffix == ".gguf" and d.is_file():
        return _read_gguf_adapter(name, d, where)
    if not (d / CONFIG_FILE).is_file():
        raise InvalidRequest(f"{where}: no {CONFIG_FILE} (a PEFT adapter directory is expected)")
    if not (d / WEIGHTS_FILE).is_file():
        extra = " (adapter_model.bin is pickle, not read: save with safe_serialization)" \
            if (d / "adapter_model.bin").exists() else ""
        raise InvalidRequest(f"{where}: no {WEIGHTS_FILE}{extra}")
    try:
        cfg = json.loads((d / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"{where}: {CONFIG_FILE} is not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise InvalidRequest(f"{where}: {CONFIG_FILE} is not a JSON object")

    def bad(msg: str) -> InvalidRequest:
        return InvalidRequest(f"{where}: {msg}")

    if cfg.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise bad(f"r (the rank) must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise bad(f"lora_alpha must be a number, got {alpha!r}")
    for key, ok in (("fan_in_fan_out", False), ("use_dora", False)):
        if cfg.get(key, ok) not in (ok, None):
            raise bad(f"{key}={cfg[key]!r} is not supported")
    if cfg.get("bias", "none") != "none":
        raise bad(f"bias={cfg['bias']!r} is not supported (only 'none': adapters add no bias)")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if cfg.get(key):
            raise bad(f"{key} is not supported (one rank and one alpha for every target; no extra modules)")
    tm = cfg.get("target_modules")
    if isinstance(tm, list):
        unknown = [t for t in tm if t not in TARGETS]
        if unknown:
            raise bad(f"target_modules {unknown} are not supported; LoRA applies to {', '.join(TARGETS)}")
    header = _safetensors_header(d / WEIGHTS_FILE)
    shapes: dict[str, tuple[int, ...]] = {}
    for key, info in header.items():
        m = _KEY.match(key)
        if m is None:
            raise bad(f"tensor {key!r} is not a LoRA A/B weight of a decoder layer's linear")
        if m[3] not in TARGETS or (m[3] in ATTN_TARGETS) != (m[2] == "self_attn"):
            raise bad(f"tensor {key!r} targets {m[2]}.{m[3]}; LoRA applies to {', '.join(TARGETS)}")
        if not isinstance(info, dict) or info.get("dtype") not in _FLOAT_DTYPES:
            raise bad(f"tensor {key!r} has dtype {info.get('dtype') if isinstance(info, dict) else info!r}; "
                      f"expected one of {', '.join(_FLOAT_DTYPES)}")
        shapes[key] = tuple(int(v) for v in info.get("shape", ()))
    if not shapes:
        raise bad(f"{WEIGHTS_FILE} holds no LoRA weights")
    spec = AdapterSpec(name, str(d), r, float(alpha), bool(cfg.get("use_rslora", False)),
                       cfg.get("base_model_name_or_path"), shapes)
    _check_pairs(spec, bad)
    return spec


_GGUF_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_(a|b)$")
_GGUF_TARGETS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                 "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_PERMUTED_ARCHS = ("llama", "granite")  # as services/worker/model/gguf_loader.py un-permutes the base


def _read_gguf_adapter(name: str, path: Path, where: str) -> AdapterSpec:
    from zeroserve.common.errors import ModelLoadError
    from zeroserve.common.gguf_config import open_gguf

    def bad(msg: str) -> InvalidRequest:
        return InvalidRequest(f"{where}: {msg}")

    try:
        gf = open_gguf(path)
    except ModelLoadError as e:
        raise bad(str(e)) from None
    md = gf.metadata
    if md.get("general.type") != "adapter" or md.get("adapter.type") != "lora":
        raise bad(f"not a LoRA adapter GGUF (general.type {md.get('general.type')!r}, adapter.type "
                  f"{md.get('adapter.type')!r}; expected 'adapter' and 'lora')")
    shapes, keys = {}, {}
    for tname, t in gf.tensors.items():
        m = _GGUF_KEY.match(tname)
        if m is None or m[2] not in _GGUF_TARGETS:
            raise bad(f"tensor {tname!r} is not a LoRA A/B of a decoder layer's linear; LoRA applies to "
                      f"{', '.join(_GGUF_TARGETS)}")
        if t.type_name not in _FLOAT_DTYPES:
            raise bad(f"tensor {tname!r} is {t.type_name}; expected one of {', '.join(_FLOAT_DTYPES)}")
        target = _GGUF_TARGETS[m[2]]
        key = f"base_model.model.model.layers.{m[1]}.{'self_attn' if target in ATTN_TARGETS else 'mlp'}." \
              f"{target}.lora_{m[3].upper()}.weight"
        shapes[key], keys[key] = tuple(t.shape), tname
    ranks = {shape[0] for key, shape in shapes.items() if key.endswith("lora_A.weight") and len(shape) == 2}
    if len(ranks) != 1:
        raise bad(f"its lora_a tensors have ranks {sorted(ranks)}; one rank for every target is served")
    r = ranks.pop()
    alpha = float(md.get("adapter.lora.alpha", 0.0)) or float(r)  # llama.cpp: alpha 0 = scale 1
    arch = md.get("general.architecture")
    spec = AdapterSpec(name, str(path), r, alpha, False, arch, shapes, "gguf", keys, arch in _PERMUTED_ARCHS)
    _check_pairs(spec, bad)
    return spec


def _check_pairs(spec: AdapterSpec, bad) -> None:
    """Every (layer, target) has both its A and its B."""
    seen: dict[tuple[int, str], set[str]] = {}
    for key in spec.shapes:
        m = _KEY.match(key)
        seen.setdefault((int(m[1]), m[3]), set()).add(m[4])
    for (layer, target), ab in seen.items():
        if ab != {"A", "B"}:
            raise bad(f"layer {layer} {target} has lora_{''.join(sorted(ab))} without lora_{({'A', 'B'} - ab).pop()}")


def target_shapes(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(in_features, out_features) of `target` in the base model (whole, not a TP shard)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    i = cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[target]


def check_adapter(spec: AdapterSpec, cfg: ModelConfig, max_rank: int) -> AdapterSpec:
    """`spec` if it fits the base model `cfg` and `max_rank`; else InvalidRequest naming what does not."""
    where = f"LoRA adapter {spec.name!r} ({spec.path})"
    if spec.rank > max_rank:
        raise InvalidRequest(f"{where}: rank {spec.rank} is above --max-lora-rank {max_rank}")
    if cfg.fused_qkv or cfg.fused_gate_up:
        raise InvalidRequest(f"{where}: the base model {cfg.name or cfg.architecture} stores fused projections; "
                             "LoRA is served for models with separate q/k/v and gate/up projections")
    for (layer, target), (ka, kb) in spec.targets().items():
        if layer >= cfg.num_layers:
            raise InvalidRequest(f"{where}: layer {layer} {target}: the base model has {cfg.num_layers} layers")
        if target in MLP_TARGETS and cfg.is_moe_layer(layer):
            raise InvalidRequest(f"{where}: layer {layer} {target}: that layer's MLP is a mixture of experts; "
                                 "LoRA on experts is not served")
        fin, fout = target_shapes(cfg, target)
        want_a, want_b = (spec.rank, fin), (fout, spec.rank)
        if spec.shapes[ka] != want_a or spec.shapes[kb] != want_b:
            raise InvalidRequest(f"{where}: layer {layer} {target}: lora_A {list(spec.shapes[ka])} / lora_B "
                                 f"{list(spec.shapes[kb])} do not fit the base model, which needs "
                                 f"{list(want_a)} / {list(want_b)} (rank {spec.rank}, {target} {fin} -> {fout})")
    return spec


class LoRARegistry:
    """The adapters a scheduler (or the in-process engine) serves: name -> checked spec and its
    base model. Requests name an adapter by `params.lora`, or by `params.model` = the adapter's
    name (vLLM's HTTP convention); `resolve` turns either into (params for the base model with
    `lora` set, the adapter's directory)."""

    def __init__(self, max_rank: int) -> None:
        self.max_rank = max_rank
        self.adapters: dict[str, tuple[AdapterSpec, str]] = {}  # name -> (spec, parent model)

    def add(self, name: str, path: str, cfg: ModelConfig, parent: str, models: Any = ()) -> AdapterSpec:
        """Check the adapter against `cfg` (the parent's config) and serve it; InvalidRequest
        when it does not fit, or its name is taken by another adapter or a model in `models`."""
        check_name(name)
        if name in models:
            raise InvalidRequest(f"LoRA adapter name {name!r} is the name of a served model")
        old = self.adapters.get(name)
        if old is not None and (old[0].path, old[1]) != (str(Path(path)), parent):
            raise InvalidRequest(f"LoRA adapter {name!r} is already loaded (from {old[0].path}); unload it first")
        spec = check_adapter(read_adapter(name, path), cfg, self.max_rank)
        self.adapters[name] = (spec, parent)
        return spec

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise InvalidRequest(f"LoRA adapter {name!r} is not loaded")

    def cards(self) -> list[tuple[str, str]]:
        """(adapter, parent model) of every adapter served."""
        return [(name, parent) for name, (_, parent) in self.adapters.items()]

    def resolve(self, params: Any, model: str | None) -> tuple[Any, str | None]:
        """(params, the adapter's path or None) for a request to `model` (its params.model or the
        default); `params.model` naming an adapter becomes its parent with `lora` set."""
        name = params.lora
        if name is None and params.model is not None and params.model in self.adapters:
            name = params.model
            params = type(params)(**{**params.to_dict(), "model": self.adapters[name][1], "lora": name})
            model = params.model
        if name is None:
            return params, None
        entry = self.adapters.get(name)
        if entry is None:
            served = ", ".join(sorted(self.adapters)) or "none"
            raise InvalidRequest(f"LoRA adapter {name!r} is not served (served: {served})")
        spec, parent = entry
        if model is not None and model != parent:
            raise InvalidRequest(f"LoRA adapter {name!r} belongs to model {parent!r}, not {model!r}")
        return params, spec.path
