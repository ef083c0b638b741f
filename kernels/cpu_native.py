"""The CPU's compiled kernels: built from kernels/csrc with the system C compiler on first use.

Why built at run time: the kernels are compiled for the CPU they run on (``-march=native``),
and a machine without a compiler still serves through the torch twins. Each shared library is
cached under ``$ZEROSERVE_CACHE/kernels`` (default ``~/.cache/zeroserve``; the temp dir if that
is not writable) keyed by the source, the flags and the CPU, so each machine compiles once
(well under a second per library).

Four libraries, each loaded on its own first use, each with a reason when it could not be:
- csrc/paged_decode.c, decode attention: ``available()`` / ``unavailable_reason()``;
- csrc/qmatmul.c, quantized matmuls (kernels/quant.py): ``quant_lib()`` / ``quant_unavailable_reason()``;
- csrc/cpu_ops.c, the per-layer small ops (kernels/cpu_ops.py): ``ops_lib()`` / ``ops_unavailable_reason()``;
- csrc/decode_step.c, a packed model's whole decode forward (services/worker/model/cpu_step.py):
  ``step_lib()``;
- csrc/lora.c, LoRA deltas of a mixed-adapter batch (kernels/lora.py): ``lora_lib()``.

``ZEROSERVE_CPU_NATIVE=0`` turns all of them off. ``ZEROSERVE_CPU_ARCH`` (default ``native``)
is the ``-march`` they are built for: ``ZEROSERVE_CPU_ARCH=x86-64-v3`` builds and runs the AVX2
path (no AVX-512, no native bf16) on an AVX-512 machine, so one machine tests both paths
(`.ci/run` runs the exactness tests that way too); `native_bf16()` then asks the compiler
whether that target has bf16 instructions.
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
from collections.abc import Callable
from pathlib import Path

import torch

from zeroserve.common.log import get_logger

log = get_logger("zeroserve.kernels.cpu_native")

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "paged_decode.c"


def _march() -> str:
    """The -march the kernels are built for: the CPU's own, or ZEROSERVE_CPU_ARCH's target."""
    return "-march=" + (os.environ.get("ZEROSERVE_CPU_ARCH", "").strip() or "native")


# -fassociative-math lets the dot products vectorize; no -ffinite-math-only (-FLT_MAX/exp of
# large negatives must behave)
CFLAGS = ["-O3", _march(), "-fopenmp", "-fPIC", "-shared", "-std=c11", "-fno-math-errno",
          "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
QUANT_SOURCE = CSRC / "qmatmul.c"
# no reassociation and no implicit FMA contraction: the summation order is the one written in
# the source (thread- and batch-invariant) and decoded weights match the torch twin exactly
QUANT_CFLAGS = ["-O3", _march(), "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-fno-math-errno",
                "-ffp-contract=off"]
OPS_SOURCE = CSRC / "cpu_ops.c"
# the same reason (the twins' roundings, operation by operation); no trapping math lets SiLU's
# clamped exp vectorize (selects), which moves no value
OPS_CFLAGS = QUANT_CFLAGS + ["-fno-trapping-math"]
STEP_SOURCE = CSRC / "decode_step.c"  # includes cpu_ops.c: built with its flags
LORA_SOURCE = CSRC / "lora.c"  # the written summation order too (batch-invariant rows): the ops' flags

_lock = threading.Lock()


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


CPUINFO = "/proc/cpuinfo"


def _cpuinfo(prefixes: tuple[str, ...]) -> list[str]:
    """The /proc/cpuinfo lines that start with one of `prefixes` (none where it cannot be read)."""
    try:
        with open(CPUINFO) as f:
            return [line for line in f if line.startswith(prefixes)]
    except OSError:
        return []


def _cpu_id() -> str:
    """What -march=native depends on: the machine and its CPU flags."""
    return platform.machine() + "".join(_cpuinfo(("flags", "Features", "model name")))


# bf16 in the instruction set: AVX-512 BF16 / AMX on x86, ARMv8.6's BF16 on aarch64
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the kernel lists them (x86 ``flags``, aarch64 ``Features``)."""
    out: set[str] = set()
    for line in _cpuinfo(("flags", "Features")):
        out.update(line.partition(":")[2].split())
    return out


def cpu_model() -> str:
    """The CPU's model name (``lscpu``'s), or the machine type where cpuinfo has none."""
    lines = _cpuinfo(("model name",))
    return lines[0].partition(":")[2].strip() if lines else platform.machine()


