"""AWQ on the embedded SmolLM2-135M: perplexity against RTN and GPTQ, and search time against autoawq.
(Not named awq.py: that would shadow the autoawq package it imports.)

    python benchmarks/awq_bench.py table [--samples 128] [--windows 40] [--duo True]
    python benchmarks/awq_bench.py speed [--samples 16] [--bits 4] [--layers 30]
    python benchmarks/awq_bench.py losses [--samples 32] [--windows 20] [--losses block,descent,output] [--widths 4,3] [--duo True]
    python benchmarks/awq_bench.py defaults [--samples 32] [--windows 160] [--widths 4,3] [--seeds 0,1]

`table`: base, RTN (asymmetric), AWQ (--duo: with duo scaling) and GPTQ (act-order, MSE clipping)
perplexity at w4 g64 and w3 g64 (llama.cpp protocol, ctx 512, first --windows windows of the wikitext-2 test file),
calibrated on --samples seeded windows of 512 tokens of the validation file.
`speed`: our AWQ and autoawq 0.2.9's search (its AwqQuantizer methods driven over the same layers
with the same windows, its Llama layer groups; float outputs passed on, as it does), wall time as
ours / theirs, and both perplexities. --layers limits both to the first N layers (autoawq's clipping
search takes minutes per layer on a CPU).
`losses`: AWQ with each --awq-loss (or those in --losses) against GPTQ with its defaults (the anchor),
w4 and w3 (--widths) in groups of 128, each with its own defaults otherwise: whole-model quantization
time, perplexity and KLD from the float model (log-probabilities saved once, in a temporary directory);
--duo True: the AWQ runs with duo scaling.
`defaults`: each tool at its own defaults on the whole model, with zero points: quantkit's AWQ
(`quantize` given no AWQ option) against autoawq 0.2.9's (duo scaling, as `speed` drives it), on the
same --samples windows for each of --seeds; perplexity, KLD from the float model and time, as ratios to
autoawq's, per seed and on the means. 160 test windows by default: on 20, two equally good AWQ runs
differed by 1.5% in perplexity (benchmarks/RESULTS.md). Groups of 64: autoawq's default 128 does not
divide SmolLM2's 576 inputs, which it refuses.
`choices`: why our AWQ scores differently on machines with and without AVX-512 at the same seed: its
defaults run twice on this machine, as it is and with torch's kernels held to AVX2 (ATEN_CPU_CAPABILITY),
each layer's chosen alphas and how many clipping steps differ (by (row, group)), and both scores.
`descent`: on every --every-th layer of the float model, for q/k/v and gate/up, the exhaustive block
search against --awq-loss descent's (the same losses, 8192 calibration tokens, g128 asym): how often
they choose the same scales, the block loss of the descent's choice over the exhaustive one's, and
the block forwards and seconds each took.
Each run is a child process (`run`).

    python benchmarks/awq_bench.py descent [--bits 4] [--every 3] [--samples 32]
    python benchmarks/awq_bench.py choices [--bits 4] [--seed 0] [--samples 32] [--windows 20]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from children import child, flag, ints

from quantkit.config import AWQ_LOSSES, QuantConfig

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
VALID = DATA / "wikitext-2" / "wiki.valid.tokens"
TEST = DATA / "wikitext-2-raw" / "wiki.test.raw"


def autoawq_quantize(m, windows, bits: int, group_size: int, layers: int) -> None:
    """autoawq's own per-layer flow: input features from the float layer (whose outputs feed the next
    layer), scale search per group, folding, clipping search, then its round-to-nearest."""
    import torch

    sys.path.insert(0, str(ROOT))
    from tests.refs import autoawq, cpu_snapshots_copied

    from quantkit.layers import LINEARS
    from quantkit.pipeline import capture_inputs

    scale = autoawq("quantize.scale")
    q = autoawq("quantize.quantizer").AwqQuantizer.__new__(autoawq("quantize.quantizer").AwqQuantizer)
    q.w_bit, q.group_size, q.zero_point, q.duo_scaling = bits, group_size, True, True
    q.max_chunk_memory, q.n_parallel_calib_samples = 2**30, None
    ((inps, kwargs),) = capture_inputs(m, windows, len(windows))
    kwargs = {k: v for k, v in kwargs.items() if k in ("position_embeddings", "attention_mask", "position_ids")}
    with cpu_snapshots_copied():
        for layer in m.layers[:layers]:
            named = {name: layer.get_submodule(name) for name in LINEARS}
            feats, handles = {name: [] for name in named}, []
            for name, lin in named.items():
                handles.append(lin.register_forward_hook(lambda mod, i, o, name=name: feats[name].append(i[0])))
            out = layer(inps, **kwargs)
            inps = out[0] if isinstance(out, tuple) else out
            for h in handles:
                h.remove()
            feat = {name: torch.cat(v, dim=0) for name, v in feats.items()}
            attn, mlp = layer.self_attn, layer.mlp
            groups = [dict(prev_op=layer.input_layernorm, layers=[attn.q_proj, attn.k_proj, attn.v_proj],
                           inp=feat["self_attn.q_proj"], module2inspect=attn, kwargs=kwargs)]
            if attn.v_proj.weight.shape == attn.o_proj.weight.shape:  # its Llama config skips o under GQA
                groups.append(dict(prev_op=attn.v_proj, layers=[attn.o_proj], inp=feat["self_attn.o_proj"]))
            groups += [dict(prev_op=layer.post_attention_layernorm, layers=[mlp.gate_proj, mlp.up_proj],
                            inp=feat["mlp.gate_proj"], module2inspect=mlp),
                       dict(prev_op=mlp.up_proj, layers=[mlp.down_proj], inp=feat["mlp.down_proj"])]
            scales = [q._search_best_scale(layer, **g) for g in groups]
            scale.apply_scale(layer, scales, input_feat_dict=feat)
            scale.apply_clip(layer, q._search_best_clip(layer, named, feat))
            for lin in named.values():
                lin.weight.data = q.pseudo_quantize_tensor(lin.weight.data)[0]


def run(a) -> dict:
    import torch

    import quantkit
    from quantkit.calibration import load_text, sample_windows

    if a.trace:
        traced = trace()
    torch.manual_seed(0)
    m = quantkit.load()
    m.materialize()  # the first layers are worked on in place, outside the pipeline
    start = time.perf_counter()
    with torch.no_grad():
        if a.impl == "autoawq":
            windows = sample_windows(m.tokenizer, load_text(VALID), a.samples, 512, seed=a.seed)
            autoawq_quantize(m, windows, a.bits, a.group_size, a.layers)
        elif a.method == "awq" and a.layers < len(m.layers):  # our search over the same first layers
            from quantkit.pipeline import capture_inputs, run_layer
            from quantkit.quantizers.awq import quantize_layer

            windows = sample_windows(m.tokenizer, load_text(VALID), a.samples, 512, seed=a.seed)
            batches = capture_inputs(m, windows, 8)
            for layer in m.layers[: a.layers]:
                quantize_layer(layer, batches, a.bits, a.group_size, False, a.duo,
                               loss=a.loss or QuantConfig(method="awq", bits=a.bits).awq_loss)
                batches = run_layer(layer, batches)
        elif a.method != "base":
            if a.defaults:  # each method as it comes
                extra = dict(awq_loss=a.loss) if a.method == "awq" and a.loss else {}
                extra |= dict(duo_scaling=True) if a.method == "awq" and a.duo else {}
            else:
                extra = dict(sym=False, duo_scaling=a.duo) | (dict(act_order=True, mse=True) if a.method == "gptq" else {})
            quantkit.quantize(m, method=a.method, bits=a.bits, group_size=a.group_size, calib_data=VALID,
                              calib_samples=a.samples, calib_seqlen=512, seed=a.seed, progress=False, **extra)
    seconds = time.perf_counter() - start
    if a.trace:
        torch.save(traced | {"capability": torch.backends.cpu.get_cpu_capability()}, a.trace)
    if a.base:  # perplexity and KLD against the float model's saved log-probabilities
        base = a.method == "base"
        d = quantkit.compare(m, m if base else a.base, TEST, 512, a.windows, save_base=a.base if base else None,
                             progress=False)
        return {"seconds": seconds, "perplexity": d.perplexity, "kld": d.kld_mean}
    ppl = quantkit.evaluate(m, TEST, "llamacpp", 512, a.windows, progress=False).perplexity
    return {"seconds": seconds, "perplexity": ppl}



def trace() -> dict:
    """Spies on our AWQ's searches: the dict they fill as it runs, with each search's alpha (alphas) and
    each clipped linear's clipping step per (row, group) (steps: bound = max|w| (1 - step / 20))."""
    import torch

    import quantkit.quantizers.awq as awq

    traced = {"alphas": [], "steps": []}
    scale, clip = awq.search_scale, awq.search_clip

    def search_scale(*args, **kw):
        found = scale(*args, **kw)
        traced["alphas"].append(found[1])
        return found

    def search_clip(w, h, bits, group_size, *args, **kw):
        bound = clip(w, h, bits, group_size, *args, **kw)
        full = w.abs().reshape(len(w), bound.shape[1], -1).amax(dim=2)
        step = torch.where(full > 0, (1 - bound / full) * kw.get("n_grid", 20), 0)
        traced["steps"].append(step.round().to(torch.uint8))
        return bound

    awq.search_scale, awq.search_clip = search_scale, search_clip
    return traced


