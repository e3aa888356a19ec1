"""Perplexity over fixed windows of a tokenized text.

wikitext: non-overlapping windows of ctx tokens, every next-token prediction in a window scored
  (the GPTQ/AWQ reference code); the text is the file as it is, tokenized once.
llamacpp: as `llama-perplexity -c ctx`: windows of ctx tokens, the first replaced by BOS only
  when the tokenizer adds BOS, and only the predictions of the second half scored.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterator, Protocol

import torch
from tqdm import tqdm

from quantkit.calibration import token_ids
from quantkit.errors import COMMAND_LINE, QuantkitError, option
from quantkit.modelio import adds_bos, check_context, with_bos

PROTOCOLS = ("wikitext", "llamacpp")
TOKENS = 2048  # window tokens a batch holds at most (ctx 512: 4 windows)
ROWS = 128  # predictions whose log-probabilities are taken in float64 at a time


class Forward(Protocol):
    """A model run some other way than whole (pipeline.Layerwise): batches of token windows and the
    positions to keep -> each batch's logits of those positions, in order."""
    ran: tuple[str, str]  # the float dtype and device type it computes in (ran_in)
    dtype: torch.dtype
    device: torch.device

    def __call__(self, batches: list[torch.Tensor], keep: int) -> Iterator[torch.Tensor]: ...


@dataclass
class Perplexity:
    perplexity: float
    perplexity_unc: float  # llama-perplexity's "+/-": the standard error of the mean loss, times the perplexity
    tokens: int  # predictions scored
    windows: int
    protocol: str
    ctx: int
    dtype: str  # what the model computed in, and where (ran_in)
    device: str

    def to_dict(self) -> dict:
        return asdict(self)


def ran_in(module: torch.nn.Module, forward: Forward | None = None) -> tuple[str, str]:
    """The float dtype and the device type a model computes in (run by forward, when given): a figure
    depends on them."""
    if forward is not None:
        return forward.ran
    p = next(p for p in module.parameters() if p.is_floating_point())
    return str(p.dtype).removeprefix("torch."), p.device.type


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


def check_settings(protocol: str, ctx: int, max_windows: int | None) -> None:
    """Refuse windows that cannot be cut, before any model loads."""
    if protocol not in PROTOCOLS:
        raise QuantkitError(f"unknown perplexity protocol {protocol!r}: use one of {', '.join(PROTOCOLS)}")
    if ctx < 2 or (protocol == "llamacpp" and ctx < 4):
        raise QuantkitError(f"context {ctx} is too short: use {option('ctx', 512)} or another length of at least 4")
    if max_windows is not None and max_windows < 1:
        raise QuantkitError(f"{option('max_windows', max_windows)} scores nothing: pass 1 or more, or "
                            f"{'none' if COMMAND_LINE.get() else 'None'} for every window")


def windows(tokenizer, text: str, protocol: str = "llamacpp", ctx: int = 512,
            max_windows: int | None = None, progress: bool = True) -> torch.Tensor:
    """The text's token windows (n, ctx) as the protocol cuts them, before any BOS replacement."""
    check_settings(protocol, ctx, max_windows)
    ids = token_ids(tokenizer, text, progress)
    ids = with_bos(tokenizer, ids)  # one BOS for the whole text, as tokenizer(text) and llama-perplexity give it
    n = len(ids) // ctx
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise QuantkitError(f"the text has {len(ids)} tokens, fewer than one window of {ctx}: use a longer text or a "
                            f"smaller {option('ctx')}")
    return ids[: n * ctx].view(n, ctx).clone()


def first_scored(protocol: str, ctx: int) -> int:
    """The position whose prediction is the first scored in a window."""
    return ctx // 2 if protocol == "llamacpp" else 0


