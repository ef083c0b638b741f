"""LoRA deltas for a batch that mixes adapters (the SGMV/BGMV idea of Punica and S-LoRA).

    add_lora(y, x, at, bt, scale, bounds, batch)    # y[T, N] += per-row LoRA delta, in place

One linear of the model holds a stack of adapter slots, transposed: `at[s]` is slot s's A for
each of the linear's P merged parts stacked, transposed (`[K, P*R]` = [A_0; A_1; ...]^T: q|k|v or
gate|up share one input, so one shrink serves them all), `bt[s]` its B^T (`[R, N]`: part p's
output columns `[bounds[p], bounds[p+1])` read part p's R columns of the shrink), `scale[s]` its
alpha/r (or alpha/sqrt(r), rsLoRA). Transposed, the C kernel's inner loops run along contiguous
outputs (see csrc/lora.c). R is the slot table's rank: a smaller adapter is zero-padded, which
adds exact zeros. A row t of the batch gets `y[t] += ((x[t] @ at[s])[part] @ bt[s])[...] * scale[s]`
with `s = batch.slots[t]`; slot -1 (the base model) is left alone. Three implementations, one
contract:

- `add_lora_twin` (the reference; torch and bf16 paths): rows gathered per slot, two matmuls;
- `add_lora_cpu` (csrc/lora.c, fp32 on CPU): per row, fixed summation order, so a row's bits
  never depend on the rest of the batch (exactness: a request's tokens never depend on batching);
- `add_lora_triton` (GPU, or CPU under TRITON_INTERPRET=1): one program per (row, output tile).
"""

from __future__ import annotations

import torch

__all__ = ["LoRABatch", "add_lora_cpu", "add_lora_triton", "add_lora_twin"]


class LoRABatch:
    """Which adapter slot each row of a step's flat batch uses, computed once per step.

    `slots[T]` int32 on the device (-1 = base model); `groups`: (slot, row indices) of every slot
    some row uses, for the twin's gathers, built on first use (the C and Triton kernels read
    `slots` only) from the host copy, so the layers never wait on the device for them."""

    def __init__(self, host_slots: torch.Tensor, device) -> None:
        self._host = host_slots
        self.slots = host_slots.to(device)
        self._groups: list[tuple[int, torch.Tensor]] | None = None

    @classmethod
    def from_rows(cls, row_slots: list[int] | torch.Tensor, device) -> LoRABatch | None:
        """From each row's slot (host ints); None when no row uses an adapter."""
        s = torch.as_tensor(row_slots, dtype=torch.int32)
        if s.numel() == 0 or int(s.max()) < 0:
            return None
        return cls(s, device)

    @property
    def groups(self) -> list[tuple[int, torch.Tensor]]:
        if self._groups is None:
            s, dev = self._host, self.slots.device
            self._groups = [(int(v), torch.nonzero(s == v).reshape(-1).to(dev)) for v in torch.unique(s).tolist()
                            if v >= 0]
        return self._groups


def _check(y, x, at, bt, scale, bounds) -> None:
    t, n = y.shape
    s, k, pr = at.shape
    p = len(bounds) - 1
    if x.shape != (t, k) or bt.shape[0] != s or bt.shape[2] != n or scale.shape != (s,) or p < 1 \
            or pr != p * bt.shape[1] or bounds[0] != 0 or bounds[-1] != n:
        raise ValueError(f"add_lora: shapes do not fit: y {list(y.shape)}, x {list(x.shape)}, at {list(at.shape)}, "
                         f"bt {list(bt.shape)}, scale {list(scale.shape)}, bounds {list(bounds)}")


def add_lora_twin(y: torch.Tensor, x: torch.Tensor, at: torch.Tensor, bt: torch.Tensor, scale: torch.Tensor,
                  bounds: tuple[int, ...], batch: LoRABatch) -> torch.Tensor:
    """The torch twin: per used slot, its rows' shrink and each part's expand."""
    _check(y, x, at, bt, scale, bounds)
    r = bt.shape[1]
    for s, rows in batch.groups:
        h = x.index_select(0, rows) @ at[s]  # [n, P*R]
        d = torch.empty((rows.numel(), y.shape[1]), dtype=y.dtype, device=y.device)
        for p in range(len(bounds) - 1):
            lo, hi = bounds[p], bounds[p + 1]
            d[:, lo:hi] = h[:, p * r:(p + 1) * r] @ bt[s, :, lo:hi]
        y.index_add_(0, rows, d * scale[s].to(d.dtype))
    return y


def add_lora_cpu(y: torch.Tensor, x: torch.Tensor, at: torch.Tensor, bt: torch.Tensor, scale: torch.Tensor,
                 bounds: tuple[int, ...], batch: LoRABatch) -> torch.Tensor:
    """csrc/lora.c where it applies (fp32 CPU tensors with contiguous rows), else the twin."""
    from zeroserve.kernels import cpu_native

    lib = cpu_native.lora_lib()
    ok = (lib is not None and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (y, x, at, bt))
          and y.stride(1) == 1 and x.stride(1) == 1 and at.is_contiguous() and bt.is_contiguous())
    if not ok:
        return add_lora_twin(y, x, at, bt, scale, bounds, batch)
    _check(y, x, at, bt, scale, bounds)
    t, n = y.shape
    s, k, _ = at.shape
    bnd = torch.tensor(bounds, dtype=torch.int64)
    sc = scale.float().contiguous()
    slots = batch.slots.contiguous()
    rc = lib.zs_lora_f32(y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), at.data_ptr(), bt.data_ptr(),
                         sc.data_ptr(), slots.data_ptr(), bnd.data_ptr(), len(bounds) - 1, t, k, n, bt.shape[1], s,
                         torch.get_num_threads())
    if rc != 0:
        raise ValueError("add_lora: the compiled kernel refused its arguments (a slot outside the table?)")
    return y


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, at: torch.Tensor, bt: torch.Tensor, scale: torch.Tensor,
                    bounds: tuple[int, ...], batch: LoRABatch) -> torch.Tensor:
    """Two launches: the shrink (row x part-rank tile) and the expand (row x output tile)."""
    from zeroserve.kernels import _triton_lora as K

    _check(y, x, at, bt, scale, bounds)
    if len(bounds) > 4:
        raise ValueError("add_lora_triton: at most 3 merged parts")
    t, n = y.shape
    s, k, pr = at.shape
    r = bt.shape[1]
    x = x.contiguous()
    a, b = at.contiguous(), bt.contiguous()
    tmp = torch.zeros((t, pr), dtype=torch.float32, device=y.device)
    sc = scale.float().contiguous()
    block_k = min(128, max(16, 1 << (k - 1).bit_length()))
    block_j = min(64, max(16, 1 << (pr - 1).bit_length()))
    K.lora_shrink_kernel[(t, -(-pr // block_j))](x, a, tmp, batch.slots, x.stride(0), pr, k,
                                                  BLOCK_J=block_j, BLOCK_K=block_k)
    b1 = bounds[1] if len(bounds) > 2 else n
    b2 = bounds[2] if len(bounds) > 3 else n
    block_n = 64 if n >= 64 else 32 if n >= 32 else 16
    block_r = max(16, 1 << (r - 1).bit_length())
    K.lora_expand_kernel[(t, -(-n // block_n))](tmp, b, sc, y, batch.slots, y.stride(0), pr, n, r, b1, b2,
                                                 BLOCK_N=block_n, BLOCK_R=block_r)
    return y

