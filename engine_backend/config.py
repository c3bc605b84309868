"""Engine configuration: one dataclass, resolved against the machine at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO_DTYPE = "auto"
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# CPU features that multiply bf16 in hardware; without one, bf16 matmuls are emulated and
# slower than float32.
_BF16_CPU_FEATURES = ("avx512_bf16", "amx_bf16")
CPUINFO = Path("/proc/cpuinfo")  # Linux; elsewhere torch's probe answers


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot products (AVX-512 BF16 or AMX), read from torch's own
    cpuinfo probe where it has one, else from /proc/cpuinfo's flags; False when neither
    says (detected, never guessed from the vendor or the model name)."""
    probe = getattr(torch._C._cpu, "_get_cpu_capability", None)
    if probe is not None:
        try:
            capabilities = probe()
        except RuntimeError:
            capabilities = None
        if isinstance(capabilities, dict):
            return any(bool(capabilities.get(name)) for name in _BF16_CPU_FEATURES)
    try:
        text = CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    flags = {
        flag
        for line in text.splitlines()
        if line.startswith("flags")
        for flag in line.partition(":")[2].split()
    }
    return any(name in flags for name in _BF16_CPU_FEATURES)


@dataclass
class EngineConfig:
    """Everything the engine needs to start; `None` fields are derived from the machine."""

    model: str
    device: str | None = None
    dtype: str | None = None  # float32, bfloat16, float16; None or "auto": see resolve_dtype
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.85
    # Per-step token budget. The one default: the standalone server and the gateway leave
    # it here unless the user sets one.
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    schedule_policy: str = "fcfs"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(
                f"schedule_policy must be 'fcfs' or 'lpm', not {self.schedule_policy!r}"
            )
        if self.dtype is not None and self.dtype != AUTO_DTYPE and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be {AUTO_DTYPE!r} or one of {sorted(_DTYPES)}, not {self.dtype!r}"
            )
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")

    def resolve_device(self) -> torch.device:
        """The configured device, or CUDA when present, else CPU."""
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        """The configured dtype; auto: bf16 on GPUs (what checkpoints ship in) and on CPUs
        that multiply bf16 in hardware (about twice float32's matmul speed there), float32
        on other CPUs (where bf16 is emulated and slower)."""
        if self.dtype is not None and self.dtype != AUTO_DTYPE:
            return _DTYPES[self.dtype]
        if device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16()):
            return torch.bfloat16
        return torch.float32
