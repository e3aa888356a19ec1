"""Triton kernels and packed layers against the torch reference. Without a GPU the kernels run in
Triton's interpreter (conftest sets TRITON_INTERPRET=1); with one, on it.

Dequantization must be exact. A matmul must equal the float32 product of x and the dequantized W
rounded to x's dtype, within one unit in the last place of that dtype (the kernels sum in a different
order), plus 1e-5 of the largest output for cancellation in float32 sums; W in float32 where the
GEMV runs, in x's dtype where tensor cores or torch's matmul take it (kernels.path).
"""
import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import quantkit
from quantkit import QuantkitError, blocks, kernels
from quantkit import qlinear
from quantkit.qlinear import GPTQLinear, NF4Linear
from quantkit.qtensor import QuantizedTensor
from quantkit.quantizers import nf4, rtn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OUTPUTS = {2: 48, 3: 96, 4: 40, 8: 44}  # out_features: whole words of zeros, not multiples of the tiles
IN = 160  # in_features: a multiple of 32 (the layout), not of the 64-input tiles nor of groups of 64 or 128


def grid(bits: int, group_size: int, act_order: bool, seed: int = 0, n: int | None = None, k: int = IN,
         sym: bool | None = None):
    """sym: symmetric codes (one zero point for all); default: for even widths."""
    g = torch.Generator().manual_seed(seed)
    sym = bits % 2 == 0 if sym is None else sym
    qt = rtn.quantize(torch.randn(n or OUTPUTS[bits], k, generator=g), bits, group_size, sym=sym)
    if act_order:
        qt.g_idx = qt.g_idx[torch.randperm(k, generator=g)].contiguous()
    return qt


def assert_product(y: torch.Tensor, x: torch.Tensor, source, layer=None) -> None:
    """W is source.dequantize(dtype): in float32 where layer's matmul takes the GEMV for x's rows
    (kernels.path), else in x's dtype."""
    gemv = layer is not None and kernels.path(layer, x.reshape(-1, x.shape[-1]).shape[0]) == "gemv"
    w = source.dequantize(torch.float32 if gemv else x.dtype).to(x.device)
    ref = (x.float() @ w.float().T).to(x.dtype).float()
    eps = torch.finfo(x.dtype).eps
    torch.testing.assert_close(y.float(), ref, rtol=eps, atol=1e-5 * ref.abs().max().item())


@pytest.fixture
def fused(monkeypatch):
    """Every row count through the fused kernels (none dequantizes W for torch's matmul)."""
    monkeypatch.setattr(kernels, "DENSE_ROWS", dict.fromkeys(kernels.DENSE_ROWS, 1 << 30))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [-1, 32, 64, 128])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_dequantize_exact(bits, group_size, act_order):
    qt = grid(bits, group_size, act_order)
    layer = GPTQLinear.from_tensor(qt).to(DEVICE)
    for dtype in (torch.float16, torch.bfloat16):
        ref = qt.dequantize(dtype)
        assert torch.equal(layer.dequantize(dtype).cpu(), ref)  # the torch fallback
        assert torch.equal(kernels.dequantize(layer, dtype).cpu(), ref)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [-1, 32, 64, 128])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_matmul(bits, group_size, act_order):
    qt = grid(bits, group_size, act_order, seed=1)
    layer = GPTQLinear.from_tensor(qt).to(DEVICE)
    g = torch.Generator().manual_seed(2)
    for rows in (1, 3, 21):  # GEMV, GEMV over 3 rows, GEMM with a partial tile
        x = torch.randn(rows, IN, generator=g).half().to(DEVICE)
        assert_product(kernels.matmul(x, layer), x, qt, layer)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [-1, 32, 128, 256])
def test_gptq_groups_whole_tiles(bits, group_size):
    """No act-order and groups that hold whole tiles: scales and zeros read once per tile (the GROUP
    path of the kernels; the GEMV's jit._gemv_words for 2, 4 and 8 bits, K in 3 slices), with a zero point
    per output and group (asymmetric codes) and one for all (symmetric); K=512 so that every group size
    divides it, and groups of 256 span two of the GEMV's tiles."""
    for sym in (False, True):
        qt = grid(bits, group_size, False, seed=5, k=512, sym=sym)
        layer = GPTQLinear.from_tensor(qt).to(DEVICE)
        assert layer.plain_order
        assert torch.equal(kernels.dequantize(layer, torch.float16).cpu(), qt.dequantize(torch.float16))
        cases = [(1, torch.float16), (21, torch.float16)] + [(1, torch.bfloat16), (1, torch.float32)] * (not sym)
        for rows, dtype in cases:
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype).to(DEVICE)
            assert_product(kernels.matmul(x, layer, split=3 if rows == 1 else None), x, qt, layer)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 9, 70])
@pytest.mark.parametrize("act_order", [True, False])
def test_matmul_dtypes_and_split(dtype, rows, act_order):
    """Every activation dtype; K split across programs (float32 partial sums added by the program
    that finishes last), in the GEMV and the GEMM; 9 rows: the GEMM's tile for few rows (FEW_TILE);
    70 rows: two GEMM tiles. In plain order the GEMV takes its own path (jit._gemv_words: codes into
    float32 by their bits, the scale after the sum). A split call twice gives the same bits: the slices
    are added in one order (which only a GPU, running programs at once, could upset; the interpreter
    runs them one by one)."""
    qt = grid(4, 64, act_order, seed=3, n=136, k=416)
    layer = GPTQLinear.from_tensor(qt).to(DEVICE)
    x = torch.randn(rows, 416, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    assert_product(kernels.matmul(x, layer), x, qt, layer)
    y = kernels.matmul(x, layer, split=3)
    assert_product(y, x, qt, layer)
    assert torch.equal(kernels.matmul(x, layer, split=3), y)
    assert not kernels.counts(x.device, 1).any()  # left zero for the next call


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits, group_size, k", [(4, 64, 448), (4, 96, 288), (3, 96, 288)])
def test_act_order_read_through_the_order(dtype, bits, group_size, k, monkeypatch):
    """Act-order with whole groups, read through the order (kernel_args' ORDER) in every activation
    dtype: the GEMV (1 and 2 rows) and the GEMM (3 and 9), K split, tiles of one group (64), tiles across
    groups with K not whole tiles (96: GROUP 0), 3-bit codes value by value, and from DENSE_ROWS."""
    qt = grid(bits, group_size, True, seed=11, n=96, k=k)
    layer = GPTQLinear.from_tensor(qt).to(DEVICE)
    assert layer.kernel_args(64)[1]["ORDER"]
    for rows in (1, 2, 3, 9):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype).to(DEVICE)
        for dense_rows in (1 << 30, 1):
            monkeypatch.setattr(kernels, "DENSE_ROWS", dict.fromkeys(kernels.DENSE_ROWS, dense_rows))
            assert_product(kernels.matmul(x, layer), x, qt, layer)
        assert_product(kernels.matmul(x, layer, split=3), x, qt, layer)


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU a CPU input is refused before, as not a CUDA tensor")
def test_an_input_on_another_device_is_refused():
    """The kernels take raw pointers: x on another device than the layer is refused by name."""
    layer = GPTQLinear.from_tensor(grid(4, 32, True, n=96))
    for call in (kernels.matmul, kernels.dense):
        with pytest.raises(QuantkitError, match="input on meta for a layer on cpu"):
            call(torch.randn(1, IN, device="meta"), layer)


