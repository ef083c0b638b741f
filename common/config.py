"""Engine arguments (vLLM's names), validated once at the boundary."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from common.errors import InvalidRequest

# auto = triton on CUDA, cpu elsewhere; cpu = the torch twins plus compiled CPU kernels where
# they build (kernels/cpu_ops.py); torch = the twins alone (the reference)
ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch")


@dataclass
class EngineArgs:
    model: str | None = None  # HF model directory; None = the built-in tiny model
    dtype: str = "auto"
    device: str = "cpu"
    attention_backend: str = "auto"  # auto | triton | cpu | torch (kernels/__init__.py)
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit capacity; else from the memory budget
    kv_cache_memory_bytes: int | None = None  # CPU budget (default 1 GiB)
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    enable_prefix_caching: bool = True
    seed: int = 0
    tp_size: int = 1
    max_queue_len: int = 4096  # admission control in the cluster scheduler

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequest:
            return InvalidRequest(f"engine args: {msg}")

        def pos_int(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(f"{name} must be a positive integer, got {v!r}")

        if self.block_size not in (16, 32, 48, 64, 80, 96, 112, 128, 256) or self.block_size % 16:
            raise bad(f"block_size must be a multiple of 16 (16..256), got {self.block_size!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tp_size", "max_queue_len"):
            pos_int(name)
        for name in ("num_kv_blocks", "kv_cache_memory_bytes", "max_model_len"):
            pos_int(name, allow_none=True)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise bad(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if not (isinstance(self.device, str) and (self.device in ("cpu", "cuda") or self.device.startswith("cuda:"))):
            raise bad(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise bad(f"seed must be a non-negative integer, got {self.seed!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs: Any) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in kwargs if k not in known)
        if unknown:
            raise InvalidRequest(f"engine args: unknown argument(s) {unknown}; known: {sorted(known)}")
        return cls(model=model, **kwargs)