def native_bf16() -> bool:
    """Whether this CPU computes in bf16 itself (else torch emulates it through fp32); under a
    ZEROSERVE_CPU_ARCH target, whether that target has bf16 instructions (and the CPU too)."""
    if not cpu_flags() & NATIVE_BF16_FLAGS:
        return False
    return _march() == "-march=native" or _target_has_bf16(_march())


_TARGET_BF16: dict[str, bool] = {}


def _target_has_bf16(march: str) -> bool:
    """Whether the compiler's `march` target defines bf16 instructions (AVX512BF16, AMX-BF16 or
    ARM's BF16): the kernels' own #if decides the path by the same macros."""
    if march not in _TARGET_BF16:
        cc = _find_cc()
        out = "" if cc is None else subprocess.run([cc, march, "-dM", "-E", "-x", "c", "/dev/null"],
                                                   capture_output=True, text=True, timeout=60).stdout
        _TARGET_BF16[march] = any(m in out for m in ("__AVX512BF16__", "__AMX_BF16__", "__ARM_FEATURE_BF16"))
    return _TARGET_BF16[march]


def _build(cc: str, source: Path = SOURCE, cflags: list[str] = CFLAGS) -> Path:
    # every file of csrc/ in the key: a source may #include another
    src = source.read_bytes() + b"".join(p.read_bytes() for p in sorted(CSRC.glob("*.[ch]")))
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


class _Native:
    """One compiled library: built and bound on first `get()`, or None with `reason` saying why."""

    def __init__(self, source: Path, cflags: list[str], bind: Callable[[ctypes.CDLL], ctypes.CDLL],
                 fallback: str) -> None:
        self.source, self.cflags, self.bind, self.fallback = source, cflags, bind, fallback
        self.lib: ctypes.CDLL | None = None
        self.reason: str | None = None
        self.loaded = False

    def get(self) -> ctypes.CDLL | None:
        if not self.loaded:  # the hot path (every layer of every step): no lock once loaded
            with _lock:
                if not self.loaded:
                    self._load()
                    self.loaded = True
        return self.lib

    def _load(self) -> None:
        if _turned_off():
            self.reason = "turned off by ZEROSERVE_CPU_NATIVE=0"
            return
        try:
            cc = _find_cc()
            if cc is None:
                raise RuntimeError("no C compiler found (install gcc, or set CC)")
            path = _build(cc, self.source, self.cflags)
            self.lib = self.bind(ctypes.CDLL(str(path)))
        except Exception as e:  # noqa: BLE001 (any failure: serve through the twin, say why)
            self.reason = f"{type(e).__name__}: {e}"
            log.warning(f"compiled {self.source.name} unavailable; {self.fallback}", reason=self.reason)
            return
        log.debug("compiled CPU kernels loaded", path=str(path))


P, I, I64, F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


def _bind_decode(lib: ctypes.CDLL) -> ctypes.CDLL:
    f = lib.zs_paged_decode_f32
    f.restype = I
    f.argtypes = [P, P, P, P, I64, P, P, I, I, I, I, I, F32, I]
    f = lib.zs_paged_decode_window_f32
    f.restype = I
    f.argtypes = [P, P, P, P, I64, P, P, I, I, I, I, I, F32, I, I, F32]
    mg, md = ctypes.c_int(), ctypes.c_int()
    lib.zs_limits(ctypes.byref(mg), ctypes.byref(md))
    lib.max_group, lib.max_dim = mg.value, md.value
    return lib