@pytest.mark.parametrize("group_size", [16, 32, 64, 128, 256])
def test_tiles_hold_one_group(group_size):
    """A group in plain order no wider than a tile's inputs gets tiles within one group, so the kernels
    read its scales once per tile, and so does act-order with whole groups (read as its twin in group
    order); uneven groups are read per column whatever the tile."""
    for act_order in (False, True):
        layer = GPTQLinear.from_tensor(grid(4, group_size, act_order, n=64, k=512))
        for rows in (1, 16):
            bk = kernels.tile(layer, rows)[1]
            assert layer.kernel_args(bk)[1]["GROUP"] == group_size
    odd = GPTQLinear.from_tensor(uneven(grid(4, 64, True, n=64, k=512)))
    assert odd.kernel_args(kernels.tile(odd, 1)[1])[1]["GROUP"] == 0


@pytest.mark.parametrize("words", [True, False])
@pytest.mark.parametrize("rows", [1, 9])
def test_last_slice_reads_no_group_past_k(words, rows, monkeypatch):
    """Three slices of 256 inputs (tiles of 64) over K = 640: the last one would reach its third and
    fourth tiles past K, in no group, but stops at K. The scales and zeros end where NaN follows, so a
    read past them would reach the product. 1 row: the GEMV; 9: the GEMM."""
    monkeypatch.setattr(kernels, "WORDS", words)
    monkeypatch.setitem(kernels.GEMV_TILE, "gptq", (128, 64))
    monkeypatch.setitem(kernels.FEW_TILE, "gptq", (128, 64))
    qt = grid(4, 128, False, seed=5, n=136, k=640)
    layer = GPTQLinear.from_tensor(qt).to(DEVICE)
    assert kernels.tile(layer, 1) == (128, 64)
    assert layer.kernel_args(64)[1]["GROUP"] == 128  # each tile in one group
    for name in ("scales", "qzeros"):
        t = getattr(layer, name)
        tail = torch.full((t.shape[0] + 4, t.shape[1]), -1, dtype=t.dtype, device=t.device)
        if t.is_floating_point():
            tail.fill_(float("nan"))
        tail[: t.shape[0]] = t
        setattr(layer, name, tail[: t.shape[0]])
    x = torch.randn(rows, 640, generator=torch.Generator().manual_seed(6)).half().to(DEVICE)
    assert_product(kernels.matmul(x, layer, split=3), x, qt, layer)


@pytest.mark.parametrize("rows", [1, 9])
def test_split_sums_over_chunks(rows):
    """36 tiles of 32 inputs in 20 slices: the last program adds the slices' sums a chunk at a time
    (16 at a time in the GEMV, 2 in the 16 x 128 GEMM tile), so several chunks and a short last one."""
    qt = grid(4, 32, False, seed=11, n=40, k=1152)
    layer = GPTQLinear.from_tensor(qt).to(DEVICE)
    x = torch.randn(rows, 1152, generator=torch.Generator().manual_seed(12)).half().to(DEVICE)
    assert kernels.tile(layer, rows)[1] == 32
    assert_product(kernels.matmul(x, layer, split=20), x, qt, layer)


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
@pytest.mark.parametrize("block_size,double_quant", [(64, False), (64, True), (128, True), (256, False)])
def test_nf4_dequantize_exact_and_matmul(kind, block_size, double_quant, fused):
    w = torch.randn(37, 333, generator=torch.Generator().manual_seed(block_size))  # odd count: a padded nibble
    qt = nf4.quantize(w, kind, block_size, double_quant)
    layer = NF4Linear.from_tensor(qt).to(DEVICE)
    for dtype in (torch.float16, torch.bfloat16):
        ref = qt.dequantize(dtype)
        assert torch.equal(layer.dequantize(dtype).cpu(), ref)
        assert torch.equal(kernels.dequantize(layer, dtype).cpu(), ref)
    for rows in (1, 19):
        x = torch.randn(rows, 333, generator=torch.Generator().manual_seed(rows)).half().to(DEVICE)
        assert_product(kernels.matmul(x, layer), x, qt, layer)


@pytest.mark.parametrize("kind,block_size,double_quant", [("nf4", 64, True), ("fp4", 128, False), ("nf4", 256, True)])
def test_nf4_tiles_in_one_block(kind, block_size, double_quant, fused):
    """Rows of whole blocks: every tile lies in one block per output (kernel_args' GROUP), so the kernels
    read the codes a byte at a time and each absmax once per tile (jit._gemv_nf4, _weight's WORDS);
    40 outputs end in a part tile, and 3 slices of K meet in _finish."""
    g = torch.Generator().manual_seed(block_size)
    qt = nf4.quantize(torch.randn(40, 512, generator=g), kind, block_size, double_quant)
    layer = NF4Linear.from_tensor(qt).to(DEVICE)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert torch.equal(kernels.dequantize(layer, dtype).cpu(), qt.dequantize(dtype))
    for rows in (1, 3, 19):
        consts = layer.kernel_args(kernels.tile(layer, rows)[1])[1]
        assert consts["GROUP"] == block_size and kernels.words(consts)
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.randn(rows, 512, generator=g).to(dtype).to(DEVICE)
            for split in (None, 3):
                assert_product(kernels.matmul(x, layer, split), x, qt, layer)


