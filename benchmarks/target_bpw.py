"""--target-bpw on the embedded SmolLM2-135M against uniform settings (the anchors) at the same bits
per weight. --format safetensors: GPTQ, each group of linears sharing an input given its bits and
group size from one measurement, against uniform GPTQ grids. --format gguf: RTN, each linear given
a block type, against llama.cpp's K-quant mixes (the same bytes llama-quantize writes). Each target
is an anchor's own size, read from its export's bytes; every point's size is read from its export
too (bits per decoder-linear weight: codes, scales, zeros, g_idx; GGUF blocks).

    python benchmarks/target_bpw.py [--format safetensors|gguf] [--windows 20] [--calib-samples 32] [--out DIR]

The measurement calibrates on WikiText-2 validation (--calib-samples windows of 512 tokens; GPTQ on
the same), measured afresh in each run (with the exports, in a temporary directory; OUT gets
results.json and the plot); perplexity is the
llama.cpp protocol, ctx 512, the first --windows windows of the WikiText-2 test file, of each export
as it loads (GGUF in llama.cpp's arithmetic). Ratios are against the anchor of the same size
measured in the same run. OUT/target_bpw.png plots both curves.
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
# per format: the method, and each anchor's label and settings
ANCHORS = {
    "safetensors": ("gptq", [(f"w{b} g{g}", dict(bits=b, group_size=g)) for b, g in ((3, 128), (3, 64), (4, 128), (4, 64))]),
    "gguf": ("rtn", [(mix, dict(gguf_type=mix)) for mix in ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M")]),
}
LABELS = {"safetensors": ("GPTQ", "uniform bits and group size", "per group of linears"),
          "gguf": ("RTN in GGUF", "llama.cpp's K-quant mixes", "a block type per linear")}


def plot(rows: list, path: Path, fmt: str = "safetensors") -> None:
    """Perplexity against bits per weight: the uniform anchors and the measured targets."""
    method, anchors, unit = LABELS[fmt]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, which in ((anchors, 1), (f"--target-bpw (measured, {unit})", 2)):
        pts = sorted((r[which]["bpw"], r[which]["perplexity"]) for r in rows)
        ax.plot(*zip(*pts), "o-", label=label)
    ax.set_xlabel("bits per weight of the decoder linears (from the file)")
    ax.set_ylabel("perplexity (WikiText-2 test)")
    ax.set_yscale("log")
    ax.set_title(f"{method} on the embedded model:\n{anchors} against measured mixed precision", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--format", choices=list(ANCHORS), default="safetensors")
    ap.add_argument("--out", type=Path, help="[benchmarks/target-bpw, or target-bpw-gguf]")
    args = ap.parse_args()
    args.out = args.out or ROOT / "benchmarks" / ("target-bpw" if args.format == "safetensors" else "target-bpw-gguf")
    method, anchors = ANCHORS[args.format]
    gguf = args.format == "gguf"

    import quantkit
    from quantkit.report import bits_per_weight, parameter_counts, tensor_bytes

    params, linear = parameter_counts(quantkit.load().module)
    args.out.mkdir(parents=True, exist_ok=True)
    calib = dict(calib_data=VALID, calib_samples=args.calib_samples, progress=False, overwrite=True)

    exports = tempfile.TemporaryDirectory()

    def point(name: str, **options) -> dict:
        out = Path(exports.name) / (name + ".gguf" * gguf)
        t0 = time.perf_counter()
        quantkit.quantize(None, method=method, out=out, format=args.format, **calib, **options)
        seconds = time.perf_counter() - t0
        _, bpw = bits_per_weight(tensor_bytes(out), params, linear)
        ppl = quantkit.evaluate(out, TEST, max_windows=args.windows, progress=False).perplexity
        print(f"{name}: {bpw:.4f} bits per linear weight, perplexity {ppl:.3f}, {seconds:.0f} s", flush=True)
        return {"bpw": bpw, "perplexity": ppl, "seconds": seconds}

    rows = []
    for label, settings in anchors:
        anchor = point(label.replace(" ", ""), **settings)
        mixed = point(f"target-{anchor['bpw']:.4f}", target_bpw=anchor["bpw"], gguf_type="Q4_K_M" if gguf else None,
                      measurement=str(Path(exports.name) / "measurement.json"))  # measured afresh each run
        rows.append((label, anchor, mixed))
    exports.cleanup()
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{LABELS[args.format][0]} on the embedded model, {args.calib_samples} calibration windows, perplexity over "
          f"{args.windows} windows (llama.cpp protocol, ctx 512); the first target's time includes the measurement")
    print(f"| anchor ({LABELS[args.format][1]}) | bpw | perplexity | --target-bpw: bpw | perplexity | perplexity / anchor | time / anchor |")
    print("|---|---|---|---|---|---|---|")
    for label, a, t in rows:
        print(f"| {label} | {a['bpw']:.3f} | {a['perplexity']:.2f} | {t['bpw']:.3f} | {t['perplexity']:.2f} "
              f"| {t['perplexity'] / a['perplexity']:.3f} | {t['seconds'] / a['seconds']:.2f} |")
    plot(rows, args.out / "target_bpw.png", args.format)


if __name__ == "__main__":
    main()
