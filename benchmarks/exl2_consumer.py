"""ExLlamaV2 itself on our EXL2 exports: its logits and perplexity against quantkit's on the same windows
(issue 15's GPU check). Needs a GPU and the `exllamav2` package, which builds its CUDA extension on
first import (nvcc and ninja).

    python benchmarks/exl2_consumer.py EXPORT [EXPORT ...] [--base MODEL] [--data FILE] [--windows 8] [--ctx 512]

Per model, the predictions the llama.cpp protocol scores (the second half of each window) of the same
token windows, by quantkit's packed model (the anchor: Triton kernels, float16) and by ExLlamaV2's
(its own loader and kernels, float16): both perplexities and ExLlamaV2's / ours, the share of
predictions with the same top token, the mean KL divergence of ExLlamaV2's distribution from ours,
the logits' relative difference (|l_exl - l_ours| / |l_ours - its row mean|), and a causality check
(how far ExLlamaV2's logits of a window's first half move when its second half is reversed).
ExLlamaV2 runs its matmul attention unless --sdpa (see exllama()). With --base (the float model the
exports came from): the same comparison of the float model itself (what ExLlamaV2's arithmetic alone
moves), and each export's KL divergence and top-token share from it (what quantization moves).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TEST = ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ours(path: str, windows_of) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(windows as run, logits, targets, seconds) of quantkit's model at path, on the GPU in float16
    (on the CPU in float32 where there is none, to try this script)."""
    from quantkit import api
    from quantkit.evals.perplexity import window_logits
    from quantkit.modelio import adds_bos

    gpu = torch.cuda.is_available()
    m = api.ready(path, device="cuda" if gpu else "cpu", dtype="float16" if gpu else "float32")
    w = windows_of(m.tokenizer)
    sync()
    start = time.perf_counter()
    pairs = [(lg.cpu(), t.cpu()) for lg, t in window_logits(m.module, m.tokenizer, w, progress=False)]
    sync()
    seconds = time.perf_counter() - start
    bos = m.tokenizer.bos_token_id if adds_bos(m.tokenizer) else None
    del m
    if gpu:
        torch.cuda.empty_cache()
    inputs = w.clone()
    if bos is not None:
        inputs[:, 0] = bos
    return inputs, torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs]), seconds


def exllama(path: str, inputs: torch.Tensor, first: int, sdpa: bool) -> tuple[torch.Tensor, float, float]:
    """ExLlamaV2's logits of the scored predictions, one window at a time; their seconds; and how far the
    logits before `first` move when the tokens from `first` on are replaced (0 in a causal model)."""
    from exllamav2 import ExLlamaV2, ExLlamaV2Config

    cfg = ExLlamaV2Config(path)
    cfg.max_seq_len = cfg.max_input_len = inputs.shape[1]
    cfg.max_attention_size = inputs.shape[1] ** 2
    # Without flash-attn or xformers, exllamav2 0.3.2 attends through torch's SDPA with the block-diagonal
    # mask, which is None for a single sequence without a cache (attn.py, _attn_torch): read there, each
    # position would see the whole window. Its matmul attention builds the causal mask.
    cfg.no_sdpa = not sdpa
    model = ExLlamaV2(cfg)
    model.load()
    out = []
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        for row in inputs:
            out.append(model.forward(row[None]).float()[0, first:-1].cpu())
        sync()
        seconds = time.perf_counter() - start
        changed = inputs[0].clone()
        changed[first:] = changed[first:].flip(0)
        a, b = (model.forward(x[None]).float()[0, :first].cpu() for x in (inputs[0], changed))
    model.unload()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return torch.stack(out), seconds, float((a - b).abs().max())


def compare(a: torch.Tensor, b: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Perplexities of a and b, b's KL divergence from a, top-token agreement, relative logit difference."""
    la, lb = torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)
    nll = lambda lp: float(-lp.gather(-1, targets[..., None]).mean())
    centred = a.double() - a.double().mean(-1, keepdim=True)
    return {"ppl_a": float(torch.exp(torch.tensor(nll(la)))), "ppl_b": float(torch.exp(torch.tensor(nll(lb)))),
            "kld": float((la.exp() * (la - lb)).sum(-1).mean()),
            "same_top": float((a.argmax(-1) == b.argmax(-1)).double().mean()),
            "rel": float((b.double() - a.double()).norm() / centred.norm())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exports", nargs="+")
    ap.add_argument("--base", help="the float model the exports came from")
    ap.add_argument("--data", type=Path, default=TEST)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--sdpa", action="store_true", help="ExLlamaV2's SDPA attention (see exllama()), not its matmul")
    a = ap.parse_args()
    if importlib.util.find_spec("exllamav2") is None:
        ap.error("exllamav2 is not installed: it runs on a CUDA GPU (benchmarks/gpu.sh installs it there)")
    print(" ".join(sys.argv), flush=True)
    from quantkit import calibration, evals
    from quantkit.evals.perplexity import first_scored

    text = calibration.load_text(a.data, split="test")
    windows_of = lambda tok: evals.windows(tok, text, "llamacpp", a.ctx, a.windows)
    first = first_scored("llamacpp", a.ctx)
    base = None
    rows = []
    for path in ([a.base] if a.base else []) + a.exports:  # the float model first: ExLlamaV2 reads it too
        inputs, mine, targets, t_ours = ours(path, windows_of)
        theirs, t_exl, leak = exllama(path, inputs, first, a.sdpa)
        row = {"model": Path(path).name, **compare(mine, theirs, targets), "s_ours": t_ours, "s_exl": t_exl,
               "future": leak}
        if path == a.base:
            base = mine
        elif base is not None:
            q = compare(base, mine, targets)
            row.update(base_kld=q["kld"], base_same_top=q["same_top"])
        rows.append(row)
        print(row, flush=True)
    print(f"\n{a.windows} windows of {a.ctx} tokens, {targets.numel()} predictions each; ExLlamaV2 with its "
          f"{'SDPA' if a.sdpa else 'matmul'} attention; {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}")
    cols = ["model", "ppl ours (anchor)", "ppl ExLlamaV2", "ExLlamaV2 / ours", "KLD ExLlamaV2 from ours",
            "same top token", "logits' relative difference", "ExLlamaV2's early logits moved by later tokens",
            "ours s", "ExLlamaV2 s"] + (["KLD ours from the base", "same top as the base"] if base is not None else [])
    print("| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols))
    for r in rows:
        cells = [r["model"], f"{r['ppl_a']:.4f}", f"{r['ppl_b']:.4f}", f"{r['ppl_b'] / r['ppl_a']:.6f}", f"{r['kld']:.2e}",
                 f"{r['same_top']:.4f}", f"{r['rel']:.2e}", f"{r['future']:.2e}", f"{r['s_ours']:.2f}", f"{r['s_exl']:.2f}"]
        if base is not None:
            cells += [f"{r['base_kld']:.2e}", f"{r['base_same_top']:.4f}"] if "base_kld" in r else ["", ""]
        print("| " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
