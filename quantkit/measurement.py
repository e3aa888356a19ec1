"""Measured mixed precision: the linears of each unit of a decoder layer quantized at each candidate
setting, the error of their block's output measured on the calibration inputs (as ExLlamaV2's
converter measures), then one candidate per unit: the least summed error within a budget of bits
per weight (allocate). It serves EXL2 (units: the attention and MLP blocks; candidates: width mixes
on its grid, exl2.CANDIDATES) and --target-bpw for RTN and GPTQ: in the GPTQ layout, units are the
groups of linears that share an input and candidates the bits and group sizes of GRIDS; in GGUF,
units are single linears (what llama-quantize's --tensor-type types) and candidates the block
types of GGUF_TYPES.

A block's error is weighted by how much the model's loss feels it: each channel's squared output
error times the mean squared gradient of the calibration loss there (the diagonal of the empirical
Fisher), so that an error is in nats, 1/2 E[d^T F d], the predicted rise of the mean next-token
loss. The error relative to the hidden state misjudged blocks wherever a few channels of the
residual stream are huge (massive activations, which the next norm divides away): on the embedded
model it gave layers 0-11 1-2 bits more than the rest and lost to the same widths everywhere
(benchmarks/RESULTS.md). The gradients take one pass of the layers forward and one backward (fisher).

The measurement is saved as JSON, so that one serves any number of targets (ExLlamaV2's converter
keeps its measurement.json too). A file is tied by a key to its model, calibration and quantizer
settings; one of another run is refused."""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import distributed
from . import blocks
from .atomic import check_writable, write_text
from .errors import QuantkitError, option, untrusted
from .layers import GROUPS, LINEARS, on_device
from .modelio import Model
from .pipeline import QuantizeFn, capture_inputs, run_layer
from .requant import fit_row

FORMAT = "quantkit-measurement/3"  # 2: EXL2's, errors relative to the hidden state; 1: per linear
# the blocks of a decoder layer whose output a measurement scores, each with its linears
BLOCKS = {"self_attn": GROUPS[0] + GROUPS[1], "mlp": GROUPS[2] + GROUPS[3]}
# what one setting covers, by name under its layer: EXL2's blocks (ExLlamaV2's converter measures
# them), --target-bpw's groups of linears that share an input (what vLLM fuses stays together), and
# in GGUF each linear alone (llama.cpp types each tensor)
BLOCK_UNITS = BLOCKS
GROUP_UNITS = {"self_attn.qkv": GROUPS[0], "self_attn.o": GROUPS[1], "mlp.gate_up": GROUPS[2], "mlp.down": GROUPS[3]}
LINEAR_UNITS = {name: (name,) for name in LINEARS}
FISHER_WINDOWS = 8  # calibration windows the loss's gradients are taken on; each layer's inputs are kept


@dataclass(frozen=True)
class Grid:
    """A uniform grid in the GPTQ layout: codes of bits, and per group of inputs a float16 scale and
    a packed zero; g_idx of int32 per input."""
    bits: int
    group_size: int

    def total_bits(self, n: int, k: int) -> int:
        return n * k * self.bits + math.ceil(k / self.group_size) * n * (16 + self.bits) + 32 * k


# what --target-bpw tries on each group of linears, narrowest first (2.6 to 8.2 bits per weight)
GRIDS = (Grid(2, 32), Grid(3, 128), Grid(3, 64), Grid(3, 32), Grid(4, 128), Grid(4, 64), Grid(4, 32), Grid(8, 128))


@dataclass(frozen=True)
class BlockType:
    """A llama.cpp block type; rows that do not fill its blocks take llama-quantize's fallback
    (Q4_K rows of 576 values are Q5_0), and are counted as such."""
    type: str

    def of(self, k: int) -> str:
        return fit_row(self.type, k)

    def total_bits(self, n: int, k: int) -> int:
        values, size = blocks.sizes(self.of(k))
        return n * k // values * size * 8


