"""The one quantized-tensor type every quantizer returns and every exporter consumes."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import QuantkitError

BITS = (2, 3, 4, 8)


def check_bits_group(bits: int, group_size: int) -> None:
    if bits not in BITS:
        raise QuantkitError(f"unsupported bit width {bits}: use one of {', '.join(map(str, BITS))}")
    if group_size != -1 and group_size < 1:
        raise QuantkitError(f"group size {group_size} is invalid: use -1 (per channel) or a positive size such as 128")


def group_index(in_features: int, group_size: int) -> torch.Tensor:
    """g_idx without act-order: column k belongs to group k // G (the last group may be shorter)."""
    g = in_features if group_size == -1 else group_size
    return torch.arange(in_features, dtype=torch.int32) // g


@dataclass
class QuantizedTensor:
    """W[n, k] = scales[n, g_idx[k]] * (codes[n, k] - zeros[n, g_idx[k]]).

    codes are kept in the original column order; act-order (a permutation of the columns
    during quantization) shows only in g_idx, as in the GPTQ checkpoint format.
    """

    codes: torch.Tensor  # uint8 [N, K], 0 .. 2^bits - 1
    scales: torch.Tensor  # float16 [N, ng]
    zeros: torch.Tensor  # uint8 [N, ng]; symmetric: 2^(bits-1)
    g_idx: torch.Tensor  # int32 [K]
    bits: int
    group_size: int  # -1: one group per row
    sym: bool

    def __post_init__(self) -> None:
        check_bits_group(self.bits, self.group_size)
        n, k = self.codes.shape
        ng = self.n_groups
        if self.scales.shape != (n, ng) or self.zeros.shape != (n, ng):
            raise QuantkitError(
                f"quantized tensor of shape {(n, k)} with group size {self.group_size} needs scales and zeros "
                f"of shape {(n, ng)}, got {tuple(self.scales.shape)} and {tuple(self.zeros.shape)}"
            )
        if self.g_idx.shape != (k,) or (k and int(self.g_idx.max()) >= ng):
            raise QuantkitError(f"g_idx must have {k} entries below {ng}, got shape {tuple(self.g_idx.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def n_groups(self) -> int:
        k = self.codes.shape[1]
        return 1 if self.group_size == -1 else math.ceil(k / self.group_size)

    @property
    def act_order(self) -> bool:
        return not torch.equal(self.g_idx, group_index(self.codes.shape[1], self.group_size))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = self.g_idx.long()
        s = self.scales.to(torch.float32)[:, g]
        z = self.zeros.to(torch.float32)[:, g]
        return (s * (self.codes.to(torch.float32) - z)).to(dtype)
