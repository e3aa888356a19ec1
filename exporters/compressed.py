"""llm-compressor's compressed-tensors checkpoints in the "pack-quantized" format (quant_method
"compressed-tensors"), what vLLM loads as WNA16 and transformers reads through the compressed-tensors package.

Per quantized linear: weight_packed int32 [N, ceil(K*b/32)] packed along K (element j at bit b*j of
its row's little-endian stream), weight_scale [N, K/G] (channel strategy: [N, 1]), weight_shape
int64 [N, K], and for asymmetric grids weight_zero_point int32 [ceil(N*b/32), K/G] packed along N.
Values are stored as signed codes plus 2^(b-1), which is our unsigned code; a zero point the same
way, which is our zero. W = scale * (stored - 2^(b-1) - zero_point), so W = s * (codes - zeros).
"""
from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from quantkit.config import CODEBOOK_METHODS, QuantConfig
from quantkit.errors import QuantkitError, option
from quantkit.layers import fused, linear_shapes
from quantkit.modelio import Model
from quantkit.packing import pack as pack_stream, unpack as unpack_stream
from quantkit.qtensor import QuantizedTensor, group_index
from quantkit.rules import exact

from . import checkpoint
from .shards import DEFAULT_MAX_SIZE

BITS = (4, 8)  # vLLM's WNA16 kernels; other widths changed layout between compressed-tensors releases


def check(module: torch.nn.Module, qconfig: QuantConfig) -> None:
    """Refuse, before any work, what the format or vLLM's reader of it cannot hold."""
    if qconfig.method in CODEBOOK_METHODS:
        raise QuantkitError(f"pack-quantized compressed-tensors holds integer grids, not {qconfig.method}: "
                            f"use {option('method', 'rtn', 'gptq', 'awq')}, or {option('format', 'safetensors')}")
    if qconfig.act_order and not qconfig.static_groups:
        raise QuantkitError("compressed-tensors no longer reads a g_idx (actorder \"group\" was removed in 0.20): "
                            f"add {option('static_groups', True)} (act-order with groups kept in column order, its "
                            f"actorder \"weight\") or use {option('format', 'safetensors')}")
    shapes = list(linear_shapes(module))
    for name, _, k in shapes:
        c = qconfig.for_linear(name)
        if c is None:
            continue
        where = f" ({name})" if qconfig.rules else ""
        if c.bits not in BITS:
            raise QuantkitError(f"vLLM reads compressed-tensors weights of 4 or 8 bits, not {c.bits}{where}: "
                                f"{ruled(qconfig, name, 'bits', 'use ' + option('bits', 4, 8))}, or "
                                f"{option('format', 'safetensors')}")
        if not c.sym and c.bits != 4:
            raise QuantkitError(f"vLLM reads asymmetric compressed-tensors weights as 4-bit only{where}: "
                                f"{ruled(qconfig, name, 'bits', 'use ' + option('bits', 4))}, or symmetric weights")
        if c.group_size != -1 and k % c.group_size:
            fits = [g for g in (128, 64, 32) if all(k % g == 0 for _, _, k in shapes)]
            hint = option("group_size", fits[0]) if fits else f"{option('group_size', -1)} (per channel)"
            fix = ruled(qconfig, name, "group_size", f"use {hint}")
            raise QuantkitError(f"{name} has {k} inputs, not a multiple of the group size "
                                f"{c.group_size}, which compressed-tensors requires: {fix}")


