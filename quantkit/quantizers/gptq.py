"""GPTQ (Frantar et al. 2022): Optimal Brain Quantization with lazy batch updates.

Columns are quantized one at a time; each one's rounding error, scaled by the inverse Hessian
(through its upper Cholesky factor), is pushed onto the columns not yet quantized. Updates inside
a block of columns are applied at once, the rest of the matrix is updated once per block.
"""
from __future__ import annotations

import ctypes
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..errors import QuantkitError
from ..qtensor import QuantizedTensor, check_bits_group, check_scales, per_slice
from .rtn import fit_grid


@dataclass
class GPTQResult:
    tensor: QuantizedTensor
    loss: float  # sum over weights of (w - q)^2 / Hinv_jj^2 / 2: the layer's output error the method minimizes


def torch_lapack() -> ctypes.CDLL | None:
    """The LAPACK torch factors with (MKL, in the x86 builds), for calls torch has no form of: its
    Cholesky zeroes the triangle it does not use, and GPTQ keeps H there. None where it is not exported."""
    try:
        lib = ctypes.CDLL(str(next(Path(torch.__file__).parent.glob("lib/libtorch_cpu.*"))))
        lib.spotrf_, lib.spotri_  # AttributeError when not exported
        return lib
    except (StopIteration, OSError, AttributeError):
        return None


LAPACK = torch_lapack()


def lapack(routine: str, uplo: str, a: torch.Tensor) -> int:
    """spotrf or spotri on a column-major square float32 a, in place; LAPACK's info (> 0: not positive
    definite)."""
    n, info = ctypes.c_int(len(a)), ctypes.c_int(0)
    getattr(LAPACK, routine + "_")(uplo.encode(), ctypes.byref(n), ctypes.c_void_p(a.data_ptr()), ctypes.byref(n),
                                   ctypes.byref(info))
    return info.value