# what --target-bpw tries on each linear of a GGUF file: the types llama.cpp's K-quant mixes are made of
# (2.6 to 8.5 bits per weight)
GGUF_TYPES = tuple(BlockType(t) for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0"))


def unit_of(linear: str, units: dict[str, tuple[str, ...]]) -> str:
    """model.layers.3.self_attn.q_proj -> model.layers.3.self_attn (BLOCK_UNITS) or
    model.layers.3.self_attn.qkv (GROUP_UNITS)"""
    layer, _, name = linear.partition(".layers.")[2].partition(".")
    return f"{linear.partition('.layers.')[0]}.layers.{layer}." + next(u for u, names in units.items() if name in names)


def grouped(shapes: dict[str, tuple[int, int]], units: dict[str, tuple[str, ...]]) -> dict[str, dict[str, tuple[int, int]]]:
    """The linears' shapes grouped by the unit one setting covers."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for name, shape in shapes.items():
        out.setdefault(unit_of(name, units), {})[name] = shape
    return out


@torch.no_grad()
def fisher(m: Model, windows: torch.Tensor, device: torch.device, progress: bool = True) -> dict[str, torch.Tensor]:
    """Each block's diagonal empirical Fisher at its output (the output it adds to the residual
    stream), by block name: the squared gradient of the summed next-token loss of the first
    FISHER_WINDOWS windows, per channel, summed over their tokens and divided by their count,
    float64 [hidden]. The layers run forward keeping their inputs (on the CPU, float32: 8 x 512
    tokens of 4096 channels are 64 MiB a layer), then backward from the output head, each read from
    the checkpoint again and recomputed on its inputs. Under torchrun each process takes a share of
    the windows and the sums are gathered in one order, so any number of processes gives the same."""
    windows = windows[:FISHER_WINDOWS]
    batches = capture_inputs(m, windows, 2, device)
    ids = distributed.share(list(windows.split(2)))
    n = len(m.layers)
    inputs = []
    for i in tqdm(range(n), desc="weighing blocks: forward", unit="layer", disable=not progress, file=sys.stderr):
        layer = m.materialize(f"model.layers.{i}", device)
        inputs.append([h.cpu() for h, _ in batches])  # run_layer replaces the entries: these stay as they were
        run_layer(layer, batches)
        m.release(f"model.layers.{i}")
    tied = m.module.config.tie_word_embeddings
    embedding = m.materialize("model.embed_tokens", device).weight if tied else None
    head = (lambda h: F.linear(h, embedding)) if tied else m.materialize("lm_head", device)
    norm = m.materialize("model.norm", device)
    grads = []
    with torch.enable_grad():
        for (h, _), x in zip(batches, ids):
            h = h.to(device).requires_grad_()
            logits = head(norm(h))
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten().to(device), reduction="sum")
            grads.append(torch.autograd.grad(loss, h)[0])
            del logits, loss
    del head, embedding
    for prefix in ("model.norm", "model.embed_tokens" if tied else "lm_head"):
        m.release(prefix)
    sums = torch.zeros(len(batches), n, len(BLOCKS), m.module.config.hidden_size, dtype=torch.float64)
    for i in tqdm(reversed(range(n)), desc="weighing blocks: backward", unit="layer", total=n, disable=not progress,
                  file=sys.stderr):
        layer = m.materialize(f"model.layers.{i}", device)
        outs = {}
        handles = [layer.self_attn.register_forward_hook(
                       lambda mod, args, out: outs.update(self_attn=out[0] if isinstance(out, tuple) else out)),
                   layer.mlp.register_forward_hook(lambda mod, args, out: outs.update(mlp=out))]
        try:
            with torch.enable_grad():
                for j, (_, kw) in enumerate(batches):
                    x = inputs[i][j].to(device).requires_grad_()
                    y = layer(x, **kw)
                    y = y[0] if isinstance(y, tuple) else y
                    gx, *gb = torch.autograd.grad(y, [x, *(outs[b] for b in BLOCKS)], grad_outputs=grads[j])
                    for b, g in enumerate(gb):
                        sums[j, i, b] = g.double().square().sum((0, 1)).cpu()
                    grads[j] = gx
        finally:
            for handle in handles:
                handle.remove()
        inputs[i] = None
        m.release(f"model.layers.{i}")
    total = distributed.gather_rows(sums, "gathering the loss's gradients").sum(0) / windows.numel()
    return {f"model.layers.{i}.{block}": total[i, b] for i in range(n) for b, block in enumerate(BLOCKS)}


@torch.no_grad()
def measure_layer(layer: torch.nn.Module, batches: list[tuple[torch.Tensor, dict]], hessians: dict,
                  candidates: list[QuantizeFn], weights: torch.Tensor, units: dict[str, tuple[str, ...]],
                  prefix: str = "", labels: list[dict[str, str]] | None = None) -> torch.Tensor:
    """One decoder layer's measurement: the linears of each unit quantized by each candidate (a
    per-linear core: name, weight, Hessian -> QuantizedTensor), the rest of the layer float, and the
    output of the unit's block (BLOCKS) run on the float block's inputs, batch by batch. Returns each
    batch's squared output error weighted per channel by weights ([blocks, hidden], fisher's),
    float64 [batches, units, candidates]. The weights stay float. labels: what each candidate makes of
    each linear, by full name (a GGUF type after llama-quantize's fallback): a candidate whose labels
    for a unit's linears are an earlier one's (Q2_K and Q3_K rows that both fall back to Q4_0) gets
    that one's error, neither quantizing nor running the block again."""
    def attention(x, kw):
        return layer.self_attn(hidden_states=layer.input_layernorm(x), **kw)[0]

    def feed_forward(x, kw):
        return layer.mlp(layer.post_attention_layernorm(x))

    spans = [b for names in units.values() for b, members in enumerate(BLOCKS.values()) if set(names) <= set(members)]
    if len(spans) != len(units):
        raise ValueError(f"each unit's linears must lie in one block of {list(BLOCKS)}: {units}")
    sq = torch.zeros(len(batches), len(units), len(candidates), dtype=torch.float64)
    # the inputs and the float outputs stay where the batches are (the CPU, for a GPU run whose activations do
    # not fit it), each batch moved to the layer as it runs
    inputs = [x for x, _ in batches]
    kwargs = [kw for _, kw in batches]
    for b, (block, members) in enumerate(zip((attention, feed_forward), BLOCKS.values())):
        reference = [block(on_device(layer, x), kw).to(x.device) for x, kw in zip(inputs, kwargs)]
        weight = weights[b].to(next(layer.parameters()).device)
        for u, names in enumerate(units.values()):
            if spans[u] != b:
                continue
            linears = [layer.get_submodule(name) for name in names]
            originals = [lin.weight.data for lin in linears]
            seen: dict[tuple, int] = {}  # the unit's labels -> the first candidate that had them
            try:
                for c, core in enumerate(candidates):
                    key = tuple(labels[c][prefix + name] for name in names) if labels else c
                    if key in seen:  # the same weights: the same error
                        sq[:, u, c] = sq[:, u, seen[key]]
                        continue
                    seen[key] = c
                    for lin, name, w in zip(linears, names, originals):
                        lin.weight.data = core(prefix + name, w, hessians[name]).dequantize().to(w.device, w.dtype)
                    for j, (x, kw, r) in enumerate(zip(inputs, kwargs, reference)):
                        sq[j, u, c] = ((block(on_device(layer, x), kw) - on_device(layer, r)).double().square()
                                       * weight).sum()
            finally:
                for lin, w in zip(linears, originals):
                    lin.weight.data = w
        if b == 0:  # the MLP's inputs: the hidden state after the float attention
            inputs = [x + r for x, r in zip(inputs, reference)]
        del reference
    return sq


class Recorder:
    """The pipeline's writer during a measurement: it writes nothing, and its progress state is
    the errors measured so far, so that a killed measurement resumes after its last layer."""
    written = 0

    def __init__(self):
        self.errors: dict[str, list[float]] = {}

    def add(self, key: str, tensor: torch.Tensor) -> None:
        pass

    def add_quantized(self, name: str, qt) -> None:
        pass

    def start(self, state: dict | None, own: str | None = None) -> None:
        self.errors = dict(state["errors"]) if state else {}

    def resumable(self, state: dict) -> bool:
        return True

    def state(self) -> dict:
        return {"errors": dict(self.errors)}


def check_path(path: str | os.PathLike) -> None:
    """Refuse, before any work, a measurement path that can be neither read nor written."""
    path = Path(path)
    if path.is_dir():
        raise QuantkitError(f"{path} is a directory: pass {option('measurement')} a file name, such as "
                            f"{path / 'measurement.json'}")
    if not path.exists() and not path.parent.is_dir():
        raise QuantkitError(f"{path.parent}: no such directory: create it or choose another {option('measurement')}")
    check_writable(path.parent, "measurement")  # the file, and its progress beside it


def described(settings: tuple) -> list[dict]:
    """The candidates as the file holds them (tuples as lists)."""
    return json.loads(json.dumps([asdict(s) for s in settings]))


def save(path: str | os.PathLike, key: str, source: str, shapes: dict[str, tuple[int, int]],
         units: dict[str, tuple[str, ...]], errors: dict[str, list[float]], settings: tuple) -> None:
    """The measurement at path, complete or not at all."""
    path = Path(path)
    body = {"format": FORMAT, "key": key, "model": source, "candidates": described(settings),
            "units": {unit: {"linears": {name: list(shape) for name, shape in linears.items()}, "errors": errors[unit]}
                      for unit, linears in grouped(shapes, units).items()}}
    write_text(path, json.dumps(body, indent=1))


def read(path: str | os.PathLike, key: str, shapes: dict[str, tuple[int, int]], units: dict[str, tuple[str, ...]],
         settings: tuple) -> dict[str, list[float]]:
    """The errors of a saved measurement, checked to be of this model, calibration and candidates."""
    path = Path(path)
    with untrusted(path, "not a measurement file", f"pass the file a quantkit run with {option('measurement')} saved, "
                   "or a new path to measure into"):
        body = json.loads(path.read_text())
        if isinstance(body, dict) and str(body.get("format")).startswith("quantkit-exl2-measurement/"):
            raise QuantkitError(f"{path} was measured by an older quantkit (errors relative to the hidden state): "
                                f"measure again into a new {option('measurement')} path")
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ValueError(f"its format is not {FORMAT}")
        if body.get("candidates") != described(settings):
            raise QuantkitError(f"{path} was measured over other candidate settings (another format, method or quantkit "
                                f"version): measure again into a new {option('measurement')} path")
        if body.get("key") != key:
            raise QuantkitError(f"{path} is the measurement of another model, calibration or quantizer settings "
                                f"({body.get('model')}), or of calibration windows an older quantkit made otherwise: "
                                f"measure this one into a new {option('measurement')} path, or calibrate and quantize "
                                "as that run did")
        entries = body["units"]
        errors = {}
        for unit, linears in grouped(shapes, units).items():
            entry = entries[unit]
            values = [float(v) for v in entry["errors"]]
            if entry["linears"] != {name: list(shape) for name, shape in linears.items()} or \
                    len(values) != len(settings) or not all(math.isfinite(v) and v >= 0 for v in values):
                raise ValueError(f"its entry for {unit} does not fit the model")
            errors[unit] = values
        return errors


def check_target(shapes: dict[str, tuple[int, int]], target: float, settings: tuple, what: str) -> None:
    """Refuse a target bits per weight that no choice of settings meets; what names the settings."""
    weights = sum(n * k for n, k in shapes.values())
    low = sum(min(s.total_bits(n, k) for s in settings) for n, k in shapes.values()) / weights
    high = sum(max(s.total_bits(n, k) for s in settings) for n, k in shapes.values()) / weights
    if not low <= target <= high:
        raise QuantkitError(f"{target} bits per weight is outside the range of {what} for this model "
                            f"({low:.3f} to {high:.3f}): choose a target in that range")


def allocate(units: dict[str, list[tuple[int, int]]], errors: dict[str, list[float]], target: float,
             settings: tuple, steps: int = 100_000) -> dict:
    """One setting per unit (for all its linears, of the given shapes) with the least summed error
    whose bits, over all the linears' weights, are at most target per weight: a knapsack solved
    exactly over bits rounded up to 1/steps of the budget (one choice per unit, dynamic
    programming), then upgrades by error saved per bit while the exact bits left allow."""
    check_target({f"{name}.{j}": shape for name, shapes in units.items() for j, shape in enumerate(shapes)},
                 target, settings, "these settings")
    names = list(units)
    e = np.array([errors[n] for n in names], dtype=np.float64)
    b = np.array([[sum(s.total_bits(*shape) for shape in units[n]) for s in settings] for n in names],
                 dtype=np.float64)
    budget = target * sum(n * k for shapes in units.values() for n, k in shapes)
    cost = np.ceil(b / budget * steps).astype(np.int64)
    best = np.full(steps + 1, np.inf)  # least error using u steps
    best[0] = 0.0
    choice = np.zeros((len(names), steps + 1), dtype=np.int8)
    for i in range(len(names)):
        new = np.full(steps + 1, np.inf)
        for c in range(len(settings)):
            shifted = np.full(steps + 1, np.inf)
            if cost[i, c] <= steps:
                shifted[cost[i, c]:] = best[:steps + 1 - cost[i, c]] + e[i, c]
            better = shifted < new
            new[better], choice[i, better] = shifted[better], c
        best = new
    rows = np.arange(len(names))
    if np.isfinite(best).any():
        pick, u = np.zeros(len(names), dtype=np.int64), int(np.argmin(best))
        for i in reversed(range(len(names))):
            pick[i] = choice[i, u]
            u -= cost[i, pick[i]]
    else:  # rounding took the narrowest choices over the budget: they are within it unrounded
        pick = np.argmin(b, axis=1)
    left = budget - b[rows, pick].sum()
    while True:
        gain_bits = b - b[rows, pick][:, None]
        saved = e[rows, pick][:, None] - e
        ok = (gain_bits > 0) & (gain_bits <= left) & (saved > 0)
        if not ok.any():
            break
        ratio = np.where(ok, saved / np.where(ok, gain_bits, 1), -1)
        i, c = np.unravel_index(np.argmax(ratio), ratio.shape)
        left -= gain_bits[i, c]
        pick[i] = c
    return {n: settings[c] for n, c in zip(names, pick)}
