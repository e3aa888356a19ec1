"""Divergence of a quantized model from its base, as `llama-perplexity --kl-divergence` measures it:
the same windows scored on both (llama.cpp protocol: the second half of each window), and per
prediction the KL divergence of the quantized model's distribution from the base's, the change in
the probability of the correct token (delta-p), and whether the top tokens agree.

The base's log-probabilities are saved in llama.cpp's own file layout (`--kl-divergence-base`), so
a base saved by either tool is read by the other:
    b"_logits_", n_ctx (u32), n_vocab (i32), n_windows (i32), tokens (i32, n_windows x n_ctx),
    then for each window's n_ctx - 1 - n_ctx/2 scored predictions a row of 2*ceil(n_vocab/2) + 4
    u16: the row's scale and lowest log-probability (two f32), then each token's log-probability
    as a 16-bit step above the lowest; the lowest lies 16 nats under the top at most, and what lies
    lower counts as zero probability.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from quantkit.atomic import check_writable
from quantkit.errors import QuantkitError, count, option, space_for
from quantkit.modelio import adds_bos

from .perplexity import ROWS, Forward, exp_or_inf, first_scored, ran_in, summed_nll, window_logits

MAGIC = b"_logits_"
HEADER = struct.Struct("<8sIii")
RANGE = 16.0  # nats under the top that a saved row resolves (llama.cpp's choice)
PERCENTILES = (99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1)
DELTA_P_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 25.0, 10.0, 5.0, 1.0, 0.1)


def row_width(n_vocab: int) -> int:
    """u16 values in a saved row: the two f32 header values, then the vocabulary padded to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


def file_size(n: int, ctx: int, n_vocab: int) -> int:
    """Bytes of a saved base of n windows of ctx tokens: header, tokens, then each scored prediction's row."""
    scored = ctx - 1 - first_scored("llamacpp", ctx)
    return HEADER.size + n * ctx * 4 + n * scored * row_width(n_vocab) * 2


def compress(logits: torch.Tensor) -> np.ndarray:
    """Saved rows (t, row_width) u16 of logits (t, vocab), as llama-perplexity writes them."""
    logits = logits.float()
    t, v = logits.shape
    top = logits.max(-1, keepdim=True).values
    low = torch.maximum(logits.min(-1, keepdim=True).values, top - RANGE)
    lse = torch.log(torch.exp(logits.double() - top.double()).sum(-1, keepdim=True)).float()
    scale = (top - low) / 65535
    steps = torch.where(logits > low, torch.round((logits - low) / scale.clamp_min(1e-30)), 0)
    steps = torch.where(scale > 0, steps, 0).to(torch.int32)
    rows = np.zeros((t, row_width(v)), dtype=np.uint16)
    head = torch.cat([scale, low - top - lse], -1).numpy().astype("<f4")
    rows[:, :4] = head.view(np.uint16)
    rows[:, 4:4 + v] = steps.numpy().astype(np.uint16)
    return rows


def expand(rows: np.ndarray, n_vocab: int) -> torch.Tensor:
    """Log-probabilities (t, vocab) float32 of saved rows."""
    head = np.ascontiguousarray(rows[:, :4]).view("<f4").astype(np.float32)
    steps = torch.from_numpy(rows[:, 4:4 + n_vocab].astype(np.float32))
    return torch.from_numpy(head[:, :1]) * steps + torch.from_numpy(head[:, 1:2])


