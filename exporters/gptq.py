"""GPTQ checkpoint format (AutoGPTQ/GPTQModel layout), read by transformers+gptqmodel, vLLM and ExLlama.

Per quantized linear: qweight int32 [K*b/32, N] packed along K, qzeros int32 [ng, N*b/32] packed
along N, scales fp16 [ng, N], g_idx int32 [K]. Symmetric exports are `checkpoint_format: gptq` (v1,
zeros stored minus one); asymmetric ones `gptq_v2` (raw zeros), since a v1 zero of 0 would underflow.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from quantkit import __version__
from quantkit.config import METHODS, QuantConfig
from quantkit.errors import QuantkitError, option
from quantkit.modelio import Model
from quantkit.layers import fused, linear_shapes
from quantkit import rules as layer_rules
from quantkit.qlinear import GPTQLinear
from quantkit.qtensor import QuantizedTensor, group_index
from quantkit.rules import parse

from . import checkpoint
from .shards import DEFAULT_MAX_SIZE


def check_shapes(module: torch.nn.Module, qconfig: QuantConfig) -> None:
    """Refuse, before any work, linears the layout cannot pack: K a multiple of 32, N*bits too."""
    for name, n, k in linear_shapes(module):
        c = qconfig.for_linear(name)
        if c is not None and (k % 32 or (n * c.bits) % 32):
            raise QuantkitError(
                f"{name} is {n}x{k}: the GPTQ layout needs in_features a multiple of 32 "
                f"and out_features*bits a multiple of 32: choose another {option('format')} or model"
            )


def quantization_config(qconfig: QuantConfig, act_order: bool, names: list[str] = (),
                        head: tuple[int, int] | None = None) -> dict:
    """head: a packed lm_head's bits and group size (GPTQModel's and vLLM's "lm_head": true)."""
    fmt = "gptq" if qconfig.sym else "gptq_v2"
    rules = dynamic(qconfig, names, head)
    return {
        "quant_method": "gptq",
        "bits": qconfig.bits,
        "group_size": qconfig.group_size,
        "desc_act": act_order,
        "static_groups": qconfig.static_groups,
        "true_sequential": qconfig.true_sequential,
        "damp_percent": qconfig.damp,
        "sym": qconfig.sym,
        "lm_head": head is not None,
        "checkpoint_format": fmt,
        "format": fmt,
        "pack_dtype": "int32",
        "meta": {"quantizer": [f"quantkit:{__version__}"], **qconfig.to_dict()},
        **({"dynamic": rules} if rules else {}),
    }


def setting(c: QuantConfig | None) -> tuple[int, int] | None:
    return None if c is None else (c.bits, c.group_size)


def dynamic(qconfig: QuantConfig, names: list[str], head: tuple[int, int] | None = None) -> dict[str, dict]:
    """The rules as GPTQModel's and vLLM's `dynamic`: the first pattern that re.match-es a module name
    wins; "-:" leaves the module unquantized, "+:" overrides the settings. vLLM reads them in order;
    GPTQModel moves every "-:" first, so the linears left in float are one "-:" of their exact names,
    which takes nothing a "+:" should. vLLM matches the name of a fused linear, which the rules that
    decide its parts need not match (`gate_proj|up_proj`): where the written patterns would give it other
    settings than its parts share, it comes first by exact name. A packed lm_head comes first by exact
    name too where it has settings of its own or a rule's pattern could take it (quantkit's rules decide
    the decoder linears alone)."""
    skipped = [n for n in names if qconfig.for_linear(n) is None]
    patterns = {f"+:.*(?:{r.match})": {k: v for k, v in (("bits", r.bits), ("group_size", r.group_size)) if v is not None}
                for r in qconfig.rules if not r.skip}
    exact = {}
    if head is not None and (head != (qconfig.bits, qconfig.group_size) or qconfig.rules):
        exact["+:lm_head$"] = {"bits": head[0], "group_size": head[1]}
    for name, parts in fused(names).items():
        mine = {setting(qconfig.for_linear(p)) for p in parts}
        # skips are written as their parts' exact names, so only the "+:" patterns can take the fused name
        read = override({"bits": qconfig.bits, "group_size": qconfig.group_size, "dynamic": patterns}, name)
        if len(mine) == 1 and (s := mine.pop()) != (read["bits"], read["group_size"]):
            if s is None:
                skipped.append(name)
            else:
                exact[f"+:{re.escape(name)}$"] = {"bits": s[0], "group_size": s[1]}
    return ({f"-:{layer_rules.exact(skipped)}": {}} if skipped else {}) | exact | patterns


def override(qc: dict, name: str) -> dict | None:
    """A module's settings under a checkpoint's `dynamic` (None: left unquantized)."""
    for pattern, settings in (qc.get("dynamic") or {}).items():
        if re.match(pattern.removeprefix("-:").removeprefix("+:"), name):
            return None if pattern.startswith("-:") else {**qc, **settings}
    return qc


