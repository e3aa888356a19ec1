"""GPTQ (Frantar et al. 2022): Optimal Brain Quantization with lazy batch updates.

Columns are quantized one at a time; each one's rounding error, scaled by the inverse Hessian
(through its upper Cholesky factor), is pushed onto the columns not yet quantized. Updates inside
a block of columns are applied at once, the rest of the matrix is updated once per block.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import QuantkitError
from ..qtensor import QuantizedTensor, check_bits_group
from .rtn import fit_grid


@dataclass
class GPTQResult:
    tensor: QuantizedTensor
    loss: float  # sum over weights of (w - q)^2 / Hinv_jj^2 / 2: the layer's output error the method minimizes


def inverse_hessian_factor(h: torch.Tensor, damp: float, name: str = "layer",
                           perm: torch.Tensor | None = None) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, with H's rows and columns in perm's
    order when given, raising damping tenfold on failure. One K x K copy of H (485 MB for K = 11008),
    factored in place: it is column-major, LAPACK's order, so torch needs no copy of its own."""
    mean_diag = torch.mean(torch.diag(h))
    for attempt in range(6):
        d = damp * 10**attempt
        try:
            m = torch.empty_like(h).mT  # column-major
            step = max(1, 2**22 // len(h))
            for r in range(0, len(h), step):  # a slice of rows at a time: no second K x K temporary
                m[r:r + step] = h[r:r + step] if perm is None else h[perm[r:r + step]][:, perm]
            m.diagonal().add_(d * mean_diag)
            torch.linalg.cholesky(m, out=m)
            torch.cholesky_inverse(m, out=m)
            return torch.linalg.cholesky(m, upper=True, out=m)
        except torch.linalg.LinAlgError:
            warnings.warn(f"{name}: Hessian not positive definite with damping {d:g}; raising it to {d * 10:g}")
    raise QuantkitError(
        f"{name}: the Hessian stays singular even with damping {d:g}: calibrate on more or more varied text"
    )


def prepare(w: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 copy of w to work on and h in float32, inputs that are always zero set to 0 in w
    (any value is exact; take 0) and to 1 on h's diagonal so that it factors."""
    w, h = w.float().clone(), h.float()
    dead = torch.diag(h) == 0
    if dead.any():
        h = h.clone()  # the caller's matrix may serve other linears
        h[dead, dead] = 1
        w[:, dead] = 0
    return w, h


def column_order(diag: torch.Tensor, g: int, act_order: bool, group_aware: bool) -> torch.Tensor:
    """The order in which columns are quantized."""
    k = diag.shape[0]
    if act_order:
        return torch.argsort(diag, descending=True)
    if not group_aware:
        return torch.arange(k, device=diag.device)
    gid = torch.arange(k, device=diag.device) // g
    score = torch.zeros(int(gid[-1]) + 1, device=diag.device).scatter_reduce(0, gid, diag, "amax", include_self=False)
    rank = torch.argsort(torch.argsort(score, descending=True))  # 0 for the most important group
    by_column = torch.argsort(diag, descending=True, stable=True)
    return by_column[torch.argsort(rank[gid[by_column]], stable=True)]


def quantize(
    w: torch.Tensor,
    h: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    sym: bool = True,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    static_groups: bool = False,
    mse: bool = False,
    group_aware: bool = False,
    name: str = "layer",
) -> GPTQResult:
    """GPTQ of w [N, K] given the Hessian h [K, K] of its inputs (2 X^T X / n).

    act_order: columns by decreasing Hessian diagonal, groups formed in that order (g_idx).
    group_aware: groups keep their columns (g_idx stays k // G, the layout fast kernels want),
    but are visited most important first, and within a group its columns by importance too.
    """
    if act_order and group_aware:
        raise QuantkitError("act-order and group-aware ordering exclude each other: choose one")
    check_bits_group(bits, group_size)
    n, k = w.shape
    g = k if group_size == -1 else group_size
    ng = -(-k // g)
    w, h = prepare(w, h)

    scales = torch.zeros(n, ng, device=w.device)
    zeros = torch.zeros(n, ng, device=w.device)
    if static_groups:  # fixed before act-order reorders the columns
        for j in range(ng):
            scales[:, j], zeros[:, j] = fit_grid(w[:, j * g : (j + 1) * g], bits, sym, mse)

    perm = column_order(torch.diag(h), g, act_order, group_aware)
    # group of each column in quantization order; each group's columns are contiguous in it
    col_group = torch.arange(k, device=w.device) // g if act_order and not static_groups else perm // g
    maxq = 2**bits - 1

    def fit(span: torch.Tensor, grp: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if not static_groups:
            scales[:, grp], zeros[:, grp] = fit_grid(span, bits, sym, mse)
        return scales[:, grp], zeros[:, grp], maxq

    codes, loss = run(w, h, perm, col_group, fit, damp, block_size, name)

    g_idx = (col_group[torch.argsort(perm)]).to(torch.int32)
    qt = QuantizedTensor(
        codes=codes,
        scales=scales.half(),
        zeros=zeros.to(torch.uint8),
        g_idx=g_idx,
        bits=bits,
        group_size=group_size,
        sym=sym,
    )
    return GPTQResult(qt, loss)


def run(w: torch.Tensor, h: torch.Tensor, perm: torch.Tensor, col_group: torch.Tensor,
        fit: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, int]], damp: float, block_size: int,
        name: str) -> tuple[torch.Tensor, float]:
    """GPTQ's loop: w [N, K]'s columns quantized in perm order, col_group[i] the group of the i-th
    of them (each group's columns contiguous in that order). At a group's first column,
    fit(span, group) gives its scale, zero (per row) and top code from the group's columns (span) as
    updated so far. w is a working copy (prepare's), permuted and updated in place. Codes [N, K] in
    the original column order, and the loss."""
    n, k = w.shape
    if torch.equal(perm, torch.arange(k, device=perm.device)):
        hinv = inverse_hessian_factor(h, damp, name)
    else:
        step = max(1, 2**22 // k)
        for r in range(0, n, step):  # in place, a slice of rows at a time: no second copy of w
            w[r:r + step] = w[r:r + step, perm]
        hinv = inverse_hessian_factor(h, damp, name, perm)
    groups, sizes = col_group.tolist(), torch.bincount(col_group).tolist()
    codes = torch.zeros(n, k, dtype=torch.uint8, device=w.device)
    loss = 0.0
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2].contiguous()  # its rows are read one by one
        diag = hinv1.diagonal().tolist()
        for i in range(i2 - i1):
            col = i1 + i
            grp = groups[col]
            if col == 0 or grp != groups[col - 1]:
                end = col + sizes[grp]  # the group's columns, contiguous in this order
                s, z, maxq = fit(torch.cat([w1[:, i:end - i1], w[:, i2:max(end, i2)]], dim=1), grp)
            q = torch.round(w1[:, i] / s).add_(z).clamp_(0, maxq)
            codes[:, col] = q
            e = (w1[:, i] - (q - z) * s) / diag[i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        loss += float(err1.square().sum()) / 2  # (w - q)^2 / Hinv_jj^2 / 2 = e^2 / 2
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return codes[:, torch.argsort(perm)], loss
