"""The compiled GGUF block quantizer (quantkit/kernels/ggml.c through quantkit.blocks) against the
torch searches it was written from, byte for byte, on data that reaches every branch: ties, zeros
of both signs, all-zero superblocks, subnormal values, values far above the rest. llama-quantize
judges the same data in tests/test_gguf.py."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from quantkit import blocks
from quantkit.quantizers import ggml


def test_the_compiled_quantizer_is_built():
    """The install built it: without it every GGUF export takes the torch path (the same bytes, ~10x
    the time) and nothing else says so."""
    assert blocks.library() is not None


def test_kernels_not_built_are_named(monkeypatch):
    """An install without a C compiler skips the optional extension: GGUF exports and the CPU's packed
    matmuls then took the torch paths, 10-40x slower, without a word."""
    monkeypatch.setattr(blocks, "EXTENSION_SUFFIXES", [".not-built.so"])
    with pytest.warns(UserWarning, match="were not built at install.*install a C compiler and reinstall"):
        assert blocks.library.__wrapped__() is None


def cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = torch.randn(24, 1024, generator=g)
    zeros = n.clone()
    zeros[:, :512] = 0  # all-zero superblocks and blocks
    zeros[::3, 600:700] = -0.0
    signed = n.abs() + 0.5
    signed[:, ::7] = 0.0
    signed[:, 3::7] = -0.0  # a block's minimum a zero of either sign, the first deciding
    tiny = n * 1e-20
    tiny[::2] *= 1e-18  # subnormal squares and sums
    return {
        "normal": n,
        "heavy": n * torch.rand(24, 1, generator=g) ** 4 * 10 + torch.randn(24, 1024, generator=g) ** 3,
        "ties": torch.randint(-3, 4, (24, 1024), generator=g).float() * 0.25,  # codes land on .5
        "zeros": zeros,
        "signed zeros": signed,
        "positive": n.abs() + 0.5,
        "tiny": tiny,
        "outliers": torch.where(torch.rand(24, 1024, generator=g) < 0.01, n * 1e4, n),
    }


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf-py's 1 / d of an all-zero block
@pytest.mark.parametrize("kind", blocks.LEGACY_TYPES + blocks.K_TYPES)
def test_compiled_blocks_equal_the_torch_searches(kind):
    """The K-quants equal the torch searches; the 32-value types gguf-py's rounding (the plain path
    before) where no zero has a sign to choose: a block of zeros of both signs, or whose minimum is
    one, gets the sign of the first in llama.cpp (and ours), numpy's choice in gguf-py; llama-quantize
    judges those in tests/test_gguf.py."""
    for name, w in cases().items():
        if kind in blocks.K_TYPES:
            theirs = ggml.pack(kind, ggml.fit_blocks(kind, w, None)).reshape(len(w), -1)
        elif name not in ("zeros", "signed zeros"):
            theirs = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[kind]).reshape(len(w), -1)
        else:
            continue
        ours = blocks.quantize(w.numpy(), kind)
        assert ours.shape == theirs.shape
        rows = np.nonzero((ours != theirs).any(axis=1))[0]
        assert rows.size == 0, f"{name}: rows {rows[:5]} differ"


@pytest.mark.parametrize("kind", blocks.LEGACY_TYPES)
def test_32_value_blocks_in_any_number(kind, monkeypatch):
    """The 32-value types are quantized eight blocks at a time (one per vector lane), the last few
    through a zero-padded buffer: any count of blocks, from float32 or float16, gives gguf-py's bytes."""
    monkeypatch.setattr(blocks, "threads", lambda: 1)  # every block count below reaches the C code whole
    w = cases()["heavy"][:, :96]  # 3 blocks a row
    for rows in (1, 2, 3, 5, 8, 11, 16):
        x = w[:rows].numpy()
        theirs = gguf.quants.quantize(x, gguf.GGMLQuantizationType[kind]).reshape(rows, -1)
        assert np.array_equal(blocks.quantize(x, kind), theirs), rows
        half = x.astype(np.float16)
        assert np.array_equal(blocks.quantize(half, kind), blocks.quantize(half.astype(np.float32), kind)), rows


