"""`quantkit eval` on the CPU: a packed 4-bit export against the float model, whole command against whole command.

    python benchmarks/packed_eval.py [--windows 8] [--repeat 2]

The embedded SmolLM2-135M and its RTN 4-bit g128 export (`quantkit quantize --out q4`, plain group
order), each scored by `quantkit eval MODEL --data wiki.test.raw --max-windows N --json` in a fresh
process (interpreter start, imports, loading, scoring), in float32 and in bfloat16 (`--dtype`), best
of --repeat. The anchor is the float model in float32, quantkit's CPU default. In bfloat16 the packed
model's linears run torch's fused int4 matmul; in float32 they dequantize a slice of rows at a time.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TEST = ROOT.parent / "shared/data/wikitext-2-raw/wiki.test.raw"


def best(command: list[str], repeat: int) -> tuple[float, float]:
    """Best wall time of repeat runs, and the perplexity the command printed."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        times.append(time.perf_counter() - start)
    return min(times), json.loads(out.strip().splitlines()[-1])["perplexity"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()

    import quantkit

    q4 = Path(tempfile.mkdtemp(prefix="packed-eval-")) / "q4"
    quantkit.quantize(None, method="rtn", bits=4, group_size=128, out=q4, progress=False)
    print(f"`quantkit eval MODEL --data wiki.test.raw --max-windows {a.windows}`, best of {a.repeat}; "
          "anchor: the float model in float32")
    print("| model | dtype | perplexity | time | time / anchor |")
    print("| --- | --- | --- | --- | --- |")
    anchor = None
    for label, model in (("float (embedded)", []), ("packed RTN w4 g128", [str(q4)])):
        for dtype in ("float32", "bfloat16"):
            t, ppl = best([sys.executable, "-m", "quantkit", "eval", *model, "--data", str(TEST), "--max-windows",
                           str(a.windows), "--dtype", dtype, "--json"], a.repeat)
            anchor = anchor or t
            print(f"| {label} | {dtype} | {ppl:.4f} | {t:.2f} s | {t / anchor:.2f} |", flush=True)


if __name__ == "__main__":
    main()
