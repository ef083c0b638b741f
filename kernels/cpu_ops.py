"""The CPU op set: the torch twins' contract, computed by compiled kernels where they apply.

Decode dominates a serving step on CPU, and there a torch twin costs more in dispatch than in
arithmetic: RMSNorm is eight aten ops on 576 floats, rotary a dozen. ``kernels/csrc/cpu_ops.c``
does each op in one call (norms, rotary, SiLU-and-mul, the KV write; numerics as the twins',
see the file), and ``kernels/csrc/paged_decode.c`` reads decode attention's blocks where they
are instead of gathering them into a padded buffer. Other dtypes or devices, layouts a kernel
does not take, and machines where the kernels cannot be built run the torch twins unchanged.
"""

from __future__ import annotations

import torch

from zeroserve.kernels.metadata import AttentionMetadata
from zeroserve.kernels import cpu_native, torch_ops

__all__ = list(torch_ops.__all__)  # the same op set


def _ops(*tensors: torch.Tensor):
    """The compiled op library when every tensor is fp32 on the CPU, else None (use the twin)."""
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            return None
    return cpu_native.ops_lib()


def _rows(x: torch.Tensor) -> bool:
    """A [T, H] matrix whose rows are contiguous (any row stride)."""
    return x.dim() == 2 and (x.stride(1) == 1 or x.shape[1] <= 1)


def _heads(x: torch.Tensor) -> bool:
    """A [T, H, D] tensor whose head vectors are contiguous."""
    return x.dim() == 3 and (x.stride(2) == 1 or x.shape[2] <= 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    lib = _ops(x, weight)
    if lib is None or not _rows(x) or not weight.is_contiguous():
        return torch_ops.rms_norm(x, weight, eps)
    t, h = x.shape
    out = torch.empty((t, h), dtype=x.dtype)
    rc = lib.zs_add_rms_norm_f32(x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), out.data_ptr(), h,
                                 None, 0, t, h, eps, torch.get_num_threads())
    if rc != 0:
        return torch_ops.rms_norm(x, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    lib = _ops(x, residual, weight)
    if lib is None or not (_rows(x) and _rows(residual)) or x.shape != residual.shape or not weight.is_contiguous():
        return torch_ops.fused_add_rms_norm(x, residual, weight, eps)
    t, h = x.shape
    out = torch.empty((t, h), dtype=x.dtype)
    new_res = torch.empty((t, h), dtype=x.dtype)
    rc = lib.zs_add_rms_norm_f32(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
                                 out.data_ptr(), h, new_res.data_ptr(), h, t, h, eps, torch.get_num_threads())
    if rc != 0:
        return torch_ops.fused_add_rms_norm(x, residual, weight, eps)
    return out, new_res


gelu_tanh_and_mul = torch_ops.gelu_tanh_and_mul  # GeGLU (Gemma): the twin; no compiled kernel


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    lib = _ops(x)
    if lib is None or not _rows(x) or x.shape[1] % 2:
        return torch_ops.silu_and_mul(x)
    t, i = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, i), dtype=x.dtype)
    if lib.zs_silu_and_mul_f32(x.data_ptr(), x.stride(0), out.data_ptr(), i, t, i, torch.get_num_threads()) != 0:
        return torch_ops.silu_and_mul(x)
    return out


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    lib = _ops(q, k, cos_sin_cache)
    if (lib is None or not (_heads(q) and _heads(k)) or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]
            or not cos_sin_cache.is_contiguous() or cos_sin_cache.dim() != 2 or positions.device.type != "cpu"
            or positions.shape != (q.shape[0],)):
        return torch_ops.rotary_embedding(positions, q, k, cos_sin_cache)
    t, hq, d = q.shape
    hk = k.shape[1]
    pos = positions if positions.dtype == torch.int64 and positions.is_contiguous() else positions.long().contiguous()
    q_out = torch.empty((t, hq, d), dtype=q.dtype)
    k_out = torch.empty((t, hk, d), dtype=k.dtype)
    max_pos, rot = cos_sin_cache.shape
    rc = lib.zs_rope_f32(pos.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), hq, k.data_ptr(), k.stride(0),
                         k.stride(1), hk, d, cos_sin_cache.data_ptr(), rot, max_pos, q_out.data_ptr(),
                         k_out.data_ptr(), t, torch.get_num_threads())
    if rc != 0:  # a position outside the table, an odd rot_dim: the twin raises what torch raises
        return torch_ops.rotary_embedding(positions, q, k, cos_sin_cache)
    return q_out, k_out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    lib = _ops(k, v, k_cache, v_cache)
    if (lib is None or not (_heads(k) and _heads(v)) or k.shape != v.shape or k_cache.shape != v_cache.shape
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape[2:] != k.shape[1:]
            or slot_mapping.device.type != "cpu" or slot_mapping.shape != (k.shape[0],)):
        return torch_ops.write_kv(k, v, k_cache, v_cache, slot_mapping)
    t, hk, d = k.shape
    slots = slot_mapping if slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() \
        else slot_mapping.long().contiguous()
    nb, bs = k_cache.shape[:2]
    rc = lib.zs_write_kv_f32(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
                             k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), nb * bs, t, hk, d)
    if rc != 0:  # a slot past the cache: the twin raises torch's index error
        return torch_ops.write_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Same contract as ``torch_ops.paged_attention`` (the compiled decode kernel honours the
    window and the soft-cap too).

    Every query row runs through the decode kernel, prefill and extend rows included: the row at
    position p of a request is a decode query over keys [0, p] (its K/V are written before
    attention), so a row's arithmetic is the kernel's fixed per-row order whether it came in a
    decode step, a prompt, a chunk of one, a batch of other requests or a recompute after
    preemption or failover. The twin's padded SDPA groups a prompt with others and its rounding
    moved with their lengths (and prefill rows would round otherwise than decoding the same
    tokens)."""
    if not cpu_native.supports(q, k_cache):
        return torch_ops.paged_attention(q, k_cache, v_cache, meta, scale,
                                         sliding_window=sliding_window, softcap=softcap)

    def decode(q_rows, block_tables, seq_lens):
        return cpu_native.paged_decode(q_rows, k_cache, v_cache, block_tables, seq_lens, scale,
                                       sliding_window=sliding_window, softcap=softcap)

    t = q.shape[0]
    nreq = meta.query_start_loc.shape[0] - 1
    if meta.max_query_len <= 1 and t == nreq:  # every request decodes: one row each, in order
        return decode(q, meta.block_tables, meta.seq_lens).to(q.dtype)
    out = torch.zeros_like(q)  # rows past query_start_loc[-1] (padding) stay zeros
    if t == 0 or nreq <= 0:
        return out
    qsl = meta.query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    real = int(qsl[-1])
    req = torch.repeat_interleave(torch.arange(nreq, device=q.device), q_lens)
    pos = meta.seq_lens.long()[req] - q_lens[req] + torch.arange(real, device=q.device) - qsl[req]
    out[:real] = decode(q[:real], meta.block_tables[req], (pos + 1).to(torch.int32)).to(q.dtype)
    return out


from zeroserve.kernels.moe import fused_moe  # noqa: E402,F401 (per active expert: torch GEMMs)
