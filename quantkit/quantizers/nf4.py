"""NF4 and FP4 block quantization (QLoRA, Dettmers et al. 2023), bit-exact with bitsandbytes.

Blocks of block_size values run over the row-major flattened weight. Each block is divided by its
absolute maximum and each value takes the nearest entry of a 16-value code table (a value exactly
between two entries takes the lower one). Double quantization stores those float32 absmax values
as 8-bit codes of the signed dynamic map, in blocks of 256, after subtracting their mean.

The arithmetic follows bitsandbytes 0.50 on the CPU to the bit: full blocks are multiplied by the
reciprocal of their absmax, a last shorter block is divided by its absmax (clamped away from zero,
and stored clamped); the nested blocks are divided, and their values snapped to a 65536-point grid
before the nearest code is taken. On the CPU the first level runs compiled (compiled_codes): the
same float32 operations in one pass, about 4x faster than torch's searchsorted.
"""
from __future__ import annotations

from functools import cache

import torch

from .. import blocks
from ..errors import QuantkitError, option
from ..qtensor import QuantizedTensor, check_scales

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
BLOCK = 64  # bitsandbytes' default values per absmax
NESTED_BLOCK = 256
TINY = 1e-38  # bitsandbytes' floor for an absmax it divides by
GRID = 65536


def dynamic_map() -> torch.Tensor:
    """The signed 8-bit dynamic tree map (Dettmers 2015), sorted: for each decade 10^-6 .. 10^0,
    2^i evenly spaced values of each sign (i = 0 .. 6), then 0 and 1. bitsandbytes' nested map."""
    return torch.tensor(dynamic_values(), dtype=torch.float32)


@cache
def dynamic_values() -> tuple[float, ...]:
    values = []
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        mids = (10 ** (i - 6)) * ((edges[:-1] + edges[1:]) / 2.0)
        values += mids.tolist() + (-mids).tolist()
    return tuple(sorted(values + [0.0, 1.0]))


def midpoints(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The midpoints between the sorted entries of table, and the entries' indices in that order."""
    order = torch.argsort(table, stable=True)
    ranked = table[order]
    return (ranked[:-1] + ranked[1:]) / 2, order


def nearest(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """uint8 index of the table entry nearest each x; ties and equal entries go to the lower one."""
    mids, order = midpoints(table)
    rank = torch.searchsorted(mids, x.contiguous(), out_int32=True)
    return torch.take(order.to(torch.uint8), rank.long())


def compiled_codes(x: torch.Tensor, block_size: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """absmax_scaled and nearest on the CPU in one compiled pass (quantkit/kernels/absmax.c, the same
    float32 operations), its blocks split over the cores: the codes [n] and each block's absmax. None
    on a GPU or without the compiled kernels."""
    lib = blocks.library()
    if lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or table.dtype != torch.float32 \
            or len(table) != 16:
        return None
    x = x.contiguous()
    mids, order = midpoints(table)
    order = order.to(torch.uint8)
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    absmax = torch.empty(-(-x.numel() // block_size), dtype=torch.float32)
    whole = x.numel() // block_size  # split by blocks; the last share takes the shorter block too

    def share(b0: int, b1: int) -> None:
        end = x.numel() if b1 == whole else b1 * block_size
        lib.absmax_codes(x.data_ptr() + 4 * b0 * block_size, end - b0 * block_size, block_size, mids.data_ptr(),
                         order.data_ptr(), codes.data_ptr() + b0 * block_size, absmax.data_ptr() + 4 * b0)

    if whole:
        blocks.split(whole, share)
    else:
        share(0, 0)
    return codes, absmax


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


def compiled_nested(x: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """absmax_scaled (divided), snap and nearest of double quantization on the CPU, compiled
    (quantkit/kernels/absmax.c, the same float32 operations) on one thread: the second level is 64
    times smaller than the first, and torch's parallel searchsorted and floor on it left their
    threads spinning against the first level's (1.5 s against 1.1 s over the embedded model).
    None on a GPU or without the compiled kernels."""
    lib = blocks.library()
    if lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or table.dtype != torch.float32:
        return None
    x = x.contiguous()
    mids, order = midpoints(table)
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    absmax = torch.empty(-(-x.numel() // NESTED_BLOCK), dtype=torch.float32)
    lib.nested_codes(x.data_ptr(), x.numel(), NESTED_BLOCK, mids.data_ptr(), len(mids), codes.data_ptr(),
                     absmax.data_ptr())
    if not torch.equal(order, torch.arange(len(order))):  # ranks to codes where entries are not sorted
        codes = order.to(torch.uint8)[codes.long()]
    return codes, absmax


def double_quantize(qt: QuantizedTensor) -> QuantizedTensor:
    """qt with its absmax stored as 8-bit dynamic codes around their mean; its scales become the
    values those codes give back, which is what every consumer dequantizes with."""
    offset = qt.scales.mean()
    centred = qt.scales - offset
    table = dynamic_map().to(qt.scales.device)
    compiled = compiled_nested(centred, table)
    if compiled is None:
        scaled, absmax = absmax_scaled(centred, NESTED_BLOCK, reciprocal=False)
        codes = nearest(snap(scaled), table)
    else:
        codes, absmax = compiled
    codes = codes[None]
    nested = QuantizedTensor(codes, absmax, None, None, 8, NESTED_BLOCK, True, codebook=table, flat=True)
    scales = nested.dequantize().view(-1) + offset
    return QuantizedTensor(qt.codes, scales, None, None, qt.bits, qt.group_size, True, codebook=qt.codebook,
                           flat=True, nested=nested, offset=float(offset))


def check(kind: str, block_size: int, name: str | None = None) -> None:
    """name: the option that gave block_size, where an option did."""
    if kind not in CODEBOOKS:
        raise QuantkitError(f"unknown 4-bit type {kind!r}: use one of {', '.join(CODEBOOKS)}")
    if block_size not in BLOCK_SIZES:
        raise QuantkitError(f"{option(name, block_size) if name else block_size} is not a block size bitsandbytes supports: use one of "
                            f"{', '.join(map(str, BLOCK_SIZES))}")


def quantize(w: torch.Tensor, kind: str = "nf4", block_size: int = BLOCK, double_quant: bool = False,
             name: str = "a weight") -> QuantizedTensor:
    """NF4 or FP4 of w [N, K] in flat blocks of block_size, optionally with double quantization."""
    check(kind, block_size)
    table = CODEBOOKS[kind].to(w.device)
    x = w.reshape(-1).float()
    compiled = compiled_codes(x, block_size, table)
    if compiled is None:
        scaled, absmax = absmax_scaled(x, block_size, reciprocal=True)
        codes = nearest(scaled.clamp(-1, 1), table)
    else:
        codes, absmax = compiled
    check_scales(w, absmax, name)
    codes = codes.view(w.shape)
    qt = QuantizedTensor(codes, absmax, None, None, 4, block_size, True, codebook=table, flat=True)
    return double_quantize(qt) if double_quant else qt
