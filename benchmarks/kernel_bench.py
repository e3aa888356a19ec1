"""Packed quantized matmuls on the linear shapes of a 7B Llama, at batch 1, 16 and 512.

    python benchmarks/kernel_bench.py [--batches 1,16,512] [--repeats 5]
    python benchmarks/kernel_bench.py --sweep [--batches 1,512] [--layouts 4-bit,4-bit act-order,NF4]
    python benchmarks/kernel_bench.py --kernels DIR      # another version of quantkit/kernels/
    python benchmarks/kernel_bench.py --gemv-rows 1 --batches 2,4,8   # the GEMM where the GEMV would run
    python benchmarks/kernel_bench.py --dense --batches 4,8,16,32,64,128,256,512   # where DENSE_ROWS starts
    python benchmarks/kernel_bench.py --rows 1,16,64,128,512   # CPU: the fused paths against the fallback by rows
    python benchmarks/kernel_bench.py --split 1,4,8,16,32      # CPU: where the GEMV splits over the cores

On a GPU (Triton kernels, float16 activations), per shape and batch:
  - time of ours (4-bit g128 GPTQ layout in plain group order and with act-order, which the kernels
    read as its twin in group order, x's columns through the order; NF4 with double quantization),
    and of act-order with x's columns reordered first (a launch of its own, as before the kernels
    read the order),
    torch's float16 matmul on the dense weight (the anchor), bitsandbytes' NF4 matmul
    (bnb.matmul_4bit) where it runs, and torch's int4 matmul (_weight_int4pack_mm, bfloat16) on the
    same 4-bit weights;
  - speedups: fp16 / ours 4-bit, int4 mm / ours 4-bit, bnb / ours NF4;
  - batch 1: achieved bandwidth of our GEMV (the bytes it must read: packed weight, scales, zeros,
    g_idx, x; and write: y) as a fraction of the device-to-device copy bandwidth measured in the
    same run (read + written bytes), and of the datasheet peak where the device is known.
  Times: triton.testing.do_bench, median, over 8 weight copies in rotation so that a 8 MiB weight is
  not served from L2; each twice: replays of a CUDA graph of one call per copy (the kernels' own
  time, what a decoder run under CUDA graphs sees), and calls from Python one by one (each with its
  launch: at batch 1 mostly launch).
--sweep: each kernel's other tiles and launch options (GEMV_TILES, GEMM_TILES), the slices of K
(SPLITS) at the default tile, and the codes read value by value (NF4: the absmax too), as ratios of
the defaults' time in the same run (graph times, copies in rotation).
--dense: the fused kernels against dequantizing W and torch's matmul (kernels.DENSE_ROWS), per layout.
--kernels DIR: another version of the package quantkit/kernels/ (its __init__.py and jit.py) in place
of quantkit's (two runs in one call compare two versions on one machine); one that takes
kernel_args' ORDER (from the commit that added it).
On the CPU, per shape and batch, best of --repeats: our packed layers as quantkit runs them (4-bit
g128 in plain group order, and in act-order with x's columns taken in group order, with bfloat16
activations: torch's fused int4 matmul up to qlinear.FUSED_ROWS rows, the fallback beyond; 4-bit
g128 plain and act-order and NF4 with double quantization, float32 activations: the compiled GEMV
up to qlinear.GEMV_ROWS rows, beyond it the fallback that dequantizes a slice of rows at a time),
against the anchor, a dense float32 matmul of the same shape, against a dense bfloat16 one, and
against dequantizing the whole weight then one matmul in the same dtype as ours. Each of ours and of the
dense weights is timed in copies taken in turn (ROTATE bytes of float32 copies), so that no call finds
its weight in the cache left by the one before, as in a model whose layers come one after another.
--rows: the fused paths against the fallback by rows of input (int4 in bfloat16, the GEMV in float32).
"""
from __future__ import annotations

import argparse
import itertools
import math
import platform
import sys
import time

import torch
import torch.nn.functional as F