def is_saved_base(path: str | os.PathLike) -> bool:
    """Whether path is a file of saved log-probabilities (not a model)."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:  # unreadable: the reader of a model names why
        return False


def check_save_path(path: str | os.PathLike | None, overwrite: bool = False) -> None:
    """Fail before any work when a base cannot be saved at path (None: none is saved); a saved base is
    replaced on overwrite alone."""
    if path is None:
        if overwrite:
            raise QuantkitError(f"{option('overwrite', True)} replaces the base saved at {option('save_base')}, and "
                                "none is saved: drop it")
        return
    path = Path(path)
    if path.is_dir() or (path.exists() and not is_saved_base(path)):
        raise QuantkitError(f"{path} exists and is not a saved base: choose another {option('save_base')}")
    if path.exists() and not overwrite:  # the base a gate compares with: lost without a word
        raise QuantkitError(f"{path} holds a saved base already: compare with it ({option('base', path)}), choose "
                            f"another {option('save_base')}, or pass {option('overwrite', True)} to replace it")
    if not path.parent.is_dir():
        raise QuantkitError(f"{path.parent}: no such directory: create it or choose another {option('save_base')}")
    check_writable(path.parent, "save_base")  # here, not after the base has loaded, and by this option's name


def check_limits(max_ppl_increase: float | None = None, max_kld: float | None = None,
                 min_same_top: float | None = None) -> None:
    """A gate's limits are numbers the figures can be held to: NaN would fail every run, a negative
    KLD limit too, and the same-top share lies between 0 and 1."""
    ranges = {"max_ppl_increase": (max_ppl_increase, -1, math.inf, "0.05"), "max_kld": (max_kld, 0, math.inf, "0.05"),
              "min_same_top": (min_same_top, 0, 1, "0.9")}
    for name, (v, low, high, example) in ranges.items():
        if v is not None and not low <= v <= high:
            raise QuantkitError(f"{option(name, v)} is not a limit: pass a number from {low:g} "
                                f"{'up' if high == math.inf else f'to {high:g}'}, such as {example}")


def tokenizer_difference(base, model, text: str) -> str | None:
    """How two tokenizers differ in what a comparison of their models needs, or None."""
    vb, vm = base.get_vocab(), model.get_vocab()
    if len(vb) != len(vm):
        return f"vocabularies of {len(vb)} and {len(vm)} tokens"
    moved = next((t for t, i in vb.items() if vm.get(t) != i), None)
    if moved is not None:
        return f"token {moved!r} is {vb[moved]} in the base and {vm.get(moved)} in the model"
    if adds_bos(base) != adds_bos(model):
        return f"the {'base' if adds_bos(base) else 'model'} puts BOS in front of a text, the other does not"
    sample = text[:20_000]
    a, b = (t(sample, add_special_tokens=False)["input_ids"] for t in (base, model))
    if a != b:
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return f"they split the text differently from token {at} on"
    return None


class BaseWriter:
    """Writes a base's log-probabilities, a window at a time, to an open file."""

    def __init__(self, file, windows: torch.Tensor, n_vocab: int):
        self.file = file
        n, ctx = windows.shape
        file.write(HEADER.pack(MAGIC, ctx, n_vocab, n))
        file.write(windows.numpy().astype("<i4").tobytes())

    def add(self, logits: torch.Tensor) -> None:
        """logits (b, t, vocab) of a batch of windows' scored predictions."""
        for window in logits:
            self.file.write(compress(window).tobytes())