def choices(a) -> None:
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        kw = dict(group_size=64, samples=a.samples, windows=a.windows, layers=a.layers, seed=a.seed,
                  base=f"{tmp}/base.logits")
        child(__file__, method="base", **kw)
        runs = []
        for cap in ("", "AVX2"):
            path = f"{tmp}/{cap or 'native'}.pt"
            r = child(__file__, env={"ATEN_CPU_CAPABILITY": cap.lower()} if cap else None, method="awq", bits=a.bits,
                      defaults=True, trace=path, **kw)
            runs.append(r | torch.load(path, weights_only=True))
    one, two = runs
    print(f"w{a.bits} g64 with zero points, {a.samples} x 512 calibration tokens, seed {a.seed}, "
          f"{a.windows} test windows")
    for r in runs:
        print(f"torch's CPU kernels {r['capability']}: perplexity {r['perplexity']:.3f}, KLD {r['kld']:.4f}, "
              f"{r['seconds']:.1f} s")
    searches, clipped = len(one["alphas"]) // a.layers, len(one["steps"]) // a.layers
    print(f"| layer | alphas, {one['capability']} | alphas, {two['capability']} | "
          "clipping steps that differ, by linear |")
    print("| --- | --- | --- | --- |")
    for layer in range(a.layers):
        alphas = [r["alphas"][layer * searches:(layer + 1) * searches] for r in runs]
        steps = zip(*(r["steps"][layer * clipped:(layer + 1) * clipped] for r in runs))
        differ = ", ".join(f"{(x != y).sum().item()}/{x.numel()}" for x, y in steps)
        print(f"| {layer} | {' '.join(f'{x:.2f}' for x in alphas[0])} | {' '.join(f'{x:.2f}' for x in alphas[1])} | "
              f"{differ} |")


