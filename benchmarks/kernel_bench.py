"""Packed quantized matmuls on the linear shapes of a 7B Llama, at batch 1, 16 and 512.

    python benchmarks/kernel_bench.py [--batches 1,16,512] [--repeats 5]

On a GPU (Triton kernels, float16 activations), per shape and batch:
  - time of ours (4-bit g128 GPTQ layout; NF4 with double quantization), torch's float16 matmul on
    the dense weight, and bitsandbytes' NF4 matmul (bnb.matmul_4bit) where it runs;
  - speedups: fp16 / ours, bnb / ours (our NF4);
  - batch 1: achieved bandwidth of our GEMV (the bytes it must read: packed weight, scales, zeros,
    g_idx, x; and write: y) as a fraction of the device-to-device copy bandwidth measured in the
    same run (read + written bytes), and of the datasheet peak where the device is known.
  Times: triton.testing.do_bench, median, over several weight copies in rotation so that a 8 MiB
  weight is not served from L2.
On the CPU, per shape and batch, best of --repeats: our packed layers as quantkit runs them (4-bit
g128 in plain group order with bfloat16 activations: torch's fused int4 matmul; 4-bit g128 act-order
and NF4 with double quantization, float32 activations: the fallback that dequantizes a slice of rows
at a time), against the anchor, a dense float32 matmul of the same shape, against a dense bfloat16
one, and against dequantizing the whole weight then one matmul in the same dtype as ours.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (out, in): q/k/v/o, gate/up, down
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
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| shape (out x in) | batch | format (path, activations) | ours | dense float32 (anchor) | ours / anchor "
          "| dense bfloat16 | ours / that | dequantize, then matmul | ours / that |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n, k in SHAPES:
        w, act, nf, plain = layers(n, k, "cpu")
        wb = w.bfloat16()
        for layer, label, dtype in ((plain, "4-bit g128 (fused int4, bf16)", torch.bfloat16),
                                    (act, "4-bit g128 act-order (slices, f32)", torch.float32),
                                    (nf, "NF4 dq (slices, f32)", torch.float32)):
            for b in batches:
                x = torch.randn(b, k)
                xq, xb = x.to(dtype), x.bfloat16()

                def ours():
                    return layer(xq)

                def baseline():
                    return F.linear(xq, layer.dequantize(dtype))

                def dense():
                    return F.linear(x, w)

                def dense_bf16():
                    return F.linear(xb, wb)

                with torch.no_grad():
                    ref = F.linear(x, layer.dequantize())
                    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bfloat16: 2^-8 per rounding
                    torch.testing.assert_close(ours().float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
                    t = {f: best(f, repeats) for f in (ours, dense, dense_bf16, baseline)}
                print(f"| {n}x{k} | {b} | {label} | {t[ours] * 1e3:.2f} ms | {t[dense] * 1e3:.2f} ms | "
                      f"{t[ours] / t[dense]:.2f} | {t[dense_bf16] * 1e3:.2f} ms | {t[ours] / t[dense_bf16]:.2f} | "
                      f"{t[baseline] * 1e3:.2f} ms | {t[ours] / t[baseline]:.2f} |", flush=True)


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
    print("| shape (out x in) | batch | fp16 | ours 4-bit | ours NF4 | bnb NF4 | fp16 / ours 4-bit | bnb / ours NF4 "
          "| GEMV bandwidth / copy (4-bit, NF4) | / datasheet |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n, k in SHAPES:
        w, q4, nf, _ = layers(n, k, "cuda")
        copies = 8  # weights in rotation, more bytes than L2 holds
        q4s = [copy.deepcopy(q4) for _ in range(copies)]
        nfs = [copy.deepcopy(nf) for _ in range(copies)]
        dense = [w.half().cuda() for _ in range(copies)]
        theirs = [bf.quantize_4bit(d, blocksize=64, quant_type="nf4", compress_statistics=True) for d in dense] if bnb else []
        turn = iter(range(1 << 40))
        for b in batches:
            x = torch.randn(b, k, dtype=torch.float16, device="cuda")
            for layer in (q4, nf):  # the right answer before any timing
                ref = x.float() @ layer.dequantize(torch.float16).float().T
                assert (kernels.matmul(x, layer).float() - ref).norm() / ref.norm() < 1e-2
            t_fp16 = timed(lambda: F.linear(x, dense[next(turn) % copies]))
            t_q4 = timed(lambda: kernels.matmul(x, q4s[next(turn) % copies]))
            t_nf = timed(lambda: kernels.matmul(x, nfs[next(turn) % copies]))
            t_bnb = timed(lambda: bnb.matmul_4bit(x, *pair(theirs[next(turn) % copies]))) if theirs else None
            cells = [f"{t * 1e6:.1f} us" for t in (t_fp16, t_q4, t_nf)]
            cells += [f"{t_bnb * 1e6:.1f} us" if t_bnb else "-", f"{t_fp16 / t_q4:.2f}",
                      f"{t_bnb / t_nf:.2f}" if t_bnb else "-"]
            if b == 1:  # bytes the GEMV must move: its weight buffers, x in, y out
                moved = [sum(t.numel() * t.element_size() for t in layer.buffers()) + 2 * (k + n) for layer in (q4, nf)]
                tbps = [m / t / 1e12 for m, t in zip(moved, (t_q4, t_nf))]
                cells += [", ".join(f"{v / copy_tbps:.2f}" for v in tbps),
                          ", ".join(f"{v / sheet:.2f}" for v in tbps) if sheet else "-"]
            else:
                cells += ["", ""]
            print(f"| {n}x{k} | {b} | " + " | ".join(cells) + " |", flush=True)


def pair(quantized):
    """bitsandbytes' (packed, state) as matmul_4bit takes them: the packed weight transposed."""
    packed, state = quantized
    return packed.t(), state


def timed(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16,512")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    print(" ".join(sys.argv), flush=True)
    if torch.cuda.is_available():
        gpu(batches)
    else:
        cpu(batches, a.repeats)


if __name__ == "__main__":
    main()
