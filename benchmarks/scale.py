"""Real-size runs: time and peak memory of `quantkit quantize` on random Llamas of real shapes,
against llama-quantize (F16 GGUF to Q4_K_M) on the same model in the same run, and GPTQ against
GPTQModel's.

    python benchmarks/scale.py [--shape 7b|7b-8l|1b|135m]
                               [--runs llama,rtn,gguf,gptq,gptq-no-mse,gptqmodel,eval,lm-eval]
                               [--gptq-samples 4] [--device cpu|cuda] [--stop-after S] [--before DIR] [--keep]
                               [--eval-windows 4] [--lm-eval-limit 8]

The model (7b: Llama-2-7B's shapes; 7b-8l: its first 8 layers, for runs that cannot stop partway;
1b: TinyLlama-1.1B's; 135m: SmolLM2-135M's) is written once,
tensor by tensor, as bf16 shards into the user cache (7b: 13.5 GB; drawn on the GPU when there is
one, so a GPU machine's model is another random draw). Each run is its own process: its peak RSS is the
process's maximum resident set (getrusage of the child), shown against the model's size on disk.
--device: where quantkit quantizes (default: quantkit's, the GPU when there is one); on a GPU the
runs also report the peak GPU memory that quantkit's progress bar shows (torch's max_memory_allocated),
and the GPTQ run states its bound: twice one layer's float32 weights, its Hessians (one per distinct
input) and its calibration activations (inputs and outputs). llama-quantize
reads the F16 GGUF that `quantkit export` writes (that export is measured too). --before DIR runs
RTN again with quantkit imported from DIR first (an older version installed with
`pip install --no-deps --target DIR <checkout>`). --stop-after S stops the GGUF and GPTQ runs after S seconds (on
2 cores they need an hour or more for the 7B shape) and reports the layers they finished: memory is
per layer, so the peak over the first layers is the run's, except that a stopped GGUF run has not
yet quantized the output matrix (bounded by the same chunking as every other tensor). The gptqmodel run
(GPTQModel importable; benchmarks/gpu.sh carries it to a GPU machine) quantizes on the same calibration
windows at its own defaults for 4-bit g128, and is then the anchor of the ratios. The eval runs score
the float model on --eval-windows windows of 512 tokens of WikiText-2 test: float32 (a 7B does not fit 24
GiB, so a layer at a time), bfloat16 whole and a layer at a time, against llama-perplexity on the F16
GGUF of the model (the anchor; its export is measured too). The lm-eval runs score dolly_mc's first
--lm-eval-limit documents: lm-eval's own command on the model as transformers loads it in bfloat16 (the
anchor, on quantkit's device), then `quantkit lm-eval` in bfloat16 whole and a layer at a time, and by
default (a CPU's float32: a layer at a time where it does not fit). Each row's ratios are against the
anchor above it (rows above every anchor: against the first). Outputs go to a
temporary directory, removed at the end unless --keep.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT.parent / "shared" / "data"
VALID = DATA / "wikitext-2" / "wiki.valid.tokens"
TEST = DATA / "wikitext-2-raw" / "wiki.test.raw"

SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),
    "7b-8l": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=8, num_attention_heads=32,
                  num_key_value_heads=32, vocab_size=32000),
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152),
}


def model_dir(shape: str) -> Path:
    """The random bf16 model of a shape, written once across processes (fill_cache: another run that asks
    for it meanwhile waits) tensor by tensor: never whole in memory."""
    import torch
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.exporters.shards import ShardWriter
    from quantkit.modelio import cache_dir, fill_cache
    from tests.conftest import tiny_tokenizer

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False, dtype="bfloat16",
                         architectures=["LlamaForCausalLM"])
    with init_empty_weights():
        skeleton = LlamaForCausalLM(config)
    state = skeleton.state_dict()

    def write(tmp: Path) -> None:
        tmp.mkdir()
        where = "cuda" if torch.cuda.is_available() else "cpu"  # a CPU draws 7B values in minutes
        writer, g = ShardWriter(tmp, "5GB"), torch.Generator(where).manual_seed(0)
        start = time.monotonic()
        for i, (name, t) in enumerate(state.items()):
            value = torch.ones(t.shape) if t.dim() == 1 else torch.randn(t.shape, generator=g, device=where) * 0.02
            writer.add(name, value.to(torch.bfloat16).cpu())
            print(f"\rwriting the random {shape} model: {i + 1}/{len(state)} tensors, {writer.total / 2**30:.1f} GiB, "
                  f"{time.monotonic() - start:.0f} s", end="", file=sys.stderr)
        writer.close()
        for f in writer.scratch():
            f.unlink()
        print(file=sys.stderr)
        config.save_pretrained(tmp)
        tiny_tokenizer(tmp, vocab_size=SHAPES[shape]["vocab_size"])

    needed = sum(t.numel() for t in state.values()) * 2
    return fill_cache(cache_dir() / "scale" / f"llama-{shape}-bf16", write, lambda d: (d / "config.json").is_file(),
                      needed)


def bound(shape: str, samples: int, seqlen: int = 512) -> int:
    """Bytes of GPU memory that GPTQ of one layer needs at most (the issue's goal): twice its float32
    weights, its Hessians (q/k/v share one input, gate/up another) and its calibration activations."""
    c = SHAPES[shape]
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = h * c["num_key_value_heads"] // c["num_attention_heads"]
    weights = h * h * 2 + 2 * h * kv + 3 * h * i
    hessians = 3 * h * h + i * i
    activations = 2 * samples * seqlen * h
    return 2 * 4 * (weights + hessians + activations)


def gptqmodel_child(model: str, out: str, samples: int, device: str) -> None:
    """GPTQModel's GPTQ 4-bit g128 at its other defaults, on the windows quantkit's run takes, in a process
    of its own (measure()): its stderr ends with its peak GPU memory, as quantkit's progress bar shows ours."""
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer

    from quantkit import calibration

    os.chdir(Path(out).parent)  # where it offloads to disk by default
    tok = AutoTokenizer.from_pretrained(model)
    windows = calibration.sample_windows(tok, calibration.load_text(VALID, tokenizer=tok), samples, 512)
    if device == "cuda":  # its peak so far every 10 s: a run stopped partway still tells it
        def peak() -> None:
            while True:
                print(f"GPU {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB at {time.monotonic() - start:.0f} s",
                      file=sys.stderr, flush=True)
                time.sleep(10)

        start = time.monotonic()
        threading.Thread(target=peak, daemon=True).start()
    m = GPTQModel.load(model, QuantizeConfig(bits=4, group_size=128), device=device)
    m.quantize([{"input_ids": w[None], "attention_mask": torch.ones_like(w)[None]} for w in windows], batch_size=1)
    m.save(out)
    if device == "cuda":
        print(f"GPU {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", file=sys.stderr)


def measure(label: str, cmd: list[str], env: dict | None = None, seconds: float | None = None) -> dict:
    """Run cmd in its own process: wall time and peak RSS. seconds: stop it (SIGTERM) after that
    long and report how many layers it finished (from its progress bar) instead of failing."""
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.PIPE, text=True)
        if seconds is not None:
            threading.Timer(seconds, proc.terminate).start()
        err = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
        out.seek(0)
        said = out.read() + err
    proc.returncode = os.waitstatus_to_exitcode(status)
    result = {"run": label, "seconds": time.monotonic() - start, "peak_rss": usage.ru_maxrss * 1024}
    ppl = re.findall(r"(?:: perplexity|Final estimate: PPL =) ([\d.]+)", said)  # quantkit's, llama.cpp's
    if ppl:
        result["perplexity"] = float(ppl[-1])
    for metric in ("acc", "acc_norm"):  # quantkit lm-eval's line ("dolly_mc: acc 0.2500 ± ..."), lm-eval's table
        score = re.findall(rf"(?:[:,] {metric} |\|{metric}\s*\|[^|]*\|)([\d.]+)", said)
        if score:
            result[metric] = float(score[-1])
    gpu = re.findall(r"GPU ([\d.]+) GiB", err)
    if gpu:
        result["peak_gpu"] = float(gpu[-1]) * 2**30
    if seconds is not None:
        done = re.findall(r"(\d+)/(\d+) \[", err)
        result["layers"] = f"{done[-1][0]}/{done[-1][1]}" if done else "0"
    elif proc.returncode:
        raise RuntimeError(f"{label}: {' '.join(map(str, cmd))} failed ({proc.returncode}):\n{err[-3000:]}")
    print(json.dumps(result), flush=True)
    return result


