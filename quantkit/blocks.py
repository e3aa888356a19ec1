"""GGUF block types (llama.cpp's ggml types): their names, sizes and widths, and plain
round-to-nearest into them compiled: quantkit/kernels/ggml.c, the searches of
quantkit.quantizers.ggml in C with the same float32 operations, built at install into
quantkit/_ggml*.so. Neither torch nor numpy nor the gguf package is imported here, so that
requantizing a GGUF file starts at once (quantize_at); quantize takes numpy arrays. The same
library holds NF4/FP4's codes (kernels/absmax.c) and the CPU's GEMV (kernels/gemv.c)."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from functools import cache
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from .errors import QuantkitError
from .gguf_constants import GGML_QUANT_SIZES, GGMLQuantizationType

if TYPE_CHECKING:
    import numpy as np

FLOAT_TYPES = ("F32", "F16", "BF16")
LEGACY_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
TYPES = FLOAT_TYPES + LEGACY_TYPES + K_TYPES
BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5,
        "Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}


def sizes(t: str) -> tuple[int, int]:
    """(values per block, bytes per block)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[t]]


def check(t: str, k: int, name: str = "tensor") -> None:
    if t not in TYPES:
        raise QuantkitError(f"unknown GGUF tensor type {t!r}: use one of {', '.join(TYPES)}")
    if k % sizes(t)[0]:
        raise QuantkitError(f"{name}: rows of {k} values do not fill {t} blocks of {sizes(t)[0]}: use another type")


def threads() -> int:
    """The cores this process may run on, or fewer where torch was told to use fewer (torch.set_num_threads,
    OMP_NUM_THREADS); GGUF export runs without torch."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch = sys.modules.get("torch")
    return max(1, min(cores, torch.get_num_threads())) if torch is not None else cores


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they were not built (no C compiler at install)."""
    here = Path(__file__).parent
    path = next((p for p in (here / f"_ggml{s}" for s in EXTENSION_SUFFIXES) if p.is_file()), None)
    slower = "GGUF quantization and the CPU's packed matmul fall back to torch, 10-40x slower"
    if path is None:
        warnings.warn(f"quantkit's compiled kernels (quantkit/_ggml) were not built at install, with no C compiler "
                      f"there: {slower}; install a C compiler and reinstall quantkit")
        return None
    try:
        return load(path)
    except OSError as e:  # built for another machine: the torch searches instead
        warnings.warn(f"{path.name} does not load ({e}): {slower}")
        return None


def load(path: Path) -> ctypes.CDLL:
    """A build of quantkit/kernels/ggml.c, absmax.c and gemv.c at path (the installed one, or a test's own build)."""
    lib = ctypes.CDLL(str(path))
    lib.quantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                             ctypes.c_void_p]
    lib.quantize.restype = ctypes.c_int
    lib.first_nonfinite.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    lib.first_nonfinite.restype = ctypes.c_int64
    lib.first_bad_block.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
    lib.first_bad_block.restype = ctypes.c_int64
    lib.absmax_codes.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p]
    lib.absmax_codes.restype = None
    lib.nested_codes.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_void_p]
    lib.nested_codes.restype = None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gptq_gemv.argtypes = [ptr, i64, i64, ptr, ctypes.c_int, ptr, ptr, ptr, i64, i64, i64, ptr]
    lib.gptq_gemv.restype = None
    lib.nf4_gemv.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, ctypes.c_float, i64, i64, i64, ptr]
    lib.nf4_gemv.restype = None
    return lib


@cache
def pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads())


os.register_at_fork(after_in_child=pool.cache_clear)  # a forked child has none of the pool's threads


def quantize(x: np.ndarray, t: str) -> np.ndarray | None:
    """The blocks of x [N, K] (float32 or float16) in type t (not a float type), [N, bytes per row]
    uint8, its rows split over the machine's cores; None without the compiled quantizer."""
    import numpy as np

    lib = library()
    if lib is None:
        return None
    half = x.dtype == np.float16
    x = np.require(x, np.float16 if half else np.float32, ["C_CONTIGUOUS", "ALIGNED"])  # a view when it is
    n, k = x.shape
    check(t, k)
    block, size = sizes(t)
    out = np.empty((n, k // block * size), dtype=np.uint8)
    split(n, lambda r0, r1: run(lib, t, x[r0:r1].ctypes.data, half, r1 - r0, k, out[r0:r1].ctypes.data))
    return out


def quantize_at(x: int, half: bool, n: int, k: int, t: str) -> bytearray | None:
    """The blocks in type t of the n rows of k float32 (half: float16) values at the address x (a
    mapped file's), [N x bytes per row], the rows split over the machine's cores; None without the
    compiled quantizer."""
    lib = library()
    if lib is None:
        return None
    check(t, k)
    block, size = sizes(t)
    width, row = 2 if half else 4, k // block * size
    out = bytearray(n * row)
    dst = ctypes.addressof(ctypes.c_char.from_buffer(out))
    split(n, lambda r0, r1: run(lib, t, x + r0 * k * width, half, r1 - r0, k, dst + r0 * row))
    return out


class Invalid(QuantkitError):
    """Values llama-quantize refuses (ggml_validate_row_data): NaN or infinity in the source, or a block
    whose values are too large for its float16 scale. The caller names the tensor."""


def invalid(x: int, t: str, count: int) -> bool:
    """Whether count values of type t at the address x fail llama.cpp's ggml_validate_row_data: a NaN
    or infinite value, or (a block type) a NaN or infinite float16 scale. False without the library."""
    lib = library()
    if lib is None:
        return False
    if t in FLOAT_TYPES:
        return lib.first_nonfinite(x, FLOAT_TYPES.index(t), count) >= 0
    return lib.first_bad_block(int(GGMLQuantizationType[t]), x, count // sizes(t)[0]) >= 0


def run(lib: ctypes.CDLL, t: str, x: int, half: bool, n: int, k: int, out: int) -> None:
    """The compiled quantizer on n rows at the address x into out, both checked as llama-quantize does."""
    if invalid(x, "F16" if half else "F32", n * k):
        raise Invalid("holds NaN or infinite values")
    if lib.quantize(int(GGMLQuantizationType[t]), x, half, n, k, out):
        raise QuantkitError(f"the compiled quantizer has no {t}")
    if invalid(out, t, n * k):
        raise Invalid(f"holds values too large for {t}'s float16 scales")


@contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back while the block runs, then raised as they came: Python runs its
    handlers in the main thread, between any two steps, so only there are they held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came = []
    held = {s: signal.signal(s, lambda signum, frame: came.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in held.items():
            signal.signal(s, handler)
        for s in came:
            signal.raise_signal(s)


def split(n: int, work: Callable[[int, int], None]) -> None:
    """work(r0, r1) on a share of n rows per core, at once (ctypes lets go of the GIL). Every share
    has ended when this returns or raises (an error or Ctrl-C in one): none is left writing to a
    buffer, or reading a map, that its caller then frees."""
    step = max(1, -(-n // threads()))
    shares = []
    try:
        with signals_held():  # a Ctrl-C between a submit and its list would leave a share unwaited for
            shares = [pool().submit(work, r0, min(n, r0 + step)) for r0 in range(step, n, step)]
        if n > 0:  # the first share on this thread: one hand-over fewer
            work(0, min(n, step))
        for share in shares:
            share.result()
    finally:
        wait(shares)