class BaseFile:
    """A saved base: its windows (n, ctx) and each window's rows, read from disk as they are needed.
    Every size in the header is checked against the file's length before anything is read."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(HEADER.size)
        if len(head) < HEADER.size or head[:8] != MAGIC:
            raise QuantkitError(f"{self.path}: not a saved base (llama.cpp's _logits_ layout): save one with "
                                f"{option('base', 'MODEL')} {option('save_base', 'FILE')}")
        _, self.ctx, self.n_vocab, self.n = HEADER.unpack(head)
        if self.ctx < 4 or self.n_vocab < 1 or self.n < 1:
            raise QuantkitError(f"{self.path}: corrupt saved base (context {self.ctx}, vocabulary {self.n_vocab}, "
                                f"{self.n} windows): save it again")
        self.scored = self.ctx - 1 - first_scored("llamacpp", self.ctx)
        self.width = row_width(self.n_vocab)
        tokens = self.n * self.ctx * 4
        expected = file_size(self.n, self.ctx, self.n_vocab)
        if size != expected:
            raise QuantkitError(f"{self.path}: {size} bytes where its header ({count(self.n, 'window')} of {self.ctx}, "
                                f"vocabulary {self.n_vocab}) needs {expected}: truncated or corrupt, save it again")
        data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.windows = torch.from_numpy(data[HEADER.size:HEADER.size + tokens].view("<i4").astype(np.int64)
                                        ).view(self.n, self.ctx)
        self.rows = data[HEADER.size + tokens:].view("<u2").reshape(self.n, self.scored, self.width)

    def logprobs(self, i: int) -> torch.Tensor:
        """Window i's base log-probabilities (scored, vocab), checked to be distributions: each row's
        probabilities sum to 1, up to the rounding of the saved steps and the tail raised to the
        floor RANGE under the top."""
        logprobs = expand(self.rows[i], self.n_vocab)
        total = torch.logsumexp(logprobs.double(), -1)
        high = math.log1p(self.n_vocab * math.exp(-RANGE)) + 1e-3
        ok = (total >= -1e-3) & (total <= high)
        if not ok.all():
            t = int((~ok).nonzero()[0])
            raise QuantkitError(f"{self.path}: window {i}, prediction {t} is not a distribution (its probabilities "
                                f"sum to {float(total[t].exp()):.6g}): corrupt, save the base again")
        return logprobs

    def perplexity(self) -> float:
        """The base's perplexity of its windows, from the saved rows."""
        targets = self.windows[:, first_scored("llamacpp", self.ctx) + 1:]
        nll = sum(-self.logprobs(i).double().gather(-1, targets[i, :, None]).sum().item() for i in range(self.n))
        return exp_or_inf(nll / targets.numel())


