"""What the write safety costs: export time of the embedded model with every fsync, file lock and
resume CRC as shipped, against the same export with os.fsync, fcntl.flock and zlib.crc32 made no-ops
(the anchor).

    python benchmarks/safety_overhead.py [--repeat 3] [--dir DIR]

Rows: 4-bit RTN in groups of 128 streamed to the GPTQ layout (shards, progress after each layer),
and the GGUF Q8_0 file. The two settings alternate, --repeat times each; the best and the median
of each, and the ratio of the medians (safe / unsafe). --dir: where the exports go (default: a
temporary directory, on the disk that holds /tmp).
"""
from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import quantkit  # noqa: E402
from quantkit.atomic import remove  # noqa: E402

ROWS = [("GPTQ layout, RTN w4 g128", {}), ("GGUF Q8_0", {"format": "gguf", "gguf_type": "Q8_0"})]
REAL = os.fsync, fcntl.flock, zlib.crc32


def safety(on: bool) -> None:
    os.fsync, fcntl.flock, zlib.crc32 = REAL if on else (lambda *a: None, lambda *a: None, lambda *a: 0)


def timed(out: Path, options: dict) -> float:
    remove(out)
    start = time.perf_counter()
    quantkit.quantize(None, method="rtn", out=out, progress=False, **options)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="quantkit-safety-"))
    model = quantkit.load(None)  # the cache fill, and the first run's imports, before any timing
    del model
    print("| export | with fsync, locks and CRCs, s (best / median) | without (anchor), s | ratio of medians |")
    print("|---|---|---|---|")
    try:
        for label, options in ROWS:
            times = {True: [], False: []}
            timed(work / "warm", options)
            for _ in range(args.repeat):
                for on in (False, True):
                    safety(on)
                    times[on].append(timed(work / "out", options))
            safety(True)
            safe, anchor = (statistics.median(times[k]) for k in (True, False))
            print(f"| {label} | {min(times[True]):.2f} / {safe:.2f} | {min(times[False]):.2f} / {anchor:.2f} | "
                  f"{safe / anchor:.3f} |", flush=True)
    finally:
        safety(True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
