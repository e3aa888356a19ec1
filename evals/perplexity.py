"""Perplexity over fixed windows of a tokenized text.

wikitext: non-overlapping windows of ctx tokens, every next-token prediction in a window scored
  (the GPTQ/AWQ reference code); the text is the file as it is, tokenized once.
llamacpp: as `llama-perplexity -c ctx`: windows of ctx tokens, the first replaced by BOS only
  when the tokenizer adds BOS, and only the predictions of the second half scored.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterator

import torch
from tqdm import tqdm

from quantkit.errors import QuantkitError

PROTOCOLS = ("wikitext", "llamacpp")


@dataclass
class Perplexity:
    perplexity: float
    tokens: int  # predictions scored
    windows: int
    protocol: str
    ctx: int

    def to_dict(self) -> dict:
        return asdict(self)


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts BOS in front of a text (llama.cpp's tokenizer.ggml.add_bos_token)."""
    if getattr(tokenizer, "bos_token_id", None) is None:
        return False
    return tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]


@contextmanager
def llamacpp_arithmetic(module: torch.nn.Module, types: dict[str, str]) -> Iterator[None]:
    """Within: each linear's input rounded as llama.cpp's CPU backend rounds it for the GGUF type of the
    linear's weight (types: module name -> type), so a GGUF file scores as llama-perplexity scores it."""
    from quantkit.quantizers.ggml import round_activations

    hooks = [module.get_submodule(name).register_forward_pre_hook(
        lambda mod, args, t=t: (round_activations(args[0], t), *args[1:])) for name, t in types.items()]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def perplexity(
    module: torch.nn.Module,
    tokenizer,
    text: str,
    protocol: str = "llamacpp",
    ctx: int = 512,
    max_windows: int | None = None,
    batch_size: int = 4,
    progress: bool = True,
) -> Perplexity:
    if protocol not in PROTOCOLS:
        raise QuantkitError(f"unknown perplexity protocol {protocol!r}: use one of {', '.join(PROTOCOLS)}")
    if ctx < 2 or (protocol == "llamacpp" and ctx < 4):
        raise QuantkitError(f"context {ctx} is too short: use --ctx 512 or another length of at least 4")
    bos = adds_bos(tokenizer)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if bos and protocol == "wikitext":
        ids = [tokenizer.bos_token_id] + ids  # what tokenizer(text) gives: one BOS for the whole text
    ids = torch.tensor(ids, dtype=torch.long)
    n = len(ids) // ctx
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise QuantkitError(f"the text has {len(ids)} tokens, fewer than one window of {ctx}: use a longer text or a smaller --ctx")
    windows = ids[: n * ctx].view(n, ctx).clone()
    first = 0
    if protocol == "llamacpp":
        first = ctx // 2
        if bos:
            windows[:, 0] = tokenizer.bos_token_id
    nll, count = 0.0, 0
    device = next(module.parameters()).device
    for batch in tqdm(windows.split(batch_size), desc="perplexity", unit="batch", disable=not progress):
        batch = batch.to(device)
        logits = module(batch, use_cache=False).logits[:, first:-1].double()
        targets = batch[:, first + 1 :]
        nll -= torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).sum().item()
        count += targets.numel()
    return Perplexity(math.exp(nll / count), count, n, protocol, ctx)
