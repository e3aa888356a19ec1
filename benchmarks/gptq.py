"""GPTQ on the embedded SmolLM2-135M: perplexity against RTN, and time and memory against auto-gptq.

    python benchmarks/gptq.py table [--samples 128] [--seqlen 512] [--windows 40]
    python benchmarks/gptq.py speed [--samples 32] [--bits 3] [--group-size 128] [--windows 20]
    python benchmarks/gptq.py defaults [--samples 32] [--windows 20] [--settings w3g128,w4g128,w3g-1,w4g-1]
    python benchmarks/gptq.py gptqmodel --python VENV/bin/python [--settings w3g128,w4g128]

`table`: base, RTN and GPTQ (act-order and MSE clipping) perplexity (llama.cpp protocol, ctx 512,
first --windows windows of the wikitext-2 test file) at w4 g128, w3 g128 and w4 per channel, sym
and asym; GPTQ calibrated on --samples seeded windows of --seqlen tokens of the validation file;
the share of RTN's gap to the base that GPTQ closes.
`speed`: our GPTQ and auto-gptq 0.7.1's GPTQ, both with the reference's defaults (true-sequential,
no act-order), driven over the same layers with the same windows: quantization wall time and peak
RSS as ours / theirs, and both perplexities; then ours with act-order and MSE clipping.
`defaults`: each GPTQ option's effect on perplexity and quantization time at w3/w4, g128 and per
channel (symmetric, --samples x --seqlen calibration tokens): the reference's settings (no act-order,
min-max grids), MSE clipping, the orderings that keep the plain g_idx layout (group-aware;
act-order with static groups) and act-order with its permuted g_idx.
`gptqmodel`: quantkit's plain command against GPTQModel's defaults (symmetric, --samples x --seqlen
tokens): both calibrated on the same windows (quantkit's sample, handed over as a file), GPTQModel's
checkpoint loaded and scored by quantkit's evaluation as ours is. GPTQModel runs in the environment of
--python (it asks for torch 2.14.1 and a newer transformers than quantkit's pins: a venv of its own,
`pip install torch==2.14.1 gptqmodel==7.7.0`); its time is its `quantize` call, the float model loaded.
Each run is a child process (`run`), so that peak RSS is that run's own.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from children import child, flag

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
VALID = DATA / "wikitext-2" / "wiki.valid.tokens"
TEST = DATA / "wikitext-2-raw" / "wiki.test.raw"
BEST = dict(act_order=True, mse=True)
SETTINGS = [(4, 128, True), (4, 128, False), (3, 128, True), (3, 128, False), (4, -1, True), (4, -1, False)]


def autogptq_quantize(m, windows, bits, group_size, sym, act_order) -> None:
    """auto-gptq's own flow for a Llama layer: per sub-group, its GPTQ objects gather their Hessians
    from forward hooks, then fasterquant; the layer is run again for the next layer's inputs."""
    sys.path.insert(0, str(ROOT))
    from tests.refs import autogptq

    from quantkit.pipeline import GROUPS, capture_inputs, run_layer

    GPTQ = autogptq("quantization.gptq").GPTQ
    batches = capture_inputs(m, windows, 8)
    for layer in m.layers:
        for group in GROUPS:
            objs, handles = {}, []
            for name in group:
                linear = layer.get_submodule(name)
                objs[name] = g = GPTQ(linear)
                g.quantizer.configure(bits, perchannel=True, sym=sym, mse=False)
                handles.append(linear.register_forward_hook(lambda mod, i, o, g=g: g.add_batch(i[0].data, o.data)))
            for hidden, kwargs in batches:
                layer(hidden, **kwargs)
            for h in handles:
                h.remove()
            for g in objs.values():
                g.fasterquant(blocksize=128, percdamp=0.01, group_size=group_size, actorder=act_order)
                g.free()
        batches = run_layer(layer, batches)


def gptqmodel_run(a) -> dict:
    """GPTQModel's GPTQ at its defaults but bits, group size and symmetry, on the windows in a.tokens, saved
    to a.path; in GPTQModel's environment, where quantkit is not imported."""
    import os

    # 7.7.0 sizes its CPU pool at half the cores, then asks for 2 workers of it to load: on 2 cores it refuses
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(os.cpu_count()))
    import gptqmodel
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig
    from safetensors.torch import load_file

    windows = load_file(a.tokens)["windows"]
    model, out = Path(a.model).resolve(), Path(a.path).resolve()
    os.chdir(out.parent)  # it writes a log folder into the working directory
    m = GPTQModel.load(str(model), QuantizeConfig(bits=a.bits, group_size=a.group_size, sym=a.sym), device="cpu")
    start = time.perf_counter()
    m.quantize([{"input_ids": w[None], "attention_mask": torch.ones_like(w)[None]} for w in windows], batch_size=1)
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    m.save(str(out))
    return {"seconds": seconds, "peak_rss_gib": rss, "version": gptqmodel.__version__}


