"""NF4 and FP4 block quantization (QLoRA, Dettmers et al. 2023), bit-exact with bitsandbytes.

Blocks of block_size values run over the row-major flattened weight. Each block is divided by its
absolute maximum and each value takes the nearest entry of a 16-value code table (a value exactly
between two entries takes the lower one). Double quantization stores those float32 absmax values
as 8-bit codes of the signed dynamic map, in blocks of 256, after subtracting their mean.

The arithmetic follows bitsandbytes 0.50 on the CPU to the bit: full blocks are multiplied by the
reciprocal of their absmax, a last shorter block is divided by its absmax (clamped away from zero,
and stored clamped); the nested blocks are divided, and their values snapped to a 65536-point grid
before the nearest code is taken.
"""
from __future__ import annotations

import torch

from ..errors import QuantkitError
from ..qtensor import QuantizedTensor

# Quantiles of N(0, 1) with an exact zero, scaled to [-1, 1] (QLoRA, appendix E).
NF4 = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
])
# bitsandbytes' FP4: a sign bit, then 2 exponent bits and 1 mantissa bit (bias 2) in its own
# bit-pattern order, scaled to [-1, 1]. Both zeros exist: +0 is code 0, -0 code 8.
FP4 = torch.tensor([0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0]) / 12
CODEBOOKS = {"nf4": NF4, "fp4": FP4}
BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes accepts
NESTED_BLOCK = 256
TINY = 1e-38  # bitsandbytes' floor for an absmax it divides by
GRID = 65536


def dynamic_map() -> torch.Tensor:
    """The signed 8-bit dynamic tree map (Dettmers 2015), sorted: for each decade 10^-6 .. 10^0,
    2^i evenly spaced values of each sign (i = 0 .. 6), then 0 and 1. bitsandbytes' nested map."""
    values = []
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        mids = (10 ** (i - 6)) * ((edges[:-1] + edges[1:]) / 2.0)
        values += mids.tolist() + (-mids).tolist()
    return torch.tensor(sorted(values + [0.0, 1.0]), dtype=torch.float32)


def nearest(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """uint8 index of the table entry nearest each x; ties and equal entries go to the lower one."""
    order = torch.argsort(table, stable=True)
    ranked = table[order]
    mids = (ranked[:-1] + ranked[1:]) / 2
    rank = torch.searchsorted(mids, x.contiguous(), out_int32=True)
    return torch.take(order.to(torch.uint8), rank.long())


def absmax_scaled(x: torch.Tensor, block_size: int, reciprocal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n] scaled into [-1, 1] block by block, and each block's absmax."""
    n = x.numel()
    full = n - n % block_size
    blocks = x[:full].view(-1, block_size)
    absmax = blocks.abs().amax(dim=1)
    if reciprocal:
        scaled = blocks * (1.0 / absmax.clamp(min=TINY))[:, None]
    else:
        scaled = blocks / absmax[:, None]
    if full == n:
        return scaled.reshape(-1), absmax
    tail = x[full:].abs().max()
    tail = tail.clamp(min=TINY) if reciprocal else tail
    return torch.cat([scaled.reshape(-1), x[full:] / tail]), torch.cat([absmax, tail[None]])


def snap(x: torch.Tensor) -> torch.Tensor:
    """x in [-1, 1] moved to the nearest of GRID evenly spaced points, as bitsandbytes' CPU kernel
    does before it looks up the nested 8-bit code (its 65536-entry table), so that a value near a
    midpoint between two codes lands where bitsandbytes puts it."""
    x = torch.nan_to_num(x, nan=-1.0)  # 0/0 from a block of zeros: bitsandbytes' table gives code 0
    i = (((x.clamp(-1, 1) + 1) * 0.5) * (GRID - 1) + 0.5).floor()
    return -1 + (2 * i) / (GRID - 1)


def double_quantize(qt: QuantizedTensor) -> QuantizedTensor:
    """qt with its absmax stored as 8-bit dynamic codes around their mean; its scales become the
    values those codes give back, which is what every consumer dequantizes with."""
    offset = qt.scales.mean()
    scaled, absmax = absmax_scaled(qt.scales - offset, NESTED_BLOCK, reciprocal=False)
    table = dynamic_map().to(qt.scales.device)
    codes = nearest(snap(scaled), table)[None]
    nested = QuantizedTensor(codes, absmax, None, None, 8, NESTED_BLOCK, True, codebook=table, flat=True)
    scales = nested.dequantize().view(-1) + offset
    return QuantizedTensor(qt.codes, scales, None, None, qt.bits, qt.group_size, True, codebook=qt.codebook,
                           flat=True, nested=nested, offset=float(offset))


def check(kind: str, block_size: int) -> None:
    if kind not in CODEBOOKS:
        raise QuantkitError(f"unknown 4-bit type {kind!r}: use one of {', '.join(CODEBOOKS)}")
    if block_size not in BLOCK_SIZES:
        raise QuantkitError(f"block size {block_size} is not one bitsandbytes supports: use one of "
                            f"{', '.join(map(str, BLOCK_SIZES))}")


def quantize(w: torch.Tensor, kind: str = "nf4", block_size: int = 64, double_quant: bool = False) -> QuantizedTensor:
    """NF4 or FP4 of w [N, K] in flat blocks of block_size, optionally with double quantization."""
    check(kind, block_size)
    table = CODEBOOKS[kind].to(w.device)
    scaled, absmax = absmax_scaled(w.reshape(-1).float(), block_size, reciprocal=True)
    codes = nearest(scaled.clamp(-1, 1), table).view(w.shape)
    qt = QuantizedTensor(codes, absmax, None, None, 4, block_size, True, codebook=table, flat=True)
    return double_quantize(qt) if double_quant else qt