def bind_quant(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare qmatmul.c's entry points on a loaded library (tests load other builds too)."""
    for name in ("zs_qmatmul_f32", "zs_qmatmul_bf16"):  # the bf16 regime: csrc/qmatmul_bf16.c
        f = getattr(lib, name)
        f.restype = I
        f.argtypes = [I, P, I64, P, P, I64, I, P, I64, P, I64, I, I, I, I]
    g = lib.zs_dequantize_f32
    g.restype = I
    g.argtypes = [I, P, I64, P, P, I64, I, P, I64, I, I, I]
    lib.zs_qm_isa.restype = I
    lib.isa = {2: "avx512", 1: "avx2"}.get(lib.zs_qm_isa(), "portable")
    lib.zs_qm_bf16_native.restype = I
    lib.bf16_native = bool(lib.zs_qm_bf16_native())  # VDPBF16PS, else rounded values through the fp32 GEMM
    lib.zs_qm_gemm_rows.restype = I
    lib.gemm_rows = lib.zs_qm_gemm_rows()  # from this many rows of x: dequantized panels + float GEMM
    return lib


def _bind_ops(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, args in (
        ("zs_add_rms_norm_f32", [P, I64, P, I64, P, P, I64, P, I64, I, I, F32, I]),
        ("zs_rope_f32", [P, P, I64, I64, I, P, I64, I64, I, I, P, I, I64, P, P, I, I]),
        ("zs_silu_and_mul_f32", [P, I64, P, I64, I, I, I]),
        ("zs_write_kv_f32", [P, I64, I64, P, I64, I64, P, P, P, I64, I, I, I]),
        ("zs_apply_token_bitmask_f32", [P, I64, P, P, I64, I, I, P, I]),
    ):
        f = getattr(lib, name)
        f.restype, f.argtypes = I, args
    return lib


_DECODE = _Native(SOURCE, CFLAGS, _bind_decode, "decode attention uses the torch twin")
_QUANT = _Native(QUANT_SOURCE, QUANT_CFLAGS, bind_quant, "quantized linears use the torch twin")
_OPS = _Native(OPS_SOURCE, OPS_CFLAGS, _bind_ops, "norms, rotary and the KV write use the torch twins")


def _bind_step(lib: ctypes.CDLL) -> ctypes.CDLL:
    f = lib.zs_decode_step_f32
    f.restype, f.argtypes = I, [P, P, P, P, P, P, P, I64, P, I, I, P]
    return lib


_STEP = _Native(STEP_SOURCE, OPS_CFLAGS, _bind_step, "decode steps run layer by layer from Python")


def _bind_lora(lib: ctypes.CDLL) -> ctypes.CDLL:
    f = lib.zs_lora_f32
    f.restype, f.argtypes = I, [P, I64, P, I64, P, P, P, P, P, I, I, I, I, I, I, I]
    return lib


_LORA = _Native(LORA_SOURCE, OPS_CFLAGS, _bind_lora, "LoRA deltas use the torch twin")


def lora_lib() -> ctypes.CDLL | None:
    """The compiled csrc/lora.c (``zs_lora_f32``), or None."""
    return _LORA.get()


def available() -> bool:
    return _DECODE.get() is not None


def unavailable_reason() -> str | None:
    _DECODE.get()
    return _DECODE.reason


def decode_lib() -> ctypes.CDLL | None:
    """The compiled csrc/paged_decode.c (``zs_paged_decode_f32``), or None."""
    return _DECODE.get()


def step_lib() -> ctypes.CDLL | None:
    """The compiled csrc/decode_step.c (``zs_decode_step_f32``), or None."""
    return _STEP.get()


def quant_lib() -> ctypes.CDLL | None:
    """The compiled csrc/qmatmul.c (``zs_qmatmul_f32``; ``.isa`` says which path it took), or None."""
    return _QUANT.get()


def quant_unavailable_reason() -> str | None:
    _QUANT.get()
    return _QUANT.reason


def ops_lib() -> ctypes.CDLL | None:
    """The compiled csrc/cpu_ops.c (norms, rotary, SiLU-and-mul, KV write), or None."""
    return _OPS.get()


def ops_unavailable_reason() -> str | None:
    _OPS.get()
    return _OPS.reason


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the compiled decode kernel takes these tensors (fp32 on CPU, shapes in limits)."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or k_cache.dtype != torch.float32:
        return False
    lib = _DECODE.get()
    if lib is None:
        return False
    hq, d = q.shape[-2], q.shape[-1]
    hk = k_cache.shape[2]
    return hq % hk == 0 and hq // hk <= lib.max_group and d <= lib.max_dim


def paged_decode(
    q: torch.Tensor,  # [B, Hq, D] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D] fp32
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention read in place from the paged cache; returns [B, Hq, D] fp32.
    `sliding_window`: each request reads only its last `sliding_window` keys; `softcap`: scores
    become softcap * tanh(score / softcap) (as the torch twin's).

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
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(), bt.stride(0), sl.data_ptr(),
            out.data_ptr(), b, hq, hk, d, bs, float(scale), torch.get_num_threads())
    if sliding_window or softcap:
        rc = _DECODE.lib.zs_paged_decode_window_f32(*args, int(sliding_window or 0), float(softcap or 0.0))
    else:
        rc = _DECODE.lib.zs_paged_decode_f32(*args)
    if rc != 0:
        raise ValueError(f"paged_decode: shapes outside the compiled limits (Hq={hq}, Hk={hk}, D={d})")
    return out
