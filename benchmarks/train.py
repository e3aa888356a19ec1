"""The trainer on the embedded model (SmolLM2-135M-Instruct), on the CPU unless there is a GPU.

  python benchmarks/train.py [--steps 200] [--seqlen 256] [--windows 40] [--parts peft,dolly,wikitext]
                             [--fsdp-model 1b]   (parts: wikitext, dolly, peft, nf4, fsdp)

wikitext: LoRA, QLoRA and DoRA fine-tuned on WikiText-2 validation; WikiText-2 test perplexity
  (llama.cpp protocol, ctx 512, the first --windows windows) of the base and of each merged model,
  then of each quantized with GPTQ w4 g128 and GGUF Q4_K_M, against the base quantized the same way:
  ratios to the base's perplexity.
dolly: LoRA instruction tuning on the Dolly slice (10% held out, seeded): held-out response loss
  before and after.
peft: our loop against PEFT + transformers' Trainer with the same model, data, rank, batch, steps
  and optimizer (torch AdamW, bf16 autocast, cosine schedule), each in its own process: tokens per
  second and peak RSS as ratios to the Trainer's, and the final held-out loss of each.
nf4: one QLoRA adapter merged into the original base (the default) and into the NF4 base it trained
  against (--onto-nf4): perplexity of each, float and quantized as in wikitext, against the base.
fsdp: our loop in two processes (torchrun) without and with --fsdp: tokens per second, each
  process's peak RSS, the final held-out loss; one process (with one thread each) as the anchor.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from children import child

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
VALID = DATA / "wikitext-2" / "wiki.valid.tokens"
TEST = DATA / "wikitext-2-raw" / "wiki.test.raw"
DOLLY = DATA / "dolly" / "dolly-15k-head.jsonl"
METHODS = {"lora": {}, "qlora": {"method": "qlora"}, "dora": {"dora": True}}
COMMON = dict(seqlen=256, batch_size=4, rank=16, alpha=32, lr=2e-4, warmup=10, optimizer="adamw", seed=0)


def ppl(model, windows: int) -> float:
    import quantkit

    return quantkit.evaluate(str(model), TEST, "llamacpp", 512, windows).perplexity


def quantized(model, out: Path, fmt: str, windows: int) -> float:
    import quantkit

    if fmt == "gguf":
        quantkit.quantize(quantkit.load(model), method="rtn", gguf_type="Q4_K_M", out=out, format="gguf", progress=False)
    else:
        quantkit.quantize(quantkit.load(model), method="gptq", bits=4, group_size=128, calib_data=VALID,
                          calib_samples=32, calib_seqlen=512, out=out, progress=False)
    return ppl(out, windows)


def scores(model, name: str, windows: int, tmp: Path) -> tuple[float, float, float]:
    """Perplexity of model in float, then quantized with GPTQ w4 g128 and to GGUF Q4_K_M."""
    return (ppl(model, windows), quantized(model, tmp / f"{name}-gptq", "gptq", windows),
            quantized(model, tmp / f"{name}.gguf", "gguf", windows))


def table(rows: dict, windows: int, steps: int) -> None:
    anchor = rows["base"][0]
    print(f"\nWikiText-2 test perplexity, llama.cpp protocol, ctx 512, {windows} windows; {steps} steps of "
          f"{COMMON['batch_size']}x{COMMON['seqlen']} tokens on wiki.valid.tokens")
    print("| model | float | GPTQ w4 g128 | GGUF Q4_K_M | held-out loss before -> after | train time | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for name, (ppls, tr) in rows.items():
        cells = [f"{v:.3f} ({v / a:.3f}x)" for v, a in zip(ppls, anchor)]
        extra = f"{tr[0]:.4f} -> {tr[1]:.4f} | {tr[2]:.0f} s | {tr[3]:.0f}" if tr else "- | - | -"
        print(f"| {name} | {' | '.join(cells)} | {extra} |")


def fine_tune(name: str, options: dict, steps: int, tmp: Path) -> tuple:
    """Train an adapter at tmp/name; its held-out loss before and after, seconds and tokens/s."""
    from quantkit.modelio import default_model_dir
    from quantkit.trainer import train

    t = time.perf_counter()
    result = train(default_model_dir(), data=VALID, out=tmp / name, steps=steps, eval_fraction=0.01,
                   eval_every=steps, progress=False, **COMMON, **options)
    return result.evals[0]["eval_loss"], result.evals[-1]["eval_loss"], time.perf_counter() - t, result.tokens_per_s


def wikitext(steps: int, windows: int, tmp: Path) -> None:
    from quantkit.modelio import default_model_dir
    from quantkit.trainer import merge

    rows = {"base": (scores(default_model_dir(), "base", windows, tmp), None)}
    for name, options in METHODS.items():
        trained = fine_tune(name, options, steps, tmp)
        merge(tmp / name, tmp / f"{name}-merged", progress=False)
        rows[name] = (scores(tmp / f"{name}-merged", name, windows, tmp), trained)
    table(rows, windows, steps)


def nf4(steps: int, windows: int, tmp: Path) -> None:
    from quantkit.modelio import default_model_dir
    from quantkit.trainer import merge

    rows = {"base": (scores(default_model_dir(), "base", windows, tmp), None)}
    trained = fine_tune("qlora", METHODS["qlora"], steps, tmp)
    for name, onto in (("QLoRA merged into the original base", False), ("QLoRA merged onto NF4 (--onto-nf4)", True)):
        merge(tmp / "qlora", tmp / f"qlora-{onto}", onto_nf4=onto, progress=False)
        rows[name] = (scores(tmp / f"qlora-{onto}", f"qlora-{onto}", windows, tmp), trained)
    table(rows, windows, steps)


def dolly(steps: int, tmp: Path) -> None:
    from quantkit.modelio import default_model_dir
    from quantkit.trainer import train

    result = train(default_model_dir(), data=DOLLY, out=tmp / "dolly", steps=steps, eval_fraction=0.1,
                   eval_every=max(steps // 4, 1), progress=False, **{**COMMON, "seqlen": 2 * COMMON["seqlen"]})
    print(f"\nDolly ({DOLLY.name}, 10% held out): held-out loss per response token by step, LoRA r16, {steps} steps")
    print(" ".join(f"{r['step']}: {r['eval_loss']:.4f}" for r in result.evals),
          f"(after/before {result.evals[-1]['eval_loss'] / result.evals[0]['eval_loss']:.3f})")


def run_one(kind: str, steps: int, seqlen: int) -> dict:
    """In a child: one training run of kind (quantkit or trainer); its speed, memory and held-out loss."""
    import torch

    from quantkit import load
    from quantkit.modelio import default_model_dir
    from quantkit.trainer import TrainConfig, dataset, train
    from quantkit.trainer.loop import held_out_loss

    config = TrainConfig(steps=steps, eval_fraction=0.02, eval_every=steps, **{**COMMON, "seqlen": seqlen})
    if kind == "quantkit":
        with tempfile.TemporaryDirectory() as tmp:
            r = train(default_model_dir(), config, data=VALID, out=Path(tmp) / "a", progress=False)
        return {"tokens_per_s": r.tokens_per_s, "eval_loss": r.evals[-1]["eval_loss"],
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

    tok = load().tokenizer
    train_set, held = dataset.split(dataset.read(VALID, tok, config.seqlen), config.eval_fraction, config.seed)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir())
    model = get_peft_model(model, LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    rows = [{"input_ids": e.ids, "labels": e.labels} for e in train_set]
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=config.batch_size, max_steps=steps,
                                 learning_rate=config.lr, warmup_steps=config.warmup, lr_scheduler_type="cosine",
                                 bf16=True, optim="adamw_torch", max_grad_norm=config.max_grad_norm, weight_decay=0.0,
                                 save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
                                 logging_steps=steps, seed=config.seed, disable_tqdm=True)
        out = Trainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator).train()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loss = held_out_loss(model, held, config, pad, device, torch.bfloat16)
    return {"tokens_per_s": steps * config.batch_size * config.seqlen / out.metrics["train_runtime"],
            "eval_loss": loss, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def peft(steps: int) -> None:
    trainer = child(__file__, kind="trainer", steps=steps, seqlen=COMMON["seqlen"])
    ours = child(__file__, kind="quantkit", steps=steps, seqlen=COMMON["seqlen"])
    print(f"\nLoRA r16 all-linear, {steps} steps of {COMMON['batch_size']}x{COMMON['seqlen']} tokens, bf16 autocast, "
          "torch AdamW: quantkit against PEFT + transformers Trainer (anchor)")
    print("| loop | tokens/s | peak RSS | final held-out loss |")
    print("|---|---|---|---|")
    for name, r in (("PEFT + Trainer", trainer), ("quantkit", ours)):
        print(f"| {name} | {r['tokens_per_s']:.0f} ({r['tokens_per_s'] / trainer['tokens_per_s']:.2f}x) | "
              f"{r['peak_rss']:.2f} GiB ({r['peak_rss'] / trainer['peak_rss']:.2f}x) | {r['eval_loss']:.4f} |")


def job(model: Path, steps: int, seqlen: int, processes: int, options: list[str]) -> dict:
    """quantkit train on model in processes processes (torchrun; one plain process when 1), one
    thread each: each process's peak RSS, the run's tokens/s and final held-out loss from its log."""
    with tempfile.TemporaryDirectory() as tmp:
        common = ["quantkit", "train", str(model), "--data", str(VALID), "--out", f"{tmp}/a", "--steps", str(steps),
                  "--seqlen", str(seqlen), "--batch-size", str(COMMON["batch_size"]), "--eval-fraction", "0.02",
                  "--eval-every", str(steps), "--precision", "bf16", *options]
        wrap = [sys.executable, str(Path(__file__).with_name("peak_rss.py"))]
        if processes == 1:
            cmd = [*wrap, *common]
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--master-port",
                   str(port), "--no-python", *wrap, *common]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        rss = [int(line.split()[1]) / 2**20 for line in out.stdout.splitlines() if line.startswith("RSS ")]
        log = json.loads(Path(f"{tmp}/a/train_log.json").read_text())
    return {"rss": rss, "tokens_per_s": log["tokens_per_s"], "eval_loss": log["evals"][-1]["eval_loss"]}


def fsdp(steps: int, shape: str) -> None:
    from quantkit.modelio import default_model_dir
    from scale import model_dir

    model, seqlen = default_model_dir() if shape == "embedded" else model_dir(shape), COMMON["seqlen"]
    runs = {name: job(model, steps, seqlen, n, options) for name, n, options in (
        ("one process (anchor)", 1, []), ("2 processes", 2, []), ("2 processes, --fsdp", 2, ["--fsdp"]))}
    anchor = runs["one process (anchor)"]
    print(f"\n{model.name}: LoRA r16 all-linear, {steps} steps of {COMMON['batch_size']}x{seqlen} tokens, bf16, "
          "one thread per process")
    print("| run | tokens/s | peak RSS per process | final held-out loss |")
    print("|---|---|---|---|")
    for name, r in runs.items():
        rss = ", ".join(f"{v:.2f}" for v in r["rss"])
        print(f"| {name} | {r['tokens_per_s']:.1f} ({r['tokens_per_s'] / anchor['tokens_per_s']:.2f}x) | "
              f"{rss} GiB ({max(r['rss']) / max(anchor['rss']):.2f}x) | {r['eval_loss']:.4f} |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "run":
        p = argparse.ArgumentParser()
        p.add_argument("run")
        p.add_argument("--kind", required=True)
        p.add_argument("--steps", type=int, required=True)
        p.add_argument("--seqlen", type=int, required=True)
        a = p.parse_args()
        print(json.dumps(run_one(a.kind, a.steps, a.seqlen)))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seqlen", type=int, default=256, help="tokens per training sequence (Dolly: twice that)")
    p.add_argument("--windows", type=int, default=40, help="perplexity windows of 512 tokens")
    p.add_argument("--parts", default="peft,dolly,wikitext", help="of wikitext, dolly, peft, nf4, fsdp")
    p.add_argument("--fsdp-model", default="1b", help="fsdp: embedded, or a random model of scale.py's shapes (1b, 7b)")
    a = p.parse_args()
    COMMON["seqlen"] = a.seqlen
    with tempfile.TemporaryDirectory() as tmp:
        parts = {"wikitext": lambda: wikitext(a.steps, a.windows, Path(tmp)), "dolly": lambda: dolly(a.steps, Path(tmp)),
                 "peft": lambda: peft(a.steps), "nf4": lambda: nf4(a.steps, a.windows, Path(tmp)),
                 "fsdp": lambda: fsdp(a.steps, a.fsdp_model)}
        unknown = [part for part in a.parts.split(",") if part not in parts]
        if unknown:
            p.error(f"--parts: no part {unknown[0]!r}: choose from {', '.join(parts)}")
        for part in a.parts.split(","):
            parts[part]()


if __name__ == "__main__":
    main()