def table(a) -> None:
    common = dict(samples=a.samples, windows=a.windows)
    base = child(__file__, method="base", **common)["perplexity"]
    print(f"base perplexity {base:.3f} (llama.cpp protocol, ctx 512, {a.windows} windows; "
          f"calibration {a.samples} x 512 tokens)")
    print("| setting | RTN asym | AWQ | GPTQ (act-order, MSE) | AWQ / RTN | AWQ time | GPTQ time |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for bits in (4, 3):
        kw = dict(bits=bits, group_size=64, **common)
        rtn, awq = child(__file__, method="rtn", **kw), child(__file__, method="awq", duo=a.duo, **kw)
        gptq = child(__file__, method="gptq", **kw)
        print(f"| w{bits} g64 | {rtn['perplexity']:.3f} | {awq['perplexity']:.3f} | {gptq['perplexity']:.3f} | "
              f"{awq['perplexity'] / rtn['perplexity']:.3f} | {awq['seconds']:.0f} s | {gptq['seconds']:.0f} s |",
              flush=True)


def speed(a) -> None:
    kw = dict(method="awq", bits=a.bits, group_size=64, samples=a.samples, windows=a.windows, layers=a.layers)
    ours, theirs = child(__file__, impl="ours", duo=True, **kw), child(__file__, impl="autoawq", **kw)
    print(f"w{a.bits} g64 asym, {a.samples} x 512 calibration tokens, duo scaling (autoawq's default), "
          f"first {a.layers} layers")
    for who, r in (("quantkit", ours), ("autoawq 0.2.9", theirs)):
        print(f"{who}: {r['seconds']:.1f} s, perplexity {r['perplexity']:.3f}")
    print(f"ours / autoawq: time {ours['seconds'] / theirs['seconds']:.2f}, "
          f"perplexity {ours['perplexity'] / theirs['perplexity']:.3f}")


def losses(a) -> None:
    import tempfile

    losses = a.losses.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        kw = dict(group_size=128, samples=a.samples, windows=a.windows, defaults=True, base=f"{tmp}/base.logits")
        child(__file__, method="base", **kw)
        print(f"g128, {a.samples} x 512 calibration tokens, {a.windows} test windows; each method's defaults; "
              "perplexity, KLD from the float model, seconds (ratio to GPTQ's)")
        print("| bits | GPTQ (anchor) | " + " | ".join(f"AWQ, --awq-loss {loss}" for loss in losses) + " |")
        print("| --- | --- |" + " --- |" * len(losses))
        for bits in a.widths:
            gptq = child(__file__, method="gptq", bits=bits, **kw)
            awq = [child(__file__, method="awq", loss=loss, bits=bits, duo=a.duo, **kw) for loss in losses]
            cells = [f"{r['perplexity']:.3f}, {r['kld']:.4f}, {r['seconds']:.0f} s ({r['seconds'] / gptq['seconds']:.2f})"
                     for r in (gptq, *awq)]
            print(f"| w{bits} | " + " | ".join(cells) + " |", flush=True)


def defaults(a) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        kw = dict(group_size=64, samples=a.samples, windows=a.windows, layers=a.layers, base=f"{tmp}/base.logits")
        child(__file__, method="base", seed=a.seeds[0], **kw)  # the test windows do not depend on the seed
        print(f"g64 with zero points, {a.samples} x 512 calibration tokens (the same windows), {a.windows} test "
              f"windows, {a.layers} layers quantized, calibration seeds {','.join(map(str, a.seeds))}; each ratio "
              "against autoawq's run of the same width and seed, and on the means over the seeds")
        print("| bits | seed | run | perplexity | KLD | time | perplexity / autoawq | KLD / autoawq | time / autoawq |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        anchor = "autoawq 0.2.9, its defaults"
        for bits in a.widths:
            runs = {anchor: [], "quantkit, its defaults": []}
            for seed in a.seeds:
                theirs = child(__file__, impl="autoawq", bits=bits, seed=seed, **kw)
                ours = child(__file__, method="awq", bits=bits, defaults=True, seed=seed, **kw)
                for who, r in zip(runs, (theirs, ours)):
                    runs[who].append(r)
                    row(f"w{bits} | {seed} | {who}", r, theirs)
            if len(a.seeds) > 1:  # one calibration sample decides little: two equally good runs differ by ~0.5%
                means = {who: {k: sum(r[k] for r in rs) / len(rs) for k in rs[0]} for who, rs in runs.items()}
                for who, r in means.items():
                    row(f"w{bits} | mean | {who}", r, means[anchor])


def row(label: str, r: dict, anchor: dict) -> None:
    print(f"| {label} | {r['perplexity']:.3f} | {r['kld']:.4f} | {r['seconds']:.1f} s | "
          f"{r['perplexity'] / anchor['perplexity']:.3f} | {r['kld'] / anchor['kld']:.3f} | "
          f"{r['seconds'] / anchor['seconds']:.2f} |", flush=True)


def descent(a) -> None:
    import torch

    import quantkit
    from quantkit.calibration import load_text, sample_windows
    from quantkit.layers import GROUPS, linear_inputs
    from quantkit.pipeline import Hessian, capture_inputs, run_layer
    from quantkit.quantizers import awq

    m = quantkit.load()
    m.materialize()
    windows = sample_windows(m.tokenizer, load_text(VALID), a.samples, 512, seed=0)
    same = forwards = searches = 0
    seconds = {"exhaustive": 0.0, "descent": 0.0}
    print(f"w{a.bits} g128 asym, {a.samples} x 512 calibration tokens, every {a.every}th layer")
    with torch.no_grad():
        batches = capture_inputs(m, windows, 8)
        for i, layer in enumerate(m.layers):
            if i % a.every == 0:
                attn, mlp = layer.self_attn, layer.mlp
                inputs = linear_inputs(layer, batches, [group[0] for group in GROUPS])
                kwargs = [kw for _, kw in batches]

                def attention(x, kw):
                    return attn(hidden_states=x, **{k: v for k, v in kw.items() if k != "hidden_states"})[0]

                for g, block in ((0, attention), (2, lambda x, kw: mlp(x))):
                    linears = [layer.get_submodule(name) for name in GROUPS[g]]
                    xs = inputs[GROUPS[g][0]]
                    x_mean = sum(x.abs().reshape(-1, x.shape[-1]).sum(0) for x in xs) / sum(x[..., 0].numel() for x in xs)
                    n = max(1, int((torch.tensor([x[..., 0].numel() for x in xs]).cumsum(0) <= 8192).sum()))
                    loss = awq.block_loss(linears, xs[:n], kwargs[:n], block, a.bits, 128, False)
                    t = time.perf_counter()
                    _, exhaustive, losses = awq.search_scale(x_mean, loss, 20)
                    seconds["exhaustive"] += time.perf_counter() - t
                    t = time.perf_counter()
                    h = Hessian(xs[0].shape[-1])
                    for x in xs[:n]:
                        h.add_batch(x)
                    own = awq.output_loss(linears, h.matrix(), a.bits, 128, False)
                    _, chosen, tried = awq.search_scale(x_mean, loss, 20, start=own)
                    seconds["descent"] += time.perf_counter() - t
                    same += chosen == exhaustive
                    forwards += len(tried)
                    searches += 1
                    ratio = losses[round(chosen * 20)] / losses[round(exhaustive * 20)]
                    print(f"layer {i} {'q/k/v' if g == 0 else 'gate/up'}: exhaustive alpha {exhaustive:.2f}, descent "
                          f"{chosen:.2f} in {len(tried)} forwards, block loss ratio {ratio:.4f}", flush=True)
            batches = run_layer(layer, batches)
    print(f"same choice in {same} of {searches} searches; block forwards {forwards} against {20 * searches}; "
          f"{seconds['descent']:.1f} s against {seconds['exhaustive']:.1f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["table", "speed", "losses", "defaults", "descent", "choices", "run"])
    p.add_argument("--impl", choices=["ours", "autoawq"], default="ours")
    p.add_argument("--method", default="awq")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--duo", type=flag, default=False)
    p.add_argument("--loss", default=None, help="run: AWQ's --awq-loss (default: its default)")
    p.add_argument("--base", default="", help="run: the float model's log-probabilities (saved by method base)")
    p.add_argument("--defaults", type=flag, default=False, help="run: each method's own defaults (sym, clipping)")
    p.add_argument("--samples", type=int)
    p.add_argument("--seed", type=int, default=0, help="run, choices: the calibration windows' seed")
    p.add_argument("--seeds", type=ints, default=[0, 1], help="defaults: the calibration seeds, each run by both tools")
    p.add_argument("--windows", type=int, help="test windows scored [40; losses and choices: 20; defaults: 160]")
    p.add_argument("--layers", type=int, default=30,
                   help="speed, defaults, choices: quantize only the first N decoder layers")
    p.add_argument("--every", type=int, default=3, help="descent: search every N-th layer")
    p.add_argument("--losses", default=",".join(AWQ_LOSSES), help="losses: the AWQ losses to run")
    p.add_argument("--widths", type=ints, default=[4, 3], help="losses, defaults: the bit widths to run")
    p.add_argument("--trace", default="", help="run: save our AWQ's choices to this file")
    a = p.parse_args()
    a.windows = a.windows or {"losses": 20, "choices": 20, "defaults": 160}.get(a.mode, 40)
    if a.mode == "run":
        print(json.dumps(run(a)))
    elif a.mode in ("losses", "defaults"):
        a.samples = a.samples or 32
        losses(a) if a.mode == "losses" else defaults(a)
    elif a.mode in ("descent", "choices"):
        a.samples = a.samples or 32
        descent(a) if a.mode == "descent" else choices(a)
    elif a.mode == "table":
        a.samples = a.samples or 128
        table(a)
    else:
        a.samples = a.samples or 16
        speed(a)


if __name__ == "__main__":
    main()
