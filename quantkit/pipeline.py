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

from .errors import QuantkitError
from .modelio import Model
from .qtensor import QuantizedTensor
from .quantizers import awq

# Linears of a decoder layer, grouped by the input they share.
GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
LINEARS = tuple(name for group in GROUPS for name in group)

QuantizeFn = Callable[[str, torch.Tensor, "Hessian | None"], QuantizedTensor]
# a whole layer at once (AWQ): (index, layer, its input batches) -> quantized tensors by name
LayerFn = Callable[[int, torch.nn.Module, list], dict[str, QuantizedTensor]]


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


def linear_inputs(layer: torch.nn.Module, batches, names) -> dict[str, list[torch.Tensor]]:
    """Each named linear's inputs, batch by batch, from one run of the layer."""
    inputs, handles = {name: [] for name in names}, []
    for name in names:
        hook = lambda module, args, name=name: inputs[name].append(args[0].detach())  # noqa: E731
        handles.append(layer.get_submodule(name).register_forward_pre_hook(hook))
    try:
        for hidden, kwargs in batches:
            layer(hidden, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return inputs


def kv_channels(attn: torch.nn.Module) -> torch.Tensor:
    """For each input channel of o_proj, the output channel of v_proj it reads (grouped-query attention:
    query heads share a kv head), so a scale folded into v_proj is shared by those o_proj channels."""
    hd, n_kv = attn.head_dim, attn.v_proj.out_features // attn.head_dim
    heads = attn.o_proj.in_features // hd
    kv_head = torch.arange(heads) // (heads // n_kv)
    return (kv_head[:, None] * hd + torch.arange(hd)).reshape(-1)


def fold(prev: torch.nn.Module, linears: list[torch.nn.Linear], s: torch.Tensor, s_full: torch.Tensor) -> None:
    """Scale the linears' input channels by s_full and the op that feeds them (a norm's weight, or a
    linear's output rows) by 1/s: the float function is unchanged."""
    if isinstance(prev, torch.nn.Linear):
        prev.weight.data /= s[:, None]
        if prev.bias is not None:
            prev.bias.data /= s
    else:
        prev.weight.data /= s
    for lin in linears:
        lin.weight.data *= s_full


AWQ_LAYOUT = ("input_layernorm", "post_attention_layernorm", *LINEARS)


def search_group(prev: torch.nn.Module, linears: list[torch.nn.Linear], xs: list[torch.Tensor], kwargs: list[dict],
                 block: Callable, channels: torch.Tensor | None, bits: int, group_size: int, sym: bool,
                 duo: bool = False, n_grid: int = 20, search_tokens: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's scale search for linears sharing the inputs xs (one tensor per batch), judged by
    block(x, kwargs)'s output on the first batches that hold search_tokens tokens (the mean |x| uses
    them all). channels maps each input channel to the output channel of prev that feeds it
    (grouped-query attention), or None. Returns prev's scales and the linears' scales."""
    x_mean = sum(x.abs().reshape(-1, x.shape[-1]).sum(0) for x in xs) / sum(x[..., 0].numel() for x in xs)
    w_mean = awq.weight_mean([lin.weight for lin in linears], group_size) if duo else None
    if channels is not None:  # one scale per output channel of prev: average what shares it
        count = torch.bincount(channels).float()
        x_mean = torch.zeros(len(count)).index_add_(0, channels, x_mean) / count
        w_mean = torch.zeros(len(count)).index_add_(0, channels, w_mean) / count if duo else None
    full = (lambda s: s[channels]) if channels is not None else (lambda s: s)
    tokens = torch.tensor([x[..., 0].numel() for x in xs]).cumsum(0)
    n = max(1, int((tokens <= search_tokens).sum()))  # each candidate costs a block forward per token
    xs, kwargs = xs[:n], kwargs[:n]
    reference = [block(x, kw) for x, kw in zip(xs, kwargs)]

    def loss(s: torch.Tensor) -> float:
        originals = [lin.weight.data for lin in linears]
        for lin in linears:
            lin.weight.data = awq.fake_quantize(lin.weight * full(s), bits, group_size, sym) / full(s)
        err = sum((block(x, kw) - ref).pow(2).sum().item() for x, kw, ref in zip(xs, kwargs, reference))
        for lin, w in zip(linears, originals):
            lin.weight.data = w
        return err / sum(ref.numel() for ref in reference)

    s, _, _ = awq.search_scale(x_mean, loss, n_grid, w_mean)
    return s, full(s)


def awq_layer(layer: torch.nn.Module, batches, bits: int, group_size: int, sym: bool, duo: bool = False,
              n_grid: int = 20, clip_tokens: int = 512, prefix: str = "") -> dict[str, QuantizedTensor]:
    """AWQ on one decoder layer in place: search and fold the scales of each group of linears that
    share an input, search each linear's clipping (not q/k: their errors pass through softmax),
    quantize. Returns the quantized tensors by full name."""
    missing = [name for name in AWQ_LAYOUT if not hasattr_path(layer, name)]
    if missing:
        raise QuantkitError(f"AWQ does not know this layer's norm/linear pairing (no {', '.join(missing)}): it "
                            "supports Llama, Mistral and Qwen2-style decoders")
    attn, mlp = layer.self_attn, layer.mlp
    inputs = linear_inputs(layer, batches, [group[0] for group in GROUPS])  # a group's input is its first linear's
    kwargs = [kw for _, kw in batches]

    def attention(x, kw):
        return attn(hidden_states=x, **{k: v for k, v in kw.items() if k != "hidden_states"})[0]

    # for each of GROUPS: the op whose output feeds it, the block whose output judges it, the channel map
    feeders = [(layer.input_layernorm, attention, None),
               (attn.v_proj, lambda x, kw: attn.o_proj(x), kv_channels(attn)),
               (layer.post_attention_layernorm, lambda x, kw: mlp(x), None),
               (mlp.up_proj, lambda x, kw: mlp.down_proj(x), None)]
    linears = [[layer.get_submodule(name) for name in group] for group in GROUPS]
    scales = [search_group(prev, lins, inputs[group[0]], kwargs, block, channels, bits, group_size, sym, duo, n_grid)
              for group, lins, (prev, block, channels) in zip(GROUPS, linears, feeders)]
    # folded after all searches, as the reference does
    for group, lins, (prev, _, _), (s, s_full) in zip(GROUPS, linears, feeders, scales):
        fold(prev, lins, s, s_full)
        inputs[group[0]] = [x / s_full for x in inputs[group[0]]]
    tensors = {}
    for group in GROUPS:
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs[group[0]]])
        x = x[:: max(1, len(x) // clip_tokens)]
        for name in group:
            linear = layer.get_submodule(name)
            bound = None if name in ("self_attn.q_proj", "self_attn.k_proj") else \
                awq.search_clip(linear.weight.data, x, bits, group_size)
            qt = awq.quantize(linear.weight.data, bits, group_size, sym, bound)
            linear.weight.data.copy_(qt.dequantize())
            tensors[f"{prefix}{name}"] = qt
    return tensors


def hasattr_path(module: torch.nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


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


def save_progress(path: Path, key: str, next_layer: int, tensors: dict, batches, other: dict) -> None:
    state = {"key": key, "next_layer": next_layer, "tensors": {n: asdict(qt) for n, qt in tensors.items()},
             "batches": batches, "other": other}
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
    quantize: QuantizeFn | None,
    windows: torch.Tensor | None = None,
    batch_size: int = 8,
    sequential: bool = False,
    progress: bool = True,
    resume: tuple[Path, str] | None = None,
    layer_fn: LayerFn | None = None,
) -> dict[str, QuantizedTensor]:
    """Quantize every decoder linear in place (weights become their dequantized values).

    With windows (LongTensor [n, seqlen]) each linear's quantizer also gets the Hessian of its
    inputs; without, it gets None and no forward pass is made. sequential: q/k/v, then o, then
    gate/up, then down, each group seeing the inputs the already quantized ones produce.
    resume (path, key): after each layer the state is saved there; a run with the same key
    starts after the last finished layer. layer_fn, when given, quantizes each layer whole instead.
    """
    tensors, start = {}, 0
    state = load_progress(*resume) if resume else None
    if state is not None:
        start, batches = state["next_layer"], state["batches"]
        tensors = {name: QuantizedTensor.from_dict(d) for name, d in state["tensors"].items()}
        for name, qt in tensors.items():
            linear = model.module.get_submodule(name)
            linear.weight.data.copy_(qt.dequantize())
        model.module.load_state_dict(state["other"], strict=False)  # norms and biases AWQ rescaled
        print(f"resuming after layer {start}/{len(model.layers)} from {resume[0]}", file=sys.stderr)
    else:
        batches = capture_inputs(model, windows, batch_size) if windows is not None else None
    stages = [(group,) for group in GROUPS] if sequential else [GROUPS]
    bar = tqdm(range(start, len(model.layers)), desc="quantizing layers", unit="layer", initial=start,
               total=len(model.layers), disable=not progress)
    for i in bar:
        layer = model.layers[i]
        attention = None  # the attention block's outputs, once they are final
        if layer_fn is not None:
            tensors.update(layer_fn(i, layer, batches))
        for stage in stages if layer_fn is None else ():
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
            other = {k: v for k, v in model.module.state_dict().items()
                     if k.startswith("model.layers.") and k.removesuffix(".weight") not in tensors}
            save_progress(resume[0], resume[1], i + 1, tensors, batches, other)
    return tensors