def quantkits_device() -> str:
    """Where quantkit runs a model when no --device is given: the GPU when there is one. Asked of a
    child: torch imported here would raise this process's peak RSS, which the next children inherit."""
    said = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                          capture_output=True, text=True, check=True).stdout
    return "cuda" if said.strip() == "True" else "cpu"


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=SHAPES, default="7b")
    ap.add_argument("--runs", default="llama,rtn,gguf,gptq")
    ap.add_argument("--gptq-samples", type=int, default=4, help="GPTQ calibration: windows of 512 tokens")
    ap.add_argument("--stop-after", type=float, help="stop the GGUF and GPTQ runs after this many seconds and "
                    "report the layers they finished")
    ap.add_argument("--before", type=Path, help="also run RTN with quantkit imported from this directory")
    ap.add_argument("--keep", action="store_true", help="keep the outputs")
    ap.add_argument("--eval-windows", type=int, default=4, help="eval: windows of 512 tokens scored")
    ap.add_argument("--lm-eval-limit", type=int, default=8, help="lm-eval: dolly_mc's documents scored")
    ap.add_argument("--device", help="cpu or cuda (default: quantkit's, the GPU when there is one)")
    a = ap.parse_args()
    runs = a.runs.split(",")

    model = model_dir(a.shape)
    disk = size_of(model)
    out = Path(tempfile.mkdtemp(prefix="scale-", dir=model.parent))
    qk = [sys.executable, "-c", "from quantkit.command import main; main()"]
    common = ["--device", a.device] if a.device else []
    results = []
    try:
        if "llama" in runs:
            results.append(measure("quantkit export F16 GGUF", [*qk, "export", model, "--gguf-type", "F16",
                                                                "--out", out / "f16.gguf"]))
            from tests import llamacpp

            binaries = llamacpp.binaries()
            results.append(measure("llama-quantize F16 -> Q4_K_M", [binaries / "llama-quantize", out / "f16.gguf",
                                                                   out / "llama-q4km.gguf", "Q4_K_M"],
                                   {"LD_LIBRARY_PATH": str(binaries)}))
            (out / "f16.gguf").unlink()
        if a.before:
            # the editable install's finder comes before sys.path: drop it so that DIR's quantkit is imported
            before = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(a.before)!r}); "
                      "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
                      "from quantkit.command import main; main()"]
            results.append(measure("before: RTN 4-bit g128 -> safetensors",
                                   [*before, "quantize", model, "--method", "rtn", "--out", out / "before-rtn"]))
            shutil.rmtree(out / "before-rtn")
        if "rtn" in runs:
            results.append(measure("RTN 4-bit g128 -> safetensors",
                                   [*qk, "quantize", model, "--method", "rtn", "--out", out / "rtn", *common]))
        if "gguf" in runs:
            results.append(measure("RTN -> GGUF Q4_K_M", [*qk, "quantize", model, "--format", "gguf", "--gguf-type",
                                                          "Q4_K_M", "--out", out / "q4km.gguf", *common],
                                   seconds=a.stop_after))
        for run, extra in (("gptq", []), ("gptq-no-mse", ["--no-mse"])):  # no-mse: without the search GPTQModel skips
            if run in runs:
                results.append(measure(f"GPTQ 4-bit g128{' ' if extra else ''}{' '.join(extra)}, {a.gptq_samples} x 512 "
                                       "tokens -> safetensors",
                                       [*qk, "quantize", model, "--method", "gptq", "--calib-data", VALID,
                                        "--calib-samples", str(a.gptq_samples), "--calib-seqlen", "512",
                                        "--out", out / run, *extra, *common], seconds=a.stop_after))
        if "eval" in runs:  # the float model scored: a layer at a time where it does not fit, and whole in bf16
            data = ["--data", TEST, "--max-windows", str(a.eval_windows)]
            results.append(measure("quantkit export F16 GGUF", [*qk, "export", model, "--gguf-type", "F16",
                                                                "--out", out / "f16.gguf"]))
            from tests import llamacpp

            binaries = llamacpp.binaries()
            results.append(measure(f"llama-perplexity F16 GGUF, {a.eval_windows} x 512 tokens",
                                   [binaries / "llama-perplexity", "-m", out / "f16.gguf", "-f", TEST, "-c", "512",
                                    "--chunks", str(a.eval_windows), "-t", str(os.cpu_count())],
                                   {"LD_LIBRARY_PATH": str(binaries)}))
            (out / "f16.gguf").unlink()
            for label, extra in (("float32, by default (a layer at a time where it does not fit)", []),
                                 ("bfloat16, whole", ["--dtype", "bfloat16", "--whole"]),
                                 ("bfloat16, a layer at a time", ["--dtype", "bfloat16", "--layerwise"])):
                results.append(measure(f"quantkit eval, {label}", [*qk, "eval", model, *data, *extra, *common]))
        if "gptqmodel" in runs:
            child = (f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import scale; "
                     f"scale.gptqmodel_child({str(model)!r}, {str(out / 'gptqmodel')!r}, {a.gptq_samples}, "
                     f"{a.device or 'cuda'!r})")
            results.append(measure(f"GPTQModel: GPTQ 4-bit g128, {a.gptq_samples} x 512 tokens -> safetensors",
                                   [sys.executable, "-c", child]))
        if "lm-eval" in runs:  # the float model on dolly_mc: lm-eval's own command, then quantkit's
            tasks = ["--tasks", "dolly_mc", "--limit", str(a.lm_eval_limit), "--seed", "0"]
            results.append(measure(f"lm_eval (lm-eval's command; transformers' model, bfloat16), dolly_mc, "
                                   f"{a.lm_eval_limit} documents",
                                   ["lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={model}",
                                    "dtype=bfloat16", "--device", a.device or quantkits_device(), *tasks,
                                    "--batch_size", "4", "--include_path", ROOT / "evals" / "tasks", "--metadata",
                                    json.dumps({"data_dir": str(DATA)})]))
            for label, extra in (("bfloat16, whole", ["--dtype", "bfloat16", "--whole"]),
                                 ("bfloat16, a layer at a time", ["--dtype", "bfloat16", "--layerwise"]),
                                 ("by default (a CPU's float32, a GPU's float16; a layer at a time where it does not "
                                  "fit)", [])):
                results.append(measure(f"quantkit lm-eval, {label}", [*qk, "lm-eval", model, *tasks, "--data-dir", DATA,
                                                                       *extra, *common]))
    finally:
        if not a.keep:
            shutil.rmtree(out, ignore_errors=True)
    anchors = ("llama-quantize", "GPTQModel", "llama-perplexity", "lm_eval")
    anchor = next((r for r in results if r["run"].startswith(anchors)), None)
    names = {r["run"].split()[0].rstrip(":") for r in results if r["run"].startswith(anchors)}
    named = names.pop() if len(names) == 1 else "its anchor"
    on_gpu = any("peak_gpu" in r for r in results)
    print(f"\n{a.shape}-shaped Llama, {disk / 1e9:.2f} GB of bf16 safetensors on disk\n")
    if on_gpu:
        print(f"GPTQ's GPU memory bound: {bound(a.shape, a.gptq_samples) / 2**30:.2f} GiB (2 x (a layer's float32 "
              "weights + its Hessians + its calibration inputs and outputs))\n")
    print("| run | time (s) | peak RSS (GiB) | peak RSS / model on disk |" + (" peak GPU (GiB) |" if on_gpu else "")
          + (f" time / {named} | RSS / it |" if anchor else ""))
    print("|---|---|---|---|" + ("---|" if on_gpu else "") + ("---|---|" if anchor else ""))
    for r in results:
        if r["run"].startswith(anchors):  # the rows after it are measured against it
            anchor = r
        run = r["run"] + (f" (stopped after {r['layers']} layers)" if "layers" in r else "") + \
            (f": perplexity {r['perplexity']:.4f}" if "perplexity" in r else "") + \
            "".join(f", {metric} {r[metric]:.4f}" for metric in ("acc", "acc_norm") if metric in r)
        row = f"| {run} | {r['seconds']:.0f} | {r['peak_rss'] / 2**30:.2f} | {r['peak_rss'] / disk:.1%} |"
        if on_gpu:
            row += f" {r['peak_gpu'] / 2**30:.2f} |" if "peak_gpu" in r else " - |"
        if anchor:
            row += f" {r['seconds'] / anchor['seconds']:.2f} | {r['peak_rss'] / anchor['peak_rss']:.2f} |"
        print(row)


if __name__ == "__main__":
    main()
