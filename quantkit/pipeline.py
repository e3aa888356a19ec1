"""The layer-wise pipeline: calibration inputs go through the decoder one layer at a time.

For each layer: hooks gather what the quantizer needs from each linear's inputs, the linears are
quantized, and the layer is run again so the next layer sees the quantized layer's outputs.
Only one layer's activations are alive at a time.
"""
from __future__ import annotations

from typing import Callable

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
    out = []
    for hidden, kwargs in batches:
        y = layer(hidden, **kwargs)
        out.append((y[0] if isinstance(y, tuple) else y, kwargs))
    return out


def gather_hessians(layer: torch.nn.Module, batches: list[tuple[torch.Tensor, dict]], groups) -> dict[str, Hessian]:
    """One Hessian per input shared by a group of linears, filled by running the layer once."""
    hessians, handles = {}, []
    for group in groups:
        first = layer.get_submodule(group[0])
        h = Hessian(first.in_features)
        handles.append(first.register_forward_pre_hook(lambda m, args, h=h: h.add_batch(args[0])))
        hessians.update({name: h for name in group})
    try:
        run_layer(layer, batches)
    finally:
        for handle in handles:
            handle.remove()
    return hessians


@torch.no_grad()
def quantize_layers(
    model: Model,
    quantize: QuantizeFn,
    windows: torch.Tensor | None = None,
    batch_size: int = 8,
    sequential: bool = False,
    progress: bool = True,
) -> dict[str, QuantizedTensor]:
    """Quantize every decoder linear in place (weights become their dequantized values).

    With windows (LongTensor [n, seqlen]) each linear's quantizer also gets the Hessian of its
    inputs; without, it gets None and no forward pass is made. sequential: q/k/v, then o, then
    gate/up, then down, each group seeing the inputs the already quantized ones produce.
    """
    batches = capture_inputs(model, windows, batch_size) if windows is not None else None
    stages = [(group,) for group in GROUPS] if sequential else [GROUPS]
    tensors = {}
    for i, layer in enumerate(tqdm(model.layers, desc="quantizing layers", unit="layer", disable=not progress)):
        for stage in stages:
            hessians = gather_hessians(layer, batches, stage) if batches is not None else {}
            for name in (name for group in stage for name in group):
                linear = layer.get_submodule(name)
                qt = quantize(f"model.layers.{i}.{name}", linear.weight.data, hessians.get(name))
                linear.weight.data = qt.dequantize(linear.weight.dtype)
                tensors[f"model.layers.{i}.{name}"] = qt
        if batches is not None:
            batches = run_layer(layer, batches)
    return tensors
