"""AWQ (Lin et al. 2023): activation-aware scaling and clipping before round-to-nearest.

For linears sharing an input, input channel j is multiplied by s_j (and the op before divides by
it, so the float model is unchanged): salient channels, those with large mean |x|, get finer
steps. s = mean|x|^alpha, alpha on a grid in [0, 1), chosen by the block's output error with the
scaled weights quantized. Then each group's clipping range is shrunk on a grid, chosen by the
linear's output error on a sample of tokens. The weights are finally quantized with RTN.
The pipeline (model plumbing) supplies the statistics and the block loss; this file is the math.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..qtensor import QuantizedTensor
from . import rtn


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool = False) -> torch.Tensor:
    """w through RTN and back: what a scaled or clipped weight becomes."""
    return rtn.quantize(w, bits, group_size, sym).dequantize(w.dtype)


def weight_mean(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Mean over output rows of |w| relative to its group's max: per input channel (AWQ's duo scaling)."""
    w = torch.cat(weights).abs()
    g = w.shape[1] if group_size == -1 else group_size
    rel = torch.cat([c / (c.amax(dim=1, keepdim=True) + 1e-6) for c in w.split(g, dim=1)], dim=1)
    return rel.mean(dim=0)


def candidate(x_mean: torch.Tensor, w_mean: torch.Tensor | None, alpha: float) -> torch.Tensor:
    """s = mean|x|^alpha (over mean w^(1-alpha) with duo scaling), normalized to geometric mean 1 of its extremes."""
    s = x_mean.pow(alpha)
    if w_mean is not None:
        s = s / (w_mean.pow(1 - alpha) + 1e-4)
    s = s.clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def search_scale(x_mean: torch.Tensor, loss: Callable[[torch.Tensor], float], n_grid: int = 20,
                 w_mean: torch.Tensor | None = None) -> tuple[torch.Tensor, float, list[float]]:
    """The scales among alpha = 0, 1/n, .., (n-1)/n with the least block loss: (scales, alpha, losses).
    loss(s) is the block's output error with its linears' input channels scaled by s and quantized."""
    losses = [loss(candidate(x_mean, w_mean, i / n_grid)) for i in range(n_grid)]
    best = min(range(n_grid), key=losses.__getitem__)  # the first of equal losses, as the reference
    return candidate(x_mean, w_mean, best / n_grid), best / n_grid, losses


def search_clip(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int, n_grid: int = 20,
                max_shrink: float = 0.5) -> torch.Tensor:
    """Per (row, group) clipping bound max|w| * (1 - i/n_grid), i < max_shrink * n_grid, with the least
    mean squared error of that group's share of the output on the tokens x [T, K]: [N, ng]."""
    g = w.shape[1] if group_size == -1 else group_size
    bounds = []
    for wc, xc in zip(w.split(g, dim=1), x.split(g, dim=1)):
        full = wc.abs().amax(dim=1, keepdim=True)
        best, best_err = full, None
        for i in range(int(max_shrink * n_grid)):
            bound = full * (1 - i / n_grid)
            q = fake_quantize(wc.clamp(-bound, bound), bits, -1)
            err = (xc @ (q - wc).T).pow(2).mean(dim=0)[:, None]
            if best_err is None:
                best_err = err
            else:
                better = err < best_err
                best, best_err = torch.where(better, bound, best), torch.where(better, err, best_err)
        bounds.append(best)
    return torch.cat(bounds, dim=1)


def clip(w: torch.Tensor, bound: torch.Tensor, group_size: int) -> torch.Tensor:
    g = w.shape[1] if group_size == -1 else group_size
    return torch.cat([c.clamp(-b, b) for c, b in zip(w.split(g, dim=1), bound.split(1, dim=1))], dim=1)


def quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool = False, bound: torch.Tensor | None = None) -> QuantizedTensor:
    """The final RTN of an AWQ-scaled weight, clipped to bound [N, ng] when given."""
    return rtn.quantize(clip(w, bound, group_size) if bound is not None else w, bits, group_size, sym)
