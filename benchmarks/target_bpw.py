"""--target-bpw on the embedded SmolLM2-135M: GPTQ with each attention and MLP block's bits and group
size chosen from one measurement, against uniform GPTQ (the anchors) at the same bits per weight.
Each target is an anchor's own size, read from its export's bytes; every point's size is read
from its export too (bits per decoder-linear weight: codes, scales, zeros, g_idx).

    python benchmarks/target_bpw.py [--windows 20] [--calib-samples 32] [--out DIR]

GPTQ calibrates on WikiText-2 validation (--calib-samples windows of 512 tokens), the measurement on
the same windows, kept in OUT/measurement.json (the exports go to a temporary directory); perplexity is the llama.cpp protocol, ctx 512, the
first --windows windows of the WikiText-2 test file, of each export as it loads. Ratios are against
the anchor of the same size measured in the same run. OUT/target_bpw.png plots both curves.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
TEST, VALID = DATA / "wikitext-2-raw" / "wiki.test.raw", DATA / "wikitext-2" / "wiki.valid.tokens"
ANCHORS = [(3, 128), (3, 64), (4, 128), (4, 64)]  # uniform bits, group size


def plot(rows: list, path: Path) -> None:
    """Perplexity against bits per weight: the uniform anchors and the measured targets."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, which in (("uniform bits and group size", 1), ("--target-bpw (measured, per group of linears)", 2)):
        pts = sorted((r[which]["bpw"], r[which]["perplexity"]) for r in rows)
        ax.plot(*zip(*pts), "o-", label=label)
    ax.set_xlabel("bits per weight of the decoder linears (from the file)")
    ax.set_ylabel("perplexity (WikiText-2 test)")
    ax.set_yscale("log")
    ax.set_title("GPTQ on the embedded model: uniform against measured mixed precision")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "target-bpw")
    args = ap.parse_args()

    import quantkit
    from quantkit.report import bits_per_weight, parameter_counts, tensor_bytes

    params, linear = parameter_counts(quantkit.load().module)
    args.out.mkdir(parents=True, exist_ok=True)
    calib = dict(calib_data=VALID, calib_samples=args.calib_samples, progress=False, overwrite=True)

    exports = tempfile.TemporaryDirectory()

    def point(name: str, **options) -> dict:
        out = Path(exports.name) / name
        t0 = time.perf_counter()
        quantkit.quantize(None, method="gptq", out=out, **calib, **options)
        seconds = time.perf_counter() - t0
        _, bpw = bits_per_weight(tensor_bytes(out), params, linear)
        ppl = quantkit.evaluate(out, TEST, max_windows=args.windows, progress=False).perplexity
        print(f"{name}: {bpw:.4f} bits per linear weight, perplexity {ppl:.3f}, {seconds:.0f} s", flush=True)
        return {"bpw": bpw, "perplexity": ppl, "seconds": seconds}

    rows = []
    for bits, group in ANCHORS:
        anchor = point(f"w{bits}g{group}", bits=bits, group_size=group)
        mixed = point(f"target-{anchor['bpw']:.4f}", target_bpw=anchor["bpw"],
                      measurement=str(args.out / "measurement.json"))
        rows.append((f"w{bits} g{group}", anchor, mixed))
    exports.cleanup()
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"\nGPTQ on the embedded model, {args.calib_samples} calibration windows, perplexity over {args.windows} "
          "windows (llama.cpp protocol, ctx 512); the first target's time includes the measurement")
    print("| anchor (uniform) | bpw | perplexity | --target-bpw: bpw | perplexity | perplexity / anchor | time / anchor |")
    print("|---|---|---|---|---|---|---|")
    for label, a, t in rows:
        print(f"| {label} | {a['bpw']:.3f} | {a['perplexity']:.2f} | {t['bpw']:.3f} | {t['perplexity']:.2f} "
              f"| {t['perplexity'] / a['perplexity']:.3f} | {t['seconds'] / a['seconds']:.2f} |")
    plot(rows, args.out / "target_bpw.png")

if __name__ == "__main__":
    main()
