"""Launching the Triton kernels of jit.py on a packed layer (quantkit.qlinear).

They run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (set before triton is first
imported), which is how the tests check them on any machine. triton is imported on first use, so
the torch fallback never needs it.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from quantkit.errors import QuantkitError

GPTQ, NF4 = 0, 1  # jit.py's FMT
# Up to this many rows of x (below DENSE_ROWS) take the GEMV, from one more the GEMM's 16-row tile. On an
# H200 (benchmarks/RESULTS.md, "The ninth GPU run") the 4-bit GEMV took 0.78-0.89 of the GEMM's time at 2
# rows and 1.23-1.60x at 4, where the GEMM's time stays flat from 2 to 8 rows; a GEMV program that read W
# once for 4 rows took 0.90-1.08x the time of a program per row. NF4 goes dense from 3 rows (its GEMM is slow)
GEMV_ROWS = 2
DEQUANT_TILE = (32, 64)  # outputs, inputs
# Tiles (outputs, inputs per step) by layout and launch options, from sweeps on an H200 and an H100
# (benchmarks/RESULTS.md, kernel_bench.py --sweep); NF4's GEMM keeps the tile that compiled for it there
# (by default NF4 goes dense before its GEMM: only a raised DENSE_ROWS or the sweep reaches it).
# A GPTQ group or NF4 block smaller than a tile's inputs takes tiles of one group (tile()).
GEMV_TILE = {"gptq": (32, 128), "act-order": (128, 64), "nf4": (64, 128)}
GEMV_LAUNCH = {"gptq": {"num_warps": 2}, "act-order": {}, "nf4": {}}  # Triton launch options by layout
GEMM_TILE = {"gptq": (64, 64), "act-order": (64, 64), "nf4": (64, 32)}
FEW_ROWS = 16  # GEMMs of up to this many rows of x (one 16-row tile) take FEW_TILE where the layout has one
FEW_TILE = {"gptq": (128, 64), "act-order": (128, 32)}  # at 16 rows on an H100: 0.57-0.93 and 0.66-1.02 of GEMM_TILE's time
# From this many rows of x a matmul dequantizes W in x's dtype and calls torch's matmul: the tensor-core
# library beats a fused tile once the weight's reads are shared by enough rows (H100, kernel_bench.py --dense)
DENSE_ROWS = {"gptq": 256, "act-order": 256, "nf4": 3}
GEMM_ROWS = 128  # rows of x per GEMM tile at most (16 to this, by M)
GEMM_LAUNCH = {"num_stages": 4}
WORDS = True  # each packed word loaded once (jit._words): GPTQ codes of 2, 4 or 8 bits (either order), NF4 in
# tiles of one block per output (its absmax read once per tile)


def _jit():
    try:
        from . import jit
    except ImportError as e:
        raise QuantkitError(f"the Triton kernels need triton ({e}): pip install triton, or use the torch backend") from None
    return jit


def _check(t: torch.Tensor, layer) -> None:
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise QuantkitError("the Triton kernels run on CUDA tensors (on the CPU only under TRITON_INTERPRET=1): "
                            "move the model to a GPU or use the torch backend")
    if not fits(layer):
        raise QuantkitError(f"a {layer.out_features}x{layer.in_features} weight has 2^31 values or more, past the "
                            "Triton kernels' int32 offsets: use the torch backend for it")
    where = next(layer.buffers()).device
    if t.device != where:
        raise QuantkitError(f"input on {t.device} for a layer on {where}: move them to one device")


OFFSETS = 1 << 31  # the kernels index W's values in int32


def fits(layer) -> bool:
    """Whether the kernels can index every value of the layer's W."""
    return layer.out_features * layer.in_features < OFFSETS


ALL = 1 << 30  # jit._weight's GROUP for one group per row


