"""Mixed precision by rules (--rules) on the embedded SmolLM2-135M: GPTQ 3-bit g64 with some linears at
more bits, against the same without rules (the anchor) and 4-bit g64: bits per decoder-linear weight
from the export's bytes, and perplexity.

    python benchmarks/rules.py [--windows 20] [--calib-samples 32]

GPTQ calibrates on WikiText-2 validation (--calib-samples windows of 512 tokens); perplexity is the
llama.cpp protocol, ctx 512, the first --windows windows of the WikiText-2 test file, of each export
as it loads. Ratios are against the anchor measured in the same run.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
TEST, VALID = DATA / "wikitext-2-raw" / "wiki.test.raw", DATA / "wikitext-2" / "wiki.valid.tokens"
EDGES = r"layers\.(0|1|28|29)\.mlp\.down_proj"  # the first and last two layers' down_proj
POINTS = [  # label, bits, rules
    ("w3 g64 (anchor)", 3, []),
    ("w3 g64, down_proj of layers 0,1,28,29 at 8 bits", 3, [{"match": EDGES, "bits": 8}]),
    ("w3 g64, every down_proj at 4 bits", 3, [{"match": r"mlp\.down_proj", "bits": 4}]),
    ("w3 g64, every v_proj and down_proj at 4 bits", 3, [{"match": r"(v|down)_proj", "bits": 4}]),
    ("w4 g64", 4, []),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--calib-samples", type=int, default=32)
    args = ap.parse_args()

    import quantkit
    from quantkit.report import bits_per_weight, parameter_counts, tensor_bytes

    params, linear = parameter_counts(quantkit.load().module)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, bits, rules) in enumerate(POINTS):
            out = Path(tmp) / f"p{i}"
            t0 = time.perf_counter()
            quantkit.quantize(None, method="gptq", bits=bits, group_size=64, rules=rules, out=out,
                              calib_data=VALID, calib_samples=args.calib_samples, progress=False)
            seconds = time.perf_counter() - t0
            _, bpw = bits_per_weight(tensor_bytes(out), params, linear)
            ppl = quantkit.evaluate(out, TEST, max_windows=args.windows, progress=False).perplexity
            rows.append((label, bpw, ppl, seconds))
            print(f"{label}: {bpw:.3f} bits per linear weight, perplexity {ppl:.3f}, {seconds:.0f} s", flush=True)
    _, bpw0, ppl0, s0 = rows[0]
    print(f"\nGPTQ g64 on the embedded model, {args.calib_samples} calibration windows, perplexity over "
          f"{args.windows} windows (llama.cpp protocol, ctx 512)")
    print("| setting | bits per linear weight | / anchor | perplexity | / anchor | quantize time / anchor |")
    print("|---|---|---|---|---|---|")
    for label, bpw, ppl, seconds in rows:
        print(f"| {label} | {bpw:.3f} | {bpw / bpw0:.3f} | {ppl:.2f} | {ppl / ppl0:.3f} | {seconds / s0:.2f} |")


if __name__ == "__main__":
    main()