from children import ints

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (out, in): q/k/v/o, gate/up, down
ROTATE = 1 << 30  # CPU: bytes of each dense float32 weight's copies timed in turn, so that none is served from cache
DATASHEET_TBPS = {"H100 80GB HBM3": 3.35, "H100 PCIe": 2.0, "H200": 4.8}


def layers(n: int, k: int, device: str):
    """A 4-bit g128 act-order GPTQ layer, an NF4 double-quantized layer and (CPU) a 4-bit g128 GPTQ layer in
    plain group order, of one random weight."""
    from quantkit.qlinear import GPTQLinear, NF4Linear
    from quantkit.quantizers import nf4, rtn

    w = torch.randn(n, k) * 0.02
    qt = rtn.quantize(w, 4, 128, sym=True)
    plain = GPTQLinear.from_tensor(qt).to(device)
    qt.g_idx = qt.g_idx[torch.randperm(k)].contiguous()
    return w, GPTQLinear.from_tensor(qt).to(device), NF4Linear.from_tensor(nf4.quantize(w, "nf4", 64, True)).to(device), plain


def cpu(batches: list[int], repeats: int) -> None:
    import copy

    from quantkit import qlinear

    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"Each weight in copies taken in turn, {ROTATE >> 20} MiB of its float32 copies (beyond the L3 cache), "
          "as a model's layers come one after another")
    print("| shape (out x in) | batch | format (path, activations) | ours | dense float32 (anchor) | ours / anchor "
          "| dense bfloat16 | ours / that | dequantize, then matmul | ours / that |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n, k in SHAPES:
        w, act, nf, plain = layers(n, k, "cpu")
        copies = -(-ROTATE // (4 * n * k))
        dense_w = [w.clone() for _ in range(copies)]
        dense_wb = [w.bfloat16() for _ in range(copies)]
        for layer, label, dtype in ((plain, "4-bit g128 (bf16)", torch.bfloat16),
                                    (act, "4-bit g128 act-order (x in group order; bf16)", torch.bfloat16),
                                    (plain, "4-bit g128 (f32)", torch.float32),
                                    (act, "4-bit g128 act-order (f32)", torch.float32),
                                    (nf, "NF4 dq (f32)", torch.float32)):
            twins = [layer] + [copy.deepcopy(layer) for _ in range(copies - 1)]
            for b in batches:
                shown = label if dtype != torch.float32 else \
                    f"{label.split(' (')[0]} ({'GEMV' if b <= qlinear.GEMV_ROWS else 'slices'}, f32)"
                x = torch.randn(b, k)
                xq, xb = x.to(dtype), x.bfloat16()
                ours = rotation(lambda t: t(xq), twins)
                dense = rotation(lambda v: F.linear(x, v), dense_w)
                dense_bf16 = rotation(lambda v: F.linear(xb, v), dense_wb)

                def baseline():
                    return F.linear(xq, layer.dequantize(dtype))

                with torch.no_grad():
                    for t in twins:  # each copy's operands made on first use, before the timing
                        t(xq)
                    ref = F.linear(x, layer.dequantize())
                    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bfloat16: 2^-8 per rounding
                    torch.testing.assert_close(layer(xq).float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
                    t = {f: best(f, repeats) for f in (ours, dense, dense_bf16, baseline)}
                print(f"| {n}x{k} | {b} | {shown} | {t[ours] * 1e3:.2f} ms | {t[dense] * 1e3:.2f} ms | "
                      f"{t[ours] / t[dense]:.2f} | {t[dense_bf16] * 1e3:.2f} ms | {t[ours] / t[dense_bf16]:.2f} | "
                      f"{t[baseline] * 1e3:.2f} ms | {t[ours] / t[baseline]:.3f} |", flush=True)
            del twins


def rotation(call, items: list):
    """A function that applies call to the next of items on each call, round and round."""
    turn = itertools.cycle(items)
    return lambda: call(next(turn))


def crossover(rows: list[int], repeats: int) -> None:
    """CPU: each fused path against the fallback (dequantize a slice of rows at a time, multiply in x's
    dtype) by rows of input, for qlinear.FUSED_ROWS and GEMV_ROWS: torch's int4 matmul in bfloat16, and
    the compiled GEMV in float32 on 4-bit g128 (plain and act-order) and NF4 with double quantization."""
    from quantkit import qlinear

    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| shape (out x in) | rows | path | fused | fallback | fused / fallback |")
    print("| --- | --- | --- | --- | --- | --- |")
    limits = qlinear.FUSED_ROWS, qlinear.GEMV_ROWS
    qlinear.FUSED_ROWS = qlinear.GEMV_ROWS = 1 << 30  # the fused paths at every row count
    for n, k in SHAPES[:2]:
        _, act, nf, plain = layers(n, k, "cpu")
        for r in rows:
            for label, layer, dtype, fused in (("int4 4-bit g128, bf16", plain, torch.bfloat16, plain.fused),
                                               ("GEMV 4-bit g128, f32", plain, torch.float32, plain.gemv),
                                               ("GEMV 4-bit g128 act-order, f32", act, torch.float32, act.gemv),
                                               ("GEMV NF4 dq, f32", nf, torch.float32, nf.gemv)):
                x = torch.randn(r, k).to(dtype)
                with torch.no_grad():
                    t_fused = best(lambda: fused(x), repeats)
                    t_fallback = best(lambda: layer.sliced(x), repeats)
                print(f"| {n}x{k} | {r} | {label} | {t_fused * 1e3:.2f} ms | {t_fallback * 1e3:.2f} ms | "
                      f"{t_fused / t_fallback:.2f} |", flush=True)
    qlinear.FUSED_ROWS, qlinear.GEMV_ROWS = limits
    print(f"(qlinear.FUSED_ROWS = {limits[0]}, GEMV_ROWS = {limits[1]})")


SPLIT_SHAPES = ((576, 576), (1536, 576), (1024, 1024), (2048, 1024), (2048, 2048), (4096, 4096))


def split(rows: list[int], repeats: int) -> None:
    """CPU: the compiled GEMV on one thread against its outputs split over the cores (blocks.split), by
    weights and rows of x, on 4-bit g128 and NF4 with double quantization: where qlinear.GEMV_SPLIT
    should start. Best of repeats of 100 calls each."""
    from quantkit import qlinear
    from quantkit.qlinear import GPTQLinear, NF4Linear
    from quantkit.quantizers import nf4, rtn

    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| shape (out x in) | rows | layout | work (weights (rows + 2) / 3) | one thread | split | split / one thread |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    threshold = qlinear.GEMV_SPLIT
    try:
        for n, k in SPLIT_SHAPES:
            w = torch.randn(n, k) * 0.02
            for label, layer in (("4-bit g128", GPTQLinear.from_tensor(rtn.quantize(w, 4, 128, sym=True))),
                                 ("NF4 dq", NF4Linear.from_tensor(nf4.quantize(w, "nf4", 64, True)))):
                for r in rows:
                    x = torch.randn(r, k)
                    t = {}
                    for name, at in (("one", 1 << 62), ("split", 0)):
                        qlinear.GEMV_SPLIT = at
                        t[name] = best(lambda: [layer.gemv(x) for _ in range(100)], repeats) / 100
                    work = n * k * (r + 2) / 3
                    print(f"| {n}x{k} | {r} | {label} | 2^{math.log2(work):.1f} | {t['one'] * 1e6:.1f} us | "
                          f"{t['split'] * 1e6:.1f} us | {t['split'] / t['one']:.2f} |", flush=True)
    finally:
        qlinear.GEMV_SPLIT = threshold


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def gpu(batches: list[int]) -> None:
    import copy

    import triton

    from quantkit import kernels

    dev = torch.cuda.get_device_name()
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_tbps = 2 * src.numel() / timed(lambda: dst.copy_(src)) / 1e12
    del src, dst
    sheet = next((v for key, v in DATASHEET_TBPS.items() if key in dev), None)
    print(f"GPU: {dev}, torch {torch.__version__}, triton {triton.__version__}; device-to-device copy "
          f"{copy_tbps:.2f} TB/s (read + written); datasheet {sheet or '?'} TB/s")
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bf
    except ImportError:
        bnb = None
    names = ("ours 4-bit", "ours 4-bit act-order", "ours NF4")
    print("Times: in a CUDA graph (the kernels alone), then (in brackets) called from Python one by one. Ratios "
          "and bandwidths from the graph times; the last column from the other.")
    print("| shape (out x in) | batch | fp16 | " + " | ".join(names) + " | act-order, x reordered first | bnb NF4 "
          "| torch int4 mm (bf16) | fp16 / ours 4-bit | int4 mm / ours 4-bit | bnb / ours NF4 | x reordered / read "
          "through the order | GEMV bandwidth / copy (4-bit, act-order, NF4) | / datasheet | fp16 / ours 4-bit, "
          "called one by one |")
    print("|" + " --- |" * 16)
    for n, k in SHAPES:
        w, act, nf, plain = layers(n, k, "cuda")
        ours = (plain, act, nf)
        copies = 8  # weights in rotation, more bytes than L2 holds
        rotations = [[copy.deepcopy(layer) for _ in range(copies)] for layer in ours]
        dense = [w.half().cuda() for _ in range(copies)]
        theirs = [bf.quantize_4bit(d, blocksize=64, quant_type="nf4", compress_statistics=True) for d in dense] if bnb else []
        try:
            int4 = [int4_operands(plain) for _ in range(copies)]
        except RuntimeError as e:  # an older GPU, or a torch without the op
            print(f"torch's int4 mm: {e}".splitlines()[0])
            int4 = None
        turn = iter(range(1 << 40))
        for b in batches:
            x = torch.randn(b, k, dtype=torch.float16, device="cuda")
            for layer in ours:  # the right answer before any timing
                ref = x.float() @ layer.dequantize(torch.float16).float().T
                for y in (kernels.matmul(x, layer), *([kernels.matmul(*layer.ordered(x))] if layer is act else [])):
                    err = (y.float() - ref).norm() / ref.norm()
                    assert err < 1e-2, f"{n}x{k} batch {b}: relative error {err:.2e}"
            xb = x.bfloat16()
            ref = xb.float() @ plain.dequantize(torch.float32).T
            int4_err = (int4_mm(xb, int4[0]).float() - ref).norm() / ref.norm() if int4 else 0
            calls = {"fp16": [lambda d=d: F.linear(x, d) for d in dense]}
            calls |= {name: [lambda r=r: kernels.matmul(x, r) for r in rot] for name, rot in zip(names, rotations)}
            calls["reordered"] = [lambda r=r: kernels.matmul(*r.ordered(x)) for r in rotations[1]]
            if theirs:
                calls["bnb"] = [lambda q=q: bnb.matmul_4bit(x, *pair(q)) for q in theirs]
            if int4:
                calls["int4"] = [lambda o=o: int4_mm(xb, o) for o in int4]
            eager = {key: timed(lambda c=c: c[next(turn) % copies]()) for key, c in calls.items()}
            graph = {}
            for key, c in calls.items():
                try:
                    graph[key] = graphed(c)
                except RuntimeError as e:  # a library call that cannot be captured: its eager time alone
                    print(f"{key}: no CUDA graph ({str(e).splitlines()[0]})", flush=True)
                    graph[key] = None

            def cell(key: str) -> str:
                if key not in eager:
                    return "-"
                g = f"{graph[key] * 1e6:.1f}" if graph[key] else "-"
                return f"{g} ({eager[key] * 1e6:.1f}) us"

            t_fp16, t_bnb, t_int4 = graph["fp16"], graph.get("bnb"), graph.get("int4")
            t_ours = [graph[name] for name in names]
            cells = [cell(key) for key in ("fp16", *names, "reordered", "bnb")]
            cells += [cell("int4") + (f" (error {int4_err:.1e})" if int4_err > 1e-2 else ""),
                      ratio(t_fp16, t_ours[0]), ratio(t_int4, t_ours[0]), ratio(t_bnb, t_ours[2]),
                      ratio(graph["reordered"], t_ours[1])]
            if b == 1:  # bytes the GEMV must move: its weight buffers, x in, y out
                moved = [sum(t.numel() * t.element_size() for t in layer.buffers()) + 2 * (k + n) for layer in ours]
                tbps = [m / t / 1e12 if t else None for m, t in zip(moved, t_ours)]
                cells += [", ".join(ratio(v, copy_tbps) for v in tbps),
                          ", ".join(ratio(v, sheet) for v in tbps) if sheet else "-"]
            else:
                cells += ["", ""]
            cells.append(ratio(eager["fp16"], eager[names[0]]))
            print(f"| {n}x{k} | {b} | " + " | ".join(cells) + " |", flush=True)


GEMV_TILES = [((64, 64), {}), ((32, 128), {}), ((64, 128), {}), ((128, 64), {}), ((128, 128), {"num_warps": 8}),
              ((128, 128), {}), ((32, 64), {"num_warps": 2}), ((16, 128), {"num_warps": 2}), ((128, 32), {}), ((256, 64), {"num_warps": 8}),
              ((16, 128), {}), ((32, 128), {"num_warps": 2}), ((16, 128), {"num_warps": 1}), ((8, 128), {"num_warps": 1})]
GEMM_TILES = [(64, (64, 32), {}), (64, (128, 32), {}), (128, (128, 32), {"num_warps": 8}), (64, (64, 64), {}),
              (128, (64, 32), {"num_stages": 4}), (128, (128, 64), {"num_warps": 8}), (64, (128, 64), {}),
              (128, (256, 32), {"num_warps": 8}), (128, (64, 64), {"num_stages": 4}), (128, (128, 32), {"num_stages": 4})]
SPLITS = (1, 2, 4, 8, 16, 32, 64)  # slices of K (kernels.split_for chooses them by the device)
LAYOUTS = ("4-bit", "4-bit act-order", "NF4")


def cases(batches: list[int], layouts: list[str]):
    """Per shape, layout (of LAYOUTS, those in layouts) and batch: the shape's label, the layout's label,
    its layer, 8 copies of it to take in rotation (more bytes than L2 holds), x (float16) and the
    float32 product x W^T."""
    import copy

    for n, k in SHAPES:
        _, act, nf, plain = layers(n, k, "cuda")
        for label, layer in zip(LAYOUTS, (plain, act, nf)):
            if label not in layouts:
                continue
            copies = [copy.deepcopy(layer) for _ in range(8)]
            for b in batches:
                x = torch.randn(b, k, dtype=torch.float16, device="cuda")
                yield f"{n}x{k}", label, layer, copies, x, x.float() @ layer.dequantize(torch.float16).float().T


def sweep(batches: list[int], layouts: list[str]) -> None:
    """The defaults (the first row of each), then each tile of GEMV_TILES (batch 1) or GEMM_TILES (larger
    batches) on each shape and layout, as a ratio of the defaults' time; also with the codes read value
    by value (kernels.WORDS off; NF4 its absmax too) at the default tiles. Fused kernels only (no
    DENSE_ROWS)."""
    from quantkit import kernels

    defaults = (dict(kernels.GEMV_TILE), dict(kernels.GEMM_TILE), kernels.GEMM_ROWS, (dict(kernels.GEMV_LAUNCH),
                kernels.GEMM_LAUNCH), kernels.WORDS, dict(kernels.FEW_TILE), kernels.DENSE_ROWS)
    kernels.DENSE_ROWS = dict.fromkeys(defaults[6], 1 << 30)
    print("| shape | batch | layout | tile (rows of x, outputs, inputs; launch) | time | / defaults |")
    print("| --- | --- | --- | --- | --- | --- |")
    try:
        for shape, label, layer, copies, x, ref in cases(batches, layouts):
            b, k = x.shape
            gemv = b <= kernels.GEMV_ROWS
            tiles = [(1, *t) for t in GEMV_TILES] if gemv else GEMM_TILES
            configs = [("defaults", None), ("codes value by value", "words")]
            bk = kernels.tile(layer, b)[1]  # matmul rounds a slice to whole tiles: the label says how many it made
            configs += [(f"defaults, K in {kernels.cdiv(k, kernels.cdiv(kernels.cdiv(k, split), bk) * bk)} "
                         "slices", split) for split in SPLITS]
            configs += [(f"{rows}, {tile[0]}, {tile[1]}; {launch or 'Triton defaults'}", (rows, tile, launch))
                        for rows, tile, launch in tiles]
            first = None
            for name, config in configs:
                kernels.GEMV_TILE, kernels.GEMM_TILE, kernels.FEW_TILE = map(dict, (defaults[0], defaults[1], defaults[5]))
                kernels.GEMM_ROWS = defaults[2]
                kernels.GEMV_LAUNCH, kernels.GEMM_LAUNCH = dict(defaults[3][0]), defaults[3][1]
                kernels.WORDS = config != "words"
                if isinstance(config, tuple):
                    rows, tile, launch = config
                    if gemv:
                        kernels.GEMV_TILE = dict.fromkeys(defaults[0], tile)
                        kernels.GEMV_LAUNCH = dict.fromkeys(defaults[3][0], launch)
                    else:
                        kernels.GEMM_TILE = dict.fromkeys(defaults[1], tile)
                        kernels.FEW_TILE = {}
                        kernels.GEMM_ROWS, kernels.GEMM_LAUNCH = rows, launch
                try:
                    split = config if isinstance(config, int) else None
                    err = (kernels.matmul(x, layer, split).float() - ref).norm() / ref.norm()
                    t = graphed([lambda c=c: kernels.matmul(x, c, split) for c in copies], rep=50) if err < 1e-2 else None
                except Exception as e:  # a tile the compiler refuses (shared memory): say so, go on
                    t, err = None, f"{type(e).__name__}"
                if name == "defaults":
                    first = t
                cell = f"{t * 1e6:.1f} us | " + (f"{t / first:.2f}" if first else "-") if t else f"failed ({err}) | -"
                print(f"| {shape} | {b} | {label} | {name} | {cell} |", flush=True)
    finally:
        kernels.GEMV_TILE, kernels.GEMM_TILE, kernels.GEMM_ROWS, (kernels.GEMV_LAUNCH, kernels.GEMM_LAUNCH), \
            kernels.WORDS, kernels.FEW_TILE, kernels.DENSE_ROWS = defaults


def dense(batches: list[int], layouts: list[str]) -> None:
    """Each layout's fused kernels against dequantizing W (in float16) and torch's matmul, at each
    batch: where kernels.DENSE_ROWS should start. Graph times, weights in rotation."""
    from quantkit import kernels

    saved = kernels.DENSE_ROWS
    print("| shape | layout | rows of x | fused | dequantize + torch matmul | fused / dense |")
    print("| --- | --- | --- | --- | --- | --- |")
    try:
        for shape, label, layer, copies, x, ref in cases(batches, layouts):
            t = {}
            for name, rows in (("fused", 1 << 30), ("dense", 0)):
                kernels.DENSE_ROWS = dict.fromkeys(saved, rows)
                err = (kernels.matmul(x, layer).float() - ref).norm() / ref.norm()
                assert err < 1e-2, f"{shape} {label} {name} batch {len(x)}: relative error {err:.2e}"
                t[name] = graphed([lambda c=c: kernels.matmul(x, c) for c in copies], rep=50)
            print(f"| {shape} | {label} | {len(x)} | {t['fused'] * 1e6:.1f} us | {t['dense'] * 1e6:.1f} us | "
                  f"{t['fused'] / t['dense']:.2f} |", flush=True)
    finally:
        kernels.DENSE_ROWS = saved


def int4_operands(layer) -> tuple[torch.Tensor, torch.Tensor, int]:
    """torch's CUDA int4 matmul operands for a 4-bit layer in plain group order: the codes packed by
    _convert_weight_to_int4pack (two per byte, the first in the high nibble), scales and float zeros."""
    from quantkit.packing import unpack

    _, scales_zeros, group, _ = layer.int4
    codes = unpack(layer.qweight.cpu(), 4).T.contiguous().to(torch.uint8)
    packed = (codes[:, ::2] << 4 | codes[:, 1::2]).cuda()
    return torch.ops.aten._convert_weight_to_int4pack(packed, 8), scales_zeros.cuda(), group


def int4_mm(x: torch.Tensor, operands) -> torch.Tensor:
    packed, scales_zeros, group = operands
    return torch.ops.aten._weight_int4pack_mm(x, packed, group, scales_zeros)


def pair(quantized):
    """bitsandbytes' (packed, state) as matmul_4bit takes them: the packed weight transposed."""
    packed, state = quantized
    return packed.t(), state


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def graphed(calls: list, rep: int = 200) -> float:
    """Seconds per call, from replays of one CUDA graph that makes the calls in turn (weights in
    rotation): the kernels' own time, without the Python launches between them."""
    from triton.testing import do_bench

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled and allocated before capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return do_bench(graph.replay, warmup=25, rep=rep, return_mode="median") / 1e3 / len(calls)


def timed(fn, rep: int = 200) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep, return_mode="median") / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=ints, default=[1, 16, 512])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sweep", action="store_true", help="GPU: time the kernels' other tiles instead")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="--sweep, --dense: which layouts")
    p.add_argument("--dense", action="store_true", help="GPU: the fused kernels against dequantize + torch's matmul")
    p.add_argument("--kernels", help="GPU: a folder to use in place of quantkit/kernels/")
    p.add_argument("--gemv-rows", type=int, help="GPU: kernels.GEMV_ROWS for the run (rows of x up to which the GEMV runs)")
    p.add_argument("--rows", type=ints, help="CPU: the fused paths against the fallback at these rows of input (1,16,...)")
    p.add_argument("--split", type=ints, help="CPU: the GEMV on one thread against split over the cores at these rows (1,4,...)")
    a = p.parse_args()
    gpu_only = [f"--{o}" for o, v in (("sweep", a.sweep), ("dense", a.dense), ("kernels", a.kernels),
                                      ("gemv-rows", a.gemv_rows)) if v not in (None, False)]
    if gpu_only and not torch.cuda.is_available():
        p.error(f"{gpu_only[0]} times the GPU kernels, and torch sees no CUDA GPU: drop it for the CPU table")
    if a.kernels:
        import importlib.util
        from pathlib import Path

        import quantkit

        spec = importlib.util.spec_from_file_location("quantkit.kernels", Path(a.kernels) / "__init__.py",
                                                      submodule_search_locations=[a.kernels])
        other = importlib.util.module_from_spec(spec)
        sys.modules["quantkit.kernels"] = quantkit.kernels = other  # before quantkit.qlinear takes it
        spec.loader.exec_module(other)
        print(f"kernels from {other.__file__}", flush=True)
    if a.gemv_rows is not None:
        from quantkit import kernels

        kernels.GEMV_ROWS = a.gemv_rows
    print(" ".join(sys.argv), flush=True)
    if torch.cuda.is_available():
        if a.sweep:
            sweep(a.batches, a.layouts.split(","))
        elif a.dense:
            dense(a.batches, a.layouts.split(","))
        else:
            gpu(a.batches)
    elif a.split:
        split(a.split, a.repeats)
    elif a.rows:
        crossover(a.rows, a.repeats)
    else:
        cpu(a.batches, a.repeats)


if __name__ == "__main__":
    main()
