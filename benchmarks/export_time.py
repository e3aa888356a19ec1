"""Export time of each format for the embedded model, against the GPTQ layout (the anchor).

    python benchmarks/export_time.py [--repeat 2]

Each row quantizes the embedded model with 4-bit RTN in groups of 64 (every format but EXL2 holds
it) streaming to the format, and reports the best of --repeat runs in seconds and as a ratio to the
GPTQ layout's, with the file's size. The last two rows are GPTQ on 16 calibration windows of 512
tokens: act-order in groups of 32 in the GPTQ layout, and EXL2 at 4.125 bits per weight.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import quantkit  # noqa: E402

ROWS = [  # (label, format, options)
    ("GPTQ layout (safetensors)", "safetensors", {}),
    ("AWQ GEMM", "awq", {}),
    ("compressed-tensors", "compressed-tensors", {}),
    ("GGUF Q4_0", "gguf", {"gguf_type": "Q4_0", "pure": True}),
    ("GGUF Q4_K_M", "gguf", {"gguf_type": "Q4_K_M"}),
    ("bitsandbytes NF4", "safetensors", {"method": "nf4"}),
    ("GPTQ w4 g32 act-order, GPTQ layout", "safetensors", {"method": "gptq", "group_size": 32, "act_order": True}),
    ("GPTQ onto EXL2, 4.125 bpw", "exl2", {"method": "gptq", "exl2": 4.125}),
]
VALID = ROOT.parent / "shared" / "data" / "wikitext-2" / "wiki.valid.tokens"


def size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.iterdir())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    quantkit.load()  # the cache filled before timing
    work = Path(tempfile.mkdtemp(prefix="export-time-"))
    print("| format | seconds | ratio to the GPTQ layout | MiB |")
    print("|---|---|---|---|")
    anchor = None
    for label, fmt, options in ROWS:
        options = {"group_size": 64, **options}
        best, out = float("inf"), work / (label.replace(" ", "_") + (".gguf" if fmt == "gguf" else ""))
        for _ in range(args.repeat):
            m = quantkit.load()
            start = time.perf_counter()
            calib = {"calib_data": VALID, "calib_samples": 16} if options.get("method") == "gptq" else {}
            quantkit.quantize(m, out=out, format=fmt, overwrite=True, progress=False, **calib, **options)
            best = min(best, time.perf_counter() - start)
        anchor = anchor or best
        print(f"| {label} | {best:.1f} | {best / anchor:.2f} | {size(out) / 2**20:.1f} |", flush=True)


if __name__ == "__main__":
    main()
