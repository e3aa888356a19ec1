"""Launching the Triton kernels of jit.py on a packed layer (quantkit.qlinear).

They run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (set before triton is first
imported), which is how the tests check them on any machine. triton is imported on first use, so
the torch fallback never needs it.
"""
from __future__ import annotations

import functools
import os

import torch

from quantkit.errors import QuantkitError

GPTQ, NF4 = 0, 1  # jit.py's FMT
GEMV_ROWS = 4  # up to this many rows of x take the GEMV: a tensor-core tile would be mostly padding
DEQUANT_TILE = (32, 64)  # outputs, inputs
# Tiles (outputs, inputs per step) by layout and launch options, from sweeps on an H200
# (benchmarks/RESULTS.md, kernel_bench.py --sweep); NF4's GEMM keeps the tile that compiled for it there.
# A GPTQ group smaller than a tile's inputs takes tiles of one group (tile()).
GEMV_TILE = {"gptq": (128, 64), "act-order": (128, 64), "nf4": (32, 128)}
GEMM_TILE = {"gptq": (64, 64), "act-order": (64, 64), "nf4": (64, 32)}
GEMM_ROWS = 128  # rows of x per GEMM tile at most (16 to this, by M)
LAUNCH = {"gemv": {}, "gemm": {"num_stages": 4}}  # Triton launch options of each (num_warps, num_stages)
WORDS = True  # GPTQ codes of 2, 4 or 8 bits (either order): each packed word loaded once (jit._words)


def _jit():
    try:
        from . import jit
    except ImportError as e:
        raise QuantkitError(f"the Triton kernels need triton ({e}): pip install triton, or use the torch backend") from None
    return jit


def _check(t: torch.Tensor) -> None:
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise QuantkitError("the Triton kernels run on CUDA tensors (on the CPU only under TRITON_INTERPRET=1): "
                            "move the model to a GPU or use the torch backend")


ALL = 1 << 30  # jit._weight's GROUP for one group per row


def dequantize(layer, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """W [N, K] in dtype, equal to layer.dequantize(dtype) bit for bit."""
    n, k = layer.out_features, layer.in_features
    bn, bk = DEQUANT_TILE
    args, consts = layer.kernel_args(bk)
    _check(args[0])
    out = torch.empty(n, k, dtype=dtype, device=args[0].device)
    # no fused multiply-add, so that the nested absmax rounds as the torch reference rounds it
    _jit().dequantize_kernel[(cdiv(n, bn), cdiv(k, bk))](out, *args, n, k, **consts, BN=bn, BK=bk,
                                                         enable_fp_fusion=False)
    return out


@functools.cache
def multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


GEMV_PROGRAMS = 8  # per multiprocessor: on an H100, 4-bit GEMVs of 7B shapes at 2 per SM took 1.2-1.4x the time at 8-16


def split_for(x: torch.Tensor, programs: int, k: int, bk: int) -> int:
    """Slices of K for the GEMV: enough programs to fill a GPU (GEMV_PROGRAMS per multiprocessor), one
    on the CPU."""
    if not x.is_cuda:
        return 1
    return max(1, min(GEMV_PROGRAMS * multiprocessors(x.device.index or 0) // programs, cdiv(k, bk)))


def layout(layer) -> str:
    """The key of a layer's tiles: GPTQ layers have plain_order, NF4 layers not."""
    plain = getattr(layer, "plain_order", None)
    return "nf4" if plain is None else "gptq" if plain else "act-order"


def tile(layer, rows: int) -> tuple[int, int]:
    """(outputs, inputs) per step for rows of x: the layout's GEMV or GEMM tile, its inputs cut to
    one group where a GPTQ group in plain order is smaller, so that each tile reads one group's
    scales (kernel_args' GROUP) rather than one per weight."""
    kind = layout(layer)
    bn, bk = (GEMV_TILE if rows <= GEMV_ROWS else GEMM_TILE)[kind]
    group = getattr(layer, "group_size", -1)
    if kind == "gptq" and 16 <= group < bk and bk % group == 0:
        bk = group
    return bn, bk


def matmul(x: torch.Tensor, layer, split: int | None = None) -> torch.Tensor:
    """x [..., K] @ W^T in x's dtype, accumulated in float32, W never written out. split: slices of
    K for the GEMV (None: by the device)."""
    _check(x)
    n, k = layer.out_features, layer.in_features
    if x.shape[-1] != k:
        raise QuantkitError(f"input of {x.shape[-1]} features for a layer of {k}")
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    jit = _jit()
    bn, bk = tile(layer, m)
    args, consts = layer.kernel_args(bk)
    words = WORDS and consts["FMT"] == GPTQ and 32 % consts["BITS"] == 0
    if m <= GEMV_ROWS:
        split = split or split_for(x, cdiv(n, bn) * m, k, bk)
        k_split = cdiv(cdiv(k, split), bk) * bk
        split = cdiv(k, k_split)
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device) if split > 1 else x2.new_empty(m, n)
        jit.gemv_kernel[(cdiv(n, bn), split, m)](x2, y, *args, n, k, k_split, **consts, BN=bn, BK=bk, ATOMIC=split > 1,
                                                 WORDS=words, **LAUNCH["gemv"])
    else:
        bm = min(GEMM_ROWS, max(16, 1 << (m - 1).bit_length()))
        y = x2.new_empty(m, n)
        precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32: no tf32 rounding of x
        upcast = not x.is_cuda and x.dtype == torch.bfloat16
        jit.gemm_kernel[(cdiv(m, bm), cdiv(n, bn))](x2, y, *args, m, n, k, **consts, BM=bm, BN=bn, BK=bk,
                                                    PRECISION=precision, UPCAST=upcast, WORDS=words, **LAUNCH["gemm"])
    return y.to(x.dtype).view(*x.shape[:-1], n)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
