"""Torch twins of the kernels: the reference every kernel is tested against, and the fallback
where a compiled kernel does not apply. CPUs run kernels/cpu_ops.py (the C kernels of
kernels/csrc, these twins for the rest), GPUs kernels/triton_ops.py; `--attention-backend torch`
runs the twins alone.

Signatures are the contract in docs/architecture.md. Everything is vectorized (no per-token
Python loops); numerics follow HF transformers' Llama modules (fp32 inside, cast back).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from zeroserve.kernels.metadata import AttentionMetadata

__all__ = [
    "fused_add_rms_norm",
    "fused_moe",
    "gelu_tanh_and_mul",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv",
]


# --------------------------------------------------------------------------- norms / mlp
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: weight * (x_fp32 * rsqrt(mean(x^2) + eps)).to(x.dtype)."""
    dtype = x.dtype
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual (in x.dtype); out = rms_norm(new_residual)."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I] = silu(x[:, :I]) * x[:, I:] (in x.dtype, like HF LlamaMLP)."""
    i = x.shape[-1] // 2
    return F.silu(x[..., :i]) * x[..., i:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I] = gelu_tanh(x[:, :I]) * x[:, I:] (GeGLU, HF gelu_pytorch_tanh)."""
    i = x.shape[-1] // 2
    return F.gelu(x[..., :i], approximate="tanh") * x[..., i:]


# --------------------------------------------------------------------------- rotary
def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX rotary on the first rot_dim dims of q[T,Hq,D] and k[T,Hk,D].

    cos_sin_cache[max_pos, rot_dim] fp32, row p = [cos(p*f) | sin(p*f)], each rot_dim/2 wide.
    Computed in fp32, returned as new tensors in the inputs' dtypes (inputs untouched).
    """
    rot_dim = cos_sin_cache.shape[-1]
    half = rot_dim // 2
    cs = cos_sin_cache.index_select(0, positions.long()).float()  # [T, rot_dim]
    cos = cs[:, :half].unsqueeze(1)  # [T, 1, half]
    sin = cs[:, half:].unsqueeze(1)
    return _rope_one(q, cos, sin, rot_dim), _rope_one(k, cos, sin, rot_dim)


def _rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    half = rot_dim // 2
    xf = x.float()
    x1 = xf[..., :half]
    x2 = xf[..., half:rot_dim]
    # HF: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), rotate_half(x) = cat(-x2, x1)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if rot_dim == x.shape[-1]:
        out = torch.cat((o1, o2), dim=-1)
    else:
        out = torch.cat((o1, o2, xf[..., rot_dim:]), dim=-1)
    return out.to(x.dtype)


# --------------------------------------------------------------------------- kv cache
def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter k/v[T,Hk,D] into the paged caches [NB,BS,Hk,D] at slot_mapping; slot < 0 skipped."""
    nb, bs, hk, d = k_cache.shape
    kf = k_cache.view(nb * bs, hk, d)
    vf = v_cache.view(nb * bs, hk, d)
    slots = slot_mapping.long()
    keep = slots >= 0
    if k_cache.device.type == "cpu" and bool(keep.all()):
        kf.index_copy_(0, slots, k.to(k_cache.dtype))
        vf.index_copy_(0, slots, v.to(v_cache.dtype))
        return
    idx = slots[keep]
    kf.index_copy_(0, idx, k[keep].to(k_cache.dtype))
    vf.index_copy_(0, idx, v[keep].to(v_cache.dtype))


# --------------------------------------------------------------------------- attention
_WS = threading.local()


def _workspace(slot: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable flat buffer (per thread): big fresh allocations page-fault on every step on
    CPU, which costs more than the gather itself."""
    bufs = getattr(_WS, "bufs", None)
    if bufs is None:
        bufs = _WS.bufs = {}
    # a buffer made under torch.inference_mode cannot be written outside it (and vice versa is
    # allowed but would leak autograd-tracked tensors into inference): one buffer per mode
    key = (slot, dtype, device, torch.is_inference_mode_enabled())
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
        bufs[key] = buf
    return buf[:numel]


def clear_workspace() -> None:
    """Free this thread's attention gather buffers (they otherwise keep their peak size)."""
    _WS.bufs = {}


