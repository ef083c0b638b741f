"""The CPU's compiled kernels: built from kernels/csrc with the system C compiler on first use.

Why built at run time: the kernels are compiled for the CPU they run on (``-march=native``),
and a machine without a compiler still serves through the torch twins. The shared library is
cached under ``$ZEROSERVE_CACHE/kernels`` (default ``~/.cache/zeroserve``; the temp dir if that
is not writable) keyed by the source,
the flags and the CPU, so each machine compiles once (well under a second).

``ZEROSERVE_CPU_NATIVE=0`` turns the compiled kernels off; ``available()`` says whether they
loaded and, if not, ``unavailable_reason()`` says why. The quantized matmul kernels
(csrc/qmatmul.c, used by kernels/quant.py) are a second library loaded on their own first use:
``quant_lib()`` returns it or None, ``quant_unavailable_reason()`` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from common.log import get_logger

log = get_logger("kernels.cpu_native")

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
# -fassociative-math lets the dot products vectorize; no -ffinite-math-only (-FLT_MAX/exp of
# large negatives must behave)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-fno-math-errno",
          "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
QUANT_SOURCE = Path(__file__).parent / "csrc" / "qmatmul.c"
# no reassociation and no implicit FMA contraction: the summation order is the one written in
# the source (thread- and batch-invariant) and decoded weights match the torch twin exactly
QUANT_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-fno-math-errno",
                "-ffp-contract=off"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None
_loaded = False
_qlib: ctypes.CDLL | None = None
_qreason: str | None = None
_qloaded = False


def _cache_dir() -> Path:
    root = os.environ.get("ZEROSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "zeroserve")
    d = Path(root) / "kernels"
    try:
        d.mkdir(parents=True, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"zeroserve-kernels-{os.getuid()}"


def _cpu_id() -> str:
    """What -march=native depends on: the machine and its CPU flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    flags += line
    except OSError:
        pass
    return platform.machine() + flags


def _build(cc: str, source: Path = SOURCE, cflags: list[str] = CFLAGS) -> Path:
    src = source.read_bytes()
    key = hashlib.sha256(src + " ".join([cc, *cflags]).encode() + _cpu_id().encode()).hexdigest()[:16]
    out = _cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # compile to a private name, then rename: processes starting together never load a half file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *cflags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _turned_off() -> bool:
    return os.environ.get("ZEROSERVE_CPU_NATIVE", "1").lower() in ("0", "false", "no", "off")


def _find_cc() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _load() -> None:
    global _lib, _reason, _loaded
    if _loaded:  # the hot path (every layer of every step): no lock once loaded
        return
    with _lock:
        if _loaded:
            return
        _loaded = True
        if _turned_off():
            _reason = "turned off by ZEROSERVE_CPU_NATIVE=0"
            return
        cc = _find_cc()
        if cc is None:
            _reason = "no C compiler found (install gcc, or set CC)"
            log.warning("compiled CPU kernels unavailable; decode attention uses the torch twin", reason=_reason)
            return
        try:
            path = _build(cc)
            lib = ctypes.CDLL(str(path))
        except Exception as e:  # noqa: BLE001 (any failure: serve through the twin, say why)
            _reason = f"{type(e).__name__}: {e}"
            log.warning("compiled CPU kernels unavailable; decode attention uses the torch twin", reason=_reason)
            return
        f = lib.zs_paged_decode_f32
        f.restype = ctypes.c_int
        p = ctypes.c_void_p
        i = ctypes.c_int
        f.argtypes = [p, p, p, p, ctypes.c_int64, p, p, i, i, i, i, i, ctypes.c_float, i]
        mg, md = ctypes.c_int(), ctypes.c_int()
        lib.zs_limits(ctypes.byref(mg), ctypes.byref(md))
        lib.max_group, lib.max_dim = mg.value, md.value
        _lib = lib
        log.debug("compiled CPU kernels loaded", path=str(path))


def available() -> bool:
    _load()
    return _lib is not None


def unavailable_reason() -> str | None:
    _load()
    return _reason


def _load_quant() -> None:
    global _qlib, _qreason, _qloaded
    if _qloaded:
        return
    with _lock:
        if _qloaded:
            return
        _qloaded = True
        if _turned_off():
            _qreason = "turned off by ZEROSERVE_CPU_NATIVE=0"
            return
        cc = _find_cc()
        try:
            if cc is None:
                raise RuntimeError("no C compiler found (install gcc, or set CC)")
            path = _build(cc, QUANT_SOURCE, QUANT_CFLAGS)
            lib = ctypes.CDLL(str(path))
        except Exception as e:  # noqa: BLE001 (any failure: serve through the twin, say why)
            _qreason = f"{type(e).__name__}: {e}"
            log.warning("compiled quantized matmul unavailable; quantized linears use the torch twin", reason=_qreason)
            return
        _qlib = bind_quant(lib)
        log.debug("compiled quantized matmul loaded", path=str(path), isa=_qlib.isa)


def bind_quant(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare qmatmul.c's entry points on a loaded library (tests load other builds too)."""
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    f = lib.zs_qmatmul_f32
    f.restype = i
    f.argtypes = [i, p, i64, p, p, i64, i, p, i64, p, i64, i, i, i, i]
    lib.zs_qm_isa.restype = i
    lib.isa = {2: "avx512", 1: "avx2"}.get(lib.zs_qm_isa(), "portable")
    return lib


def quant_lib() -> ctypes.CDLL | None:
    """The compiled csrc/qmatmul.c (``zs_qmatmul_f32``; ``.isa`` says which path it took), or None."""
    _load_quant()
    return _qlib


def quant_unavailable_reason() -> str | None:
    _load_quant()
    return _qreason


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the compiled decode kernel takes these tensors (fp32 on CPU, shapes in limits)."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or k_cache.dtype != torch.float32:
        return False
    if not available():
        return False
    hq, d = q.shape[-2], q.shape[-1]
    hk = k_cache.shape[2]
    return hq % hk == 0 and hq // hk <= _lib.max_group and d <= _lib.max_dim


def paged_decode(
    q: torch.Tensor,  # [B, Hq, D] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D] fp32
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:
    """Decode attention read in place from the paged cache; returns [B, Hq, D] fp32.

    Call ``supports`` first. Entries of block_tables past a request's length are never read."""
    b, hq, d = q.shape
    _, bs, hk, _ = k_cache.shape
    q = q.contiguous()
    bt = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    bt = bt.contiguous()
    sl = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    sl = sl.contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the paged KV cache must be contiguous")
    out = torch.empty_like(q)
    rc = _lib.zs_paged_decode_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(),
                                  bt.stride(0), sl.data_ptr(), out.data_ptr(), b, hq, hk, d, bs, float(scale),
                                  torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"paged_decode: shapes outside the compiled limits (Hq={hq}, Hk={hk}, D={d})")
    return out