@dataclass
class Sums:
    """Per-prediction values of the windows scored so far."""
    nll: list[np.ndarray] = field(default_factory=list)
    nll_base: list[np.ndarray] = field(default_factory=list)
    nll_seen: list[np.ndarray] = field(default_factory=list)  # the model's, floored as the base's saved rows are
    kld: list[np.ndarray] = field(default_factory=list)
    delta_p: list[np.ndarray] = field(default_factory=list)
    same_top: list[np.ndarray] = field(default_factory=list)

    def add(self, logits: torch.Tensor, base: torch.Tensor, targets: torch.Tensor) -> None:
        """One window: logits (t, vocab) of the model, base (t, vocab) log-probabilities, targets (t,);
        in float64, ROWS predictions at a time (a long window of a large vocabulary is gigabytes in float64)."""
        for rows in zip(*(t.split(ROWS) for t in (logits, base, targets))):
            self.add_rows(*rows)

    def add_rows(self, logits: torch.Tensor, base: torch.Tensor, targets: torch.Tensor) -> None:
        logq = torch.log_softmax(logits.double(), -1)
        base = base.double()
        nll = -logq.gather(-1, targets[:, None])[:, 0]
        nll_base = -base.gather(-1, targets[:, None])[:, 0]
        # a saved row holds a target more than RANGE under its top at that floor: there the model's nll
        # is compared with the base's as such a row would hold it, or a model scored against itself is worse
        floored = nll_base >= RANGE - base.max(-1).values - 1e-3
        nll_seen = torch.where(floored, torch.minimum(nll, RANGE - logq.max(-1).values), nll)
        kept = base > -RANGE  # what the saved row resolves
        kld = torch.where(kept, base.exp() * (base - logq), 0).sum(-1)
        for name, v in (("nll", nll), ("nll_base", nll_base), ("nll_seen", nll_seen), ("kld", kld),
                        ("delta_p", (-nll).exp() - (-nll_base).exp()),
                        ("same_top", logits.argmax(-1) == base.argmax(-1))):
            getattr(self, name).append(v.numpy())

    def result(self, windows: int, ctx: int, dtype: str, device: str) -> Divergence:
        nll, nll_base, seen, kld, dp, top = (np.concatenate(getattr(self, k)).astype(np.float64)
                                             for k in ("nll", "nll_base", "nll_seen", "kld", "delta_p", "same_top"))
        n = len(nll)
        ln_q, ln_q_unc = mean_unc(nll)
        ln_b, ln_b_unc = mean_unc(nll_base)
        ln_s, ln_s_unc = mean_unc(seen)  # the ratio's: both sides as the saved rows resolve them
        cov = float(np.mean(seen * nll_base) - seen.mean() * nll_base.mean()) / (n - 1) if n >= 10 else 0.0
        ln_ratio_unc = math.sqrt(max(ln_s_unc ** 2 + ln_b_unc ** 2 - 2 * cov, 0.0))
        ppl, ppl_base, ratio = exp_or_inf(ln_q), exp_or_inf(ln_b), exp_or_inf(ln_s - ln_b)
        kld_mean, kld_unc = mean_unc(kld)
        dp_mean, dp_unc = mean_unc(dp)
        mse, mse_unc = mean_unc(dp ** 2)
        rms = math.sqrt(mse)
        same = float(top.mean())
        return Divergence(
            perplexity=ppl, perplexity_unc=ppl * ln_q_unc if ln_q_unc else 0.0, base_perplexity=ppl_base,
            base_perplexity_unc=ppl_base * ln_b_unc if ln_b_unc else 0.0,
            ln_ratio=ln_s - ln_b, ln_ratio_unc=ln_ratio_unc,
            ppl_ratio=ratio, ppl_ratio_unc=ratio * ln_ratio_unc if ln_ratio_unc else 0.0,
            ppl_correlation=cov / (ln_s_unc * ln_b_unc) if ln_s_unc * ln_b_unc > 0 else 0.0,
            kld_mean=kld_mean, kld_unc=kld_unc, kld_median=float(np.median(kld)),
            kld_max=float(kld.max()), kld_min=float(kld.min()),
            kld_percentiles={p: float(np.percentile(kld, p)) for p in PERCENTILES},
            delta_p_mean=dp_mean, delta_p_unc=dp_unc, delta_p_median=float(np.median(dp)),
            delta_p_max=float(dp.max()), delta_p_min=float(dp.min()),
            delta_p_percentiles={p: float(np.percentile(dp, p)) for p in DELTA_P_PERCENTILES},
            delta_p_rms=rms, delta_p_rms_unc=0.5 / rms * mse_unc if rms > 0 else 0.0,
            same_top=same, same_top_unc=math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0,
            tokens=n, windows=windows, ctx=ctx, dtype=dtype, device=device)


