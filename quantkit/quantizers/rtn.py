"""Round-to-nearest onto a uniform grid: min/max per group, the building block of every uniform quantizer."""
from __future__ import annotations

import torch

from ..qtensor import QuantizedTensor, check_bits_group, check_scales, group_index

FP16_TINY = 2.0**-24  # smallest positive float16: scales are stored in float16


def fit_grid(w: torch.Tensor, bits: int, sym: bool, mse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point per row of w [N, G] from its range, as the GPTQ reference does.

    The range always includes 0. The scale is rounded to float16 after the zero point is set (as the
    reference's checkpoint stores it), so what we store is what we quantize with. mse: shrink the
    range by the step (of 80 steps of 1%, the reference's clipping grid) with least |error|^2.4,
    searched coarse to fine: every 5th step, then the 4 either side of each row's best.
    """
    maxq = 2**bits - 1
    w = w.float()
    lo = w.amin(dim=1).clamp(max=0)
    hi = w.amax(dim=1).clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = torch.where(lo < 0, -hi, lo)
    empty = (lo == 0) & (hi == 0)
    lo = torch.where(empty, -1.0, lo)
    hi = torch.where(empty, 1.0, hi)
    scale, zero = grid_of(lo, hi, maxq, sym)
    if not mse:
        return scale, zero
    best = torch.full_like(scale, float("inf"))
    step = torch.zeros_like(scale)  # each row's best shrink so far, in steps of 1%

    def shrunk(i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keep = 1 - i / torch.full_like(i, 100)  # a tensor divisor: see grid_of
        return grid_of(lo * keep, hi * keep, maxq, sym)

    def trial(i: torch.Tensor) -> None:
        nonlocal best, step
        s, z = shrunk(i)
        err = (dequantize(round_codes(w, s, z, bits), s, z) - w).abs().pow(2.4).sum(dim=1)
        better = err < best
        best, step = torch.where(better, err, best), torch.where(better, i, step)

    for i in range(0, 80, 5):
        trial(torch.full_like(scale, i))
    coarse = step.clone()
    for d in (-4, -3, -2, -1, 1, 2, 3, 4):
        trial((coarse + d).clamp(0, 79))
    return shrunk(step)


def grid_of(lo: torch.Tensor, hi: torch.Tensor, maxq: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # divided by a tensor: CUDA multiplies by the reciprocal of a number, which can end 1 ulp off the
    # CPU's quotient and, after rounding to float16, a scale apart (seen on an H200)
    scale = (hi - lo) / torch.full_like(hi, maxq)
    zero = torch.full_like(scale, (maxq + 1) // 2) if sym else torch.round(-lo / scale).clamp(0, maxq)
    return scale.clamp(min=FP16_TINY).half().float(), zero


def round_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """q = clamp(round(w / s) + z, 0, 2^b - 1) with s, z broadcast over w's columns."""
    return torch.clamp(torch.round(w.float() / scale[:, None]) + zero[:, None], 0, 2**bits - 1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return scale[:, None] * (q - zero[:, None])


def quantize(w: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True, mse: bool = False,
             name: str = "a weight") -> QuantizedTensor:
    """RTN of w [N, K], group-wise along K; a last group shorter than group_size is allowed."""
    check_bits_group(bits, group_size)
    k = w.shape[1]
    g = k if group_size == -1 else group_size
    scales, zeros, codes = [], [], []
    for chunk in torch.split(w, g, dim=1):
        s, z = fit_grid(chunk, bits, sym, mse)
        codes.append(round_codes(chunk, s, z, bits))
        scales.append(s)
        zeros.append(z)
    scales = torch.stack(scales, dim=1).half()
    check_scales(w, scales, name)
    return QuantizedTensor(
        codes=torch.cat(codes, dim=1).to(torch.uint8),
        scales=scales,
        zeros=torch.stack(zeros, dim=1).to(torch.uint8),
        g_idx=group_index(k, group_size),
        bits=bits,
        group_size=group_size,
        sym=sym,
    )