def _gather_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int, slot: str
) -> torch.Tensor:
    """[NB,BS,Hk,D] gathered by block_tables[B, :num_blocks] -> [B, Hk, num_blocks*BS, D] fp32.

    The result is a view of a workspace buffer: valid until the next call with the same slot."""
    _, bs, hk, d = cache.shape
    bt = block_tables[:, :num_blocks].long().clamp_min(0).flatten()  # -1 entries: masked later
    b = block_tables.shape[0]
    n = bt.numel() * bs * hk * d
    raw = _workspace(slot, n, cache.dtype, cache.device).view(bt.numel(), bs, hk, d)
    torch.index_select(cache, 0, bt, out=raw)
    if cache.dtype != torch.float32:
        f32 = _workspace(slot + "32", n, torch.float32, cache.device).view(raw.shape)
        f32.copy_(raw)
        raw = f32
    return raw.view(b, num_blocks * bs, hk, d).transpose(1, 2)


def _additive(keep: torch.Tensor) -> torch.Tensor:
    """Boolean keep-mask -> additive fp32 mask (0 / -inf); CPU SDPA runs ~15% faster with it."""
    return torch.zeros(keep.shape, dtype=torch.float32, device=keep.device).masked_fill_(~keep, float("-inf"))


_HAS_ENABLE_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _attention_group(
    q_rows: torch.Tensor,  # [B, Qmax, Hq, D] (padded queries)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    q_lens: torch.Tensor,  # [B]
    max_seq_len: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    fresh: bool = False,
) -> torch.Tensor:
    """Padded batched causal attention; returns [B, Qmax, Hq, D] fp32 (padding rows: junk).
    `fresh`: every request's queries are its whole sequence (q_len = seq_len = Qmax), so the
    mask is SDPA's own causal one (no mask tensor built per layer; its flash kernel skips the
    masked blocks: 2.1x faster for a 256-token prompt on CPU).

    `window`: a query at position p sees keys p - window < j <= p (HF's sliding-window mask:
    the last `window` positions, itself included). `softcap`: scores become
    softcap * tanh(scores / softcap) before the mask and softmax (Gemma 2)."""
    b, qmax, hq, d = q_rows.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    grp = hq // hk
    nblk = max(1, -(-max_seq_len // bs))
    nblk = min(nblk, block_tables.shape[1])
    k = _gather_kv(k_cache, block_tables, nblk, "k")  # [B, Hk, L, D]
    v = _gather_kv(v_cache, block_tables, nblk, "v")
    lmax = k.shape[2]
    dev = q_rows.device
    seq = seq_lens.long().view(b, 1, 1)
    j = torch.arange(lmax, device=dev).view(1, 1, lmax)
    qf = q_rows if q_rows.dtype == torch.float32 else q_rows.float()
    if qmax == 1:
        # Decode: fold the GQA group into the query-row axis (K/V never expanded, q is a view).
        # Key 0 stays visible so no row is ever fully masked (seq_len >= 1 for real rows).
        if window is None:
            keep = (j < seq) | (j == 0)
        else:  # the window's first key; an empty row (seq 0) keeps key 0 so nothing is fully masked
            keep = ((j < seq) & (j >= seq - window)) | ((j == 0) & (seq <= 0))
        mask = _additive(keep)  # [B, 1, L]
        if softcap is not None:
            out = _capped(qf.reshape(b, hk, grp, 1, d), k, v, mask.view(b, 1, 1, 1, lmax), scale, softcap)
            return out.reshape(b, 1, hq, d)
        out = F.scaled_dot_product_attention(
            qf.reshape(b, hk, grp, d), k, v, attn_mask=mask.unsqueeze(1), scale=scale
        )  # [B, Hk, grp, D]
        return out.reshape(b, 1, hq, d)
    if fresh and window is None and softcap is None:
        out = _sdpa_gqa(qf.transpose(1, 2), k[:, :, :qmax], v[:, :, :qmax], grp, scale, is_causal=True)
        return out.transpose(1, 2)
    ql = q_lens.long().view(b, 1, 1)
    i = torch.arange(qmax, device=dev).view(1, qmax, 1)
    qpos = seq - ql + i  # absolute position of query i
    # causal + length; padding rows (i >= q_len) see key 0 only, so nothing is fully masked
    if window is None:
        keep = ((j <= qpos) & (i < ql)) | (j == 0)
    else:  # key 0 only for padding rows: for real rows it may lie outside the window
        keep = ((j <= qpos) & (j > qpos - window) & (i < ql)) | ((j == 0) & (i >= ql))
    mask = _additive(keep).unsqueeze(1)  # [B, 1, Qmax, L]
    qh = qf.transpose(1, 2)  # [B, Hq, Qmax, D]
    if softcap is not None:
        out = _capped(qh.reshape(b, hk, grp, qmax, d), k, v, mask.unsqueeze(1), scale, softcap)
        return out.reshape(b, hq, qmax, d).transpose(1, 2)
    return _sdpa_gqa(qh, k, v, grp, scale, attn_mask=mask).transpose(1, 2)


def _sdpa_gqa(qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grp: int, scale: float, **mask) -> torch.Tensor:
    """SDPA of qh [B, Hq, Q, D] over k/v [B, Hk, L, D], Hq = grp * Hk (`mask`: attn_mask= or
    is_causal=): torch's own GQA where it has it, else K/V repeated per query head."""
    if grp > 1 and _HAS_ENABLE_GQA:
        return F.scaled_dot_product_attention(qh, k, v, scale=scale, enable_gqa=True, **mask)
    if grp > 1:
        k, v = k.repeat_interleave(grp, 1), v.repeat_interleave(grp, 1)
    return F.scaled_dot_product_attention(qh, k, v, scale=scale, **mask)


def _capped(q5: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float) -> torch.Tensor:
    """Soft-capped attention (SDPA has no cap): q5 [B, Hk, G, Q, D], k/v [B, Hk, L, D], additive
    mask broadcastable to [B, Hk, G, Q, L] -> [B, Hk, G, Q, D]. Order as HF's eager Gemma 2:
    scale, divide by the cap, tanh, multiply, add the mask, softmax in fp32."""
    scores = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap + mask
    return torch.matmul(torch.softmax(scores, dim=-1), v.unsqueeze(2))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode=None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of q[T,Hq,D] over the paged cache (new K/V already written).

    ``decode``, when given, computes the decode rows instead of the batched SDPA below:
    ``decode(q_rows [n, Hq, D], block_tables [n, W], seq_lens [n]) -> [n, Hq, D]`` (the CPU op
    set passes its compiled kernel; prefill/extend rows always run here).

    Decode requests (q_len == 1) run as batched SDPA calls with the GQA group folded into the
    query axis (K/V gathered once per kv head, never expanded); prefill/extend requests as
    padded batched calls with a causal + length mask. Requests are grouped by length so that
    padding costs at most PAD_WASTE x the ragged work (usually one group). Softmax in fp32,
    output in q.dtype. Rows past query_start_loc[-1] (padding tokens) come back as zeros.

    ``sliding_window`` / ``softcap``: see _attention_group (``decode`` must then honour them too).
    """
    win = dict(window=sliding_window, softcap=softcap)
    t = q.shape[0]
    qsl = meta.query_start_loc.long()
    nreq = qsl.shape[0] - 1
    if t == 0 or nreq <= 0:
        return torch.zeros_like(q)
    q_lens = qsl[1:] - qsl[:-1]
    seq_lens = meta.seq_lens
    bt = meta.block_tables

    if meta.max_query_len <= 1 and t == nreq and q.device.type != "cpu":
        # pure decode on an accelerator (the twin as a reference): one op, no host sync
        res = _attention_group(q.unsqueeze(1), k_cache, v_cache, bt, seq_lens, q_lens,
                               meta.max_seq_len, scale, **win)
        return res[:, 0].to(q.dtype)

    if decode is not None and meta.max_query_len <= 1 and t == nreq:  # every request decodes
        return decode(q, bt, seq_lens).to(q.dtype)

    if meta.max_query_len <= 1:
        dec, ext = (q_lens == 1).nonzero().flatten(), None
    else:
        dec, ext = (q_lens == 1).nonzero().flatten(), (q_lens > 1).nonzero().flatten()
    out = torch.zeros_like(q)
    if dec.numel() and decode is not None:
        rows = qsl[dec]
        out[rows] = decode(q[rows], bt[dec], seq_lens[dec]).to(q.dtype)
    elif dec.numel():
        # decode rows: batched, grouped by length so short requests are not padded to the
        # longest one (gather + attention cost ~ n * max_len per group)
        dec_l = dec.tolist()
        sl_l = seq_lens[dec].tolist()
        groups = _group_by_padding([1] * len(dec_l), sl_l)
        for grp_idx in groups:
            sel = dec if len(groups) == 1 else torch.tensor([dec_l[i] for i in grp_idx])
            smax = max(sl_l[i] for i in grp_idx)
            if t == nreq and len(groups) == 1:  # every request decodes: rows are in order
                res = _attention_group(q.unsqueeze(1), k_cache, v_cache, bt, seq_lens, q_lens,
                                       smax, scale, **win)
                return res[:, 0].to(q.dtype)
            sel = sel.to(q.device)
            rows = qsl[sel]
            res = _attention_group(q[rows].unsqueeze(1), k_cache, v_cache, bt[sel],
                                   seq_lens[sel], q_lens[sel], smax, scale, **win)
            out[rows] = res[:, 0].to(q.dtype)
    if ext is not None and ext.numel():
        # Prefill/extend requests run as padded batches, grouped so that padding stays bounded:
        # one big prompt next to short ones would otherwise pad every one of them to its size
        # (measured on CPU: ragged batches ran 2-4x slower as one padded op than grouped).
        ext_l = ext.tolist()
        ql_l = q_lens[ext].tolist()
        sl_l = seq_lens[ext].tolist()
        for grp_idx in _group_by_padding(ql_l, sl_l):
            sel = [ext_l[i] for i in grp_idx]
            qmax = max(ql_l[i] for i in grp_idx)
            smax = max(sl_l[i] for i in grp_idx)
            # whole prompts of one length with nothing cached before them: plain causal attention
            fresh = all(ql_l[i] == sl_l[i] == qmax for i in grp_idx)
            _extend_group(q, out, k_cache, v_cache, bt, seq_lens, q_lens, qsl,
                          torch.tensor(sel, device=q.device), qmax, smax, scale, fresh=fresh, **win)
    return out


PAD_WASTE = 1.5  # a padded group may cost at most this much more than its ragged work ...
PAD_SLACK = 4096  # ... unless the padding is this small anyway (query x key pairs)


def _group_by_padding(q_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Greedy grouping (longest first): a group's padded cost n * max_q * max_seq stays within
    PAD_WASTE x its ragged cost sum(q * seq), or within PAD_SLACK of it."""
    order = sorted(range(len(q_lens)), key=lambda i: (seq_lens[i], q_lens[i]), reverse=True)
    groups: list[list[int]] = []
    cur: list[int] = []
    work = qmax = smax = 0
    for i in order:
        nq, ns = max(qmax, q_lens[i]), max(smax, seq_lens[i])
        nwork = work + q_lens[i] * seq_lens[i]
        padded = (len(cur) + 1) * nq * ns
        if cur and padded > PAD_WASTE * nwork and padded - nwork > PAD_SLACK:
            groups.append(cur)
            cur, work, nq, ns, nwork = [], 0, q_lens[i], seq_lens[i], q_lens[i] * seq_lens[i]
        cur.append(i)
        work, qmax, smax = nwork, nq, ns
    if cur:
        groups.append(cur)
    return groups


def _extend_group(q, out, k_cache, v_cache, bt, seq_lens, q_lens, qsl, sel, qmax, smax, scale, fresh=False, **win):
    """Padded causal attention for the requests `sel`; writes their rows of `out`. `fresh`:
    each request's queries are all its qmax tokens (no padding, nothing cached before)."""
    t, hq, d = q.shape
    ne = sel.numel()
    eql = q_lens[sel]
    if ne == 1:
        start = int(qsl[sel[0]])
        if fresh:  # one whole prompt: its rows in place, no padding to index
            res = _attention_group(q[start:start + qmax].unsqueeze(0), k_cache, v_cache, bt[sel], seq_lens[sel],
                                   eql, smax, scale, fresh=True, **win)
            out[start:start + qmax] = res[0].to(q.dtype)
            return
    i = torch.arange(qmax, device=q.device).view(1, qmax)
    valid = i < eql.view(ne, 1)
    src = (qsl[sel].view(ne, 1) + i).clamp_max(t - 1)  # request e, query i -> row qsl[e] + i
    if ne == 1:
        q_pad = q[start:start + qmax].unsqueeze(0)
    else:
        q_pad = q[src.flatten()].view(ne, qmax, hq, d)
    res = _attention_group(q_pad, k_cache, v_cache, bt[sel], seq_lens[sel], eql, smax, scale, fresh=fresh, **win)
    out[src[valid]] = res[valid].to(q.dtype)


from zeroserve.kernels.moe import fused_moe  # noqa: E402,F401 (the MoE twin lives beside its Triton launch)