@pytest.mark.parametrize("kind", ["gptq", "nf4"])
def test_dense_rows_dequantize_then_matmul(kind, monkeypatch):
    """From DENSE_ROWS rows of x a matmul dequantizes W once and calls torch's matmul; below, the
    fused kernels; both give the product."""
    qt = grid(4, 64, True, seed=7, n=40, k=256) if kind == "gptq" else nf4.quantize(torch.randn(40, 256), "nf4", 64, True)
    layer = qlinear.from_tensor(qt).to(DEVICE)
    monkeypatch.setattr(kernels, "DENSE_ROWS", dict.fromkeys(kernels.DENSE_ROWS, 6))
    calls, dequantize = [], kernels.dequantize
    monkeypatch.setattr(kernels, "dequantize", lambda *a, **kw: calls.append(a) or dequantize(*a, **kw))
    for shape, dense in (((1, 256), False), ((5, 256), False), ((6, 256), True), ((2, 10, 256), True)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])).half().to(DEVICE)
        y = kernels.matmul(x, layer)
        assert y.shape == (*shape[:-1], 40)
        assert_product(y.reshape(-1, 40), x.reshape(-1, 256), qt, layer)
        assert len(calls) == dense
        calls.clear()


def test_torch_fallback_slices_rows(monkeypatch):
    """The fallback dequantizes a slice of rows at a time; slices must meet exactly."""
    torch.manual_seed(0)
    monkeypatch.setattr(qlinear, "CHUNK", 32 * IN)  # 32 rows of W per slice
    qt = grid(3, 64, True, n=96)
    layer = GPTQLinear.from_tensor(qt, bias=torch.randn(96))
    layer.backend = "torch"
    x = torch.randn(2, 5, IN, generator=torch.Generator().manual_seed(0))
    ref = torch.nn.functional.linear(x, qt.dequantize(), layer.bias)
    # float32 sums in another order: 1e-5 of the largest output
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    q4 = nf4.quantize(torch.randn(45, 63), "nf4", 64, True)
    monkeypatch.setattr(qlinear, "CHUNK", 7 * 63)  # slices that start inside a byte and inside an absmax block
    l4 = NF4Linear.from_tensor(q4)
    assert torch.equal(torch.cat([l4.dequantize(torch.float32, r, min(r + 7, 45)) for r in range(0, 45, 7)]),
                       q4.dequantize())
    # torch's CPU float16 matmul takes a transposed weight ~20x slower: the GPTQ layout's slices come contiguous
    assert layer.dequantize(torch.float16, 0, 32).is_contiguous()
    assert torch.equal(layer.dequantize(torch.float16, 0, 32), qt.dequantize()[:32].half())


@pytest.mark.parametrize("group_size", [-1, 32, 64, 128])
@pytest.mark.parametrize("act_order", [False, True])
def test_cpu_int4_path(group_size, act_order):
    """4-bit weights in plain group order, or in act-order with whole groups (their columns and x's
    taken in group order), with bfloat16 inputs run torch's fused int4 matmul on the CPU (K=160 pads to
    whole kernel groups, N=40 to the kernel's 16). It rounds s and (8 - z) s to bfloat16 (2^-9 relative
    each, |q - 8| and |8 - z| at most 8) and may round the weight, |q - z| s <= 15 s, once more: each
    weight is off by at most 31 s 2^-9 < s / 16; the output is rounded to bfloat16 (2^-8)."""
    if act_order and group_size == -1:
        pytest.skip("per channel, act-order is plain order (every g_idx is 0)")
    qt = grid(4, group_size, act_order, seed=6)
    layer = GPTQLinear.from_tensor(qt, bias=torch.randn(OUTPUTS[4]))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, IN, generator=g).bfloat16()
    with torch.no_grad():
        y = layer.fused(x)
        assert y is not None and (layer.fused(x.float()) is not None) == (blocks.library() is not None)  # the GEMV
        assert layer.fused(torch.zeros(qlinear.FUSED_ROWS + 1, IN).bfloat16()) is None  # and at many rows
        assert torch.equal(layer(x), y + layer.bias.bfloat16())
        xt = torch.randn(IN, 3, generator=g).bfloat16().T  # a view the kernel cannot read as it is, nor pad a copy of
        assert torch.equal(layer.fused(xt), layer.fused(xt.contiguous()))
    x2, y2 = x.reshape(-1, IN).float(), y.reshape(-1, OUTPUTS[4]).float()
    exact = x2 @ qt.dequantize().T
    bound = x2.abs() @ qt.scales.float()[:, qt.g_idx.long()].T / 16 + exact.abs() * 2 ** -8
    assert ((y2 - exact).abs() <= bound).all()
    x = torch.randn(5, IN, generator=g).bfloat16().requires_grad_()
    layer(x).sum().backward()  # the fallback: the fused kernel has no backward
    torch.testing.assert_close(x.grad, torch.ones(5, OUTPUTS[4]).bfloat16() @ qt.dequantize(torch.bfloat16))
    assert GPTQLinear.from_tensor(grid(8, group_size, act_order)).int4 is None
    if act_order:  # groups of unequal sizes: no order makes them plain
        assert GPTQLinear.from_tensor(uneven(qt)).int4 is None


def uneven(qt: QuantizedTensor) -> QuantizedTensor:
    """A copy of qt whose g_idx has groups of unequal numbers of columns (valid GPTQ, unlike act-order's)."""
    g_idx = torch.randint(0, int(qt.g_idx.max()) + 1, qt.g_idx.shape, generator=torch.Generator().manual_seed(8),
                          dtype=torch.int32)
    return dataclasses.replace(qt, g_idx=g_idx)


