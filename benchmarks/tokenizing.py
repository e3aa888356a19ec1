"""Tokenizing a long text: the whole text in one tokenizer call (the anchor) against
`calibration.token_ids` (pieces of CHUNK characters, a few at once), each in its own process:
peak memory above the process's start, time, and whether the ids are the same.

    python benchmarks/tokenizing.py [--copies 12] [--model DIR]

The text is WikiText-2 test + validation repeated --copies times (2.4 MB each)."""
import argparse
import hashlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def child(how: str, model: str, path: str) -> None:
    from transformers import AutoTokenizer

    from quantkit.calibration import token_ids

    tok = AutoTokenizer.from_pretrained(model)
    text = Path(path).read_text()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    if how == "whole":
        import torch

        ids = torch.tensor(tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    else:
        ids = token_ids(tok, text)
    took = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps({"s": took, "gib": peak / 2**20, "tokens": len(ids),
                      "sha": hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=12)
    ap.add_argument("--model", default=None, help="a model directory (default: the embedded model)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(*a.child)
    from quantkit.modelio import default_model_dir

    model = a.model or str(default_model_dir())
    path = Path("/tmp/quantkit-tokenize-bench.txt")
    one = (DATA / "wikitext-2-raw" / "wiki.test.raw").read_text() + (DATA / "wikitext-2" / "wiki.valid.tokens").read_text()
    path.write_text(one * a.copies)
    runs = {how: json.loads(subprocess.run([sys.executable, __file__, "--child", how, model, str(path)], check=True,
                                           capture_output=True, text=True).stdout.splitlines()[-1])
            for how in ("whole", "pieces")}
    w, p = runs["whole"], runs["pieces"]
    print(f"{path.stat().st_size / 1e6:.1f} MB of text, {w['tokens']} tokens")
    print(f"whole text (anchor): {w['s']:.1f} s, {w['gib']:.2f} GiB above the start")
    print(f"pieces: {p['s']:.1f} s ({p['s'] / w['s']:.2f}x), {p['gib']:.2f} GiB ({p['gib'] / w['gib']:.2f}x); "
          f"same ids: {p['sha'] == w['sha'] and p['tokens'] == w['tokens']}")
    path.unlink()


if __name__ == "__main__":
    main()
