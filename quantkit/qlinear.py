"""A linear layer whose weight is a frozen QuantizedTensor, the base of QLoRA-style training."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .qtensor import QuantizedTensor


class QuantLinear(torch.nn.Module):
    """y = x W^T + b with W dequantized on the fly in each forward, so no float copy of the weight
    is kept between calls. W is not a parameter: gradients reach the input (and any adapter on
    top), never the quantized weight."""

    def __init__(self, qt: QuantizedTensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.qt = qt
        self.out_features, self.in_features = qt.shape
        self.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.qt.dequantize(x.dtype), self.bias)

    def extra_repr(self) -> str:
        kind = "codebook" if self.qt.codebook is not None else "int"
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.qt.bits}-bit {kind}, group {self.qt.group_size}"