def dequantize(layer, dtype: torch.dtype = torch.float16, stored: bool = False) -> torch.Tensor:
    """W [N, K] in dtype, equal to layer.dequantize(dtype) bit for bit; stored: with its columns in the
    order the kernels read them, where kernel_args has an ORDER (W[:, order], order its w4: an
    act-order layer's twin in plain group order)."""
    n, k = layer.out_features, layer.in_features
    bn, bk = DEQUANT_TILE
    args, consts = layer.kernel_args(bk)
    _check(args[0], layer)
    consts["ORDER"] = consts["ORDER"] and not stored
    out = torch.empty(n, k, dtype=dtype, device=args[0].device)
    # no fused multiply-add, so that the nested absmax rounds as the torch reference rounds it
    with on(out):
        _jit().dequantize_kernel[(cdiv(n, bn), cdiv(k, bk))](out, *args, n, k, **consts, BN=bn, BK=bk,
                                                             WORDS=words(consts), enable_fp_fusion=False)
    return out


def on(t: torch.Tensor):
    """Triton launches on the current device's stream: make it t's (a layer on cuda:1 while cuda:0 is
    current would otherwise run there)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def words(consts: dict) -> bool:
    """Whether the kernels read a layer's codes a packed word at a time (jit._words; WORDS)."""
    return WORDS and (32 % consts["BITS"] == 0 if consts["FMT"] == GPTQ else consts["GROUP"] > 0)


@functools.cache
def multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# Programs per multiprocessor that a matmul's split of K aims at (split_for; benchmarks/RESULTS.md): on
# an H100, 4-bit GEMVs of 7B shapes at 2 per SM took 1.2-1.4x the time at 8-16; GEMMs of 16 rows took
# 1.1-1.9x at 1 per SM, and 0.95-1.13x at 4, what they take at 2
GEMV_PROGRAMS = 8
GEMM_PROGRAMS = 2


