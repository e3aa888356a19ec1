"""`quantkit eval` on the CPU: a packed 4-bit export against the float model, whole command against
whole command; and decoding speed, token by token.

    python benchmarks/packed_eval.py [--windows 8] [--repeat 2] [--act-order] [--nf4] [--tokens 64]

The embedded SmolLM2-135M and its RTN 4-bit g128 export (`quantkit quantize --out q4`, plain group
order), each scored by `quantkit eval MODEL --data wiki.test.raw --max-windows N --json` in a fresh
process (interpreter start, imports, loading, scoring), in float32 and in bfloat16 (`--dtype`), best
of --repeat. The anchor is the float model in float32, quantkit's CPU default. In bfloat16 the packed
model's linears run torch's fused int4 matmul up to qlinear.FUSED_ROWS rows of input, in float32 the
compiled GEMV up to qlinear.GEMV_ROWS, and beyond they dequantize a slice of rows at a time (an
evaluation window is 512 rows). --act-order adds a GPTQ 4-bit g128 --act-order export (calibrated on
wiki.valid.tokens; minutes); --nf4 an NF4 export with double quantization.

Decoding: greedy generation of --tokens tokens after a 32-token prompt, batch 1 (every linear's input
is one row: the fused paths), in float32 and in bfloat16, tokens per second, best of --repeat,
against the float model in the same dtype in the same run.
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
DATA = ROOT.parent / "shared/data"
TEST = DATA / "wikitext-2-raw/wiki.test.raw"


def best(command: list[str], repeat: int) -> tuple[float, float]:
    """Best wall time of repeat runs, and the perplexity the command printed."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        times.append(time.perf_counter() - start)
    return min(times), json.loads(out.strip().splitlines()[-1])["perplexity"]


def decode(path: str | None, tokens: int, repeat: int, dtype: str) -> float:
    """Tokens per second of greedy batch-1 generation in dtype, best of repeat."""
    import torch
    from transformers import AutoModelForCausalLM

    import quantkit
    from quantkit.modelio import default_model_dir

    if path is None:  # quantkit.load streams a float model's layers from disk: it holds none in memory
        model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=getattr(torch, dtype))
    else:
        model = quantkit.load(path, packed=True).module.to(getattr(torch, dtype))
    model.eval()
    prompt = torch.arange(100, 132)[None]
    times = []
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=4, do_sample=False)  # first use: the fused operands are made
        for _ in range(repeat):
            start = time.perf_counter()
            model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            times.append(time.perf_counter() - start)
    return tokens / min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--act-order", action="store_true", help="also a GPTQ --act-order export")
    ap.add_argument("--nf4", action="store_true", help="also an NF4 export with double quantization")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per decoding run")
    a = ap.parse_args()

    import quantkit

    work = Path(tempfile.mkdtemp(prefix="packed-eval-"))
    models = [("float (embedded)", None), ("packed RTN w4 g128", str(work / "q4"))]
    quantkit.quantize(None, method="rtn", bits=4, group_size=128, out=work / "q4", progress=False)
    if a.act_order:
        quantkit.quantize(None, method="gptq", bits=4, group_size=128, act_order=True, out=work / "act",
                          calib_data=str(DATA / "wikitext-2/wiki.valid.tokens"), progress=False)
        models.append(("packed GPTQ w4 g128 act-order", str(work / "act")))
    if a.nf4:
        quantkit.quantize(None, method="nf4", double_quant=True, out=work / "nf4", progress=False)
        models.append(("packed NF4 dq", str(work / "nf4")))
    print(f"`quantkit eval MODEL --data wiki.test.raw --max-windows {a.windows}`, best of {a.repeat}; "
          "anchor: the float model in float32")
    print("| model | dtype | perplexity | time | time / anchor |")
    print("| --- | --- | --- | --- | --- |")
    anchor = None
    for label, model in models:
        for dtype in ("float32", "bfloat16"):
            t, ppl = best([sys.executable, "-m", "quantkit", "eval", *([model] if model else []), "--data", str(TEST),
                           "--max-windows", str(a.windows), "--dtype", dtype, "--json"], a.repeat)
            anchor = anchor or t
            print(f"| {label} | {dtype} | {ppl:.4f} | {t:.2f} s | {t / anchor:.2f} |", flush=True)
    print(f"\nDecoding {a.tokens} tokens, batch 1, best of {a.repeat}; anchor: the float model in the same dtype")
    print("| model | float32 tokens/s | / anchor | bfloat16 tokens/s | / anchor |")
    print("| --- | --- | --- | --- | --- |")
    anchors = {}
    for label, model in models:
        rates = {dtype: decode(model, a.tokens, a.repeat, dtype) for dtype in ("float32", "bfloat16")}
        anchors = anchors or rates
        print(f"| {label} | " + " | ".join(f"{rates[d]:.1f} | {rates[d] / anchors[d]:.2f}" for d in rates) + " |",
              flush=True)

if __name__ == "__main__":
    main()