@contextmanager
def inverse_factor(h: torch.Tensor, damp: float, name: str = "layer",
                   perm: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
    """The upper Cholesky factor U of (H' + damp * mean(diag H') * I)^-1, H' being the symmetric H with
    its rows and columns in perm's order (when given) and each zero on its diagonal (an input that is
    always zero) made 1; damping rises tenfold while it does not factor. Only U's upper triangle is
    meant: the rest of the matrix yielded is not U's.

    On the CPU, a symmetric float32 H (as 2 X^T X / n is) is lent: U is made in its own memory (485 MB
    saved on a 7B model's down_proj), by the calls torch's own would make. LAPACK works on one
    triangle, so the other keeps H to start again from, and H is whole again when the context ends
    (linears sharing an input share H). Any other H, or without torch's LAPACK at hand, U is made in
    a copy."""
    given = h.diagonal().clone()
    diag = torch.where(given == 0, 1, given).float()
    mean = diag.mean()  # a float32 tensor: d * mean rounded as torch rounds it, not in double
    diag = diag if perm is None else diag[perm]
    own = LAPACK is not None and h.device.type == "cpu" and h.dtype == torch.float32 and h.is_contiguous() \
        and not h.requires_grad and symmetric(h)  # else torch's calls read the triangle this does not
    if own and perm is not None:
        permute_(h, perm)
    try:
        for attempt in range(6):
            d = damp * 10**attempt
            factor = factor_in_place(h, diag + d * mean) if own else factor_copy(h, diag + d * mean, perm)
            if factor is not None:
                yield factor
                return
            warnings.warn(f"{name}: Hessian not positive definite with damping {d:g}; raising it to {d * 10:g}")
    finally:
        if own:  # H again: the triangle U took from the one that kept H, then H's order and diagonal
            mirror_lower(h.mT)
            if perm is not None:
                permute_(h, torch.argsort(perm))
            h.diagonal().copy_(given)
    raise QuantkitError(
        f"{name}: the Hessian stays singular even with damping {d:g}: calibrate on more or more varied text"
    )


def symmetric(h: torch.Tensor) -> bool:
    """h equals its transpose exactly, compared a block of rows at a time."""
    step = per_slice(len(h))
    return all(torch.equal(h[r:r + step], h[:, r:r + step].T) for r in range(0, len(h), step))


def factor_in_place(h: torch.Tensor, diag: torch.Tensor) -> torch.Tensor | None:
    """inverse_factor's U for the symmetric h with diag on its diagonal, made in h's memory read
    column-major (m = h.mT), with the LAPACK calls torch.linalg.cholesky, cholesky_inverse and
    cholesky(upper=True) make, so the same values: the factor and its inverse in m's lower triangle
    while m's strict upper keeps H; then the two swap, and the upper factor is made in m's upper
    triangle while its strict lower keeps H. Returns m, or None with h symmetric again."""
    m = h.mT
    m.diagonal().copy_(diag)
    if lapack("spotrf", "L", m) or lapack("spotri", "L", m):
        mirror_lower(h)  # m's lower triangle from its upper one
        return None
    transpose_(m)  # the inverse to m's upper triangle, H to its lower
    if lapack("spotrf", "U", m):
        mirror_lower(m)
        return None
    return m


def factor_copy(h: torch.Tensor, diag: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor | None:
    """inverse_factor's U, in a float32 copy of h in perm's order (None when it does not factor). The
    copy is column-major, LAPACK's order, so torch factors it in place without one of its own."""
    m = torch.empty(h.shape, dtype=torch.float32, device=h.device).mT
    step = per_slice(len(h))
    for r in range(0, len(h), step):  # a slice of rows at a time: no second K x K temporary
        m[r:r + step] = h[r:r + step] if perm is None else h[perm[r:r + step]][:, perm]
    m.diagonal().copy_(diag)
    try:
        torch.linalg.cholesky(m, out=m)
        torch.cholesky_inverse(m, out=m)
        return torch.linalg.cholesky(m, upper=True, out=m)
    except torch.linalg.LinAlgError:
        return None


def mirror_lower(t: torch.Tensor) -> None:
    """t's strict upper triangle set from its strict lower one, a block of rows at a time."""
    k = len(t)
    step = per_slice(k)
    for r in range(0, k, step):
        s = min(step, k - r)
        t[r:r + s, r + s:] = t[r + s:, r:r + s].T
        d = t[r:r + s, r:r + s]
        d.copy_(d.tril() + d.tril(-1).T)


def transpose_(t: torch.Tensor) -> None:
    """t = t.T in place, a pair of blocks at a time."""
    k, step = len(t), 256
    for r in range(0, k, step):
        d = t[r:r + step, r:r + step]
        d.copy_(d.T.clone())
        for c in range(r + step, k, step):
            upper = t[r:r + step, c:c + step].clone()
            t[r:r + step, c:c + step] = t[c:c + step, r:r + step].T
            t[c:c + step, r:r + step] = upper.T


def permute_(h: torch.Tensor, perm: torch.Tensor) -> None:
    """h[perm][:, perm] in place: the columns a slice of rows at a time, the rows along the
    permutation's cycles, one row held aside per cycle."""
    k = len(h)
    step = per_slice(k)
    for r in range(0, k, step):
        h[r:r + step] = h[r:r + step, perm]
    p, seen = perm.tolist(), [False] * k
    for start in range(k):
        if seen[start]:
            continue
        row, j = h[start].clone(), start
        while not seen[j]:
            seen[j] = True
            if p[j] == start:
                h[j] = row
            else:
                h[j] = h[p[j]]
            j = p[j]


def prepare(w: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 copy of w to work on, and H's diagonal, where an input that is always zero (0 on the
    diagonal) gets 1, as inverse_factor gives it; its column of w is set to 0 (any value is exact)."""
    w = w.to(torch.float32, copy=True)
    diag = h.diagonal().float()
    dead = diag == 0
    w[:, dead] = 0
    return w, torch.where(dead, 1, diag)


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
    w, diag = prepare(w, h)

    scales = torch.zeros(n, ng, device=w.device)
    zeros = torch.zeros(n, ng, device=w.device)
    if static_groups:  # fixed before act-order reorders the columns
        for j in range(ng):
            scales[:, j], zeros[:, j] = fit_grid(w[:, j * g : (j + 1) * g], bits, sym, mse)

    perm = column_order(diag, g, act_order, group_aware)
    # group of each column in quantization order; each group's columns are contiguous in it
    col_group = torch.arange(k, device=w.device) // g if act_order and not static_groups else perm // g
    maxq = 2**bits - 1

    def fit(span: torch.Tensor, grp: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if not static_groups:
            scales[:, grp], zeros[:, grp] = fit_grid(span, bits, sym, mse)
        return scales[:, grp], zeros[:, grp], maxq

    codes, loss = run(w, h, perm, col_group, fit, damp, block_size, name)
    scales = scales.half()
    check_scales(w, scales, name)  # w: the weights as GPTQ's updates left them, of the same magnitude

    g_idx = (col_group[torch.argsort(perm)]).to(torch.int32)
    qt = QuantizedTensor(
        codes=codes,
        scales=scales,
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
    updated so far. w is a working copy (prepare's), permuted and updated in place; h, H as summed
    (symmetric), is lent to inverse_factor and whole again on return. Codes [N, K] in the original
    column order, and the loss."""
    n, k = w.shape
    identity = torch.equal(perm, torch.arange(k, device=perm.device))
    if not identity:
        rows = per_slice(k)
        for r in range(0, n, rows):  # in place, a slice of rows at a time: no second copy of w
            w[r:r + rows] = w[r:r + rows, perm]
    groups, sizes = col_group.tolist(), torch.bincount(col_group).tolist()
    codes = torch.zeros(n, k, dtype=torch.uint8, device=w.device)
    loss = 0.0
    with inverse_factor(h, damp, name, None if identity else perm) as hinv:
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
            push_error(w, err1, hinv, i1, i2)
    return codes[:, torch.argsort(perm)], loss


def push_error(w: torch.Tensor, err: torch.Tensor, hinv: torch.Tensor, i1: int, i2: int) -> None:
    """The columns of w after i2 take the errors err of columns i1:i2 through hinv's rows, a slice of
    columns at a time: no [N, K] product beside w (180 MB on a 7B model's down_proj)."""
    step = per_slice(len(w))
    for c in range(i2, w.shape[1], step):
        w[:, c:c + step] -= err @ hinv[i1:i2, c:c + step]