def run(a) -> dict:
    """One measurement in this process: load, quantize (timed, peak RSS after it), evaluate; or
    GPTQModel's quantization (impl gptqmodel); or a saved checkpoint's perplexity (impl saved)."""
    if a.impl == "gptqmodel":
        return gptqmodel_run(a)
    import torch

    import quantkit
    from quantkit.calibration import load_text, sample_windows

    if a.impl == "saved":
        m = quantkit.load(a.path)
        return {"perplexity": quantkit.evaluate(m, TEST, "llamacpp", 512, a.windows, progress=False).perplexity}
    torch.manual_seed(0)
    m = quantkit.load()
    m.materialize()  # auto-gptq works on the layers in place, outside the pipeline; both timed from memory
    start = time.perf_counter()
    if a.impl == "autogptq":
        with torch.no_grad():
            windows = sample_windows(m.tokenizer, load_text(VALID), a.samples, a.seqlen, seed=0)
            autogptq_quantize(m, windows, a.bits, a.group_size, a.sym, a.act_order)
    elif a.method != "base":
        options = {} if a.impl == "defaults" else dict(act_order=a.act_order, static_groups=a.static_groups,
                                                          group_aware=a.group_aware, mse=a.mse)
        quantkit.quantize(m, method=a.method, bits=a.bits, group_size=a.group_size, sym=a.sym, calib_data=VALID,
                          calib_samples=a.samples, calib_seqlen=a.seqlen, seed=0, progress=False, **options)
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    ppl = quantkit.evaluate(m, TEST, "llamacpp", 512, a.windows, progress=False).perplexity
    return {"seconds": seconds, "peak_rss_gib": rss, "perplexity": ppl}



def table(a) -> None:
    common = dict(samples=a.samples, seqlen=a.seqlen, windows=a.windows)
    base = child(__file__, method="base", **common)["perplexity"]
    print(f"base perplexity {base:.3f}  (llama.cpp protocol, ctx 512, {a.windows} windows; "
          f"GPTQ on {a.samples} x {a.seqlen} calibration tokens, act-order, MSE clipping, true-sequential)")
    print("| setting | RTN | GPTQ | GPTQ / RTN | gap to base closed |")
    print("| --- | --- | --- | --- | --- |")
    for bits, group_size, sym in SETTINGS:
        kw = dict(bits=bits, group_size=group_size, sym=sym, **common)
        rtn = child(__file__, method="rtn", **kw)["perplexity"]
        gptq = child(__file__, method="gptq", **BEST, **kw)["perplexity"]
        name = f"w{bits} {'g' + str(group_size) if group_size > 0 else 'per-channel'} {'sym' if sym else 'asym'}"
        print(f"| {name} | {rtn:.3f} | {gptq:.3f} | {gptq / rtn:.3f} | {(rtn - gptq) / (rtn - base):.0%} |", flush=True)


def speed(a) -> None:
    kw = dict(method="gptq", bits=a.bits, group_size=a.group_size, sym=True, samples=a.samples, seqlen=a.seqlen,
              windows=a.windows)
    ours = child(__file__, impl="ours", **kw)
    theirs = child(__file__, impl="autogptq", **kw)
    print(f"w{a.bits} g{a.group_size} sym, {a.samples} x {a.seqlen} calibration tokens, true-sequential, no act-order")
    for who, r in (("quantkit", ours), ("auto-gptq 0.7.1", theirs)):
        print(f"{who}: {r['seconds']:.1f} s, peak RSS {r['peak_rss_gib']:.2f} GiB, perplexity {r['perplexity']:.3f}")
    ratios(ours, theirs, "ours / auto-gptq")
    best = child(__file__, impl="ours", **BEST, **kw)
    print(f"quantkit, act-order + MSE clipping: {best['seconds']:.1f} s, peak RSS {best['peak_rss_gib']:.2f} GiB, "
          f"perplexity {best['perplexity']:.3f}")


VARIANTS = {  # name: options; the first is the anchor
    "reference (no act-order, min-max)": dict(act_order=False, static_groups=False, group_aware=False, mse=False),
    "MSE clipping": dict(act_order=False, static_groups=False, group_aware=False, mse=True),
    "act-order + static groups (plain g_idx)": dict(act_order=True, static_groups=True, group_aware=False, mse=False),
    "group-aware + MSE (plain g_idx)": dict(act_order=False, static_groups=False, group_aware=True, mse=True),
    "act-order + static groups + MSE (plain g_idx)": dict(act_order=True, static_groups=True, group_aware=False, mse=True),
    "act-order + MSE (permuted g_idx)": dict(act_order=True, static_groups=False, group_aware=False, mse=True),
}
REFERENCE, DEFAULT = "reference (no act-order, min-max)", "group-aware + MSE (plain g_idx)"
ROWS = [((3, 128), list(VARIANTS)), ((4, 128), [REFERENCE, DEFAULT]), ((3, -1), [REFERENCE, DEFAULT]),
        ((4, -1), [REFERENCE, DEFAULT])]


