"""Divergence from the base, quantkit against llama-perplexity --kl-divergence, and the cost of --base.

    python benchmarks/kld.py [--windows 16] [--work DIR]

For Q4_K_M, Q3_K_M and Q2_K of the embedded model: our file and llama-quantize's (from the same F32
GGUF), each scored by llama-perplexity against its own saved base of the F32 file and by quantkit
against ours; the ratio is ours over llama.cpp's. Then the time of `quantkit eval --base SAVED`
against a plain perplexity run of the same packed GPTQ export (the anchor).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import quantkit  # noqa: E402
from tests import llamacpp  # noqa: E402

TEST = ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
VALID = ROOT.parent / "shared" / "data" / "wikitext-2" / "wiki.valid.tokens"
MIXES = ("Q4_K_M", "Q3_K_M", "Q2_K")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--work", type=Path)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="kld-"))
    try:
        f32 = work / "f32.gguf"
        if not f32.exists():
            quantkit.api.export_gguf(quantkit.load(), f32, "F32", progress=False)
        theirs_base, ours_base = work / "theirs.logits", work / "ours.logits"
        llamacpp.save_base(f32, TEST, theirs_base, args.windows)
        print("| file | llama.cpp KLD | quantkit KLD | ratio | llama.cpp same top | quantkit same top | difference |")
        print("|---|---|---|---|---|---|---|")
        for mix in MIXES:
            ours_file, their_file = work / f"ours-{mix}.gguf", work / f"lq-{mix}.gguf"
            q = quantkit.load()
            quantkit.quantize(q, method="rtn", format="gguf", gguf_type=mix, out=ours_file, keep=True, overwrite=True,
                              progress=False)
            llamacpp.quantize(f32, their_file, mix)
            same = ours_file.read_bytes() == their_file.read_bytes()
            # llama-quantize's file holds our model when the bytes are equal; else it is loaded
            for label, path in (("ours", ours_file), ("llama-quantize's" + (", same bytes" if same else ""), their_file)):
                model = q if path == ours_file or same else quantkit.api.ready(quantkit.load(path))
                theirs = llamacpp.kl_divergence(path, theirs_base)
                base = {"base": ours_base} if ours_base.exists() else {"base": quantkit.load(), "save_base": ours_base}
                d = quantkit.compare(model, data=TEST, max_windows=args.windows, progress=False, **base)
                print(f"| {mix} ({label}) | {theirs['kld_mean']:.6f} | {d.kld_mean:.6f} | "
                      f"{d.kld_mean / theirs['kld_mean']:.4f} | {100 * theirs['same_top']:.3f}% | {100 * d.same_top:.3f}% | "
                      f"{100 * (d.same_top - theirs['same_top']):+.3f} points |", flush=True)

        export = work / "gptq-w4g128"
        if not export.exists():
            quantkit.quantize(method="gptq", out=export, calib_data=VALID, calib_samples=32, progress=False)
        m = quantkit.api.ready(quantkit.load(export, packed=True))
        times = {}
        for label, run in (("plain perplexity", lambda: quantkit.evaluate(m, TEST, max_windows=args.windows, progress=False)),
                           ("--base SAVED", lambda: quantkit.compare(m, ours_base, TEST, max_windows=args.windows,
                                                                      progress=False))):
            start = time.perf_counter()
            run()
            times[label] = time.perf_counter() - start
        anchor = times["plain perplexity"]
        for label, t in times.items():
            print(f"{label}: {t:.1f} s ({t / anchor:.2f}x the plain perplexity run), packed GPTQ w4g128, "
                  f"{args.windows} windows of 512")
    finally:
        if args.work is None:  # a --work directory is kept, for the next run to reuse
            shutil.rmtree(work)


if __name__ == "__main__":
    main()
