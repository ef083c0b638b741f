"""Weight-only quantized linears for CPU: packed weights, a compiled matmul that reads them, and
the torch twin (dequantize-then-matmul).

A ``QuantizedWeight`` holds one [N_out, K_in] weight in a named format:

=======  =====================================================  ==================  ==========
format   layout (per row of the weight)                          value               bytes/wt
=======  =====================================================  ==================  ==========
q8_0     GGUF Q8_0 blocks of 32: fp16 d, int8 q[32]              d*q                 1.0625
q4_0     GGUF Q4_0 blocks of 32: fp16 d, 16 B nibbles            d*(q-8)             0.5625
q4_1     GGUF Q4_1 blocks of 32: fp16 d, fp16 m, 16 B nibbles    d*q + m             0.625
q4_k     GGUF Q4_K super-blocks of 256 (d, dmin, 12 B of 6-bit   (d*sc)*q - dmin*mn  0.5625
         scales/mins, 128 B nibbles)
int8     int8 q[K] + fp32 scale per group (symmetric)            s*q                 1 + 4/g
int4     nibbles (packed like q4_1 per 32) + fp32 scale and min  s*q + m             0.5 + 8/g
         per group (asymmetric)
f32      a plain fp32 weight, its bytes (``from_float``: a view)  w                   4
bf16     a plain weight held in bf16                             w                   2
=======  =====================================================  ==================  ==========

Why plain formats: every CPU linear goes through the compiled kernel, whose per-row arithmetic
does not depend on the batch (torch's fp32 GEMM gives row 0 of a 1-row call other bits than of
a 4-row one), so a float model is batch-invariant as a quantized one is.

In a 32-element block of q4_0/q4_1/int4, element i < 16 is the low nibble of byte i and
element 16 + i its high nibble (llama.cpp's order). GGUF formats are read byte for byte as
llama.cpp writes them (``from_gguf``); int8/int4 come from float weights (``quantize_int8``,
``quantize_int4``; K must be a multiple of 32, the group size a power of two >= 32, the last
group may be shorter).

Numerics: ``linear`` runs kernels/csrc/qmatmul.c when it is built (x, accumulation and the
output fp32) and the twin ``F.linear(x, dequantize())`` otherwise. ``dequantize()`` gives the
exact values of the format (equal to gguf.quants.dequantize). The kernel multiplies those exact
values and sums them over K in a fixed vector-lane order; the twin lets BLAS choose the order.
So the two agree to fp32 rounding (|diff| ~ 1e-6 of sum|x*w| for K ~ 1e3), not bit for bit. The
kernel's result for a row of x does not depend on T, the other rows, the thread count or a row
slice (``rows``), at any T; it does depend on the build (AVX-512 vs AVX2 vs portable).
"""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from zeroserve.kernels import cpu_native

