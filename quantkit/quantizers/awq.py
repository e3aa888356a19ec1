"""AWQ (Lin et al. 2023): activation-aware scaling and clipping before round-to-nearest.

For linears sharing an input, input channel j is multiplied by s_j (and the op before divides by
it, so the float model is unchanged): salient channels, those with large mean |x|, get finer
steps. s = mean|x|^alpha, alpha on a grid in [0, 1), chosen by the block's output error with the
scaled weights quantized. Then each group's clipping range is shrunk on a grid, chosen by the
linear's output error on a sample of tokens. The weights are finally quantized with RTN.
The first half is the math on tensors; the second applies it to one decoder layer (its groups of
linears, the ops that feed them, the blocks that judge them), called by the pipeline layer by layer.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from .. import distributed
from ..errors import QuantkitError
from ..layers import GROUPS, LINEARS, run_hooked
from ..pipeline import Hessian
from ..qtensor import QuantizedTensor
from . import rtn


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool = False) -> torch.Tensor:
    """w through RTN and back: what a scaled or clipped weight becomes (RTN's values, all whole groups
    at once, a shorter last group after them)."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    whole = k - k % g
    if whole == k:
        return round_trip(w.reshape(-1, g), bits, sym).reshape(n, k)
    out = torch.empty_like(w)
    out[:, :whole] = round_trip(w[:, :whole].reshape(-1, g), bits, sym).reshape(n, whole)
    out[:, whole:] = round_trip(w[:, whole:], bits, sym)
    return out


def round_trip(rows: torch.Tensor, bits: int, sym: bool) -> torch.Tensor:
    """Each row [R, G] as one group, quantized and dequantized: rtn's operations, in place on one copy."""
    s, z = rtn.fit_grid(rows, bits, sym)
    s, z = s[:, None], z[:, None]
    return (rows.float() / s).round_().add_(z).clamp_(0, 2**bits - 1).sub_(z).mul_(s).to(rows.dtype)


