"""What a decoder layer is made of, for the pipeline and the methods: its linears, grouped by the
input they share, and the hooks that read those inputs."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Iterator

if TYPE_CHECKING:
    import torch

# Linears of a decoder layer, grouped by the input they share.
GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
LINEARS = tuple(name for group in GROUPS for name in group)
# the groups vLLM loads as one linear, by that linear's name: they must share their settings
FUSED = {"self_attn.qkv_proj": GROUPS[0], "mlp.gate_up_proj": GROUPS[2]}


def linear_shapes(module: torch.nn.Module) -> Iterator[tuple[str, int, int]]:
    """Each decoder linear's name, outputs and inputs, from the skeleton (no weight is read)."""
    for i, layer in enumerate(module.model.layers):
        for name in LINEARS:
            n, k = layer.get_submodule(name).weight.shape
            yield f"model.layers.{i}.{name}", n, k


def shapes_by_name(module: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """linear_shapes as a mapping: each decoder linear's (outputs, inputs) by name."""
    return {name: (n, k) for name, n, k in linear_shapes(module)}


def fused(names: Iterable[str]) -> dict[str, list[str]]:
    """The groups among the linears names (full names) that vLLM loads as one linear: each one's full
    name and its parts', in the order of names."""
    out = {}
    for name in names:
        for one, parts in FUSED.items():
            if name.endswith(f".{parts[0]}"):
                prefix = name.removesuffix(parts[0])
                out[prefix + one] = [prefix + p for p in parts]
    return out


def on_device(layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A batch of hidden states where the layer is (they may be kept in CPU memory for a GPU run)."""
    return hidden.to(next(layer.parameters()).device, non_blocking=True)


class Captured(Exception):
    """Raised by a hook to end a forward pass once what it needed is captured."""


def linear_inputs(layer: torch.nn.Module, batches, names) -> dict[str, list[torch.Tensor]]:
    """Each named linear's inputs, batch by batch, from one run of the layer."""
    inputs = {name: [] for name in names}
    run_hooked(layer, batches, {name: lambda i, x, name=name: inputs[name].append(x) for name in names})
    return inputs


def run_hooked(layer: torch.nn.Module, batches, takes: dict[str, Callable[[int, torch.Tensor], None]],
               stop: bool = False) -> None:
    """Run the layer on each batch, handing each named linear's input, with the batch's number, to its
    take(i, x); with stop, each run ends at the last name's input (names in the layer's order), since
    nothing after it is needed."""
    handles, last, i = [], list(takes)[-1], 0
    for name, take in takes.items():
        def hook(module, args, name=name, take=take):
            take(i, args[0].detach())  # i: the batch running now
            if stop and name == last:
                raise Captured
        handles.append(layer.get_submodule(name).register_forward_pre_hook(hook))
    try:
        for i, (hidden, kwargs) in enumerate(batches):
            try:
                layer(on_device(layer, hidden), **kwargs)
            except Captured:
                pass
    finally:
        for handle in handles:
            handle.remove()
