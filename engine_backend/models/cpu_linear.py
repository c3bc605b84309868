"""Float32 projections on the CPU through oneDNN, with each weight packed once at load time.

PyTorch's default CPU linear hands MKL a plain row-major weight on every call. oneDNN
(bundled with PyTorch; vLLM's CPU backend uses it for the same layers) multiplies from a
weight reordered once into its own blocked layout, which on a 2-core AVX2 host measured
0.55-0.9x the time of the default for SmolLM2-135M's projections and logits at 8 to 512
rows. Only float32 on the CPU is packed: bf16 keeps PyTorch's default until it is measured
on a CPU with native bf16. The dense weights are released once packed (no second copy).
"""

from __future__ import annotations

import torch
from torch import nn

_PACK = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
_PACKED_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
# Rows the packing is tuned for; any row count works (decode steps have a few, prefill
# chunks hundreds or more).
BATCH_HINT = 64


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed oneDNN projections apply: float32 on a CPU build with oneDNN."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and _PACK is not None
        and _PACKED_LINEAR is not None
    )


class PackedLinear(nn.Module):
    """`x @ weight.T + bias` with the weight in oneDNN's layout; x is [rows, in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        assert _PACK is not None, "callers check packing_available"
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            self.packed = _PACK(weight.detach(), BATCH_HINT)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert _PACKED_LINEAR is not None
        return _PACKED_LINEAR(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear under `model` by a PackedLinear; the number replaced."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child.weight, child.bias))
                replaced += 1
    return replaced