def gemv_layers():
    """Every layout the compiled GEMV reads: GPTQ's 2, 3, 4 and 8 bits per channel, in groups, in
    act-order and in uneven groups; NF4 and FP4 with and without double quantization."""
    layers = {}
    for bits in (2, 3, 4, 8):  # outputs in 10 or 20 units of 8: 3 shares of unequal size below
        for group_size, act_order in ((-1, False), (32, False), (64, False), (32, True)):
            layers[f"gptq{bits}-g{group_size}{'-act' if act_order else ''}"] = grid(bits, group_size, act_order, seed=bits,
                                                                                   n=160 if bits == 3 else 80)
    layers["gptq4-uneven"] = uneven(grid(4, 32, True, seed=11))
    w = torch.randn(56, 256, generator=torch.Generator().manual_seed(12))
    across = torch.randn(40, 96, generator=torch.Generator().manual_seed(14))  # blocks that run from row to row
    for kind in ("nf4", "fp4"):
        for block, double in ((64, False), (128, True), (256, True)):
            layers[f"{kind}-b{block}{'-dq' if double else ''}"] = nf4.quantize(w, kind, block, double)
            layers[f"{kind}-b{block}{'-dq' if double else ''}-across"] = nf4.quantize(across, kind, block, double)
    return layers


GEMV_LAYERS = gemv_layers()


@pytest.mark.parametrize("name", list(GEMV_LAYERS))
def test_cpu_gemv(name, monkeypatch):
    """The compiled GEMV (quantkit/kernels/gemv.c) on the CPU, for 1 to GEMV_ROWS rows of x: each weight is
    the float32 value dequantize gives it and only the sums' order differs, so each output is within
    (K + 1) 2^-24 sum |x| |w| of the exact product (float32's bound for a sum of K products in any
    order). Any split of the outputs over threads gives the same values; x in bfloat16 is multiplied in
    float32; more rows, and gradients, take the sliced fallback."""
    if blocks.library() is None:
        pytest.skip("the compiled kernels were not built")
    qt = GEMV_LAYERS[name]
    layer = qlinear.from_tensor(qt)
    assert layer.gemv_fits()
    n, k = qt.shape
    w = qt.dequantize().double()
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for start in range(0, k, qlinear.GEMV_ROWS):  # x one-hot: each weight is dequantize's float32 value
            eye = torch.eye(k)[start:start + qlinear.GEMV_ROWS]
            assert torch.equal(layer(eye), w.float()[:, start:start + qlinear.GEMV_ROWS].T)
        for rows in (1, 3, 4, 5, 9, qlinear.GEMV_ROWS):
            x = torch.randn(rows, k, generator=g)
            y = layer(x)  # act-order with whole groups: x's columns in group order, and the twin's GEMV
            exact = x.double() @ w.T
            bound = (k + 1) * 2 ** -24 * (x.double().abs() @ w.abs().T)
            for z in (y, layer.gemv(x)):  # and in act-order
                assert ((z.double() - exact).abs() <= bound).all(), rows
            monkeypatch.setattr(qlinear, "GEMV_SPLIT", 0)
            monkeypatch.setattr(blocks, "threads", lambda: 3)  # shares of whole units, the last shorter
            assert torch.equal(layer(x), y)
            monkeypatch.undo()
        x3 = torch.randn(2, 3, k, generator=g)
        assert torch.equal(layer.gemv(x3.bfloat16()), layer.gemv(x3.bfloat16().float()).bfloat16())
        assert layer.gemv(torch.zeros(qlinear.GEMV_ROWS + 1, k)) is None
        assert layer.gemv(x.double()) is None  # float64: the fallback's float64 product
        with torch.autocast("cpu", dtype=torch.bfloat16):  # x cast as autocast casts a linear's: the fused paths
            y = layer(x)  # take it (before, the fallback dequantized the whole weight per call)
            assert layer.gemv(x.bfloat16()) is not None
        assert y.dtype == torch.bfloat16 and torch.equal(y, layer(x.bfloat16()))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # float16 in: nn.Linear's bfloat16 out, the GEMV's rows too
            assert layer(x.half()).dtype == torch.nn.functional.linear(x.half(), w.half()).dtype == torch.bfloat16
        assert layer.gemv(x.to("meta")) is None and copy.deepcopy(layer).to("meta").gemv(x) is None  # off the CPU
        assert ("-act" in name) == (layer.__dict__.get("grouped") is not None)  # the twin was made and used
    x = torch.randn(2, k, generator=g, requires_grad=True)
    torch.testing.assert_close(layer(x), x.detach() @ w.float().T)  # with a gradient: the fallback
    layer.backend = "torch"
    with torch.no_grad():
        assert torch.equal(layer(x), layer.sliced(x))


