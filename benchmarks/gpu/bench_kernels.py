"""GPU check + benchmark for zeroserve's Triton kernels.

On a CUDA machine (defaults):
  1. correctness: every Triton op vs its torch twin in bf16 (max abs error vs tolerance, PASS/FAIL)
  2. decode attention timing (batch 64, ctx 2048 and 8192, 32 q / 8 kv heads, D 128, bf16):
     achieved KV-read GB/s vs the HBM roofline (--bandwidth-gbs, H200 ~4800), plus the split
     count used, a sweep of forced split counts, and the torch twin for comparison
  3. one whole decode step of an 8B-shaped Llama (random weights, bf16) vs the roofline
     (weight bytes + KV bytes) / bandwidth

    python benchmarks/gpu/bench_kernels.py                  # everything, on cuda
    python benchmarks/gpu/bench_kernels.py --skip-model     # kernels only
    python benchmarks/gpu/bench_kernels.py --dry-run   # CPU: tiny shapes, twins + interpreter

Exit status 1 if any correctness check fails.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# --------------------------------------------------------------------------- args / shapes
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on CPU: the torch twins + the Triton interpreter")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--bandwidth-gbs", type=float, default=4800.0,
                   help="HBM bandwidth for the roofline, GB/s (H200 ~4800, H100 SXM ~3350)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", default="2048,8192", help="decode context lengths, comma separated")
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--model-ctx", type=int, default=2048, help="context per request, model step")
    p.add_argument("--model-layers", type=int, default=32)
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--no-split-sweep", action="store_true",
                   help="don't time decode attention at forced split counts 1..16")
    p.add_argument("--skip-torch", action="store_true", help="don't time the torch twin")
    p.add_argument("--model-impl", default="auto", choices=["auto", "zeroserve", "composed"],
                   help="zeroserve = zeroserve.services.worker.model.build_model; composed = the ops + "
                        "F.linear in this script; auto = zeroserve when importable")
    args = p.parse_args(argv)
    if args.dry_run:
        args.device = args.device or "cpu"
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu":
        args.dry_run = True  # a CPU run is always the tiny-shape dry run
    args.ctx_list = [int(c) for c in str(args.ctx).split(",") if c]
    return args


@dataclass
class ModelShape:
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    rope_theta: float = 500000.0
    eps: float = 1e-5

    def weight_bytes(self, elt: int) -> int:
        h, d = self.hidden, self.head_dim
        per_layer = h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h
        per_layer += 3 * h * self.intermediate + 2 * h
        # decode reads every layer, the final norm and the lm_head (embedding: B rows only)
        return (self.layers * per_layer + h + self.vocab * h) * elt


def setup_shapes(args) -> dict:
    """Everything sized from the args; dry runs shrink to tiny CPU shapes."""
    if args.dry_run:
        return dict(
            dtype_name="float32",
            batch=3, ctx_list=[40, 70], hq=4, hk=2, d=64, bs=16, iters=1, warmup=0,
            model=ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                             intermediate=96, vocab=128, rope_theta=10000.0),
            model_ctx=20, check=dict(t=5, h=64, inter=48, hq=4, hk=2, d=64, bs=16, ctx=40),
        )
    return dict(
        dtype_name=args.dtype,
        batch=args.batch, ctx_list=args.ctx_list, hq=args.num_q_heads, hk=args.num_kv_heads,
        d=args.head_dim, bs=args.block_size, iters=args.iters, warmup=args.warmup,
        model=ModelShape(layers=args.model_layers),
        model_ctx=args.model_ctx,
        check=dict(t=37, h=4096, inter=14336, hq=32, hk=8, d=128, bs=args.block_size, ctx=1000),
    )


# --------------------------------------------------------------------------- helpers
def _sync(device):
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_fn(fn, device, iters: int, warmup: int) -> float:
    """Mean seconds per call."""
    import torch

    for _ in range(warmup):
        fn()
    _sync(device)
    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / max(iters, 1)
    t0 = time.perf_counter()
    for _ in range(max(iters, 1)):
        fn()
    return (time.perf_counter() - t0) / max(iters, 1)


def cos_sin_cache(max_pos: int, rot_dim: int, theta: float, device):
    import torch

    inv = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    f = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat((f.cos(), f.sin()), -1).to(device)


def paged_batch(seq_lens, q_lens, hq, hk, d, bs, dtype, device, seed=0, num_blocks=None):
    """Random cache with shuffled block tables: (q, k_cache, v_cache, meta)."""
    import torch

    from zeroserve.kernels.metadata import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    per = [max(1, math.ceil(s / bs)) for s in seq_lens]
    nb = num_blocks or sum(per) + 1
    perm = torch.randperm(nb, generator=g)
    bt = torch.zeros(len(seq_lens), max(per), dtype=torch.int32)
    p = 0
    for b, n in enumerate(per):
        bt[b, :n] = perm[p:p + n].to(torch.int32)
        p += n
    k_cache = torch.empty(nb, bs, hk, d, dtype=dtype, device=device).normal_()
    v_cache = torch.empty(nb, bs, hk, d, dtype=dtype, device=device).normal_()
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype).to(device)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    slots = []
    for b, (s, ql) in enumerate(zip(seq_lens, q_lens)):
        pos = torch.arange(s - ql, s)
        slots.append(bt[b].long()[pos // bs] * bs + pos % bs)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device), block_tables=bt.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
    )
    return q, k_cache, v_cache, meta


# --------------------------------------------------------------------------- 1. checks
TOL = {"bfloat16": {"attn": 2e-2, "ew": 3e-2}, "float16": {"attn": 3e-3, "ew": 3e-3},
       "float32": {"attn": 2e-5, "ew": 1e-5}}


def run_checks(args, shapes, tri, ref) -> bool:
    import torch

    dev, dt_name = args.device, shapes["dtype_name"]
    dt = getattr(torch, dt_name)
    c = shapes["check"]
    tol = TOL[dt_name]
    ok_all = True
    print(f"\n== correctness: triton vs torch twin ({dt_name}, {dev}) ==")

    def report(name, got, want, t):
        nonlocal ok_all
        got_t = got if isinstance(got, (tuple, list)) else (got,)
        want_t = want if isinstance(want, (tuple, list)) else (want,)
        err = max(((a.float() - b.float()).abs().max().item() if a.numel() else 0.0)
                  for a, b in zip(got_t, want_t))
        # relative to magnitude for elementwise ops (bf16 rounding scales with |x|)
        scale = max(b.float().abs().max().item() for b in want_t) if t == tol["ew"] else 1.0
        finite = all(bool(torch.isfinite(a).all()) for a in got_t)
        ok = finite and err <= t * max(1.0, scale)
        ok_all &= ok
        print(f"  {name:<34} max_err={err:.3e}  tol={t * max(1.0, scale):.3e}  "
              f"{'PASS' if ok else 'FAIL'}")

    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dt).to(dev)
    x, r = rnd(c["t"], c["h"]), rnd(c["t"], c["h"])
    w = (torch.rand(c["h"], generator=g) + 0.5).to(dt).to(dev)
    report("rms_norm", tri.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), tol["ew"])
    report("fused_add_rms_norm", tri.fused_add_rms_norm(x, r, w, 1e-5),
           ref.fused_add_rms_norm(x, r, w, 1e-5), tol["ew"])
    xi = rnd(c["t"], 2 * c["inter"])
    report("silu_and_mul", tri.silu_and_mul(xi), ref.silu_and_mul(xi), tol["ew"])
    hq, hk, d = c["hq"], c["hk"], c["d"]
    cache = cos_sin_cache(8192, d, 500000.0, dev)
    pos = torch.randint(0, 8192, (c["t"],), generator=g).to(dev)
    qkv = rnd(c["t"], (hq + 2 * hk) * d)
    q = qkv[:, : hq * d].view(c["t"], hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(c["t"], hk, d)
    report("rotary_embedding", tri.rotary_embedding(pos, q, k, cache),
           ref.rotary_embedding(pos, q, k, cache), tol["ew"])
    nb, bs = 8, c["bs"]
    slots = torch.randperm(nb * bs, generator=g)[: c["t"]]
    slots[::4] = -1
    slots = slots.to(dev)
    caches = [torch.zeros(nb, bs, hk, d, dtype=dt, device=dev) for _ in range(4)]
    v = rnd(c["t"], hk, d)
    tri.write_kv(k, v, caches[0], caches[1], slots)
    ref.write_kv(k, v, caches[2], caches[3], slots)
    report("write_kv", (caches[0], caches[1]), (caches[2], caches[3]), 0.0)

    ctx = c["ctx"]
    lens = [1, bs, bs + 1, ctx // 3, ctx]
    q, kc, vc, meta = paged_batch(lens, [1] * len(lens), hq, hk, d, bs, dt, dev, seed=1)
    scale = d ** -0.5
    report("paged_attention decode (split-K)", tri.paged_attention(q, kc, vc, meta, scale),
           ref.paged_attention(q, kc, vc, meta, scale), tol["attn"])
    report("paged_attention decode (1 split)",
           tri.paged_attention_impl(q, kc, vc, meta, scale, num_splits=1),
           ref.paged_attention(q, kc, vc, meta, scale), tol["attn"])
    # mixed: decodes, an extend over a cached prefix, a fresh prefill
    lens = [ctx, 37, ctx // 2 + 45, 2 * bs + 3, 9]
    qls = [1, 1, 40, 2 * bs + 3, 3]
    q, kc, vc, meta = paged_batch(lens, qls, hq, hk, d, bs, dt, dev, seed=2)
    report("paged_attention mixed/extend", tri.paged_attention(q, kc, vc, meta, scale),
           ref.paged_attention(q, kc, vc, meta, scale), tol["attn"])
    return ok_all


# --------------------------------------------------------------------------- 2. decode attention
def bench_decode_attention(args, shapes, tri, ref) -> list[dict]:
    import torch

    dev = args.device
    b, hq, hk, d, bs = shapes["batch"], shapes["hq"], shapes["hk"], shapes["d"], shapes["bs"]
    rows = []
    print(f"\n== decode attention: B={b} Hq={hq} Hk={hk} D={d} block={bs} "
          f"{shapes['dtype_name']} (roofline {args.bandwidth_gbs:.0f} GB/s) ==")
    for ctx in shapes["ctx_list"]:
        rows.append(_decode_one(args, shapes, tri, ref, ctx))
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def _decode_one(args, shapes, tri, ref, ctx: int) -> dict:
    import torch

    dev = args.device
    dt = getattr(torch, shapes["dtype_name"])
    elt = torch.empty((), dtype=dt).element_size()
    b, hq, hk, d, bs = shapes["batch"], shapes["hq"], shapes["hk"], shapes["d"], shapes["bs"]
    q, kc, vc, meta = paged_batch([ctx] * b, [1] * b, hq, hk, d, bs, dt, dev, seed=ctx)
    scale = d ** -0.5
    io_bytes = 2 * b * ctx * hk * d * elt + 2 * q.numel() * elt  # K+V read, q read, out write
    iters, warmup = shapes["iters"], shapes["warmup"]
    row = dict(ctx=ctx)
    line = f"  ctx={ctx:<6}"
    if tri is not None and not args.dry_run:  # interpreter timings would mean nothing
        from zeroserve.kernels.triton_ops import _decode_splits

        t_tri = time_fn(lambda: tri.paged_attention(q, kc, vc, meta, scale), dev, iters, warmup)
        splits = _decode_splits(b, hk, ctx, 64, q.device)[0]
        row.update(ms=t_tri * 1e3, gbs=io_bytes / t_tri / 1e9, splits=splits)
        row["roofline_frac"] = row["gbs"] / args.bandwidth_gbs
        line += (f" triton {row['ms']:.3f} ms  {row['gbs']:.0f} GB/s "
                 f"({100 * row['roofline_frac']:.1f}% of roofline, auto splits={splits})")
    if not args.skip_torch or args.dry_run:
        t_ref = time_fn(lambda: ref.paged_attention(q, kc, vc, meta, scale), dev,
                        max(1, iters // 4), 1)
        row["ms_torch"] = t_ref * 1e3
        line += f"  torch twin {row['ms_torch']:.3f} ms ({io_bytes / t_ref / 1e9:.1f} GB/s)"
    print(line)
    if tri is not None and not args.dry_run and not args.no_split_sweep:
        sweep = []
        for ns in (1, 2, 4, 8, 16):
            t_ns = time_fn(
                lambda ns=ns: tri.paged_attention_impl(q, kc, vc, meta, scale, num_splits=ns),
                dev, iters, warmup)
            sweep.append(f"{ns}:{t_ns * 1e3:.3f}ms/{io_bytes / t_ns / 1e9:.0f}GB/s")
        row["split_sweep"] = sweep
        print("      split sweep (splits:time/GB/s)  " + "  ".join(sweep))
    return row


# --------------------------------------------------------------------------- 3. whole decode step
def _model_config(ms: ModelShape):
    from zeroserve.common.model_config import ModelConfig

    return ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=ms.hidden, num_layers=ms.layers,
        num_heads=ms.heads, num_kv_heads=ms.kv_heads, head_dim=ms.head_dim,
        intermediate_size=ms.intermediate, vocab_size=ms.vocab, rope_theta=ms.rope_theta,
        rms_norm_eps=ms.eps, max_position_embeddings=131072 if ms.hidden >= 1024 else 4096,
        torch_dtype="bfloat16", name="bench-8b-shape",
    )


class ComposedLlama:
    """A decode step composed from the ops + F.linear (fallback when our model is absent)."""

    def __init__(self, ms: ModelShape, ops, device, dtype, max_pos: int):
        import torch

        g = torch.Generator(device=device).manual_seed(0)

        def w(*shape):
            return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32)
                    .mul_(0.02).to(dtype))

        h, d = ms.hidden, ms.head_dim
        self.ms, self.ops = ms, ops
        self.embed = w(ms.vocab, h)
        self.layers = [dict(
            ln1=torch.ones(h, dtype=dtype, device=device),
            qkv=w((ms.heads + 2 * ms.kv_heads) * d, h), o=w(h, ms.heads * d),
            ln2=torch.ones(h, dtype=dtype, device=device),
            gate_up=w(2 * ms.intermediate, h), down=w(h, ms.intermediate),
        ) for _ in range(ms.layers)]
        self.norm = torch.ones(h, dtype=dtype, device=device)
        self.lm_head = w(ms.vocab, h)
        self.cos_sin = cos_sin_cache(max_pos, d, ms.rope_theta, device)

    def __call__(self, input_ids, positions, kv_caches, meta):
        import torch.nn.functional as F

        ms, ops = self.ms, self.ops
        t, d = input_ids.shape[0], ms.head_dim
        x = self.embed[input_ids]
        res = None
        for lw, (kc, vc) in zip(self.layers, kv_caches):
            if res is None:
                res, hs = x, ops.rms_norm(x, lw["ln1"], ms.eps)
            else:
                hs, res = ops.fused_add_rms_norm(x, res, lw["ln1"], ms.eps)
            qkv = F.linear(hs, lw["qkv"])
            q = qkv[:, : ms.heads * d].view(t, ms.heads, d)
            k = qkv[:, ms.heads * d:(ms.heads + ms.kv_heads) * d].view(t, ms.kv_heads, d)
            v = qkv[:, (ms.heads + ms.kv_heads) * d:].view(t, ms.kv_heads, d)
            q, k = ops.rotary_embedding(positions, q, k, self.cos_sin)
            ops.write_kv(k, v, kc, vc, meta.slot_mapping)
            a = ops.paged_attention(q, kc, vc, meta, d ** -0.5)
            x = F.linear(a.reshape(t, ms.heads * d), lw["o"])
            hs, res = ops.fused_add_rms_norm(x, res, lw["ln2"], ms.eps)
            x = F.linear(ops.silu_and_mul(F.linear(hs, lw["gate_up"])), lw["down"])
        hs, _ = ops.fused_add_rms_norm(x, res, self.norm, ms.eps)
        return hs

    def compute_logits(self, hidden):
        import torch.nn.functional as F

        return F.linear(hidden, self.lm_head).float()


def bench_model_step(args, shapes, ops) -> dict:
    import torch

    dev = args.device
    dt = getattr(torch, shapes["dtype_name"])
    elt = torch.empty((), dtype=dt).element_size()
    ms: ModelShape = shapes["model"]
    b, ctx, bs = shapes["batch"], shapes["model_ctx"], shapes["bs"]
    impl = args.model_impl
    model = None
    if impl in ("auto", "zeroserve"):
        try:
            from zeroserve.services.worker.model import build_model

            model = build_model(_model_config(ms), dev, dt, ops, init="random")
            impl = "zeroserve"
        except ImportError as e:
            if impl == "zeroserve":
                raise
            print(f"  (zeroserve.services.worker.model unavailable: {e}; composing the step from the ops)")
    if model is None:
        impl = "composed"
        model = ComposedLlama(ms, ops, dev, dt, max_pos=max(ctx + 1, 4096))
    nb = b * math.ceil(ctx / bs) + 1
    kv_caches = [(torch.empty(nb, bs, ms.kv_heads, ms.head_dim, dtype=dt, device=dev).normal_(),
                  torch.empty(nb, bs, ms.kv_heads, ms.head_dim, dtype=dt, device=dev).normal_())
                 for _ in range(ms.layers)]
    _, _, _, meta = paged_batch([ctx] * b, [1] * b, 1, 1, 16, bs, dt, "cpu", seed=5,
                                num_blocks=nb)  # only the metadata is used
    from zeroserve.kernels.metadata import AttentionMetadata

    meta = AttentionMetadata(meta.slot_mapping.to(dev), meta.block_tables.to(dev),
                             meta.seq_lens.to(dev), meta.query_start_loc.to(dev),
                             meta.max_query_len, meta.max_seq_len)
    ids = torch.randint(0, ms.vocab, (b,), device=dev)
    pos = torch.full((b,), ctx - 1, dtype=torch.long, device=dev)

    @torch.inference_mode()
    def step():
        h = model(ids, pos, kv_caches, meta)
        return model.compute_logits(h)

    logits = step()
    assert logits.shape == (b, ms.vocab) and torch.isfinite(logits).all(), "bad logits"
    t = time_fn(step, dev, max(1, shapes["iters"] // 2), shapes["warmup"])
    w_bytes = ms.weight_bytes(elt)
    kv_bytes = 2 * ms.layers * b * ctx * ms.kv_heads * ms.head_dim * elt
    roof = (w_bytes + kv_bytes) / (args.bandwidth_gbs * 1e9)
    res = dict(impl=impl, ms=t * 1e3, roofline_ms=roof * 1e3, ratio=roof / t,
               tok_s=b / t, weight_gb=w_bytes / 1e9, kv_gb=kv_bytes / 1e9)
    print(f"\n== decode step, {impl} model: {ms.layers} layers hidden {ms.hidden}, B={b}, "
          f"ctx={ctx}, {shapes['dtype_name']} ==")
    print(f"  step {res['ms']:.3f} ms ({res['tok_s']:.0f} tok/s); roofline "
          f"{res['roofline_ms']:.3f} ms = ({res['weight_gb']:.2f} GB weights + "
          f"{res['kv_gb']:.2f} GB KV) / {args.bandwidth_gbs:.0f} GB/s; "
          f"roofline/actual = {res['ratio']:.2f}")
    return res


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        # the Triton kernels can only run in the interpreter here; must precede importing triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from zeroserve.kernels import torch_ops as ref

    shapes = setup_shapes(args)
    print(f"device={args.device} dry_run={args.dry_run} dtype={shapes['dtype_name']} "
          f"torch={torch.__version__}")
    if args.device == "cuda":
        print(f"gpu={torch.cuda.get_device_name()}")
    tri = None
    try:
        import triton  # noqa: F401  (only to know it is there)

        from zeroserve.kernels import triton_ops as tri
    except ImportError as e:
        print(f"triton unavailable ({e}): checking the torch twins only")
        tri = None
    ok = True
    if not args.skip_checks and tri is not None:
        ok = run_checks(args, shapes, tri, ref)
    if not args.skip_attention:
        bench_decode_attention(args, shapes, tri, ref)
    if not args.skip_model:
        # GPU: the Triton path; dry run: the twins (the CPU production path)
        ops = tri if (args.device == "cuda" and tri is not None) else ref
        bench_model_step(args, shapes, ops)
    print("\nRESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
