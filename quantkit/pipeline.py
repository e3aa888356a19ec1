"""The layer-wise pipeline: calibration inputs go through the decoder one layer at a time.

For each layer: hooks gather what the quantizer needs from each linear's inputs, the linears are
quantized, and the layer is run again so the next layer sees the quantized layer's outputs.
Only one layer's activations are alive at a time.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from .modelio import Model
from .qtensor import QuantizedTensor

# Linears of a decoder layer, grouped by the input they share.
GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
LINEARS = tuple(name for group in GROUPS for name in group)

QuantizeFn = Callable[[str, torch.Tensor, "Hessian | None"], QuantizedTensor]


class Hessian:
    """Running H = 2 X^T X / n of one linear's inputs: float32 products, float64 sum."""

    def __init__(self, cols: int):
        self.sum = torch.zeros(cols, cols, dtype=torch.float64)
        self.count = 0

    def add_batch(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.sum += (x.T @ x).double()
        self.count += x.shape[0]

    def matrix(self) -> torch.Tensor:
        return (2 * self.sum / max(self.count, 1)).float()


class _Captured(Exception):
    pass


def capture_inputs(model: Model, windows: torch.Tensor, batch_size: int) -> list[tuple[torch.Tensor, dict]]:
    """The first decoder layer's inputs (hidden states and keyword arguments), one entry per batch."""
    captured = []

    def grab(module, args, kwargs):
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kwargs.pop("past_key_values", None)
        kwargs["use_cache"] = False
        captured.append((hidden.detach(), kwargs))
        raise _Captured

    handle = model.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for batch in windows.split(batch_size):
            try:
                model.module(batch, use_cache=False)
            except _Captured:
                pass
    finally:
        handle.remove()
    return captured


def run_layer(layer: torch.nn.Module, batches: list[tuple[torch.Tensor, dict]]) -> list[tuple[torch.Tensor, dict]]:
    """Replace each batch's hidden states by the layer's output, in place: one copy alive at a time."""
    for j, (hidden, kwargs) in enumerate(batches):
        y = layer(hidden, **kwargs)
        batches[j] = (y[0] if isinstance(y, tuple) else y, kwargs)
    return batches


def gather_hessians(layer: torch.nn.Module, batches: list[tuple[torch.Tensor, dict]], groups,
                    keep: str | None = None) -> tuple[dict[str, Hessian], list[torch.Tensor]]:
    """One Hessian per input shared by a group of linears, filled by running the layer once;
    the run stops at the last group's input, since nothing after it is needed. The inputs of the
    linear named keep are returned too."""
    hessians, handles, kept = {}, [], []
    for group in groups:
        first = layer.get_submodule(group[0])
        h = Hessian(first.in_features)

        def hook(module, args, h=h, last=group is groups[-1], keep=group[0] == keep):
            h.add_batch(args[0])
            if keep:
                kept.append(args[0])
            if last:
                raise _Captured

        handles.append(first.register_forward_pre_hook(hook))
        hessians.update({name: h for name in group})
    try:
        for hidden, kwargs in batches:
            try:
                layer(hidden, **kwargs)
            except _Captured:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return hessians, kept


@contextmanager
def replaying_attention(layer: torch.nn.Module, outputs: list[torch.Tensor] | None) -> Iterator[None]:
    """Once q/k/v/o are quantized the attention block's output is fixed: hand out the cached
    outputs, batch by batch, instead of recomputing q/k/v and attention on every later pass."""
    if outputs is None:
        yield
        return
    queue = iter(outputs)
    layer.self_attn.forward = lambda *args, **kwargs: (next(queue), None)
    try:
        yield
    finally:
        del layer.self_attn.forward  # the class's forward again


def save_progress(path: Path, key: str, next_layer: int, tensors: dict, batches) -> None:
    state = {"key": key, "next_layer": next_layer, "tensors": {n: asdict(qt) for n, qt in tensors.items()},
             "batches": batches}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def load_progress(path: Path, key: str) -> dict | None:
    """The state saved after the last finished layer of the same run (same model, config, data)."""
    if not path.is_file():
        return None
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:  # a file cut short by a kill: start afresh
        print(f"ignoring unreadable progress file {path} ({type(e).__name__})", file=sys.stderr)
        return None
    if state.get("key") != key:
        print(f"ignoring progress file {path}: it is from another model, configuration or calibration set",
              file=sys.stderr)
        return None
    return state


@torch.no_grad()
def quantize_layers(
    model: Model,
    quantize: QuantizeFn,
    windows: torch.Tensor | None = None,
    batch_size: int = 8,
    sequential: bool = False,
    progress: bool = True,
    resume: tuple[Path, str] | None = None,
) -> dict[str, QuantizedTensor]:
    """Quantize every decoder linear in place (weights become their dequantized values).

    With windows (LongTensor [n, seqlen]) each linear's quantizer also gets the Hessian of its
    inputs; without, it gets None and no forward pass is made. sequential: q/k/v, then o, then
    gate/up, then down, each group seeing the inputs the already quantized ones produce.
    resume (path, key): after each layer the state is saved there; a run with the same key
    starts after the last finished layer.
    """
    tensors, start = {}, 0
    state = load_progress(*resume) if resume else None
    if state is not None:
        start, batches = state["next_layer"], state["batches"]
        tensors = {name: QuantizedTensor(**d) for name, d in state["tensors"].items()}
        for name, qt in tensors.items():
            linear = model.module.get_submodule(name)
            linear.weight.data.copy_(qt.dequantize())
        print(f"resuming after layer {start}/{len(model.layers)} from {resume[0]}", file=sys.stderr)
    else:
        batches = capture_inputs(model, windows, batch_size) if windows is not None else None
    stages = [(group,) for group in GROUPS] if sequential else [GROUPS]
    bar = tqdm(range(start, len(model.layers)), desc="quantizing layers", unit="layer", initial=start,
               total=len(model.layers), disable=not progress)
    for i in bar:
        layer = model.layers[i]
        attention = None  # the attention block's outputs, once they are final
        for stage in stages:
            hessians, o_inputs = {}, []
            if batches is not None:
                # o_proj's inputs are final when q/k/v were quantized in an earlier stage
                keep = "self_attn.o_proj" if stage == (("self_attn.o_proj",),) else None
                with replaying_attention(layer, attention):
                    hessians, o_inputs = gather_hessians(layer, batches, stage, keep)
            for name in (name for group in stage for name in group):
                linear = layer.get_submodule(name)
                qt = quantize(f"model.layers.{i}.{name}", linear.weight.data, hessians.get(name))
                linear.weight.data.copy_(qt.dequantize())  # in place: no second copy of the layer
                tensors[f"model.layers.{i}.{name}"] = qt
            if o_inputs:
                attention = [layer.self_attn.o_proj(x) for x in o_inputs]
        if batches is not None:
            with replaying_attention(layer, attention):
                batches = run_layer(layer, batches)
        if resume:
            save_progress(resume[0], resume[1], i + 1, tensors, batches)
    return tensors