def test_cpu_gemv_builds_for_every_target_agree(tmp_path, monkeypatch):
    """gemv.c built for the baseline x86-64 (SSE2), for AVX2 and, where this CPU runs it, AVX-512 (the
    clones the installed build chooses from at load) gives the installed build's bits: the same
    float32 operations in the same order on every target, whichever the CPU picks."""
    import platform
    import shutil

    gcc = shutil.which("gcc")
    installed = blocks.library()
    cpuinfo = Path("/proc/cpuinfo")
    if gcc is None or installed is None or platform.machine() != "x86_64" or not cpuinfo.is_file():
        pytest.skip("needs gcc, the installed build and an x86-64 Linux CPU")
    source = Path(__file__).resolve().parents[1] / "quantkit" / "kernels" / "gemv.c"
    flags = set(cpuinfo.read_text().split())
    needs = {"x86-64": set(), "x86-64-v3": {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"},
             "x86-64-v4": {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "avx512f", "avx512bw", "avx512cd",
                           "avx512dq", "avx512vl"}}
    targets = [t for t, need in needs.items() if need <= flags]  # each one this CPU runs
    layouts = {name: qlinear.from_tensor(GEMV_LAYERS[name]) for name in ("gptq3-g32-act", "gptq4-g64", "nf4-b128-dq", "fp4-b64")}
    g = torch.Generator().manual_seed(14)
    xs = {name: [torch.randn(rows, layer.in_features, generator=g) for rows in (1, 5)] for name, layer in layouts.items()}
    with torch.no_grad():
        want = {name: [layer.gemv(x) for x in xs[name]] for name, layer in layouts.items()}
    for target in targets:
        path = tmp_path / f"gemv-{target}.so"  # without __linux__: no clones, this target alone
        subprocess.run([gcc, "-O3", "-ffp-contract=off", "-Wno-psabi", f"-march={target}", "-U__linux__", "-shared",
                        "-fPIC", "-o", str(path), str(source)], check=True)
        import ctypes

        lib = ctypes.CDLL(str(path))
        for fn in ("gptq_gemv", "nf4_gemv"):
            getattr(lib, fn).argtypes = getattr(installed, fn).argtypes
        monkeypatch.setattr(blocks, "library", lambda: lib)
        with torch.no_grad():
            for name, layer in layouts.items():
                assert all(torch.equal(layer.gemv(x), y) for x, y in zip(xs[name], want[name])), (target, name)
        monkeypatch.undo()


def test_cpu_gemv_declines_what_it_does_not_read():
    """GPTQ outputs not in eights, and NF4 rows not in runs of 16 codes (blocks across rows it reads: SmolLM2's
    576 inputs in blocks of 128 took the fallback, 51x a dense matmul at one row)."""
    assert not GPTQLinear.from_tensor(grid(8, 32, False, n=44)).gemv_fits()
    layer = NF4Linear.from_tensor(nf4.quantize(torch.randn(8, 40), "nf4", 64))
    assert not layer.gemv_fits() and layer.fused(torch.randn(1, 40)) is None


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_act_order_kernels_read_group_order(bits, monkeypatch):
    """The kernels take an act-order layer with whole groups as its twin in plain group order (made
    once): the GEMV reads x's columns through the order itself (no reordered copy of x), and so does
    dequantize W's; the GEMM and, from DENSE_ROWS, the dense path take x's columns gathered once. The
    checkpoint's buffers and state stay as loaded; moving the layer makes the twin again on its
    device; uneven groups keep act-order."""
    qt = grid(bits, 32, True, seed=9, n=96)
    layer = GPTQLinear.from_tensor(qt).to(DEVICE)
    layer.backend = "triton"
    state = {key: t.clone() for key, t in layer.state_dict().items()}
    monkeypatch.setattr(GPTQLinear, "ordered", None)  # the CPU GEMV's reorder of x: not for the kernels
    w = qt.dequantize(torch.float16).to(DEVICE)
    assert torch.equal(kernels.dequantize(layer), w)
    assert torch.equal(kernels.dequantize(layer, stored=True), w[:, layer.order])  # the dense path's W
    for rows in (1, 9):
        x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(10)).half().to(DEVICE)
        for dense_rows in (1 << 30, 1):
            monkeypatch.setattr(kernels, "DENSE_ROWS", dict.fromkeys(kernels.DENSE_ROWS, dense_rows))
            with torch.no_grad():
                assert_product(layer(x), x, qt, layer)
            assert_product(kernels.matmul(x, layer, split=3), x, qt, layer)
    twin = layer.grouped
    assert twin.plain_order and layer.kernel_args(32)[1]["ORDER"] and kernels.layout(layer) == "gptq"
    assert torch.equal(twin.dequantize(), layer.dequantize()[:, layer.order])
    assert layer.state_dict().keys() == state.keys() and all(torch.equal(t, state[key]) for key, t in layer.state_dict().items())
    layer.to(DEVICE)
    assert "grouped" not in layer.__dict__ and "order" not in layer.__dict__
    assert GPTQLinear.from_tensor(grid(4, 64, False)).order is None  # plain, with a short last group (K = 160)
    short = GPTQLinear.from_tensor(grid(4, 64, True))  # act-order with one: x sorted for the CPU's int4, no twin
    assert short.order is not None and short.grouped is None and not short.kernel_args(32)[1]["ORDER"]
    odd = uneven(qt)
    other = GPTQLinear.from_tensor(odd).to(DEVICE)
    assert other.order is None and kernels.layout(other) == "act-order"
    other.backend = "triton"
    with torch.no_grad():
        assert_product(other(x), x, odd, other)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_quant_linear_module(backend):
    torch.manual_seed(0)
    qt = grid(4, 32, False, n=72)
    layer = GPTQLinear.from_tensor(qt, bias=torch.randn(72)).to(DEVICE)
    layer.backend = backend
    x = torch.randn(2, 3, IN, generator=torch.Generator().manual_seed(0)).to(DEVICE).requires_grad_()
    y = layer(x)  # with a gradient wanted: the kernels dequantize, torch multiplies
    ref_x = x.detach().clone().requires_grad_()
    ref = torch.nn.functional.linear(ref_x, qt.dequantize().to(DEVICE), layer.bias)
    tol = {"rtol": 1e-5, "atol": 1e-5 * ref.abs().max().item()}  # float32 sums in another order
    torch.testing.assert_close(y, ref, **tol)
    y.square().sum().backward()
    ref.square().sum().backward()
    # float32 sums in another order: 1e-5 of the largest gradient
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-5 * ref_x.grad.abs().max().item())
    with torch.no_grad():
        torch.testing.assert_close(layer(x), ref, **tol)
    assert not any(p.requires_grad for p in layer.parameters())


def test_state_dict_g_idx_checked_on_load():
    """A state dict loaded into a GPTQ layer: g_idx's values index the scales, so one out of range is
    refused (the GEMV would read past them), and an act-order g_idx makes every path act-order."""
    state = GPTQLinear.from_tensor(grid(4, 32, False)).state_dict()
    with pytest.raises(QuantkitError, match=r"g_idx in \[268435456, 268435456\] does not fit"):
        GPTQLinear.from_tensor(grid(4, 32, False)).load_state_dict({**state, "g_idx": torch.full_like(state["g_idx"], 1 << 28)})
    act = grid(4, 32, True, seed=3)
    layer = GPTQLinear.from_tensor(grid(4, 32, False, seed=3))
    layer.load_state_dict(GPTQLinear.from_tensor(act).state_dict())
    assert not layer.plain_order and torch.equal(layer.dequantize(), act.dequantize())


