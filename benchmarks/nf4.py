"""NF4/FP4 on the embedded SmolLM2-135M: perplexity and bits per weight next to RTN w4 g64, and
quantization time against bitsandbytes' own quantize_4bit on the same tensors.

    python benchmarks/nf4.py [speed|table] [--windows 40] [--repeats 5]     # both when neither is named

Perplexity: llama.cpp protocol, ctx 512, first --windows windows of the wikitext-2 test file.
Bits per weight: codes, scales (float16 for RTN, float32 absmax for NF4/FP4, or their 8-bit codes
with double quantization) and zero points, averaged over the quantized linears.
Time: every decoder linear's weight (float32) quantized by ours and by bitsandbytes, best of
--repeats passes each, interleaved, in this process; the ratio is ours / bitsandbytes'.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TEST = ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
SETTINGS = [  # label, quantize() arguments
    ("RTN w4 g64 sym", dict(method="rtn", bits=4, group_size=64, sym=True)),
    ("RTN w4 g64 asym", dict(method="rtn", bits=4, group_size=64, sym=False)),
    ("NF4 b64", dict(method="nf4")),
    ("NF4 b64 + double quant", dict(method="nf4", double_quant=True)),
    ("FP4 b64", dict(method="fp4")),
    ("FP4 b64 + double quant", dict(method="fp4", double_quant=True)),
]


def perplexities(windows: int) -> None:
    import quantkit

    base = quantkit.evaluate(None, TEST, "llamacpp", 512, windows, progress=False).perplexity
    print(f"base perplexity {base:.3f} (llama.cpp protocol, ctx 512, {windows} windows)")
    print("| setting | bits per weight | perplexity | / base |")
    print("| --- | --- | --- | --- |")
    for label, kw in SETTINGS:
        model = quantkit.quantize(None, progress=False, **kw)  # from the float weights each time
        bpw = sum(qt.bits_per_weight * qt.codes.numel() for qt in model.tensors.values()) / \
            sum(qt.codes.numel() for qt in model.tensors.values())
        ppl = quantkit.evaluate(model, TEST, "llamacpp", 512, windows, progress=False).perplexity
        print(f"| {label} | {bpw:.3f} | {ppl:.3f} | {ppl / base:.3f} |", flush=True)


def speed(repeats: int) -> None:
    import bitsandbytes.functional as F

    import quantkit
    from quantkit.layers import LINEARS
    from quantkit.quantizers import nf4

    model = quantkit.load()
    model.materialize()
    weights = [layer.get_submodule(name).weight.detach().clone() for layer in model.layers for name in LINEARS]
    n = sum(w.numel() for w in weights)
    print(f"{len(weights)} linears, {n / 1e6:.1f} M weights, float32, {torch.get_num_threads()} threads")
    for kind in ("nf4", "fp4"):
        for double in (False, True):
            best = {"ours": float("inf"), "bitsandbytes": float("inf")}
            runs = {"ours": lambda w: nf4.quantize(w, kind, 64, double),
                    "bitsandbytes": lambda w: F.quantize_4bit(w, blocksize=64, compress_statistics=double, quant_type=kind)}
            for _ in range(repeats):
                for who, fn in runs.items():
                    start = time.perf_counter()
                    for w in weights:
                        fn(w)
                    best[who] = min(best[who], time.perf_counter() - start)
            print(f"{kind}{' + double quant' if double else ''}: ours {best['ours']:.3f} s, bitsandbytes "
                  f"{best['bitsandbytes']:.3f} s, ours / bitsandbytes {best['ours'] / best['bitsandbytes']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", nargs="?", choices=["speed", "table"])
    p.add_argument("--windows", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    if a.part != "table":
        speed(a.repeats)
    if a.part != "speed":
        perplexities(a.windows)


if __name__ == "__main__":
    main()