def split_for(x: torch.Tensor, programs: int, k: int, bk: int, per_sm: int) -> int:
    """Slices of K that bring programs up to about per_sm per multiprocessor (none where they are
    more than half that already); one on the CPU."""
    if not x.is_cuda:
        return 1
    return max(1, min(per_sm * multiprocessors(x.device.index or 0) // programs, cdiv(k, bk)))


_counts: dict[tuple[torch.device, int], torch.Tensor] = {}


def counts(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 counts of the finished slices of each output tile, for the kernels' split sums, zero at
    the start of a call (each kernel leaves them so). On a GPU one buffer per stream, so that matmuls
    on two streams never share one; under CUDA graph capture a new one per call (zeroed in the
    graph: two graphs captured on one stream may be replayed on two at once); on the CPU (the
    interpreter, which an interrupt can stop midway) a new one per call."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    if key not in _counts or _counts[key].numel() < tiles:
        _counts[key] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return _counts[key]


def layout(layer) -> str:
    """The key of a layer's tiles: GPTQ layers have plain_order, NF4 layers not; act-order with whole
    groups is read as its twin in plain group order (qlinear.GPTQLinear.grouped)."""
    plain = getattr(layer, "plain_order", None)
    return "nf4" if plain is None else "gptq" if plain or layer.grouped is not None else "act-order"


def tile(layer, rows: int) -> tuple[int, int]:
    """(outputs, inputs) per step for rows of x: the layout's GEMV or GEMM tile, its inputs cut to
    one group where a GPTQ group in plain order (or an NF4 block) is smaller, so that each tile reads one
    group's scales (kernel_args' GROUP) rather than one per weight."""
    kind = layout(layer)
    if rows <= GEMV_ROWS:
        bn, bk = GEMV_TILE[kind]
    else:
        bn, bk = FEW_TILE.get(kind, GEMM_TILE[kind]) if rows <= FEW_ROWS else GEMM_TILE[kind]
    group = getattr(layer, "group_size", getattr(layer, "blocksize", -1))
    # only where the layer then reads a group per tile (plain order; NF4 rows of whole blocks)
    if 16 <= group < bk and bk % group == 0 and layer.kernel_args(group)[1]["GROUP"]:
        bk = group
    return bn, bk


def path(layer, rows: int) -> str:
    """Which way matmul multiplies rows of x by the layer's W: "gemv" by W in float32 (the value of
    dequantize in float32), "gemm" (tensor cores) and "dense" (torch's matmul) by W in x's dtype."""
    return "dense" if rows >= DENSE_ROWS[layout(layer)] else "gemv" if rows <= GEMV_ROWS else "gemm"


def matmul(x: torch.Tensor, layer, split: int | None = None) -> torch.Tensor:
    """x [..., K] @ W^T in x's dtype, W as path() says. Below DENSE_ROWS rows W is never written out,
    the sums are float32, and split (slices of K; None: by the device) is summed in a fixed order, so
    that a call gives the same y every time; from DENSE_ROWS, torch's matmul of x and the dequantized W
    (under torch's precision settings: TF32, reduced-precision reductions)."""
    _check(x, layer)
    n, k = layer.out_features, layer.in_features
    if x.shape[-1] != k:
        raise QuantkitError(f"input of {x.shape[-1]} features for a layer of {k}")
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    way = path(layer, m)
    if way == "dense":
        return dense(x2, layer).view(*x.shape[:-1], n)
    jit = _jit()
    bn, bk = tile(layer, m)
    args, consts = layer.kernel_args(bk)
    gemv = way == "gemv"
    order = consts.pop("ORDER")  # the GEMV reads x through it; a GEMM tile of x read so would be BM x BK
    if order and not gemv:  # scattered loads per tile of W: x's columns reordered once instead
        x2 = x2.index_select(1, args[4])
    if gemv:
        grid, per_sm = (cdiv(n, bn), 1, m), GEMV_PROGRAMS
    else:
        bm = min(GEMM_ROWS, max(16, 1 << (m - 1).bit_length()))
        grid, per_sm = (cdiv(m, bm), cdiv(n, bn), 1), GEMM_PROGRAMS
    tiles = grid[0] * grid[1] * grid[2]
    split = min(split or split_for(x, tiles, k, bk, per_sm), (2**31 - 1) // (m * n))  # int32 offsets into part
    k_split = cdiv(cdiv(k, split), bk) * bk
    split = cdiv(k, k_split)
    y = x2.new_empty(m, n)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    count = counts(x.device, tiles) if split > 1 else y
    with on(x):
        if gemv:
            jit.gemv_kernel[(grid[0], split, m)](x2, y, part, count, *args, n, k, k_split, **consts, ORDER=order, BN=bn, BK=bk,
                                                 SPLIT=split > 1, WORDS=words(consts), **GEMV_LAUNCH[layout(layer)])
        else:
            precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32: no tf32 rounding of x
            upcast = not x.is_cuda and x.dtype == torch.bfloat16
            jit.gemm_kernel[(grid[0], grid[1], split)](x2, y, part, count, *args, m, n, k, k_split, **consts, BM=bm,
                                                       BN=bn, BK=bk, PRECISION=precision, UPCAST=upcast, WORDS=words(consts),
                                                       SPLIT=split > 1, **GEMM_LAUNCH)
    return y.view(*x.shape[:-1], n)


def dense(x: torch.Tensor, layer) -> torch.Tensor:
    """x W^T by torch's matmul of x and W dequantized by the kernel in x's dtype (differentiable in x).
    W comes in the order the kernels read it, its tiles written contiguously (as DENSE_ROWS was
    measured), and x's columns are gathered to it where that is another order."""
    _check(x, layer)
    args, consts = layer.kernel_args(DEQUANT_TILE[1])
    if consts["ORDER"]:
        x = x.index_select(-1, args[4])
    return torch.nn.functional.linear(x, dequantize(layer, x.dtype, stored=True))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
