"""Compile every kernel variant to GPU machine code without a GPU (Triton's bundled ptxas), so that a
kernel the interpreter accepts but the compiler rejects fails here. Run without TRITON_INTERPRET:

    python tests/compile_kernels.py [capability ...]        # default: 90 (Hopper)
"""
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from quantkit import kernels
from quantkit.kernels import GPTQ, NF4, jit

LAYOUTS = [  # FMT, BITS, NESTED, GROUP, ORDER, the five weight pointers' types
    (GPTQ, bits, False, group, False, ["*i32", "*i32", "*fp16", "*i32", "*i32"]) for bits in (2, 3, 4, 8) for group in (0, 128)
] + [(GPTQ, bits, False, group, True, ["*i32", "*i32", "*fp16", "*i32", "*i32"]) for bits in (3, 4) for group in (0, 128)
     ] + [(NF4, 4, nested, group, False, ["*u8", "*u8" if nested else "*fp32", "*fp32", "*fp32", "*fp32"])
          for nested in (False, True) for group in (0, 64)]


def compile_one(fn, types: dict, consts: dict, capability: int, warps: int = 4) -> None:
    names = fn.arg_names
    sig = {n: types.get(n, "constexpr") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": warps, "num_stages": 3})


def compile_layout(cap: int, layout: tuple) -> str:
    fmt, bits, nested, group, order, w = layout
    args = dict(zip(["w0", "w1", "w2", "w3", "w4"], w)) | {
        "fparam": "fp32", "i0": "i32", "i1": "i32", "M": "i32", "N": "i32", "K": "i32", "K_SPLIT": "i32"}
    c = {"FMT": fmt, "BITS": bits, "NESTED": nested, "GROUP": group, "ORDER": order}
    words = 32 % bits == 0 if fmt == GPTQ else group > 0  # as kernels.matmul decides
    kind = "nf4" if fmt == NF4 else "act-order" if order else "gptq"  # kernels.layout
    bn, bk = kernels.GEMV_TILE[kind]
    for dt in ("fp16", "bf16", "fp32"):
        compile_one(jit.dequantize_kernel, args | {"out": f"*{dt}"}, c | {"BN": 32, "BK": 64, "WORDS": words}, cap)
        io = args | {"x": f"*{dt}", "y": f"*{dt}", "part": "*fp32", "count": "*i32"}
        for split in (False, True):  # the layout's GEMV tile and launch, as matmul runs them
            compile_one(jit.gemv_kernel, io, c | {"BN": bn, "BK": bk, "SPLIT": split, "WORDS": words}, cap,
                        kernels.GEMV_LAUNCH[kind].get("num_warps", 4))
            tile = {"BM": 16, "BN": 128, "BK": 64} if split else {"BM": 64, "BN": 64, "BK": 32}  # split: few rows
            if not order:  # the GEMM takes x reordered, and no ORDER
                gemm = {key: v for key, v in c.items() if key != "ORDER"} | tile
                compile_one(jit.gemm_kernel, io, gemm | {"UPCAST": False, "WORDS": words, "SPLIT": split,
                                                         "PRECISION": "ieee" if dt == "fp32" else "tf32"}, cap)
    return f"sm_{cap}: FMT {fmt}, {bits} bits, nested {nested}, group {group}, order {order}: compiled"


def main(capabilities: list[int]) -> None:
    # a process per core: each compile is single-threaded, and there are 216 of them per capability
    with ProcessPoolExecutor(os.cpu_count() or 1, mp_context=multiprocessing.get_context("spawn")) as pool:
        for line in pool.map(compile_layout, *zip(*[(cap, layout) for cap in capabilities for layout in LAYOUTS])):
            print(line, flush=True)


if __name__ == "__main__":
    main([int(c) for c in sys.argv[1:]] or [90])