def defaults(a) -> None:
    print(f"GPTQ, symmetric, {a.samples} x {a.seqlen} calibration tokens, {a.windows} test windows; "
          "ratios against the reference settings of the same row")
    print("| setting | options | perplexity | time | perplexity / reference | time / reference |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (bits, group_size), names in ROWS:
        if a.settings and f"w{bits}g{group_size}" not in a.settings.split(","):
            continue
        anchor = None
        for name in names:
            r = child(__file__, method="gptq", bits=bits, group_size=group_size, sym=True, samples=a.samples,
                      seqlen=a.seqlen, windows=a.windows, **VARIANTS[name])
            anchor = anchor or r
            setting = f"w{bits} {'g' + str(group_size) if group_size > 0 else 'per-channel'}"
            print(f"| {setting} | {name} | {r['perplexity']:.3f} | {r['seconds']:.1f} s | "
                  f"{r['perplexity'] / anchor['perplexity']:.3f} | {r['seconds'] / anchor['seconds']:.2f} |", flush=True)


def against_gptqmodel(a) -> None:
    """quantkit's GPTQ defaults against GPTQModel's, on the same windows, scored by one evaluation."""
    import subprocess
    import tempfile

    from safetensors.torch import save_file

    import quantkit
    from quantkit.api import calibration_windows
    from quantkit.modelio import default_model_dir

    if subprocess.run([a.python, "-c", "import gptqmodel"], capture_output=True).returncode:
        print(f"error: {a.python} cannot import gptqmodel: make a venv with `pip install torch==2.14.1 "
              "gptqmodel==7.7.0` and pass its Python as --python", file=sys.stderr)
        sys.exit(2)
    model = default_model_dir()  # the embedded model as float32 safetensors, which GPTQModel loads
    print(f"GPTQ, symmetric, {a.samples} x {a.seqlen} calibration tokens (the same windows), {a.windows} test "
          "windows; each ratio against GPTQModel's defaults in the same row")
    print("| setting | run | perplexity | time | peak RSS | perplexity / GPTQModel | time / GPTQModel |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="gptqmodel-") as tmp:
        tokens = Path(tmp) / "windows.safetensors"
        save_file({"windows": calibration_windows(quantkit.load(), VALID, a.samples, a.seqlen, 0, False)}, str(tokens))
        for setting in (a.settings or "w3g128,w4g128").split(","):
            bits, group_size = map(int, setting[1:].split("g"))
            kw = dict(bits=bits, group_size=group_size, sym=True)
            out = Path(tmp) / setting
            theirs = child(__file__, python=a.python, impl="gptqmodel", model=model, tokens=tokens, path=out, **kw)
            theirs |= child(__file__, impl="saved", path=out, windows=a.windows)
            ours = child(__file__, impl="defaults", method="gptq", samples=a.samples, seqlen=a.seqlen,
                         windows=a.windows, **kw)
            for who, r in ((f"GPTQModel {theirs['version']}, its defaults", theirs), ("quantkit, its defaults", ours)):
                print(f"| w{bits} g{group_size} | {who} | {r['perplexity']:.3f} | {r['seconds']:.1f} s | "
                      f"{r['peak_rss_gib']:.2f} GiB | {r['perplexity'] / theirs['perplexity']:.3f} | "
                      f"{r['seconds'] / theirs['seconds']:.2f} |", flush=True)


def ratios(ours: dict, theirs: dict, label: str) -> None:
    print(f"{label}: time {ours['seconds'] / theirs['seconds']:.2f}, "
          f"peak RSS {ours['peak_rss_gib'] / theirs['peak_rss_gib']:.2f}, "
          f"perplexity {ours['perplexity'] / theirs['perplexity']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["table", "speed", "defaults", "gptqmodel", "run"])
    p.add_argument("--impl", choices=["ours", "defaults", "autogptq", "gptqmodel", "saved"], default="ours",
                   help="defaults: ours without the order and clipping options (quantize's own defaults)")
    p.add_argument("--python", default=sys.executable, help="gptqmodel: the Python of GPTQModel's environment")
    p.add_argument("--model", help="run --impl gptqmodel: the float model's directory")
    p.add_argument("--tokens", help="run --impl gptqmodel: a safetensors file of the calibration windows")
    p.add_argument("--path", help="run --impl gptqmodel and saved: the checkpoint written and read")
    p.add_argument("--method", default="gptq")
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--sym", type=flag, default=True)
    p.add_argument("--act-order", type=flag, default=False)
    p.add_argument("--mse", type=flag, default=False)
    p.add_argument("--static-groups", type=flag, default=False)
    p.add_argument("--group-aware", type=flag, default=False)
    p.add_argument("--samples", type=int)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--windows", type=int)
    p.add_argument("--settings", help="defaults: only these rows, e.g. w4g128,w3g-1")
    a = p.parse_args()
    if a.mode == "run":
        print(json.dumps(run(a)))
    elif a.mode == "table":
        a.samples, a.windows = a.samples or 128, a.windows or 40
        table(a)
    else:
        a.samples, a.windows = a.samples or 32, a.windows or 20
        {"speed": speed, "defaults": defaults, "gptqmodel": against_gptqmodel}[a.mode](a)


if __name__ == "__main__":
    main()