def pack(name: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
    """A quantized linear's checkpoint tensors (symmetric ones as v1: zero - 1 stored)."""
    return GPTQLinear.from_tensor(qt, name=name).packed()


def writer(model: Model, out: str | Path, qconfig: QuantConfig, overwrite: bool = False,
           max_shard_size: int | str = DEFAULT_MAX_SIZE) -> checkpoint.CheckpointWriter:
    """Called by exporters.open_writer, which has checked the shapes; the other tensors in float16."""
    names = [name for name, _, _ in linear_shapes(model.module)]
    return checkpoint.CheckpointWriter(
        model, out, dtype=torch.float16, pack=pack,
        quantization_config=lambda w: quantization_config(qconfig, w.act_order, names, w.head),
        config_copies=("quantize_config.json",), overwrite=overwrite, max_shard_size=max_shard_size, packs_head=True,
        qconfig=qconfig)


def check_settings(path: Path, name: str, layer: GPTQLinear, act_order: bool, static_groups: bool) -> None:
    """The tensors agree with the config's settings that consumers take on trust: a symmetric grid's
    zeros are all its midpoint (converters drop them), and without act-order (or with static groups)
    each input's group is k // G (kernels assume it)."""
    mid = 1 << (layer.bits - 1)
    if layer.sym and not bool((layer.zeros() == mid).all()):
        raise QuantkitError(f"{path}: {name}: quantization_config says sym, but its zero points are not all {mid}: "
                            "fix sym (and checkpoint_format: gptq stores zeros minus one, gptq_v2 as they are) in "
                            "config.json, or re-export it")
    plain = group_index(layer.in_features, layer.group_size)
    if (not act_order or static_groups) and not torch.equal(layer.g_idx.cpu(), plain):
        raise QuantkitError(f"{path}: {name}: g_idx is not k // group_size, as a checkpoint without desc_act (or "
                            "with static_groups) has it: fix desc_act in config.json, or re-export it")


def read(path: Path, packed: bool = False) -> Model:
    """Load a GPTQ checkpoint (ours or another tool's): with dequantized float weights, or packed,
    its linears GPTQLinear layers that hold the file's tensors as they are."""
    cfg, qc = checkpoint.config(path)
    meta = qc.get("meta") or {}  # transformers' GPTQConfig writes null
    bits, group_size, sym = qc["bits"], qc["group_size"], qc.get("sym", True)
    v1 = qc.get("checkpoint_format", qc.get("format", "gptq")) == "gptq"
    state = checkpoint.read_tensors(path)
    layers = {}
    for key in [k for k in state if k.endswith(".qweight")]:
        name = key[: -len(".qweight")]
        mine = override(qc, name)
        if mine is None or (name == "lm_head" and not qc.get("lm_head")):
            said = "lm_head is false" if mine else "dynamic says it is not"
            raise QuantkitError(f"{path}: {name} is quantized where the config's {said}: the checkpoint is "
                                "inconsistent (its consumers would not load it); re-export it")
        tensors = checkpoint.take(state, path, name, [part for part in GPTQLinear.PACKED if part != "g_idx"])
        checkpoint.half_scales(tensors["scales"], path, name)  # the packed layer keeps them; its QuantizedTensor not
        # GPTQ-for-LLaMa's checkpoints hold no g_idx: groups in plain order, as AutoGPTQ's default
        k = tensors["qweight"].shape[0] * 32 // mine["bits"]
        tensors["g_idx"] = state.pop(f"{name}.g_idx", None)
        if tensors["g_idx"] is None:
            tensors["g_idx"] = group_index(k, mine["group_size"]).int()
        layer = layers[name] = GPTQLinear(**tensors, bits=mine["bits"], group_size=mine["group_size"], v1=v1,
                                          sym=mine.get("sym", sym), bias=state.pop(f"{name}.bias", None),
                                          name=f"{path}: {name}")
        check_settings(path, name, layer, mine.get("desc_act", qc.get("desc_act")),
                       mine.get("static_groups", qc.get("static_groups")))
    method = meta.get("method")
    # ours name the rules they were made with; another tool's dynamic becomes rules by exact name
    rules = parse(r, f"{path}: meta.rules") if (r := meta.get("rules")) else \
        checkpoint.rules_read(layers, state, bits, group_size)
    # rules go with RTN and GPTQ grids: another method's mixed checkpoint reads as the grids it holds
    method = method if method in METHODS and (not rules or method in ("rtn", "gptq")) else "gptq"
    qconfig = QuantConfig(method, bits, group_size, sym,
                          act_order=bool(qc.get("desc_act")), static_groups=bool(qc.get("static_groups")), rules=rules)
    return checkpoint.model(path, cfg, state, layers, qconfig, packed)