def ruled(qconfig: QuantConfig, name: str, attr: str, advice: str) -> str:
    """advice, or where the rule that gave the linear its attr is (a setting a rule gave is changed there)."""
    at = qconfig.rule_of(name)
    if at is None or getattr(qconfig.rules[at], attr) is None:
        return advice
    return f"change rule {at + 1} of {option('rules')} (match {qconfig.rules[at].match!r})"


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [R, C] -> int32 [R, ceil(C*bits/32)], each row one little-endian stream of bits-bit values."""
    c = values.shape[1]
    padded = F.pad(values, (0, (-c) % 32))
    return pack_stream(padded.T, bits).T[:, : math.ceil(c * bits / 32)].contiguous()


def unpack(packed: torch.Tensor, bits: int, c: int) -> torch.Tensor:
    """Inverse of pack: int32 [R, W] -> uint8 [R, c]."""
    words = F.pad(packed, (0, (-packed.shape[1]) % bits))  # whole runs of 32 values
    return unpack_stream(words.T.contiguous(), bits).T[:, :c].to(torch.uint8).contiguous()


def pack_tensor(name: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
    if qt.codebook is not None or qt.ggml is not None or qt.act_order:
        raise QuantkitError(f"{name}: pack-quantized holds integer grids with groups in column order")
    n, k = qt.shape
    tensors = {"weight_packed": pack(qt.codes, qt.bits), "weight_scale": qt.scales.half().contiguous(),
               "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not qt.sym:
        tensors["weight_zero_point"] = pack(qt.zeros.T.contiguous(), qt.bits).T.contiguous()
    return tensors


def weights_scheme(c: QuantConfig) -> dict:
    channel = c.group_size == -1
    return {"num_bits": c.bits, "type": "int", "symmetric": c.sym, "strategy": "channel" if channel else "group",
            "group_size": None if channel else c.group_size, "dynamic": False,
            "actorder": "weight" if c.act_order else None}


def quantization_config(qconfig: QuantConfig, names: list[str], head: tuple[int, int] | None = None) -> dict:
    """One config group for the run's settings, targeting every Linear; with rules, one more per other
    setting before it, targeting its linears by exact name (compressed-tensors prefers an exact name to
    a class; the parts vLLM fuses by a pattern, with_fused), and the linears the rules skip ignored.
    lm_head is ignored unless packed (head: its bits and group size), then targeted by name."""
    targets: dict[tuple, list[str]] = {}
    ignore = [] if head else ["lm_head"]
    if head:
        targets[head] = ["lm_head"]
    for name in names:
        c = qconfig.for_linear(name)
        if c is None:
            ignore.append(name)
        elif (c.bits, c.group_size) != (qconfig.bits, qconfig.group_size):
            targets.setdefault((c.bits, c.group_size), []).append(name)
    # the named groups first: transformers' loader takes the first group that matches a module
    schemes = [(replace(qconfig, rules=(), bits=b, group_size=g), with_fused(t)) for (b, g), t in targets.items()] + \
        [(qconfig, ["Linear"])]
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {f"group_{i}": {"targets": t, "weights": weights_scheme(c), "input_activations": None,
                                         "output_activations": None, "format": "pack-quantized"}
                          for i, (c, t) in enumerate(schemes)},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def with_fused(names: list[str]) -> list[str]:
    """A config group's targets: exact names, but the parts of a linear vLLM fuses (q/k/v, gate/up) as
    one pattern that also matches the fused name. vLLM looks that name up, then the class name, where
    "Linear" (contained in QKVParallelLinear) would give it the run's settings, not its parts'."""
    out = list(names)
    for name, parts in fused(names).items():
        if set(parts) <= set(out):
            out = [n for n in out if n not in parts]
            out.append(f"re:{exact([*parts, name])}")
    return out


def writer(model: Model, out: str | Path, qconfig: QuantConfig, overwrite: bool = False,
           max_shard_size: int | str = DEFAULT_MAX_SIZE) -> checkpoint.CheckpointWriter:
    """Called by exporters.open_writer, which has run check; the other tensors in float16."""
    names = [name for name, _, _ in linear_shapes(model.module)]
    return checkpoint.CheckpointWriter(model, out, dtype=torch.float16, pack=pack_tensor,
                                       quantization_config=lambda w: quantization_config(qconfig, names, w.head),
                                       overwrite=overwrite, max_shard_size=max_shard_size, packs_head=True,
                                       qconfig=qconfig)


def scheme(path: Path, group: dict) -> tuple[int, int, bool, bool]:
    """bits, group size (-1: per channel), symmetry and act-order ("weight": static groups) of one
    config group of a pack-quantized checkpoint."""
    w = group.get("weights") or {}
    if group.get("format", "pack-quantized") != "pack-quantized" or w.get("type", "int") != "int" or \
            w.get("strategy") not in ("group", "channel") or group.get("input_activations") or \
            group.get("output_activations") or \
            not isinstance(w.get("num_bits"), int):
        raise QuantkitError(f"{path}: quantkit reads compressed-tensors pack-quantized integer weights in group or "
                            "channel schemes and unquantized activations")
    order = w.get("actorder")
    if order in GROUP_ORDER:
        raise QuantkitError(f"{path}: actorder {order!r} (groups in activation order, a weight_g_idx): quantkit "
                            "reads compressed-tensors checkpoints without one (actorder null or \"weight\"); "
                            "quantize the float model with quantkit instead")
    return (w["num_bits"], w["group_size"] if w["strategy"] == "group" else -1, w.get("symmetric", True),
            order in WEIGHT_ORDER)


# compressed-tensors' ActivationOrdering: "group" (true in older configs, alias "dynamic") stores a
# weight_g_idx; "weight" (alias "static") permutes at quantization only, with groups in plain order
GROUP_ORDER, WEIGHT_ORDER = ("group", "dynamic", True), ("weight", "static")


def schemes(path: Path, qc: dict) -> Callable[[str], tuple[int, int, bool, bool]]:
    """Each linear's scheme by name, as compressed-tensors resolves its config groups: a target naming
    the module exactly first, then a "re:" pattern, then a class name (Linear)."""
    if qc.get("format") not in (None, "pack-quantized"):
        raise QuantkitError(f"{path}: quantkit reads compressed-tensors pack-quantized checkpoints, not {qc.get('format')}")
    if qc.get("kv_cache_scheme"):  # its scales are tensors no layer of ours reads, its cache arithmetic ours does not do
        raise QuantkitError(f"{path}: a quantized KV cache (kv_cache_scheme): quantkit reads weight-only checkpoints; "
                            "quantize the float model with quantkit instead")
    groups = list(qc.get("config_groups", {}).values())
    if not groups:
        raise QuantkitError(f"{path}: the quantization_config has no config_groups: the checkpoint is incomplete")
    by_target = {t: scheme(path, g) for g in groups for t in g.get("targets", [])}

    def of(name: str) -> tuple[int, int, bool, bool]:
        hit = by_target.get(name) or next((v for t, v in by_target.items()
                                           if t.startswith("re:") and re.match(t[3:], name)), None)
        hit = hit or by_target.get("Linear")
        if hit is None:
            raise QuantkitError(f"{path}: no config group targets {name}: the checkpoint is inconsistent")
        return hit

    return of


def read(path: Path, packed: bool = False) -> Model:
    """Load a pack-quantized checkpoint (ours or llm-compressor's): with dequantized float weights, or
    packed, its grids repacked into GPTQLinear layers where that layout holds them (checkpoint.model)."""
    cfg, qc = checkpoint.config(path)
    scheme_of = schemes(path, qc)
    state = checkpoint.read_tensors(path)
    layers, seen = {}, set()
    ignore = qc.get("ignore") or []
    for key in [k for k in state if k.endswith(".weight_packed")]:
        name = key.removesuffix(".weight_packed")
        if any(name == t or t.startswith("re:") and re.match(t[3:], name) for t in ignore):
            raise QuantkitError(f"{path}: {name} is packed where the config ignores it: the checkpoint is "
                                "inconsistent (its consumers would not load it); re-export it")
        bits, group_size, sym, ordered = scheme_of(name)
        seen.add((bits, group_size, sym, ordered))
        parts = checkpoint.take(state, path, name, ("weight_packed", "weight_scale", "weight_shape")
                                + (() if sym else ("weight_zero_point",)))
        words, scales, zp = parts["weight_packed"], parts["weight_scale"], parts.get("weight_zero_point")
        n, k = parts["weight_shape"].tolist()
        ng = 1 if group_size == -1 else k // group_size
        if words.shape != (n, math.ceil(k * bits / 32)) or scales.shape != (n, ng) or \
                (zp is not None and zp.shape != (math.ceil(n * bits / 32), ng)):
            raise QuantkitError(f"{path}: {name}'s tensors do not fit a {n}x{k} weight of {bits} bits in groups of "
                                f"{group_size}: the checkpoint is corrupt")
        zeros = torch.full((n, ng), 1 << (bits - 1), dtype=torch.uint8) if zp is None else \
            unpack(zp.T.contiguous(), bits, n).T.contiguous()
        layers[name] = QuantizedTensor(unpack(words, bits, k), checkpoint.half_scales(scales, path, name), zeros,
                                       group_index(k, group_size), bits, group_size, sym)
    # the run's settings: those of the group targeting every Linear (or the only one); the others as
    # rules (rules_read), so that the model exports again as it was read
    bits, group_size, sym, ordered = next(iter(seen)) if len(seen) == 1 else scheme_of("Linear")
    qconfig = QuantConfig("gptq", bits, group_size, sym, act_order=ordered, static_groups=ordered,
                          rules=checkpoint.rules_read(layers, state, bits, group_size))
    return checkpoint.model(path, cfg, state, layers, qconfig, packed)