def mean_unc(values: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error (llama.cpp's: none under 11 values)."""
    n = len(values)
    mean = float(values.mean())
    var = float(np.mean(values ** 2)) - mean ** 2
    return mean, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def percent_key(p: float) -> str:
    return f"p{p:g}".replace(".", "_")


@dataclass
class Divergence:
    perplexity: float
    perplexity_unc: float
    base_perplexity: float
    base_perplexity_unc: float
    ln_ratio: float  # mean ln(PPL(Q)/PPL(base)), of targets as the base's saved rows resolve them (RANGE)
    ln_ratio_unc: float
    ppl_ratio: float
    ppl_ratio_unc: float
    ppl_correlation: float
    kld_mean: float
    kld_unc: float
    kld_median: float
    kld_max: float
    kld_min: float
    kld_percentiles: dict[float, float]
    delta_p_mean: float
    delta_p_unc: float
    delta_p_median: float
    delta_p_max: float
    delta_p_min: float
    delta_p_percentiles: dict[float, float]
    delta_p_rms: float
    delta_p_rms_unc: float
    same_top: float
    same_top_unc: float
    tokens: int
    windows: int
    ctx: int
    dtype: str  # what the model computed in, and where (a saved base does not record the base's)
    device: str

    def to_dict(self) -> dict:
        """Flat: the percentiles as kld_p99, kld_p99_9, delta_p_p1, ..."""
        out = {}
        for k, v in self.__dict__.items():
            if isinstance(v, dict):
                out.update({f"{k.removesuffix('_percentiles')}_{percent_key(p)}": x for p, x in v.items()})
            else:
                out[k] = v
        return out

    def failures(self, max_ppl_increase: float | None = None, max_kld: float | None = None,
                 min_same_top: float | None = None) -> list[str]:
        """The limits this result breaks, each with its measured value (for a pass/fail gate)."""
        return [text for kept, text in self.gate(max_ppl_increase, max_kld, min_same_top) if not kept]

    def gate(self, max_ppl_increase: float | None = None, max_kld: float | None = None,
             min_same_top: float | None = None) -> list[tuple[bool, str]]:
        """Each limit given: whether this result keeps it, and its figure with its standard error against it
        (a NaN figure, from broken logits, keeps none)."""
        check_limits(max_ppl_increase=max_ppl_increase, max_kld=max_kld, min_same_top=min_same_top)
        out = []
        if max_ppl_increase is not None:
            kept = self.ppl_ratio - 1 <= max_ppl_increase
            out.append((kept, f"perplexity increase {self.ppl_ratio - 1:.4f} ± {self.ppl_ratio_unc:.4f} "
                              f"(PPL(Q)/PPL(base) - 1) is {'within' if kept else 'above'} "
                              f"{option('max_ppl_increase', max_ppl_increase)}"))
        if max_kld is not None:
            kept = self.kld_mean <= max_kld
            out.append((kept, f"mean KL divergence {self.kld_mean:.6f} ± {self.kld_unc:.6f} is "
                              f"{'within' if kept else 'above'} {option('max_kld', max_kld)}"))
        if min_same_top is not None:
            kept = self.same_top >= min_same_top
            out.append((kept, f"same top token {self.same_top:.4f} ± {self.same_top_unc:.4f} is "
                              f"{'within' if kept else 'below'} {option('min_same_top', min_same_top)}"))
        return out

    def report(self) -> str:
        """The figures as llama-perplexity prints them."""
        lines = [
            f"PPL(Q)              : {self.perplexity:10.6f} ± {self.perplexity_unc:10.6f}",
            f"PPL(base)           : {self.base_perplexity:10.6f} ± {self.base_perplexity_unc:10.6f}",
            f"Cor(ln PPL(Q), ln PPL(base)): {100 * self.ppl_correlation:6.2f}%",
            f"Mean ln(PPL(Q)/PPL(base)): {self.ln_ratio:10.6f} ± {self.ln_ratio_unc:10.6f}",
            f"PPL(Q)/PPL(base)    : {self.ppl_ratio:10.6f} ± {self.ppl_ratio_unc:10.6f}",
            f"Mean    KLD: {self.kld_mean:10.6f} ± {self.kld_unc:10.6f}",
            f"Maximum KLD: {self.kld_max:10.6f}",
            *(f"{p:4.1f}%   KLD: {x:10.6f}" for p, x in self.kld_percentiles.items() if p > 50),
            f"Median  KLD: {self.kld_median:10.6f}",
            *(f"{p:4.1f}%   KLD: {x:10.6f}" for p, x in self.kld_percentiles.items() if p < 50),
            f"Minimum KLD: {self.kld_min:10.6f}",
            f"Mean    Δp: {100 * self.delta_p_mean:6.3f} ± {100 * self.delta_p_unc:5.3f} %",
            f"Maximum Δp: {100 * self.delta_p_max:6.3f}%",
            *(f"{p:4.1f}%   Δp: {100 * x:6.3f}%" for p, x in self.delta_p_percentiles.items() if p > 50),
            f"Median  Δp: {100 * self.delta_p_median:6.3f}%",
            *(f"{p:4.1f}%   Δp: {100 * x:6.3f}%" for p, x in self.delta_p_percentiles.items() if p < 50),
            f"Minimum Δp: {100 * self.delta_p_min:6.3f}%",
            f"RMS Δp    : {100 * self.delta_p_rms:6.3f} ± {100 * self.delta_p_rms_unc:5.3f} %",
            f"Same top p: {100 * self.same_top:6.3f} ± {100 * self.same_top_unc:5.3f} %",
        ]
        return "\n".join(lines)


def save_base(module: torch.nn.Module, tokenizer, windows: torch.Tensor, path: str | os.PathLike,
              batch_size: int = 4, progress: bool = True, overwrite: bool = False,
              forward: Forward | None = None) -> float:
    """Score windows (n, ctx) on the base model and save its log-probabilities at path (atomically);
    overwrite: replace a file there (else one that appeared while the base was scored is refused).
    forward: how the model runs (window_logits).
    The base's perplexity, exact (the saved rows floor a target 16 nats under the top), as Sums takes a model's."""
    from quantkit.atomic import Staged

    staged = Staged(path, overwrite=overwrite, directory=False, option="save_base")
    n, ctx = windows.shape
    needed = file_size(n, ctx, module.config.vocab_size)
    try:
        staged.fresh()
        with space_for(path, needed, "the saved base", "save it again"):  # the commit's fsyncs too
            with open(staged.path, "wb") as f:
                writer, nll, count = None, 0.0, 0
                for logits, targets in window_logits(module, tokenizer, windows, "llamacpp", batch_size, progress,
                                                     "base", forward):
                    writer = writer or BaseWriter(f, windows, logits.shape[-1])
                    logits = logits.cpu()
                    writer.add(logits)
                    nll += summed_nll(logits, targets.cpu())
                    count += targets.numel()
                f.flush()
                os.fsync(f.fileno())
            staged.commit()
    except BaseException:
        staged.abort()
        raise
    return exp_or_inf(nll / count)


def check_base(base: BaseFile, ctx: int, windows: torch.Tensor | None = None, vocab: int | None = None) -> None:
    """Refuse a saved base that windows of ctx tokens (these, when given) of a model with a vocabulary of
    vocab cannot be compared with: before the windows are cut and the model is read, a mistake in
    --ctx was named as a text too short for it."""
    if ctx != base.ctx:
        raise QuantkitError(f"{base.path} was saved with a context of {base.ctx}, not {ctx}: pass "
                            f"{option('ctx', base.ctx)}")
    if vocab is not None and vocab != base.n_vocab:
        raise QuantkitError(f"the model has a vocabulary of {vocab}, the base {base.n_vocab}: compare a model with "
                            "its own base")
    if windows is None:
        return
    n = len(windows)
    if n > base.n:
        raise QuantkitError(f"{base.path} holds {count(base.n, 'window')}, fewer than the {n} asked for: pass "
                            f"{option('max_windows', base.n)}, or save the base again with more")
    if not torch.equal(windows, base.windows[:n]):
        w, pos = divmod(int((windows != base.windows[:n]).flatten().nonzero()[0]), ctx)
        raise QuantkitError(f"{base.path} was saved from other tokens (window {w}, position {pos} differs): "
                            f"the text or the tokenizer is not the base's; pass the {option('data')} it was saved with")


def divergence(module: torch.nn.Module, tokenizer, windows: torch.Tensor, base: BaseFile,
               batch_size: int = 4, progress: bool = True, forward: Forward | None = None) -> Divergence:
    """Score windows (n, ctx) on the model and compare each prediction with the saved base (forward:
    how the model runs, as in window_logits)."""
    n, ctx = windows.shape
    check_base(base, ctx, windows)
    sums, i = Sums(), 0
    for logits, targets in window_logits(module, tokenizer, windows, "llamacpp", batch_size, progress, "divergence",
                                         forward):
        if logits.shape[-1] != base.n_vocab:
            raise QuantkitError(f"the model has a vocabulary of {logits.shape[-1]}, the base {base.n_vocab}: "
                                "compare a model with its own base")
        for lg, tg in zip(logits.cpu(), targets.cpu()):
            sums.add(lg, base.logprobs(i), tg)
            i += 1
    return sums.result(n, ctx, *ran_in(module, forward))