def weight_mean(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Mean over output rows of |w| relative to its group's max: per input channel (AWQ's duo scaling)."""
    w = torch.cat(weights).abs()
    g = w.shape[1] if group_size == -1 else group_size
    rel = torch.cat([c / (c.amax(dim=1, keepdim=True) + 1e-6) for c in w.split(g, dim=1)], dim=1)
    return rel.mean(dim=0)


def candidate(x_mean: torch.Tensor, w_mean: torch.Tensor | None, alpha: float) -> torch.Tensor:
    """s = mean|x|^alpha (over mean w^(1-alpha) with duo scaling), normalized to geometric mean 1 of its extremes."""
    s = x_mean.pow(alpha)
    if w_mean is not None:
        s = s / (w_mean.pow(1 - alpha) + 1e-4)
    s = s.clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def search_scale(x_mean: torch.Tensor, loss: Callable[[torch.Tensor], float], n_grid: int = 20,
                 w_mean: torch.Tensor | None = None, start: Callable[[torch.Tensor], float] | None = None,
                 smooth: bool = False) -> tuple[torch.Tensor, float, dict[int, float]]:
    """The scales among alpha = 0, 1/n, .., (n-1)/n with the least block loss: (scales, alpha, the
    losses by candidate tried). loss(s) is the block's output error with its linears' input channels
    scaled by s and quantized. start: a cheaper loss; then loss descends from the candidate start
    ranks best, two candidates each side at a time, until none is lower (a few evaluations of loss
    instead of n). smooth: the loss that ranks every candidate (start, or else loss) is an output loss,
    which varies smoothly with alpha: its least is sought coarse to fine (least)."""
    def judged(i: int) -> float:
        if i not in losses:
            losses[i] = loss(candidate(x_mean, w_mean, i / n_grid))
        return losses[i]

    losses: dict[int, float] = {}
    if start is None:
        best = least(judged, n_grid, smooth)  # not smooth: the first of equal losses, as the reference
    else:
        ranked = functools.cache(lambda i: start(candidate(x_mean, w_mean, i / n_grid)))
        # under torchrun every process must descend alike (each runs the block loss's collectives): one
        # start, in case the processes' arithmetic differs (GPUs of two kinds)
        best = distributed.agree(least(ranked, n_grid, smooth), "min", "searching AWQ's scales")
        while True:
            # two neighbours each side: the block loss has shallow local minima a step wide
            step = min((j for j in range(best - 2, best + 3) if 0 <= j < n_grid), key=judged)
            if step == best:
                break
            best = step
    return candidate(x_mean, w_mean, best / n_grid), best / n_grid, losses


def least(f: Callable[[int], float], n: int, smooth: bool) -> int:
    """The i < n of least f(i), the first of equal ones tried. smooth: from every other i and then the
    neighbours of the best two of those, 12 to 14 evaluations of 20 (for the output losses of a whole
    model, at w3 and at w4, the same i as all 20 in each of 240 searches; the best one's neighbours
    alone missed 3 at w4, where some curves have more than one local minimum)."""
    if not smooth:
        return min(range(n), key=f)
    near = sorted(range(0, n, 2), key=f)[:2]
    return min(sorted({j for i in near for j in (i - 1, i, i + 1) if 0 <= j < n}), key=f)


def search_clip(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int, sym: bool = False, n_grid: int = 20,
                max_shrink: float = 0.5) -> torch.Tensor:
    """Per (row, group) clipping bound max|w| * (1 - i/n_grid), i < max_shrink * n_grid, with the least
    squared error of that group's share of the output on the grid (sym or not) it is quantized on,
    dW_g H_gg dW_g^T with H the inputs' Hessian [K, K] (a g x g product per row instead of a pass over
    the tokens): [N, ng]."""
    g = w.shape[1] if group_size == -1 else group_size
    bounds = []
    for c in range(0, w.shape[1], g):
        wc, hc = w[:, c:c + g], h[c:c + g, c:c + g]
        full = wc.abs().amax(dim=1, keepdim=True)
        best, best_err = full, None
        for i in range(int(max_shrink * n_grid)):
            bound = full * (1 - i / n_grid)
            dw = fake_quantize(torch.max(torch.min(wc, bound), -bound), bits, -1, sym) - wc
            err = ((dw @ hc) * dw).sum(dim=1, keepdim=True)
            if best_err is None:
                best_err = err
            else:
                better = err < best_err
                best, best_err = torch.where(better, bound, best), torch.where(better, err, best_err)
        bounds.append(best)
    return torch.cat(bounds, dim=1)


def clip(w: torch.Tensor, bound: torch.Tensor, group_size: int) -> torch.Tensor:
    g = w.shape[1] if group_size == -1 else group_size
    return torch.cat([c.clamp(-b, b) for c, b in zip(w.split(g, dim=1), bound.split(1, dim=1))], dim=1)


def quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool = False, bound: torch.Tensor | None = None) -> QuantizedTensor:
    """The final RTN of an AWQ-scaled weight, clipped to bound [N, ng] when given."""
    return rtn.quantize(clip(w, bound, group_size) if bound is not None else w, bits, group_size, sym)


def fold(prev: torch.nn.Module, linears: list[torch.nn.Linear], s: torch.Tensor) -> None:
    """Scale the linears' input channels by s and the op that feeds them (a norm's weight, or a
    linear's output rows) by 1/s: the float function is unchanged."""
    if isinstance(prev, torch.nn.Linear):
        prev.weight.data /= s[:, None]
        if prev.bias is not None:
            prev.bias.data /= s
    else:
        prev.weight.data /= s
    for lin in linears:
        lin.weight.data *= s


AWQ_LAYOUT = ("input_layernorm", "post_attention_layernorm", *LINEARS)