# format -> (kernel id, elements per block, bytes per block); int formats: bytes per 32 values
_FORMATS = {
    "q8_0": (0, 32, 34),
    "q4_0": (1, 32, 18),
    "q4_1": (2, 32, 20),
    "q4_k": (3, 256, 144),
    "int8": (4, 32, 32),
    "int4": (5, 32, 16),
    "f32": (6, 32, 128),
    "bf16": (7, 32, 64),
}
FORMATS = tuple(_FORMATS)
# GGMLQuantizationType values (ggml.h) of the GGUF types we read
GGML_TYPES = {8: "q8_0", 2: "q4_0", 3: "q4_1", 12: "q4_k"}
_GGML_NAMES = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q4_K": 12}


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A packed [N, K] weight. ``data`` is uint8 [N, bytes per row] (may be a column-sliced view);
    ``scales``/``mins`` are fp32 [N, groups] for int8/int4 (mins: int4 only), None otherwise."""

    format: str
    shape: tuple[int, int]
    data: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    group_size: int = 32

    def __post_init__(self):
        if self.format not in _FORMATS:
            raise ValueError(f"unknown format {self.format!r}; one of {FORMATS}")
        n, k = self.shape
        _, block, _ = _FORMATS[self.format]
        if k % block or self.group_size < 32 or self.group_size & (self.group_size - 1):
            raise ValueError(f"{self.format}: K={k} must be a multiple of {block} (group {self.group_size})")
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape != (n, self.row_bytes):
            raise ValueError(f"{self.format}: data must be uint8 [{n}, {self.row_bytes}], got "
                             f"{self.data.dtype} {tuple(self.data.shape)}")
        if self.data.stride(1) != 1:
            raise ValueError("data rows must be contiguous bytes")
        if self.format in ("int8", "int4"):
            groups = -(-k // self.group_size)
            for name in ("scales", "mins") if self.format == "int4" else ("scales",):
                t = getattr(self, name)
                if t is None or t.dtype != torch.float32 or t.shape != (n, groups) or t.stride(1) != 1:
                    raise ValueError(f"{self.format}: {name} must be float32 [{n}, {groups}] with unit column stride")
            if self.mins is not None and self.mins.stride(0) != self.scales.stride(0):
                raise ValueError("scales and mins must share a row stride")
        # the kernel's per-weight arguments, built once: a decode step makes hundreds of calls
        sc, mn = self.scales, self.mins
        object.__setattr__(self, "_kargs", (
            _FORMATS[self.format][0], self.data.data_ptr(), self.data.stride(0),
            sc.data_ptr() if sc is not None else None, mn.data_ptr() if mn is not None else None,
            sc.stride(0) if sc is not None else 0, self.group_size))

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, raw, ggml_type, shape) -> "QuantizedWeight":
        """From a GGUF tensor's raw data. ``ggml_type``: a GGMLQuantizationType, its int value or
        name ("Q4_K"); ``shape``: (N, K) in torch order (GGUF lists it reversed, as ne = [K, N]).
        ``raw``: bytes, a numpy array (e.g. GGUFReader's memmap) or a uint8 tensor; not copied
        when it is already contiguous."""
        code = _GGML_NAMES.get(ggml_type.upper(), -1) if isinstance(ggml_type, str) else int(ggml_type)
        if code not in GGML_TYPES:
            raise ValueError(f"GGML type {ggml_type!r} is not one of {sorted(_GGML_NAMES)}")
        fmt = GGML_TYPES[code]
        n, k = (int(s) for s in shape)
        _, block, nbytes = _FORMATS[fmt]
        if k % block:
            raise ValueError(f"{fmt}: K={k} is not a multiple of the block size {block}")
        data = _as_bytes(raw)
        row = k // block * nbytes
        if data.numel() != n * row:
            raise ValueError(f"{fmt} [{n}, {k}] needs {n * row} bytes, got {data.numel()}")
        return cls(fmt, (n, k), data.reshape(n, row), group_size=block)

    @classmethod
    def from_float(cls, w: torch.Tensor, fmt: str = "f32") -> "QuantizedWeight":
        """A plain float weight [N, K] (K a multiple of 32) as "f32" (its own bytes when it is a
        contiguous fp32 CPU tensor: no copy, so it must outlive this object and not change) or
        "bf16" (a rounded copy)."""
        if fmt not in ("f32", "bf16") or w.dim() != 2:
            raise ValueError(f"from_float takes a 2-D weight and 'f32' or 'bf16', got {tuple(w.shape)} {fmt!r}")
        t = w.detach().to(torch.float32 if fmt == "f32" else torch.bfloat16).contiguous()
        return cls(fmt, tuple(t.shape), t.view(torch.uint8))

    # --- geometry -----------------------------------------------------------------------------

    @property
    def row_bytes(self) -> int:
        _, block, nbytes = _FORMATS[self.format]
        return self.shape[1] // block * nbytes

    @property
    def block_size(self) -> int:
        """Column slicing granularity: the GGUF block or the int group."""
        return self.group_size if self.format in ("int8", "int4") else _FORMATS[self.format][1]

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads for the weight (packed data + scales + mins)."""
        extra = sum(t.numel() * 4 for t in (self.scales, self.mins) if t is not None)
        return self.shape[0] * self.row_bytes + extra

    def rows(self, start: int, end: int) -> "QuantizedWeight":
        """Output rows [start, end) (column-parallel TP shard): views, no copy."""
        n, k = self.shape
        if not 0 <= start <= end <= n:
            raise ValueError(f"rows [{start}, {end}) outside [0, {n})")
        sl = slice(start, end)
        return replace(self, shape=(end - start, k), data=self.data[sl],
                       scales=None if self.scales is None else self.scales[sl],
                       mins=None if self.mins is None else self.mins[sl])

    def select_rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """Rows ``index`` in that order (a copy), e.g. to undo llama.cpp's per-head q/k permutation."""
        index = torch.as_tensor(index, dtype=torch.int64)

        def pick(t):
            return None if t is None else t.index_select(0, index).contiguous()

        return replace(self, shape=(index.numel(), self.shape[1]), data=pick(self.data),
                       scales=pick(self.scales), mins=pick(self.mins))

    @classmethod
    def cat(cls, parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Rows of ``parts`` stacked (a copy): fused q/k/v or gate/up projections."""
        first = parts[0]
        for p in parts[1:]:
            if (p.format, p.shape[1], p.group_size) != (first.format, first.shape[1], first.group_size):
                raise ValueError(f"cannot stack {p!r} under {first!r}")

        def cat(name):
            return None if getattr(first, name) is None else torch.cat([getattr(p, name) for p in parts])

        return replace(first, shape=(sum(p.shape[0] for p in parts), first.shape[1]), data=cat("data"),
                       scales=cat("scales"), mins=cat("mins"))

    def cols(self, start: int, end: int) -> "QuantizedWeight":
        """Input columns [start, end) (row-parallel TP shard): views, no copy. Both ends must sit
        on a block/group boundary (``end`` may also be K)."""
        n, k = self.shape
        b = self.block_size
        if not (0 <= start < end <= k and start % b == 0 and (end % b == 0 or end == k)):
            raise ValueError(f"cols [{start}, {end}) must lie in [0, {k}] on multiples of {b}")
        if self.format in ("int8", "int4"):
            per = 1 if self.format == "int8" else 2
            g = slice(start // b, -(-end // b))
            return replace(self, shape=(n, end - start), data=self.data[:, start // per:end // per],
                           scales=self.scales[:, g], mins=None if self.mins is None else self.mins[:, g])
        nbytes = _FORMATS[self.format][2]
        return replace(self, shape=(n, end - start), data=self.data[:, start // b * nbytes:end // b * nbytes])

    def to(self, device=None) -> "QuantizedWeight":
        """A copy that owns its memory: contiguous data/scales/mins on ``device`` (default: where
        they are). Keeps a shard from pinning the whole tensor (or a file's memory map) it was
        cut from."""
        def own(t):
            return None if t is None else t.to(device or t.device, copy=True, memory_format=torch.contiguous_format)

        return replace(self, data=own(self.data), scales=own(self.scales), mins=own(self.mins))

    # --- numerics -----------------------------------------------------------------------------

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as float [N, K]: the format's exact values (compiled for CPU tensors when
        the kernels are built, else the torch twin; the two are equal bit for bit)."""
        lib = cpu_native.quant_lib() if self.data.is_cpu else None
        if lib is None:
            return self.dequantize_twin(dtype)
        n, k = self.shape
        out = torch.empty((n, k), dtype=torch.float32)
        if n and k and lib.zs_dequantize_f32(*self._kargs, out.data_ptr(), k, n, k, torch.get_num_threads()) != 0:
            raise ValueError(f"dequantize rejected {self!r}")
        return out if dtype == torch.float32 else out.to(dtype)

    def dequantize_twin(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as float [N, K] in torch ops: the reference for the compiled kernels."""
        n, k = self.shape
        fmt, d = self.format, self.data
        if fmt in ("f32", "bf16"):
            return d.contiguous().view(torch.float32 if fmt == "f32" else torch.bfloat16).to(dtype)
        if fmt in ("int8", "int4"):
            if fmt == "int8":
                q = d.contiguous().view(torch.int8).float()
            else:
                q = _nibbles(d.contiguous().reshape(n, k // 32, 16)).reshape(n, k).float()
            s = self.scales.repeat_interleave(self.group_size, dim=1)[:, :k]
            w = q * s
            if fmt == "int4":
                w = w + self.mins.repeat_interleave(self.group_size, dim=1)[:, :k]
            return w.to(dtype)
        _, block, nbytes = _FORMATS[fmt]
        b = d.contiguous().reshape(n, k // block, nbytes)
        if fmt == "q8_0":
            w = _f16(b[..., 0:2]) * b[..., 2:].contiguous().view(torch.int8).float()
        elif fmt == "q4_0":
            w = _f16(b[..., 0:2]) * (_nibbles(b[..., 2:]).to(torch.int8) - 8).float()
        elif fmt == "q4_1":
            w = _f16(b[..., 0:2]) * _nibbles(b[..., 4:]).float() + _f16(b[..., 2:4])
        else:  # q4_k
            sc, mn = _q4k_scale_min(b[..., 4:16])  # [n, blocks, 8]
            qs = b[..., 16:].reshape(n, k // 256, 4, 32)
            q = torch.stack([qs & 15, qs >> 4], dim=3).reshape(n, k // 256, 8, 32).float()
            dd = (_f16(b[..., 0:2]) * sc).unsqueeze(-1)
            dm = (_f16(b[..., 2:4]) * mn).unsqueeze(-1)
            w = dd * q - dm
        return w.reshape(n, k).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] (x @ W.T + bias): the compiled kernel for CPU tensors when it is
        built, else the twin. Computes in fp32; returns x's dtype."""
        lib = cpu_native.quant_lib() if x.is_cpu else None
        if lib is None:
            return F.linear(x, self.dequantize(x.dtype).to(x.device), bias)
        return self._on_kernel(lib, x, bias, bf16=False)

    def linear_bf16(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias) in the bf16 regime: x and the dequantized W rounded to bf16, the
        products summed in fp32, the result fp32 (x's dtype back); the compiled kernel
        (csrc/qmatmul_bf16.c) on CPU, else `linear_bf16_twin`. The bias is added in fp32."""
        lib = cpu_native.quant_lib() if x.is_cpu else None
        if lib is None:
            return self.linear_bf16_twin(x, bias)
        return self._on_kernel(lib, x, bias, bf16=True)

    def _on_kernel(self, lib: ctypes.CDLL, x: torch.Tensor, bias: torch.Tensor | None, bf16: bool) -> torch.Tensor:
        """kernel_linear in fp32 for any x dtype, the bias added in fp32, x's dtype back."""
        y = kernel_linear(lib, self, x if x.dtype == torch.float32 else x.float(), bf16=bf16)
        if bias is not None:
            y += bias.float()
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def linear_bf16_twin(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """What `linear_bf16` computes, in torch: both operands rounded to bf16, an fp32 matmul
        (the products are exact in fp32; only the summation order differs)."""
        w = self.dequantize(torch.float32).to(x.device).to(torch.bfloat16).float()
        y = F.linear(x.to(torch.bfloat16).float(), w)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)

    def __repr__(self) -> str:
        g = f", group {self.group_size}" if self.format in ("int8", "int4") else ""
        return f"QuantizedWeight({self.format}, {list(self.shape)}{g}, {self.nbytes / 2**20:.2f} MiB)"


def kernel_linear(lib: ctypes.CDLL, w: QuantizedWeight, x: torch.Tensor, threads: int | None = None,
                  bf16: bool = False) -> torch.Tensor:
    """y = x @ W.T through a loaded qmatmul library (``cpu_native.quant_lib()``); x fp32 on CPU.
    `bf16`: in the bf16 regime (x and W rounded to bf16, fp32 sums: csrc/qmatmul_bf16.c)."""
    n, k = w.shape
    if x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(f"the kernel takes fp32 CPU inputs, got {x.dtype} on {x.device}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {k}")
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    t = x2.shape[0]
    ldx = x2.stride(0) if t > 1 else k
    if x2.stride(1) != 1 or ldx < k:
        x2, ldx = x2.contiguous(), k
    y = torch.empty((t, n), dtype=torch.float32)
    fn = lib.zs_qmatmul_bf16 if bf16 else lib.zs_qmatmul_f32
    rc = fn(*w._kargs, x2.data_ptr(), ldx, y.data_ptr(), n, t, n, k, threads or torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"qmatmul rejected {w!r} (rc {rc})")
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)


# --- quantizing float weights --------------------------------------------------------------------


def _grouped(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """w [N, K] float -> [N, groups, group_size] fp32, the last group padded with its row's last
    value (padding must not widen a group's range)."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    if k % 32 or group_size < 32 or group_size & (group_size - 1):
        raise ValueError(f"K={k} must be a multiple of 32 and group_size={group_size} a power of two >= 32")
    w = w.detach().float().cpu()
    pad = -k % group_size
    if pad:
        w = torch.cat([w, w[:, -1:].expand(n, pad)], dim=1)
    return w.reshape(n, -1, group_size), k


def quantize_int8(w: torch.Tensor, group_size: int = 128) -> QuantizedWeight:
    """Symmetric int8 per group of ``group_size`` input columns: s = max|w| / 127,
    q = round(w / s) in [-127, 127]. Error <= s / 2 per weight."""
    g, k = _grouped(w, group_size)
    s = g.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, 1)), 0).clamp(-127, 127)
    q = q.to(torch.int8).reshape(w.shape[0], -1)[:, :k].contiguous()
    return QuantizedWeight("int8", (w.shape[0], k), q.view(torch.uint8), scales=s.squeeze(-1).contiguous(),
                           group_size=group_size)


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Asymmetric int4 per group: m = min, s = (max - min) / 15, q = round((w - m) / s) in
    [0, 15], value s*q + m (exact at the group's min). Error <= s / 2 per weight."""
    g, k = _grouped(w, group_size)
    n = w.shape[0]
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    s = (hi - lo) / 15
    q = torch.where(s > 0, torch.round((g - lo) / torch.where(s > 0, s, 1)), 0).clamp(0, 15)
    q = q.to(torch.uint8).reshape(n, -1)[:, :k].reshape(n, k // 32, 2, 16)
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    return QuantizedWeight("int4", (n, k), packed, scales=s.squeeze(-1).contiguous(),
                           mins=lo.squeeze(-1).contiguous(), group_size=group_size)


# --- helpers -------------------------------------------------------------------------------------


def _as_bytes(raw) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        t = raw if raw.dtype == torch.uint8 else raw.contiguous().view(torch.uint8)
        return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    a = np.ascontiguousarray(raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, dtype=np.uint8))
    a = a.reshape(-1).view(np.uint8)
    with warnings.catch_warnings():  # read-only memmaps are fine: the weight is never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian fp16 bytes -> fp32 [...,1] (exact)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] uint8: low nibbles (elements 0..15), then high (16..31)."""
    return torch.cat([b & 15, b >> 4], dim=-1)


def _q4k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes [..., 12] -> 6-bit scales and mins [..., 8] as fp32."""
    s = s.to(torch.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 6) << 4)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], dim=-1)
    return sc.float(), mn.float()
