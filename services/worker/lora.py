"""LoRA adapters as worker state: resident slots in every targeted linear, LRU over them, and
each step's row -> slot map.

Every decoder layer's q|k|v, o, gate|up and down linears get a `LoRALinear` (its `lora`
attribute, applied in services/worker/model/layers.py after the base matmul, whatever the base
weight's format: float, packed GGUF or int8/int4). It holds `max_loras` slots of A and B stacked
(transposed) for kernels/lora.py's `add_lora`, each zero-padded to `max_lora_rank` (padding adds exact zeros).
Tensor parallelism shards them like the base weights: a column-parallel linear keeps all of A and
its rows of each part's B; a row-parallel linear keeps its columns of A and all of B, and its
delta is added to the partial sum before the all-reduce (sum over ranks of B A_r x_r = B A x).

`LoRAManager` maps adapters to slots: `acquire` loads an adapter (checked against the model by
common/lora.py first) into a free slot, or the least recently used slot no live request holds;
`release` unpins it; `set_batch` tells the layers which slot each row of the step uses.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from safetensors import safe_open

from zeroserve.common.errors import InvalidRequest
from zeroserve.common.lora import (
    ATTN_TARGETS,
    CONFIG_FILE,
    TARGETS,
    WEIGHTS_FILE,
    AdapterSpec,
    check_adapter,
    read_adapter,
    target_shapes,
)
from zeroserve.common.model_config import ModelConfig
from zeroserve.kernels.lora import LoRABatch


class LoRAContext:
    """Shared by every LoRALinear of a model: the step's rows -> slots, the slots' scalings."""

    def __init__(self, ops, num_slots: int, device) -> None:
        self.ops = ops
        self.batch: LoRABatch | None = None
        self.scale = torch.zeros(num_slots, dtype=torch.float32, device=device)


class LoRALinear:
    """One linear's adapter slots, transposed as kernels/lora.py takes them: at [S, K, P*R] (each
    part's A^T side by side), bt [S, R, N] (B^T)."""

    def __init__(self, ctx: LoRAContext, targets: list[str], in_features: int, out_parts: list[int],
                 row_parallel: bool, tp, rank: int, device, dtype) -> None:
        self.ctx, self.targets, self.row_parallel, self.tp = ctx, targets, row_parallel, tp
        s = ctx.scale.shape[0]
        self.k = in_features // tp.size if row_parallel else in_features
        self.parts = out_parts if row_parallel else [n // tp.size for n in out_parts]  # this shard's rows
        bounds = [0]
        for n in self.parts:
            bounds.append(bounds[-1] + n)
        self.bounds = tuple(bounds)
        self.rank = rank
        self.at = torch.zeros((s, self.k, len(targets) * rank), dtype=dtype, device=device)
        self.bt = torch.zeros((s, rank, bounds[-1]), dtype=dtype, device=device)

    def load(self, slot: int, pieces: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill `slot` from full (unsharded) A [r, in] and B [out, r] per target; a target the
        adapter lacks stays zero."""
        self.at[slot].zero_()
        self.bt[slot].zero_()
        for p, target in enumerate(self.targets):
            if target not in pieces:
                continue
            a, b = pieces[target]
            r = a.shape[0]
            if self.row_parallel:
                a = a[:, self.tp.rank * self.k:(self.tp.rank + 1) * self.k]
            else:
                n = self.parts[p]
                b = b[self.tp.rank * n:(self.tp.rank + 1) * n]
            self.at[slot, :, p * self.rank:p * self.rank + r] = a.t().to(self.at.dtype)
            lo, hi = self.bounds[p], self.bounds[p + 1]
            self.bt[slot, :r, lo:hi] = b.t().to(self.bt.dtype)

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        batch = self.ctx.batch
        if batch is None:
            return y
        return self.ctx.ops.add_lora(y, x, self.at, self.bt, self.ctx.scale, self.bounds, batch)


class LoRAManager:
    """`max_loras` resident adapter slots of rank up to `max_rank` in `model`'s dense linears."""

    def __init__(self, model, cfg: ModelConfig, ops, max_loras: int, max_rank: int, device, dtype) -> None:
        from zeroserve.services.worker.model.llama import MLP

        self.cfg, self.max_rank, self.device = cfg, max_rank, device
        self.ctx = LoRAContext(ops, max_loras, device)
        self.linears: dict[tuple[int, str], LoRALinear] = {}  # (layer, first target) -> its slots
        c, tp = cfg, model.tp
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            self._attach(i, attn.qkv_proj, ["q_proj", "k_proj", "v_proj"], c.hidden_size, [q, kv, kv], False, tp,
                         dtype)
            self._attach(i, attn.o_proj, ["o_proj"], q, [c.hidden_size], True, tp, dtype)
            if isinstance(layer.mlp, MLP):  # MoE layers' experts take no adapter (common/lora.py refuses)
                n = c.intermediate_size
                self._attach(i, layer.mlp.gate_up_proj, ["gate_proj", "up_proj"], c.hidden_size, [n, n], False, tp,
                             dtype)
                self._attach(i, layer.mlp.down_proj, ["down_proj"], n, [c.hidden_size], True, tp, dtype)
        model.lora_ctx = self.ctx
        if model.__dict__.get("_step") is not None:  # built already: again, with the adapters' slots
            model.set_cpu_step(True)
        self.slot_of: OrderedDict[tuple[str, str], int] = OrderedDict()  # (name, path) -> slot, LRU first
        self.pins = [0] * max_loras  # live requests per slot
        self.free = list(range(max_loras))[::-1]

    def _attach(self, layer: int, module, targets, fin, parts, row, tp, dtype) -> None:
        lin = LoRALinear(self.ctx, targets, fin, parts, row, tp, self.max_rank, self.device, dtype)
        module.lora = lin
        self.linears[(layer, targets[0])] = lin

    @property
    def num_slots(self) -> int:
        return len(self.pins)

    def resident(self) -> list[str]:
        """The adapters in slots, least recently used first."""
        return [name for name, _ in self.slot_of]

    def acquire(self, name: str, path: str) -> int:
        """The slot holding adapter (name, path), loaded now if it is not resident; pinned until
        `release`. InvalidRequest when it does not fit the model or every slot is pinned."""
        key = (name, path)
        slot = self.slot_of.get(key)
        if slot is None:
            slot = self._take_slot(name)
            try:
                self._load(slot, check_adapter(read_adapter(name, path), self.cfg, self.max_rank))
            except BaseException:
                self.free.append(slot)
                raise
            self.slot_of[key] = slot
        self.slot_of.move_to_end(key)
        self.pins[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        if slot >= 0:
            self.pins[slot] -= 1

    def _take_slot(self, name: str) -> int:
        if self.free:
            return self.free.pop()
        for key, slot in self.slot_of.items():  # least recently used first
            if not self.pins[slot]:
                del self.slot_of[key]
                return slot
        raise InvalidRequest(f"LoRA adapter {name!r}: all {self.num_slots} adapter slots (--max-loras) are held by "
                             "running requests")

    def _load(self, slot: int, spec: AdapterSpec) -> None:
        per_layer: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, target), ab in read_tensors(spec, self.cfg.head_dim).items():
            per_layer.setdefault(layer, {})[target] = ab
        for (layer, _), lin in self.linears.items():
            lin.load(slot, per_layer.get(layer, {}))
        self.ctx.scale[slot] = spec.scaling

    def set_batch(self, row_slots) -> None:
        """Which slot each row of the next forward uses (-1: none); None or all -1: no adapter."""
        self.ctx.batch = None if row_slots is None else LoRABatch.from_rows(row_slots, self.device)


def read_tensors(spec: AdapterSpec, head_dim: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, target) -> (A [r, in], B [out, r]) in fp32, in HF's row order, from either format."""
    out = {}
    if spec.format == "gguf":
        from zeroserve.common.gguf_config import open_gguf
        from zeroserve.services.worker.model.gguf_loader import dequantize_rows, unpermute_rows

        gf = open_gguf(spec.path)

        def get(key: str) -> torch.Tensor:
            t = gf.tensors[spec.file_keys[key]]
            return dequantize_rows(gf.raw_rows(t), t.type_name).float().reshape(t.shape)

        for (layer, target), (ka, kb) in spec.targets().items():
            b = get(kb)
            if spec.permuted and target in ("q_proj", "k_proj"):  # B's rows, as the base weight's
                b = unpermute_rows(b, head_dim)
            out[(layer, target)] = (get(ka), b)
        return out
    with safe_open(f"{spec.path}/{WEIGHTS_FILE}", framework="pt") as f:
        for (layer, target), (ka, kb) in spec.targets().items():
            out[(layer, target)] = (f.get_tensor(ka).float(), f.get_tensor(kb).float())
    return out


def make_lora(args, runner) -> LoRAManager | None:
    """The runner's adapter slots when LoRA is enabled (EngineArgs' LoRA knobs), else None."""
    if not getattr(args, "lora_enabled", False):
        return None
    return LoRAManager(runner.model, runner.cfg, runner.ops, args.max_loras, args.max_lora_rank, runner.device,
                       runner.dtype)


def acquire_slots(lora: LoRAManager | None, new_reqs) -> list[int]:
    """The slot of each new request's adapter (-1: none), all or nothing: a failure releases the
    slots taken before it and raises, before the runner changes any request state."""
    slots: list[int] = []
    try:
        for n in new_reqs:
            if n.lora_path is None:
                slots.append(-1)
            elif lora is None:
                raise InvalidRequest(f"request {n.req_id!r} asks for LoRA adapter {n.params.lora!r}; this worker "
                                     "serves no adapters (start it with --enable-lora or --lora-modules)")
            else:
                slots.append(lora.acquire(n.params.lora, n.lora_path))
    except BaseException:
        for s in slots:
            lora.release(s)
        raise
    return slots


def write_random_adapter(path, cfg: ModelConfig, rank: int, seed: int, std: float = 0.02,
                         targets: tuple[str, ...] = TARGETS) -> str:
    """Write a PEFT adapter for model `cfg` with random A and B ~ N(0, std^2) and lora_alpha = 2 *
    rank at `path` (a directory); for benchmarks and tests that need adapters without training."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for t in targets:
            fin, fout = target_shapes(cfg, t)
            key = f"base_model.model.model.layers.{layer}.{'self_attn' if t in ATTN_TARGETS else 'mlp'}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * std
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / WEIGHTS_FILE))
    (d / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                             "target_modules": list(targets), "use_rslora": False, "bias": "none"}))
    return str(d)
