"""GGUF on the embedded SmolLM2-135M: llama-quantize against ours, judged by llama-perplexity.

    python benchmarks/gguf_bench.py [--types Q8_0,Q6_K,Q5_K_M,Q4_K_M,Q4_0,Q3_K_M,Q2_K] [--windows 40] [--samples 128]
                                    [--gptq-types Q5_K_M,Q4_K_M,Q4_0,Q3_K_M,Q2_K]

For each type: llama-quantize from our F16 export (and its time); ours by plain RTN (the same
search, so the same bytes: checked, and then llama-quantize's score is reused), RTN weighted by an importance matrix from our calibration, and GPTQ onto
the same block grids (calibrated on --samples seeded windows of 512 tokens of the wikitext-2
validation file). Perplexity is llama-perplexity's (ctx 512, the first --windows windows of the
wikitext-2 test file) for every file; figures as ratios to llama-quantize's, and wall times of the
export (ours: quantization and writing, the model already loaded) against llama-quantize's.
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
DATA = ROOT.parent / "shared" / "data"
VALID = DATA / "wikitext-2" / "wiki.valid.tokens"
TEST = DATA / "wikitext-2-raw" / "wiki.test.raw"


def tensors(path: Path) -> dict:
    import gguf
    import numpy as np

    return {t.name: np.asarray(t.data).tobytes() for t in gguf.GGUFReader(path).tensors}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q8_0,Q6_K,Q5_K_M,Q4_K_M,Q4_0,Q3_K_M,Q2_K")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--gptq-types", default="Q5_K_M,Q4_K_M,Q4_0,Q3_K_M,Q2_K", help="types GPTQ runs for")
    a = ap.parse_args()

    import quantkit
    from tests import llamacpp

    tmp = Path(tempfile.mkdtemp(prefix="gguf-bench-"))
    try:
        f16 = tmp / "f16.gguf"
        quantkit.api.export_gguf(quantkit.load(), f16, "F16", progress=False)
        print(f"F16 {llamacpp.perplexity(f16, TEST, a.windows):.3f}", flush=True)
        rows = []
        for kind in a.types.split(","):
            ref = tmp / f"lq-{kind}.gguf"
            t0 = time.perf_counter()
            llamacpp.quantize(f16, ref, kind)
            row = {"type": kind, "lq_time": time.perf_counter() - t0, "lq": llamacpp.perplexity(ref, TEST, a.windows)}
            for label, method, imatrix in (("rtn", "rtn", False), ("imatrix", "rtn", True), ("gptq", "gptq", False)):
                if label == "gptq" and kind not in a.gptq_types.split(","):
                    row["gptq"], row["gptq_time"] = float("nan"), float("nan")
                    continue
                m = quantkit.load(f16)
                out = tmp / f"{label}-{kind}.gguf"
                t0 = time.perf_counter()
                quantkit.quantize(m, method=method, format="gguf", gguf_type=kind, imatrix=imatrix, out=out,
                                  calib_data=VALID, calib_samples=a.samples, progress=False)
                row[f"{label}_time"] = time.perf_counter() - t0
                # plain RTN is llama.cpp's own search: the same bytes, so the same score (checked, not assumed)
                same = label == "rtn" and tensors(out) == tensors(ref)
                row[label] = row["lq"] if same else llamacpp.perplexity(out, TEST, a.windows)
                out.unlink()
            rows.append(row)
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    finally:  # the F16 file and llama-quantize's, hundreds of MB
        shutil.rmtree(tmp)
    print("\n| type | llama-quantize | ours RTN | ours imatrix | ours GPTQ | best / llama-quantize | "
          "time RTN / llama-quantize |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        best = min(r["imatrix"], r["gptq"]) if r["gptq"] == r["gptq"] else r["imatrix"]
        print(f"| {r['type']} | {r['lq']:.3f} | {r['rtn']:.3f} | {r['imatrix']:.3f} | {r['gptq']:.3f} | "
              f"{best / r['lq']:.3f} | {r['rtn_time'] / r['lq_time']:.2f} ({r['rtn_time']:.1f} s / {r['lq_time']:.1f} s) |")


if __name__ == "__main__":
    main()
