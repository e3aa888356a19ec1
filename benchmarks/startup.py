"""The command line's start: help, and a mistake in the options, answered before the libraries load.

    python benchmarks/startup.py [--repeat 5]
    PYTHONPATH=OTHER python benchmarks/startup.py      # another checkout's code (OTHER holds a quantkit package)

Each command runs as a fresh process, as a user runs it (`python -m quantkit ...`), best of --repeat.
Anchor, measured in the same run: `python -c "import torch"`, what every command paid before it
could answer. Also printed: the interpreter's own start, and which quantkit the runs imported.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

COMMANDS = {
    "quantkit --help": ["--help"],
    "quantkit quantize --help": ["quantize", "--help"],
    "quantkit train --help": ["train", "--help"],
    "quantkit quantize --bogus (unknown option)": ["quantize", "--bogus"],
    "quantkit quantize --bits 4.5 --out x (malformed option)": ["quantize", "--bits", "4.5", "--out", "x"],
    "quantkit quantize --method rtn --calib-samples 8 --out x (contradicting options)":
        ["quantize", "--method", "rtn", "--calib-samples", "8", "--out", "x"],
}


def best(command: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(command, capture_output=True)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    where = subprocess.run([sys.executable, "-c", "import quantkit; print(quantkit.__file__)"], capture_output=True,
                           text=True, check=True).stdout.strip()
    print(f"quantkit from {where}; best of {a.repeat}")
    python = best([sys.executable, "-c", "pass"], a.repeat)
    torch = best([sys.executable, "-c", "import torch"], a.repeat)
    print(f"| command | seconds | / python -c 'import torch' ({torch:.2f} s) |")
    print("| --- | --- | --- |")
    print(f"| python -c pass | {python:.2f} | {python / torch:.2f} |")
    for name, args in COMMANDS.items():
        t = best([sys.executable, "-m", "quantkit", *args], a.repeat)
        print(f"| {name} | {t:.2f} | {t / torch:.2f} |", flush=True)


if __name__ == "__main__":
    main()