CHILD = """
import sys
import numpy as np
from quantkit import blocks
lib = blocks.load(sys.argv[1])
blocks.library = lambda: lib
x = np.random.default_rng(0).standard_normal((9, 768)).astype(np.float32)
for t in sys.argv[2:]:
    for rows, k in ((1, 96), (7, 96), (9, 768), (3, 256)):
        if k % blocks.sizes(t)[0] == 0:
            blocks.quantize(x[:rows, :k], t)
            blocks.quantize(x[:rows, :k].astype(np.float16), t)
mids, order = np.linspace(-1, 1, 15, dtype=np.float32), np.arange(16, dtype=np.uint8)[::-1].copy()
for n, block in ((1, 64), (63, 64), (64, 64), (6911, 64), (100, 4096)):  # NF4/FP4 codes, tails too
    codes, absmax = np.empty(n, np.uint8), np.empty(-(-n // block), np.float32)
    lib.absmax_codes(x.ctypes.data, n, block, mids.ctypes.data, order.ctypes.data, codes.ctypes.data,
                     absmax.ctypes.data)
    lib.nested_codes(x.ctypes.data, n, 256, mids.ctypes.data, 15, codes.ctypes.data, absmax.ctypes.data)
rng = np.random.default_rng(1)
for m in (1, 5):  # the GEMVs (quantkit.qlinear): a last share of outputs, rows past one pass of 4
    xs, y = rng.standard_normal((m, 128)).astype(np.float32), np.zeros((m, 24), np.float32)
    for bits in (2, 3, 4, 8):
        qweight = rng.integers(-2 ** 31, 2 ** 31, (128 * bits // 32, 24)).astype(np.int32)
        g_idx = rng.integers(0, 3, 128).astype(np.int32)
        scales, zeros = rng.random((3, 24), np.float32), rng.integers(0, 1 << bits, (3, 24)).astype(np.int32)
        lib.gptq_gemv(xs.ctypes.data, m, 128, qweight.ctypes.data, bits, g_idx.ctypes.data, scales.ctypes.data,
                      zeros.ctypes.data, 24, 16, 24, y.ctypes.data)
    packed, table = rng.integers(0, 256, 24 * 64).astype(np.uint8), np.linspace(-1, 1, 16, dtype=np.float32)
    absmax, codes = rng.random(48, np.float32), rng.integers(0, 256, 48).astype(np.uint8)
    nested, nested_map = rng.random(12, np.float32), np.linspace(-1, 1, 256, dtype=np.float32)  # blocks of 4
    lib.nf4_gemv(xs.ctypes.data, m, 128, packed.ctypes.data, table.ctypes.data, 64, absmax.ctypes.data, None, None,
                 None, 256, 0.0, 20, 24, 24, y.ctypes.data)
    lib.nf4_gemv(xs.ctypes.data, m, 128, packed.ctypes.data, table.ctypes.data, 64, None, codes.ctypes.data,
                 nested.ctypes.data, nested_map.ctypes.data, 4, 0.5, 20, 24, 24, y.ctypes.data)
"""


def test_the_compiled_quantizer_stays_inside_its_buffers(tmp_path):
    """Built with AddressSanitizer: every type, from float32 and float16, on block counts that end in a
    partial group of eight, the NF4/FP4 codes on counts that end in a shorter block, and the GEMVs on
    a last share of outputs, read and write nothing outside their buffers (a tail buffer too small for
    Q8_0 once passed every byte test, its overflow landing in a buffer already read)."""
    gcc = shutil.which("gcc")
    asan = gcc and subprocess.run([gcc, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not asan or not os.path.isabs(asan):
        pytest.skip("no gcc with AddressSanitizer here")
    kernels = Path(__file__).resolve().parents[1] / "quantkit" / "kernels"
    lib = tmp_path / "ggml_asan.so"
    subprocess.run([gcc, "-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer", "-ffp-contract=off",
                    "-Wno-psabi", "-shared", "-fPIC", "-o", str(lib), str(kernels / "ggml.c"),
                    str(kernels / "absmax.c"), str(kernels / "gemv.c"), "-lm"], check=True)
    run = subprocess.run([sys.executable, "-c", CHILD, str(lib), *blocks.LEGACY_TYPES, *blocks.K_TYPES],
                         capture_output=True, text=True,
                         env={**os.environ, "LD_PRELOAD": asan, "ASAN_OPTIONS": "detect_leaks=0"})
    assert run.returncode == 0, run.stderr[-3000:]


def test_rows_split_over_threads_give_the_rows_alone(monkeypatch):
    """Each thread takes a slice of rows: any split gives the bytes of each row quantized alone."""
    w = cases()["heavy"].numpy()
    monkeypatch.setattr(blocks, "threads", lambda: 5)  # slices of 5, 5, 5, 5, 4 rows
    split = blocks.quantize(w, "Q4_K")
    assert np.array_equal(split, np.concatenate([blocks.quantize(w[i:i + 1], "Q4_K") for i in range(len(w))]))


def test_float16_rows_quantize_as_their_float32_values():
    """A float16 source (an F16 GGUF) is widened block by block inside the compiled quantizer."""
    w = cases()["heavy"].half().numpy()
    for kind in ("Q8_0", "Q4_K", "Q6_K"):
        assert np.array_equal(blocks.quantize(w, kind), blocks.quantize(w.astype(np.float32), kind))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_without_the_compiled_quantizer_the_bytes_are_the_same(monkeypatch):
    """No C compiler at install: gguf-py's rounding and the torch searches give the same bytes (but
    for a zero's sign, above)."""
    w = cases()["heavy"]
    compiled = {kind: ggml.quantize(w, kind).codes for kind in blocks.LEGACY_TYPES + blocks.K_TYPES}
    monkeypatch.setattr(blocks, "library", lambda: None)
    for kind, codes in compiled.items():
        assert torch.equal(ggml.quantize(w, kind).codes, codes), kind


def test_ctrl_c_while_shares_are_handed_out_waits_for_them(monkeypatch):
    """A SIGINT between a share's submit and its list left that share running after split raised:
    `quantkit export X.gguf` then unmapped the file the share read (a segfault, 4 in ~90 Ctrl-C)."""
    import os
    import signal
    import time

    running = set()

    def work(r0, r1):
        running.add(r0)
        time.sleep(0.3)
        running.discard(r0)

    submit = blocks.pool().submit

    def interrupted(*a, **k):
        share = submit(*a, **k)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # Python runs the handler here, at the next step, unless it is held
        return share

    monkeypatch.setattr(blocks.pool(), "submit", interrupted)
    monkeypatch.setattr(blocks, "threads", lambda: 4)
    # Python's own Ctrl-C handler, as in a terminal (a shell's background job starts with SIGINT ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            blocks.split(8, work)
        assert not running
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
