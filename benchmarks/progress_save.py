"""What a quantize run's progress saves cost it: GPTQ of a model streamed to an export, each layer's
progress (the calibration activations, 4 bytes per hidden value per token) written behind the next
layer as shipped, against the same run with each save waited for at once (the anchor, as quantkit
saved before).

    python benchmarks/progress_save.py [--model DIR] [--samples 128] [--repeat 2] [--dir DIR]

The two settings alternate, --repeat times each. Each row: the runs' times, the time their saves
took (save_progress, in the saving thread) and the time the layer loop spent waiting for them, with
the size of one save; ratios are of the medians, against the anchor's. --model: default the embedded model;
--samples: calibration windows of 512 tokens of wiki.valid.tokens (the command line's default, 128).
--dir: where the exports and progress go (default: a temporary directory, on the disk of /tmp).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VALID = ROOT.parent / "shared" / "data" / "wikitext-2" / "wiki.valid.tokens"

import quantkit  # noqa: E402
from quantkit import pipeline  # noqa: E402

REAL_SAVE, REAL_WAIT, REAL_START = pipeline.save_progress, pipeline.Saver.wait, pipeline.Saver.save


def timed(model: str | None, out: Path, samples: int, behind: bool) -> dict:
    """One run; behind=False: each save waited for as soon as it starts."""
    saving, waiting, sizes = [], [], []

    def save(path, state):
        t = time.perf_counter()
        REAL_SAVE(path, state)
        saving.append(time.perf_counter() - t)
        sizes.append(path.stat().st_size)

    def wait(self):
        t = time.perf_counter()
        REAL_WAIT(self)
        waiting.append(time.perf_counter() - t)

    def start(self, state, next_layer):
        REAL_START(self, state, next_layer)
        if not behind:
            self.wait()

    pipeline.save_progress, pipeline.Saver.wait, pipeline.Saver.save = save, wait, start
    try:
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        quantkit.quantize(model, method="gptq", calib_data=VALID, calib_samples=samples, out=out, progress=False)
        total = time.perf_counter() - t
    finally:
        pipeline.save_progress, pipeline.Saver.wait, pipeline.Saver.save = REAL_SAVE, REAL_WAIT, REAL_START
    return {"time": total, "saving": sum(saving), "waiting": sum(waiting), "saves": len(saving),
            "size": max(sizes, default=0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory (default: the embedded model)")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", type=Path)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="progress-", dir=a.dir))
    runs = {False: [], True: []}
    try:
        for k in range(a.repeat):
            for behind in (False, True):
                r = timed(a.model, work / "q", a.samples, behind)
                runs[behind].append(r)
                print(f"run {k + 1}, {'behind' if behind else 'waited'}: {r['time']:.1f} s, saves {r['saving']:.1f} s, "
                      f"waited {r['waiting']:.1f} s", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    anchor = {k: statistics.median(r[k] for r in runs[False]) for k in ("time", "waiting")}
    r0 = runs[False][0]
    print(f"GPTQ of {a.model or 'the embedded model'}, {a.samples} windows of 512: {r0['saves']} saves of "
          f"{r0['size'] / 2**20:.0f} MiB")
    print("| saves | runs (s) | median (s) | saves took (s), median | loop waited (s), median | waited / anchor's | "
          "time / anchor |")
    print("|---|---|---|---|---|---|---|")
    for behind, label in ((False, "waited for at once (anchor)"), (True, "behind the next layer")):
        rs = runs[behind]
        med = {k: statistics.median(r[k] for r in rs) for k in ("time", "saving", "waiting")}
        each = ", ".join(f"{r['time']:.1f}" for r in rs)
        print(f"| {label} | {each} | {med['time']:.1f} | {med['saving']:.1f} | {med['waiting']:.1f} | "
              f"{med['waiting'] / anchor['waiting']:.3f} | {med['time'] / anchor['time']:.3f} |")


if __name__ == "__main__":
    main()