@torch.no_grad()
def window_logits(module: torch.nn.Module, tokenizer, windows: torch.Tensor, protocol: str = "llamacpp",
                  batch_size: int = 4, progress: bool = True, desc: str = "perplexity",
                  forward: Forward | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, targets) of the scored predictions, a batch of windows at a time: logits (b, t, vocab)
    in float32, targets (b, t). Under llamacpp the first token of a window becomes BOS when the
    tokenizer adds BOS. forward: how the model runs (default: whole, a batch at a time)."""
    check_context(module.config, windows.shape[1], "ctx")
    first = first_scored(protocol, windows.shape[1])
    bos = protocol == "llamacpp" and adds_bos(tokenizer)
    began = time.monotonic()
    # at most TOKENS a batch (one window at least): several long windows' logits of a large vocabulary take gigabytes
    batch_size = max(1, min(batch_size, TOKENS // windows.shape[1]))
    batches = list(windows.split(batch_size))
    inputs = [b.clone() for b in batches]
    for x in inputs if bos else ():
        x[:, 0] = tokenizer.bos_token_id
    # the head computes only the scored positions' logits (half the window's under llamacpp)
    keep = windows.shape[1] - first
    if forward is None:
        device = next(module.parameters()).device

        def forward(xs: list[torch.Tensor], keep: int) -> Iterator[torch.Tensor]:  # whole, a batch at a time
            return (module(x.to(device), use_cache=False, logits_to_keep=keep).logits for x in xs)
    with tqdm(total=len(windows), desc=desc, unit="window", disable=not progress) as bar:
        for b, (batch, out) in enumerate(zip(batches, forward(inputs, keep), strict=True)):
            computed = out.dtype
            logits = out[:, :-1].float()
            del out  # a float16 model's logits: not kept beside their float32 copy
            check_finite(logits, b * batch_size, len(windows), computed, "base" if desc == "base" else "model")
            yield logits, batch[:, first + 1:].to(logits.device)
            bar.set_postfix_str(f"{(bar.n + len(batch)) * windows.shape[1] / (time.monotonic() - began):.0f} tok/s",
                                refresh=False)
            bar.update(len(batch))


def check_finite(logits: torch.Tensor, first: int, n: int, dtype: torch.dtype, who: str = "model") -> None:
    """Refuse a batch of windows (from window first of n) whose logits hold NaN or Inf: no figure
    (and no saved base) computed from them means anything. A sum first: a twentieth of the time of
    a look at every logit, which is made only when the sum is not finite."""
    if torch.isfinite(logits.sum(-1)).all():
        return
    bad = ~torch.isfinite(logits).all(-1).all(-1)
    if bad.any():
        at = first + int(bad.nonzero()[0]) + 1
        raise QuantkitError(f"the {who}'s logits are not finite (NaN or Inf) in window {at} of {n}: "
                            f"{overflow(dtype)}")


def overflow(dtype: torch.dtype) -> str:
    """Why a model computing in dtype gives logits that are not finite, and what to do."""
    if dtype == torch.float16:
        return f"it overflows float16: run it in float32 or bfloat16 ({option('dtype', 'float32')})"
    return f"its weights or activations overflow {str(dtype).removeprefix('torch.')}: the model is broken (for an " \
        "export, score its float model to tell whether quantizing did it)"


def exp_or_inf(x: float) -> float:
    """e**x, inf past float64's range (a broken model's perplexity fails a gate, not the program)."""
    return math.exp(x) if x < 709.78 else math.inf


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The negative log-likelihood of each of a batch's targets (b, t), flat, in float64."""
    # ROWS predictions at a time: a window's float64 copy is gigabytes at a long context and a large vocabulary
    return torch.cat([-torch.log_softmax(lg.double(), dim=-1).gather(-1, tg[:, None])[:, 0]
                      for lg, tg in zip(logits.reshape(-1, logits.shape[-1]).split(ROWS), targets.reshape(-1).split(ROWS))])


def summed_nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """The negative log-likelihood of a batch's targets (b, t), summed, in float64."""
    return token_nll(logits, targets).sum().item()


def perplexity(
    module: torch.nn.Module,
    tokenizer,
    text: str,
    protocol: str = "llamacpp",
    ctx: int = 512,
    max_windows: int | None = None,
    batch_size: int = 4,
    progress: bool = True,
    forward: Forward | None = None,
) -> Perplexity:
    """The perplexity of the text's windows (forward: how the model runs, as in window_logits)."""
    w = windows(tokenizer, text, protocol, ctx, max_windows, progress)
    nll, nll2, count = 0.0, 0.0, 0
    for logits, targets in window_logits(module, tokenizer, w, protocol, batch_size, progress, forward=forward):
        each = token_nll(logits, targets)
        nll, nll2, count = nll + each.sum().item(), nll2 + each.square().sum().item(), count + each.numel()
    ppl = exp_or_inf(nll / count)
    var = nll2 / count - (nll / count) ** 2  # as llama-perplexity: none for a single prediction
    unc = ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 and math.isfinite(ppl) else 0.0
    return Perplexity(ppl, unc, count, len(w), protocol, ctx, *ran_in(module, forward))