def tokens_in(xs: list[torch.Tensor]) -> int:
    """The tokens of the batches xs, under torchrun those of every process."""
    n = torch.tensor(sum(x[..., 0].numel() for x in xs), dtype=torch.float64, device=distributed.collective_device())
    return int(distributed.sum_(n).item())


def spacing(xs: list[torch.Tensor], tokens: int) -> int:
    """The step between the rows of each of the batches xs ([windows, tokens, channels]) that takes about
    tokens rows, evenly spaced over all of them (under torchrun, over every process's: each takes from its
    own the rows one process would). The step shares no factor with the window length, so every position
    in a window is taken alike: a step dividing it took the same positions of every window (at 128 x 512
    tokens, every 8th row gave the windows' first tokens 8 times their share: 62% of down_proj's Hessian
    trace in a layer of SmolLM2 where they hold 19%)."""
    step = max(1, tokens_in(xs) // tokens)
    while math.gcd(step, xs[0].shape[-2]) > 1:
        step += 1
    return step


def first_batches(xs: list[torch.Tensor], tokens: int) -> list[int]:
    """The indices among xs of the job's first batches holding at most tokens tokens (at least one).
    Under torchrun the batches are dealt in turn (distributed.share): the job's j-th batch is process
    j % world's (j // world)-th."""
    sizes = distributed.gather_rows(torch.tensor([float(x[..., 0].numel()) for x in xs], dtype=torch.float64)[:, None])
    n = max(1, int((sizes[:, 0].cumsum(0) <= tokens).sum()))
    return [i for i in range(len(xs)) if distributed.rank() + distributed.world() * i < n]


def head(x: torch.Tensor, kwargs: dict, tokens: int) -> tuple[torch.Tensor, dict]:
    """A batch's first windows holding at most tokens tokens (at least one), and its keyword arguments
    with their rows per window taken alike (those made for one window broadcast, as Llama's are)."""
    n = max(1, tokens // x.shape[1])  # x: [windows, tokens, channels]
    if n >= len(x):
        return x, kwargs

    def rows(v):
        if isinstance(v, tuple):
            return tuple(rows(u) for u in v)
        if isinstance(v, dict):  # masks by kind of layer (pipeline.capture_inputs)
            return {k: rows(u) for k, u in v.items()}
        return v[:n] if torch.is_tensor(v) and v.dim() and len(v) == len(x) else v
    return x[:n], {k: rows(v) for k, v in kwargs.items()}


class Gathered:
    """What AWQ's searches take from one group's inputs, gathered batch by batch as the float layer runs,
    so that no batch's inputs outlive its run (all of them at once took 6.5 times the hidden states: 13
    GiB for a 70B layer at 128 x 512 tokens): the sum of |x| and the rows summed; the Hessian of every
    step-th row of each batch; and the block loss's inputs xs with their keyword arguments, by block:
    "head", the first windows of the batches numbered in first (head), "spread", every block_step-th row
    of each batch (for a block that works on each token alone, the MLP), or None."""

    def __init__(self, cols: int, device: torch.device, step: int, block: str | None = None, block_tokens: int = 0,
                 block_step: int = 1, first: frozenset[int] = frozenset()):
        self.sum = torch.zeros(cols, dtype=torch.float64, device=device)
        self.rows = 0
        self.h = Hessian(cols, device)
        self.step, self.block, self.block_tokens, self.block_step, self.first = step, block, block_tokens, block_step, first
        self.xs: list[torch.Tensor] = []
        self.kwargs: list[dict] = []

    def add(self, i: int, x: torch.Tensor, kwargs: dict) -> None:
        """Batch i's inputs x (run with kwargs)."""
        self.sum += x.abs().reshape(-1, x.shape[-1]).sum(0)
        self.rows += x[..., 0].numel()
        self.h.add_batch(x.reshape(-1, x.shape[-1])[::self.step])
        if self.block == "spread":  # copies: a view would keep the whole batch
            self.xs.append(x.reshape(-1, x.shape[-1])[::self.block_step].clone())
            self.kwargs.append({})
        elif self.block == "head" and i in self.first:
            x, kwargs = head(x, kwargs, self.block_tokens)
            self.xs.append(x.clone())
            self.kwargs.append(kwargs)

    def mean(self) -> torch.Tensor:
        """Mean |x| of each input channel over the rows summed (under torchrun, every process's)."""
        rows = torch.tensor(float(self.rows), dtype=torch.float64, device=self.sum.device)
        return (distributed.sum_(self.sum) / distributed.sum_(rows)).float()


def gather(layer: torch.nn.Module, batches, blocks: list[str | None], search_tokens: int,
           block_tokens: int) -> list[Gathered]:
    """Each of GROUPS' inputs Gathered (blocks: each group's block loss inputs). One float run of the
    layer over the batches, ended at the MLP's input, gives the attention's groups and gate/up's from
    every token; down_proj's come from the MLP run on gate/up's Hessian rows alone, since it works on each
    token alone (at 128 x 512 tokens, gate/up skipped for 8 tokens in 9: about a quarter of the float
    run's multiplies). The Hessians take about search_tokens rows spread over all batches, the block losses
    block_tokens."""
    hidden = [h for h, _ in batches]  # each batch's tokens are its linears' input rows
    step, block_step = spacing(hidden, search_tokens), spacing(hidden, block_tokens)
    first = frozenset(first_batches(hidden, block_tokens))
    names = [group[0] for group in GROUPS]
    device = next(layer.parameters()).device
    gathered = [Gathered(layer.get_submodule(name).in_features, device, step, block, block_tokens, block_step, first)
                for name, block in zip(names[:-1], blocks)]
    sample = []  # gate/up's Hessian rows, batch by batch

    def mlp_input(i: int, x: torch.Tensor) -> None:
        gathered[-1].add(i, x, batches[i][1])
        sample.append(x.reshape(-1, x.shape[-1])[::step].clone())

    takes = {name: lambda i, x, g=g: g.add(i, x, batches[i][1]) for name, g in zip(names[:-2], gathered)}
    run_hooked(layer, batches, takes | {names[-2]: mlp_input}, stop=True)
    down = Gathered(layer.get_submodule(names[-1]).in_features, device, 1, blocks[-1])
    run_hooked(layer.mlp, [(rows, {}) for rows in sample], {"down_proj": lambda i, x: down.add(i, x, {})}, stop=True)
    return gathered + [down]


def search_group(linears: list[torch.nn.Linear], xs: list[torch.Tensor], x_mean: torch.Tensor, kwargs: list[dict],
                 block: Callable | None, h: torch.Tensor, bits: int, group_size: int, sym: bool, *, duo: bool = False,
                 n_grid: int = 20, descent: bool = False) -> torch.Tensor:
    """AWQ's scales for linears sharing an input (mean |x| x_mean, Hessian h), judged by block(x,
    kwargs)'s output on the inputs xs (block_loss; None: output_loss). descent: the block loss only
    descends from the candidate of least output_loss (search_scale's start)."""
    w_mean = weight_mean([lin.weight for lin in linears], group_size) if duo else None
    own = output_loss(linears, h, bits, group_size, sym)
    # each candidate of a block loss costs a block forward per token
    loss = own if block is None else block_loss(linears, xs, kwargs, block, bits, group_size, sym)
    s, _, _ = search_scale(x_mean, loss, n_grid, w_mean, own if block is not None and descent else None,
                           smooth=block is None or descent)
    return s


def block_loss(linears: list[torch.nn.Linear], xs: list[torch.Tensor], kwargs: list[dict], block: Callable,
               bits: int, group_size: int, sym: bool) -> Callable[[torch.Tensor], float]:
    """loss(s): the mean squared change of block(x)'s output with the linears' input channels scaled
    by s and quantized (a forward of the block per candidate; under torchrun, over every process's xs)."""
    reference = [block(x, kw) for x, kw in zip(xs, kwargs)]
    size = sum(ref.numel() for ref in reference)

    def loss(s: torch.Tensor) -> float:
        originals = [lin.weight.data for lin in linears]
        for lin in linears:
            lin.weight.data = fake_quantize(lin.weight * s, bits, group_size, sym).div_(s)
        err = sum(((block(x, kw) - ref).pow(2).sum().item() for x, kw, ref in zip(xs, kwargs, reference)), 0.0)
        for lin, w in zip(linears, originals):
            lin.weight.data = w
        total = distributed.sum_(torch.tensor([err, size], dtype=torch.float64, device=distributed.collective_device()),
                                 "summing AWQ's losses")
        return (total[0] / total[1]).item()
    return loss


def output_loss(linears: list[torch.nn.Linear], h: torch.Tensor, bits: int, group_size: int,
                sym: bool) -> Callable[[torch.Tensor], float]:
    """loss(s): the mean squared change of the linears' own outputs, tr(dW H dW^T) / 2N with H the
    Hessian of their inputs (hessian): a K x K product per candidate instead of a forward over the
    tokens. Where the block is one linear (o_proj, down_proj) this is the block loss itself."""
    w = torch.cat([lin.weight.data for lin in linears])

    def loss(s: torch.Tensor) -> float:
        dw = fake_quantize(w * s, bits, group_size, sym).div_(s).sub_(w)
        return quadratic(dw, h) / (2 * len(w))
    return loss


def quadratic(dw: torch.Tensor, h: torch.Tensor, blocks: int | None = None) -> float:
    """tr(dW H dW^T) for a symmetric H, from H's blocks on and above the diagonal (each pair of input
    blocks once, the off-diagonal ones doubled): about (blocks + 1) / (2 blocks) of the full product.
    By default one block per 1024 inputs, 2 to 8 of them: smaller products lose more to their
    overhead than they save (2 cores: 576 inputs fastest in 2 blocks, 4096 in 2-4, 11008 in 8)."""
    blocks = blocks or max(2, min(8, h.shape[0] // 1024))
    step = -(-h.shape[0] // blocks)
    total = dw.new_zeros((), dtype=torch.float64)
    for a in range(0, h.shape[0], step):
        p = dw[:, a:a + step] @ h[a:a + step, a:]
        total += (p[:, :step] * dw[:, a:a + step]).sum().double() + 2 * (p[:, step:] * dw[:, a + step:]).sum().double()
    return total.item()  # one wait for a GPU per candidate


def quantize_layer(layer: torch.nn.Module, batches, bits: int, group_size: int, sym: bool, duo: bool = False, *,
                   loss: str, n_grid: int = 20, prefix: str = "", search_tokens: int = 8192,
                   block_tokens: int = 2048) -> dict[str, QuantizedTensor]:
    """AWQ on one decoder layer in place: search and fold the scales of each group of linears that
    share an input (o_proj's only without grouped-query attention), search each linear's clipping
    (not q/k: their errors pass through softmax), quantize. Returns the quantized tensors by full
    name. loss "block" judges q/k/v by the attention block's output and gate/up by the MLP's
    (AutoAWQ's losses), on block_tokens tokens (the first windows for attention; for the MLP, which
    works on each token alone, tokens spread over all); "descent" runs the blocks only on a descent
    from the candidate of least output loss; "output" judges them by their own outputs
    (output_loss), without forwards. o_proj and down_proj, whose blocks are themselves, always go
    through output_loss. The output losses and the clipping are judged through each input's Hessian
    over search_tokens tokens spread over the batches."""
    missing = [name for name in AWQ_LAYOUT if not hasattr_path(layer, name)]
    if missing:
        raise QuantkitError(f"AWQ does not know this layer's norm/linear pairing (no {', '.join(missing)}): it "
                            "supports Llama, Mistral and Qwen2-style decoders")
    attn, mlp = layer.self_attn, layer.mlp

    def attention(x, kw):
        return attn(hidden_states=x, **{k: v for k, v in kw.items() if k != "hidden_states"})[0]

    forwards = loss != "output"
    # o_proj's inputs take scales only where each reads a v_proj output of its own: under grouped-query
    # attention one v_proj channel feeds a channel of several heads, and the scale they would share
    # scored worse than none on the embedded model at w4 and tied at w3 (benchmarks/RESULTS.md);
    # AutoAWQ skips it too
    tied = attn.v_proj.out_features != attn.o_proj.in_features
    # for each of GROUPS: the op whose output feeds it (None: not scaled), the block whose output
    # judges it (None: the linears' own outputs)
    feeders = [(layer.input_layernorm, attention if forwards else None),
               (None if tied else attn.v_proj, None),
               (layer.post_attention_layernorm, (lambda x, kw: mlp(x)) if forwards else None),
               (mlp.up_proj, None)]
    linears = [[layer.get_submodule(name) for name in group] for group in GROUPS]
    # the attention's block loss runs on the first windows, the MLP's (token by token) on rows spread over all
    blocks = ["head" if forwards else None, None, "spread" if forwards else None, None]
    inputs = gather(layer, batches, blocks, search_tokens, block_tokens)
    hessians = [g.h.reduce().matrix() for g in inputs]
    # under torchrun a block loss sums every process's forwards, so every process runs those searches
    # together; a search by the output loss alone, and each linear's clipping, need only the summed
    # statistics: the processes run their shares of them at once, then exchange the results
    dev = linears[0][0].weight.device
    scaled = [j for j, (prev, _) in enumerate(feeders) if prev is not None]
    means = {j: inputs[j].mean() for j in scaled}  # each a sum over the processes: for the searches alone

    def search(j: int) -> torch.Tensor:
        return search_group(linears[j], inputs[j].xs, means[j], inputs[j].kwargs, feeders[j][1], hessians[j], bits,
                            group_size, sym, duo=duo, n_grid=n_grid, descent=loss == "descent")

    alone = [j for j in scaled if feeders[j][1] is None]
    found = {j: search(j) for j in scaled if j not in alone}
    found |= {j: search(j) for n, j in enumerate(alone) if distributed.owner(n) == distributed.rank()}
    # every process folds the same scales, each group's from one process
    scales = {j: distributed.shared(found.get(j), distributed.owner(alone.index(j)) if j in alone else 0, dev)
              for j in scaled}
    del inputs, found
    # every scale folded after all searches and before any quantization, as the reference does: o_proj's
    # (where scaled) and down_proj's fold into the rows of v_proj and up_proj, which must be final when
    # quantized
    for j, s in scales.items():
        fold(feeders[j][0], linears[j], s)
        hessians[j].div_(s[:, None]).div_(s[None, :])  # the inputs are now x / s
    names = [name for group in GROUPS for name in group]
    flat = [(lin, h) for lins, h in zip(linears, hessians) for lin in lins]
    mine = {}
    for j, (name, (linear, h)) in enumerate(zip(names, flat)):
        if distributed.owner(j) == distributed.rank():
            bound = None if name in ("self_attn.q_proj", "self_attn.k_proj") else \
                search_clip(linear.weight.data, h, bits, group_size, sym)
            mine[j] = quantize(linear.weight.data, bits, group_size, sym, bound)
    tensors = {}
    for j, (name, (linear, _)) in enumerate(zip(names, flat)):
        qt = distributed.shared(mine.get(j), distributed.owner(j), dev)
        linear.weight.data.copy_(qt.dequantize())
        tensors[f"{prefix}{name}"] = qt
    return tensors


def hasattr_path(module: torch.nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False
