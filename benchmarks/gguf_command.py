"""GGUF export, whole command against whole command: `quantkit export` against `llama-quantize`.

    python benchmarks/gguf_command.py [--types Q8_0,Q6_K,...] [--repeat 2] [--source F32] [--model 1b]

Both start from the same F32 (or F16) GGUF of the embedded SmolLM2-135M (or --model 1b: the random
TinyLlama-1.1B-shaped model of benchmarks/scale.py, whose rows fill the K-quants' 256-value blocks
where SmolLM2's 576-wide rows fall back to 32-value types) and write the same mix (plain rounding, no
importance matrix); each command runs as a fresh process, as a user runs it (interpreter start,
imports, reading the file, quantizing, writing), best of --repeat. The two files are compared byte
for byte. Ratios: ours / llama-quantize's, the anchor measured in the same run.
"""
from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def best(command: list[str], repeat: int, env: dict | None = None) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, env=env)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q8_0,Q6_K,Q5_K_M,Q4_K_M,Q4_0,Q3_K_M,Q2_K")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--source", default="F32", choices=["F32", "F16"])
    ap.add_argument("--model", default="embedded", choices=["embedded", "1b"])
    a = ap.parse_args()

    import quantkit
    from tests import llamacpp

    tmp = Path(tempfile.mkdtemp(prefix="gguf-command-"))
    src = tmp / f"{a.source.lower()}.gguf"
    if a.model == "1b":
        from scale import model_dir

        model = quantkit.load(model_dir("1b"))
    else:
        model = quantkit.load()
    quantkit.api.export_gguf(model, src, a.source, progress=False)
    tools = llamacpp.binaries()
    lq, env = str(tools / "llama-quantize"), {**os.environ, "LD_LIBRARY_PATH": str(tools)}
    print(f"source: {src.name} ({src.stat().st_size / 1e9:.2f} GB) of the {a.model} model; best of {a.repeat}; "
          "ratios ours / llama-quantize")
    print("| type | llama-quantize | quantkit export | ours / llama-quantize | files equal |")
    print("| --- | --- | --- | --- | --- |")
    for kind in a.types.split(","):
        ref, ours = tmp / f"lq-{kind}.gguf", tmp / f"ours-{kind}.gguf"
        t_lq = best([lq, str(src), str(ref), kind, "2"], a.repeat, env)
        t_ours = best([sys.executable, "-m", "quantkit", "export", str(src), "--out", str(ours), "--gguf-type", kind,
                       "--overwrite"], a.repeat)
        equal = filecmp.cmp(ref, ours, shallow=False)
        ref.unlink()
        ours.unlink()
        print(f"| {kind} | {t_lq:.2f} s | {t_ours:.2f} s | {t_ours / t_lq:.2f} | {'yes' if equal else 'NO'} |",
              flush=True)
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
