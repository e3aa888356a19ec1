"""Machine instructions per weight in the GEMV's inner loop, without a GPU: Triton compiles the kernel for
a Hopper GPU (sm_90) with its own ptxas, cuobjdump (shipped with Triton) disassembles it, and the loop
(the first backward branch) is counted. Instructions are not time (a GEMV also waits on memory), but
they show what a change to the arithmetic does before a GPU is lent.

    python benchmarks/gemv_sass.py [--kernels DIR] [--tiles 32x128,64x128,128x128] [--warps 2]

Cases: 4-bit GPTQ in groups of 128 and NF4 in blocks of 64 with double quantization, float16 x, K
split (as kernel_bench.py's shapes run), tiles' inputs cut to one group or block as kernels.tile cuts
them, integer arguments and pointers taken as multiples of 16 (as Triton specializes them at run time). --kernels DIR: another version of quantkit/kernels/jit.py, the
anchor; each row gives its count and this checkout's as a ratio.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as at run time (and quiet)
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
CASES = {"4-bit g128": (0, 4, 128, ["*i32", "*i32", "*fp16", "*i32", "*i32"]),
         "NF4 b64 nested": (1, 4, 64, ["*u8", "*u8", "*fp32", "*fp32", "*fp32"])}
ALIGNED = ["x", "y", "part", "count", "w0", "w1", "w2", "w3", "w4", "N", "K", "K_SPLIT", "i0"]


def jit_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"jit_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def loop_counts(jit, case: str, bn: int, bk: int, warps: int) -> collections.Counter:
    """Opcodes of the GEMV's inner loop for one case and tile."""
    fmt, bits, group, pointers = CASES[case]
    fn = jit.gemv_kernel
    types = dict(zip(["w0", "w1", "w2", "w3", "w4"], pointers)) | {
        "fparam": "fp32", "i0": "i32", "i1": "i32", "N": "i32", "K": "i32", "K_SPLIT": "i32", "x": "*fp16",
        "y": "*fp16", "part": "*fp32", "count": "*i32"}
    consts = {"FMT": fmt, "BITS": bits, "NESTED": fmt == 1, "GROUP": group, "ORDER": False, "BN": bn, "BK": bk,
              "SPLIT": True, "WORDS": True}
    names = fn.arg_names
    src = ASTSource(fn=fn, signature={n: types.get(n, "constexpr") for n in names},
                    constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in ALIGNED})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(CUOBJDUMP), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+(.*?);", sass)]
    for at, text in code:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < at:  # the first backward branch closes the inner loop
            start = int(target.group(1), 16)
            ops = (re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9]+)", t) for a, t in code if start <= a <= at)
            return collections.Counter(m.group(1) for m in ops if m)
    raise RuntimeError(f"{case} {bn}x{bk}: no loop found")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", type=Path, help="a folder holding another jit.py: the anchor")
    p.add_argument("--tiles", default="32x128,64x128,128x128", help="outputs x inputs per step, comma separated")
    p.add_argument("--warps", type=int, default=2, help="warps per program (kernels.GEMV_LAUNCH: 2 for GPTQ)")
    a = p.parse_args()
    here = jit_module(Path(__file__).resolve().parents[1] / "quantkit" / "kernels" / "jit.py")
    anchor = jit_module(a.kernels / "jit.py") if a.kernels else None
    print(f"triton {triton.__version__}, sm_90, {a.warps} warps; instructions in the GEMV's inner loop per weight "
          f"a thread reads in one step" + (f"; anchor: {a.kernels}" if anchor else ""))
    print("| case | tile | weights per thread per step | this checkout | anchor | anchor / this | top opcodes (this) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case in CASES:
        for tile in a.tiles.split(","):
            bn, bk = map(int, tile.split("x"))
            group = CASES[case][2]
            bk = group if 16 <= group < bk else bk  # as kernels.tile cuts a tile to one group
            per = bn * bk / (32 * a.warps)
            ours = loop_counts(here, case, bn, bk, a.warps)
            theirs = loop_counts(anchor, case, bn, bk, a.warps) if anchor else None
            mine, base = sum(ours.values()) / per, sum(theirs.values()) / per if theirs else None
            top = ", ".join(f"{op} {n}" for op, n in ours.most_common(6))
            print(f"| {case} | {bn}x{bk} | {per:.0f} | {mine:.2f} | {f'{base:.2f}' if base else '-'} | "
                  f"{f'{base / mine:.2f}' if base else '-'} | {top} |", flush=True)


if __name__ == "__main__":
    main()
