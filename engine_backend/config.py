"""Engine configuration: one dataclass, resolved against the machine at start-up."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass
class EngineConfig:
    """Everything the engine needs to start; `None` fields are derived from the machine."""

    model: str
    device: str | None = None
    dtype: str | None = None
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
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {self.dtype!r}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")

    def resolve_device(self) -> torch.device:
        """The configured device, or CUDA when present, else CPU."""
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        """bf16 on GPUs (what checkpoints ship in), float32 on CPU (fast and exact there)."""
        if self.dtype is not None:
            return _DTYPES[self.dtype]
        return torch.bfloat16 if device.type == "cuda" else torch.float32
