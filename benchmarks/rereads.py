"""What a run reads more than once: a text's tokens, and the embedded GGUF's tensor table.

    python benchmarks/rereads.py [--repeat 3]

In one process, best of --repeat, on the embedded model's tokenizer and `wiki.test.raw`:
- tokenizing the text (the anchor: what calibration, each evaluation and each side of a comparison
  paid before), against `calibration.token_ids` asked for it again (a hit, by a copy of the tokenizer);
- gguf-py's reader of the embedded Q4_1 file (the anchor: what the first run's cache fill paid to size
  the float32 copy), against quantkit's header reader (`modelio.gguf_header`), the same sum.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


def best(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    import gguf

    from quantkit.calibration import windows
    from quantkit.modelio import default_gguf, default_model_dir, gguf_header, load_tokenizer

    text = (DATA / "wikitext-2-raw" / "wiki.test.raw").read_text()
    tok = load_tokenizer(default_model_dir())
    plain, ids = best(lambda: torch.tensor(tok(text, add_special_tokens=False)["input_ids"]), a.repeat)
    windows.token_ids(tok, text)
    copy = load_tokenizer(default_model_dir())
    hit, again = best(lambda: windows.token_ids(copy, text), a.repeat)
    assert torch.equal(ids, again)
    print(f"tokenizing wiki.test.raw ({len(ids)} tokens): {plain:.2f} s (anchor, 1.00); "
          f"token_ids again, from a copy of the tokenizer: {hit:.3f} s ({hit / plain:.3f})")
    path = default_gguf()
    reader, n = best(lambda: sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors), a.repeat)
    header, m = best(lambda: sum(math.prod(t.shape) for t in gguf_header(path)[1].tensors), a.repeat)
    assert n == m
    print(f"the embedded GGUF's weights ({n}): gguf-py's reader {reader:.2f} s (anchor, 1.00); "
          f"gguf_header {header:.3f} s ({header / reader:.3f})")


if __name__ == "__main__":
    main()