def test_casting_keeps_packed_buffers():
    """model.to(bfloat16) must not round the fp16 scales; only the bias follows the model's dtype."""
    qt = grid(4, 32, False)
    layer = GPTQLinear.from_tensor(qt, bias=torch.randn(OUTPUTS[4]))
    scales = layer.scales.clone()
    layer.to(torch.bfloat16)
    assert layer.scales.dtype == torch.float16 and torch.equal(layer.scales, scales)
    assert layer.bias.dtype == torch.bfloat16 and layer.qweight.dtype == torch.int32
    nf = NF4Linear.from_tensor(nf4.quantize(torch.randn(8, 64), "nf4", 64, True)).half()
    assert nf.absmax.dtype == torch.uint8 and nf.nested_absmax.dtype == torch.float32


@pytest.mark.parametrize("make", [lambda: GPTQLinear.from_tensor(grid(4, 32, True, n=72)),
                                  lambda: NF4Linear.from_tensor(nf4.quantize(torch.randn(72, IN), "nf4", 64, True))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_frozen_base_keeps_no_float_weight_for_the_backward(make, dtype, monkeypatch):
    """With a gradient wanted for x, torch's linear kept each dequantized slice of W until the backward:
    a float copy of every layer's weight through the whole forward, QLoRA's base at bf16's size. Now
    nothing of W is kept, the backward dequantizes it again (in slices of 32 rows here), and x's
    gradient is g W."""
    monkeypatch.setattr(qlinear, "CHUNK", 32 * IN)
    layer = make()
    kept = []
    x = torch.randn(3, 5, IN, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel() * t.element_size()) or t, lambda t: t):
        y = layer(x)
    assert sum(kept) == 0, kept
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    y.backward(g)
    w = layer.dequantize(torch.float32)
    eps = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps  # float32 sums in another order; bf16's rounding
    for got, want in ((y, x.detach().float() @ w.T), (x.grad, g.float() @ w)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=eps, atol=eps * want.abs().max().item())


def test_torchs_default_dtype_and_device_do_not_reach_the_gemv():
    """The compiled GEMV's output was made in torch's default dtype on its default device: float64 gave
    garbage, bfloat16 a buffer half the size it writes (a corrupted heap), the meta device a null pointer."""
    layers = [GPTQLinear.from_tensor(grid(4, 32, False, n=72)),
              NF4Linear.from_tensor(nf4.quantize(torch.randn(72, IN), "nf4", 64, True))]
    x = torch.randn(2, IN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = [layer(x) for layer in layers]
        for default in (torch.float64, torch.bfloat16):
            before = torch.get_default_dtype()
            torch.set_default_dtype(default)
            try:
                assert all(torch.equal(layer(x), y) for layer, y in zip(layers, want))
            finally:
                torch.set_default_dtype(before)
        with torch.device("meta"):
            assert all(torch.equal(layer(x), y) for layer, y in zip(layers, want))


def test_the_gemv_splits_over_the_threads_torch_is_given(monkeypatch):
    """torch.set_num_threads(1) (or OMP_NUM_THREADS=1) left the GEMV's split on every core."""
    monkeypatch.setattr(blocks.os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert blocks.threads() == 1
        torch.set_num_threads(3)
        assert blocks.threads() == 3
    finally:
        torch.set_num_threads(before)


def test_a_move_that_fails_leaves_the_layer_whole():
    """.to() took the packed buffers out before moving the rest: a move that failed left a layer with
    no weight, whose next forward was an AttributeError."""
    layer = GPTQLinear.from_tensor(grid(4, 32, False), bias=torch.randn(OUTPUTS[4]))
    x = torch.randn(2, IN)
    with torch.no_grad():
        y = layer(x)
        with pytest.raises((RuntimeError, AssertionError)):  # no CUDA build, or no 100th GPU
            layer.to("cuda:99")
        assert set(layer.PACKED) <= set(dict(layer.named_buffers())) and torch.equal(layer(x), y)
        # the packed weight runs out of memory on the way, after the bias could have moved: none has moved
        real = torch.Tensor.to

        def short_of_memory(t, *args, **kwargs):
            if t.dtype == torch.int32 and args and str(args[0]) == "meta":
                raise torch.OutOfMemoryError("out of memory")
            return real(t, *args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.Tensor, "to", short_of_memory)
            with pytest.raises(torch.OutOfMemoryError):
                layer.to("meta")
        assert all(t.device.type == "cpu" for t in layer.state_dict().values()) and torch.equal(layer(x), y)


def test_state_dict_assigned_takes_the_layers_dtypes():
    """load_state_dict(assign=True) installs the state dict's own tensors: an int64 g_idx (as g_idx often
    is) was then read as int32 by the GEMV, giving wrong outputs where the fallback gave right ones."""
    act = grid(4, 32, True, seed=3)
    state = {k: v.long() if k == "g_idx" else v for k, v in GPTQLinear.from_tensor(act).state_dict().items()}
    layer = GPTQLinear.from_tensor(grid(4, 32, False, seed=4))
    layer.load_state_dict(state, assign=True)
    assert layer.g_idx.dtype == torch.int32
    x = torch.randn(1, IN)
    with torch.no_grad():
        assert_product(layer(x), x, act)


def test_int4_operands_made_in_slices_are_those_made_whole(monkeypatch):
    """The CPU's int4 operands are made a slice of output rows at a time (whole, a 16384 x 4096 weight took
    0.8 GB more at the first call): torch packs them in blocks of 64 rows, so slices give the same bytes."""
    qt = grid(4, 32, False, n=200)  # 208 rows with the kernel's padding: a last slice of 16
    whole = GPTQLinear.from_tensor(qt).int4
    monkeypatch.setattr(qlinear, "INT4_SLICE", 64)
    sliced = GPTQLinear.from_tensor(qt).int4
    assert all(torch.equal(a, b) for a, b in zip(whole[:2], sliced[:2])) and whole[2:] == sliced[2:]


def test_an_input_of_another_width_is_named():
    layer = GPTQLinear.from_tensor(grid(4, 32, False))
    for x in (torch.randn(1, IN + 96), torch.randn(1, IN).long()):
        with pytest.raises(QuantkitError, match=f"input of {x.shape[-1]} features in {x.dtype} for a layer of {IN}"):
            layer(x)


def test_weights_past_int32_offsets_are_refused(monkeypatch):
    """The kernels index W in int32: a weight of 2^31 values or more is refused, not read out of place,
    and the auto backend takes the torch fallback for it."""
    layer = GPTQLinear.from_tensor(grid(4, 32, False, n=40, k=160))
    x = torch.randn(2, 160).half()
    monkeypatch.setattr(kernels, "OFFSETS", 40 * 160)
    for call in (lambda: kernels.matmul(x, layer), lambda: kernels.dequantize(layer)):
        with pytest.raises(QuantkitError, match=r"40x160 weight has 2\^31 values or more"):
            call()
    layer.backend = "triton"
    with pytest.raises(QuantkitError, match="int32 offsets"):
        layer(x)
    assert not kernels.fits(layer)
    if torch.cuda.is_available():
        layer.backend = "auto"
        y = layer.cuda()(x.cuda())
        assert_product(y, x.cuda(), layer)  # the torch fallback: W in x's dtype
    monkeypatch.setattr(kernels, "OFFSETS", 40 * 160 + 1)
    assert kernels.fits(layer)


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    if DEVICE == "cuda":
        pytest.skip("a GPU runs the kernels")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    layer = GPTQLinear.from_tensor(grid(4, 32, False))
    layer.backend = "triton"
    with pytest.raises(QuantkitError, match="CUDA tensors"):
        layer(torch.randn(1, IN))


@pytest.mark.parametrize("method,fmt", [("rtn", "safetensors"), ("nf4", "safetensors"), ("awq", "awq")])
def test_load_packed(tiny_dir, tmp_path, method, fmt):
    """A packed load holds the file's tensors in packed layers, no float weight, and computes what
    the dequantized load computes."""
    from .conftest import VALID

    kw = {"rtn": {"group_size": 32}, "nf4": {"double_quant": True},
          "awq": {"group_size": 32, "calib_data": VALID, "calib_samples": 4, "calib_seqlen": 64}}[method]
    m = quantkit.quantize(str(tiny_dir), method=method, out=tmp_path / "q", format=fmt, keep=True, progress=False, **kw)
    packed = quantkit.load(tmp_path / "q", packed=True)
    plain = quantkit.load(tmp_path / "q")
    kind = NF4Linear if method == "nf4" else GPTQLinear
    for name in m.tensors:
        assert isinstance(packed.module.get_submodule(name), kind)
        assert f"{name}.weight" not in packed.module.state_dict()
    assert not packed.tensors and packed.qconfig.method == m.qconfig.method
    if fmt == "safetensors":  # the file's own bytes, not a repacking
        state = load_file(tmp_path / "q" / "model.safetensors")
        name = next(iter(m.tensors))
        layer = packed.module.get_submodule(name)
        if method == "rtn":
            assert torch.equal(layer.qweight, state[f"{name}.qweight"])
        else:
            assert torch.equal(layer.packed, state[f"{name}.weight"].reshape(-1))
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(packed.module(ids).logits, plain.module(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method,fmt", [("rtn", "compressed-tensors"), ("awq", "awq")])
def test_exports_whose_inputs_the_gptq_layout_cannot_hold_read_back(tmp_path, method, fmt):
    """AWQ and compressed-tensors take any whole groups, and both readers repacked every grid into the
    GPTQ layout, which needs inputs in multiples of 32: a 48-wide model exported fine and was refused at
    every load, --dequantized too. Now such linears are held in float in a packed load; the others packed."""
    from .conftest import VALID, make_tiny

    model = make_tiny(tmp_path / "m", hidden=48, intermediate=96)  # down_proj's 96 inputs fit, the rest do not
    kw = {"calib_data": VALID, "calib_samples": 4, "calib_seqlen": 64} if method == "awq" else {}
    m = quantkit.quantize(str(model), method=method, group_size=16, out=tmp_path / "q", format=fmt, keep=True,
                          progress=False, **kw)
    plain, packed = quantkit.load(tmp_path / "q"), quantkit.load(tmp_path / "q", packed=True)
    assert plain.tensors.keys() == m.tensors.keys()
    assert all(torch.equal(plain.tensors[n].dequantize(), m.tensors[n].dequantize()) for n in m.tensors)
    kinds = {n: type(packed.module.get_submodule(n)) for n in m.tensors}
    assert {n for n, k in kinds.items() if k is GPTQLinear} == {n for n in m.tensors if n.endswith("down_proj")}
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(packed.module(ids).logits, plain.module(ids).logits, rtol=1e-4, atol=1e-4)


def edit_checkpoint(path, tensors=None, config=None):
    f = path / "model.safetensors"
    state = load_file(f)
    for key, fn in (tensors or {}).items():
        state[key] = fn(state[key])
    save_file(state, f, metadata={"format": "pt"})
    if config:
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"].update(config)
        (path / "config.json").write_text(json.dumps(cfg))


NAME = "model.layers.1.mlp.down_proj"


@pytest.mark.parametrize("tensors,config,match", [
    ({f"{NAME}.qweight": lambda t: t[:-4]}, None, r"qweight \(\d+, \d+\) holds 4-bit weights of \d+ inputs, g_idx"),
    ({f"{NAME}.scales": lambda t: t[:-1]}, None, "scales is"),
    ({f"{NAME}.g_idx": lambda t: t + 7}, None, "g_idx in"),
    ({f"{NAME}.qzeros": lambda t: t.float()}, None, "qzeros is torch.float32"),
    ({f"{NAME}.scales": lambda t: t.to(torch.uint8)}, None, "scales is torch.uint8"),
    ({f"{NAME}.g_idx": lambda t: t[:-32]}, None, r"qweight \(\d+, \d+\) holds 4-bit weights of \d+ inputs, g_idx \(\d+,\) indexes"),
    ({f"{NAME}.g_idx": lambda t: t.float()}, None, "g_idx is torch.float32"),
    (None, {"bits": 5}, "5-bit weights are not supported"),
    (None, {"group_size": 0}, "group size 0 is not supported"),
    (None, {"group_size": 64}, "in groups of 64"),
])
@pytest.mark.parametrize("packed", [True, False])
def test_bad_gptq_checkpoint_fails_at_load(tiny_dir, tmp_path, tensors, config, match, packed):
    quantkit.quantize(str(tiny_dir), bits=4, group_size=32, out=tmp_path / "q", progress=False)
    edit_checkpoint(tmp_path / "q", tensors, config)
    with pytest.raises(QuantkitError, match=match) as e:
        quantkit.load(tmp_path / "q", packed=packed)
    assert "model.layers" in str(e.value) and "checkpoint" in str(e.value)


@pytest.mark.parametrize("tensors,state,match", [
    ({f"{NAME}.weight.absmax": lambda t: t[:-1]}, None, "absmax is"),
    ({f"{NAME}.weight": lambda t: t[:-1]}, None, "packed is"),
    (None, {"blocksize": 48}, "block size 48 is not one bitsandbytes writes"),
    (None, {"shape": [96.0, 96.0]}, "out_features is 96.0, not a whole number"),
    (None, {"shape": [128, 48]}, "128x48 weight"),
])
def test_bad_nf4_checkpoint_fails_at_load(tiny_dir, tmp_path, tensors, state, match):
    quantkit.quantize(str(tiny_dir), method="nf4", out=tmp_path / "q", progress=False)
    if state:
        key = f"{NAME}.weight.quant_state.bitsandbytes__nf4"
        tensors = {key: lambda t: torch.tensor(list(json.dumps(json.loads(bytes(t.tolist())) | state).encode()),
                                               dtype=torch.uint8)}
    edit_checkpoint(tmp_path / "q", tensors)
    with pytest.raises(QuantkitError, match=match):
        quantkit.load(tmp_path / "q", packed=True)


@pytest.mark.slow
def test_kernels_compile_for_a_gpu():
    """Triton's compiler, with its own ptxas and no GPU, takes every kernel variant to Hopper machine
    code: what the interpreter runs here is also code a GPU can run."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("compile_kernels.py")), "90"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("compiled") == 16


@pytest.fixture(scope="module")
def embedded_w4(tmp_path_factory):
    out = tmp_path_factory.mktemp("embedded") / "w4g128"
    quantkit.quantize(None, method="rtn", bits=4, group_size=128, out=out, progress=False)
    return out


@pytest.mark.slow
def test_packed_perplexity_equals_fake_quantized(embedded_w4):
    """The embedded model at 4 bits, g128: the packed model scores what the dequantized copy scores.
    On the CPU both run float32 (the torch fallback), so only summation order may differ: 1e-5
    relative. On a GPU both run float16 (Triton against cuBLAS), each layer's outputs rounded to
    float16 (2^-11 relative) in a different way: 2e-3 relative."""
    from .conftest import TEST

    fake = quantkit.evaluate(embedded_w4, TEST, max_windows=8, progress=False, packed=False, device=DEVICE)
    packed = quantkit.evaluate(embedded_w4, TEST, max_windows=8, progress=False, device=DEVICE)
    assert abs(packed.perplexity - fake.perplexity) <= (1e-5 if DEVICE == "cpu" else 2e-3) * fake.perplexity


@pytest.mark.slow
@pytest.mark.skipif(DEVICE != "cpu", reason="the fused int4 path is the CPU's")
def test_packed_bfloat16_on_the_cpu(embedded_w4, monkeypatch):
    """--dtype bfloat16 on the CPU: every one of the 210 4-bit linears can run the fused int4 matmul,
    and the perplexity stays within 1% of float32's (bfloat16 activations carry 8 bits). Evaluation's
    512-row windows are past FUSED_ROWS, where the sliced fallback is faster: raised here, so that
    the fused kernel's accuracy is what is scored."""
    from .conftest import TEST

    monkeypatch.setattr(qlinear, "FUSED_ROWS", 1 << 20)

    used, fused = set(), GPTQLinear.fused

    def counted(self, x):
        y = fused(self, x)
        if y is not None:
            used.add(self)
        return y

    monkeypatch.setattr(GPTQLinear, "fused", counted)
    f32 = quantkit.evaluate(embedded_w4, TEST, max_windows=2, progress=False, device="cpu")
    assert not used
    bf16 = quantkit.evaluate(embedded_w4, TEST, max_windows=2, progress=False, device="cpu", dtype="bfloat16")
    assert len(used) == 210
    assert abs(bf16.perplexity / f32.perplexity - 1) < 0.01
    with pytest.raises(QuantkitError, match="unknown dtype 'int4': use one of float32, bfloat16, float16"):
        quantkit.evaluate(embedded_w4, TEST, dtype="int4")


@pytest.mark.slow
def test_kernels_on_the_embedded_models_layers(embedded_w4):
    """Every linear of a decoder layer (each of the model's shapes), on its real inputs (one window
    of 16 tokens and one decode row): the Triton kernels give the torch fallback's product (the
    interpreter is too slow to run all 30 layers on the CPU; on a GPU the perplexity test above runs them)."""
    from .conftest import TEST

    m = quantkit.load(embedded_w4, packed=True)
    ids = m.tokenizer(TEST.read_text()[:2000], return_tensors="pt")["input_ids"][:, :16]
    inputs = {}

    def keep(mod, args):
        inputs[mod] = args[0][0]

    hooks = [layer.register_forward_pre_hook(keep)
             for layer in m.module.model.layers[0].modules() if isinstance(layer, GPTQLinear)]
    with torch.no_grad():
        m.module(ids)
    for h in hooks:
        h.remove()
    assert len(inputs) == 7
    for layer, x in inputs.items():
        for rows in (x, x[-1:]):
            assert_product(kernels.matmul(rows.to(DEVICE), layer.to(DEVICE)), rows.to(DEVICE), layer, layer)
