"""safetensors -> our model, reading only this tensor-parallel shard's slice of each tensor.

Works with a single `model.safetensors` (or any set of *.safetensors files) and with a sharded
checkpoint described by `model.safetensors.index.json`. Each parameter of the model says which
checkpoint tensors (and which slices of them) fill it (`CausalLM.weight_sources()`); the loader
checks every tensor's full shape first, then reads just the slice with `get_slice`, so a shard
of a big model never materializes the whole tensor in memory.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from zeroserve.common.errors import ModelLoadError
from zeroserve.services.worker.model.layers import WeightSource

INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the file that holds it."""
    d = Path(model_dir)
    index = d / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"broken {INDEX_FILE} in {str(d)!r}: {type(e).__name__}: {e}") from None
        out = {}
        for name, fname in weight_map.items():
            f = d / fname
            if not f.is_file():
                raise ModelLoadError(f"{INDEX_FILE} maps tensor {name!r} to {fname!r}, which is missing in {str(d)!r}")
            out[name] = f
        return out
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weight files in model directory {str(d)!r}")
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open is not iterable
                    out.setdefault(name, f)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ModelLoadError(f"cannot read weight file {str(f)!r}: {e}") from None
    return out


def _slice_index(src: WeightSource, ndim: int):
    length = src.full_shape[src.src_dim] if src.src_len is None else src.src_len
    idx = [slice(None)] * ndim
    idx[src.src_dim] = slice(src.src_start, src.src_start + length)
    return tuple(idx), length


@torch.no_grad()
def load_weights(model, model_dir: str | Path, quantization: str | None = None) -> None:
    """Fill every parameter of `model` from the safetensors files in `model_dir`; with
    quantization "int8"/"int4" each linear is quantized as soon as its slice is read
    (services/worker/model/quantize.py)."""
    import zeroserve.services.worker.model.quantize as Q

    quantization = Q.resolve_quantization(quantization)
    targets = Q.int_targets(model, quantization)
    files = weight_files(model_dir)
    if model.cfg.is_moe:  # experts per expert (save_pretrained) or fused 3-D (transformers' modules)
        from zeroserve.services.worker.model.moe import use_fused_experts

        use_fused_experts(model, files)
    params = dict(model.named_parameters())
    sources = model.weight_sources()
    missing_params = sorted(set(params) - set(sources))
    if missing_params:  # a bug in the model code, not in the checkpoint
        raise RuntimeError(f"no checkpoint source for parameters {missing_params}")

    # group the reads by file so each file is opened once
    by_file: dict[Path, list[tuple[str, WeightSource]]] = defaultdict(list)
    for pname, srcs in sources.items():
        for src in srcs:
            f = files.get(src.hf_name)
            if f is None:
                raise ModelLoadError(
                    f"checkpoint in {str(model_dir)!r} is missing tensor {src.hf_name!r} "
                    f"(needed for {model.cfg.architecture})"
                )
            by_file[f].append((pname, src))
    left = {pname: len(srcs) for pname, srcs in sources.items()}

    def done(pname: str) -> None:
        left[pname] -= 1
        if left[pname] == 0 and pname in targets:
            Q.quantize_module(pname, *targets[pname], model.device)

    for f, items in by_file.items():
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"cannot read weight file {str(f)!r}: {e}") from None
        with handle as sf:
            for pname, src in items:
                param = params[pname]
                sl = sf.get_slice(src.hf_name)
                shape = tuple(sl.get_shape())
                if shape != tuple(src.full_shape):
                    raise ModelLoadError(
                        f"tensor {src.hf_name!r} in {f.name!r} has shape {list(shape)}, "
                        f"expected {list(src.full_shape)} from config.json"
                    )
                idx, length = _slice_index(src, len(shape))
                dim = src.src_dim
                if src.expert is not None:  # one expert of a fused [E, rows, cols] tensor
                    idx, dim = (src.expert, *idx[1:]), dim - 1
                if length:  # 0: a shard made only of vocab padding
                    dst = param.data.narrow(dim, src.dst_start, length)
                    dst.copy_(sl[idx].to(dtype=param.dtype))
                done(pname)
    # vocab padding rows (and anything the sources did not cover along the split dim) are zero
    _zero_vocab_padding(model)
    if quantization != "auto" and quantization != "none":
        Q.log_summary(model, quantization, str(model_dir))


def _zero_vocab_padding(model) -> None:
    for mod in (model.embed_tokens, model.lm_head):
        if mod is None or getattr(mod, "tied", False) or mod.quantized:  # not on this stage; packed: real rows only
            continue
        real = max(0, min(mod.end, mod.vocab_size) - mod.start)
        if real < mod.shard_size:
            mod.weight.data[real:].zero_()


