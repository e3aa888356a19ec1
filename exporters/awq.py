"""AutoAWQ's GEMM checkpoint layout (quant_method "awq", version "gemm"), read by transformers with
autoawq or gptqmodel, and by vLLM's `awq`.

Per quantized linear: qweight int32 [K, N/8] and qzeros int32 [K/G, N/8], both packed along N in
AWQ's interleaved order (nibble i of word c holds column 8c + ORDER[i]), scales fp16 [K/G, N].
4-bit only, no g_idx, so no act-order and no shorter last group.
"""
from __future__ import annotations

from pathlib import Path

import torch

from quantkit.config import QuantConfig
from quantkit.errors import QuantkitError, option
from quantkit.modelio import Model
from quantkit.layers import linear_shapes
from quantkit.qtensor import QuantizedTensor, group_index

from . import checkpoint
from .shards import DEFAULT_MAX_SIZE

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack(values: torch.Tensor) -> torch.Tensor:
    """uint8 [R, N] (4-bit values) -> int32 [R, N/8], interleaved as AutoAWQ packs."""
    v = values.to(torch.int64).view(values.shape[0], -1, 8)[:, :, list(ORDER)]
    words = (v << (4 * torch.arange(8))).sum(dim=-1)
    return (words - (words >> 31 << 32)).to(torch.int32)  # as signed 32-bit words


def unpack(packed: torch.Tensor) -> torch.Tensor:
    w = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = (w[:, :, None] >> (4 * torch.arange(8))) & 15  # [R, N/8, 8] in packed order
    out = torch.empty_like(nibbles)
    out[:, :, list(ORDER)] = nibbles
    return out.reshape(packed.shape[0], -1).to(torch.uint8)


def check(module: torch.nn.Module, qconfig: QuantConfig) -> None:
    """Refuse, before any work, what the layout cannot hold."""
    if qconfig.bits != 4:
        raise QuantkitError(f"the AWQ GEMM layout holds 4-bit weights only, not {qconfig.bits}-bit: "
                            f"use {option('bits', 4)} or {option('format', 'safetensors')}")
    if qconfig.group_size == -1:
        raise QuantkitError(f"the AWQ GEMM layout needs one group size for every linear: use "
                            f"{option('group_size', 64, 32, 128)} or {option('format', 'safetensors')}")
    if qconfig.act_order and not qconfig.static_groups:
        raise QuantkitError(f"the AWQ GEMM layout has no g_idx, so no act-order with its groups reordered: "
                            f"add {option('static_groups', True)}, drop {option('act_order', True)} or use "
                            f"{option('format', 'safetensors')}")
    for name, n, k in linear_shapes(module):
        if k % qconfig.group_size or n % 8:
            raise QuantkitError(
                f"{name} is {n}x{k}: the AWQ GEMM layout needs the group size to divide "
                f"in_features and out_features a multiple of 8: choose "
                f"{option('group_size', 64 if k % 64 == 0 else 32)} or {option('format', 'safetensors')} (the GPTQ "
                "layout allows a shorter last group)")


def pack_tensor(name: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
    if qt.act_order or qt.codebook is not None:
        raise QuantkitError(f"{name}: the AWQ GEMM layout holds plain group-wise integer grids only")
    return {"qweight": pack(qt.codes.T.contiguous()), "qzeros": pack(qt.zeros.T.contiguous()),
            "scales": qt.scales.T.contiguous()}


def quantization_config(qconfig: QuantConfig) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": qconfig.group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def writer(model: Model, out: str | Path, qconfig: QuantConfig, overwrite: bool = False,
           max_shard_size: int | str = DEFAULT_MAX_SIZE) -> checkpoint.CheckpointWriter:
    """Called by exporters.open_writer, which has run check; the other tensors in float16."""
    return checkpoint.CheckpointWriter(model, out, dtype=torch.float16, pack=pack_tensor,
                                       quantization_config=lambda w: quantization_config(qconfig),
                                       overwrite=overwrite, max_shard_size=max_shard_size)


def read(path: Path, packed: bool = False) -> Model:
    """Load an AWQ GEMM checkpoint (ours or AutoAWQ's): with dequantized float weights, or packed, its
    grids repacked into GPTQLinear layers where that layout holds them (checkpoint.model)."""
    cfg, qc = checkpoint.config(path)
    bits, group_size = qc.get("bits", qc.get("w_bit", 4)), qc.get("group_size", qc.get("q_group_size", 128))
    if bits != 4 or str(qc.get("version", "gemm")).lower() != "gemm":
        raise QuantkitError(f"{path}: AWQ {bits}-bit {qc.get('version')}: quantkit reads the 4-bit GEMM layout")
    state = checkpoint.read_tensors(path)
    layers = {}
    for key in [k for k in state if k.endswith(".qweight")]:
        name = key.removesuffix(".qweight")
        qweight, qzeros, scales = checkpoint.take(state, path, name, ("qweight", "qzeros", "scales")).values()
        codes, zeros = unpack(qweight).T.contiguous(), unpack(qzeros).T.contiguous()
        k = codes.shape[1]
        if zeros.shape != scales.T.shape or k % group_size:
            raise QuantkitError(f"{path}: {name} has qzeros {tuple(qzeros.shape)} and scales {tuple(scales.shape)}, which "
                                f"do not fit {k} inputs in groups of {group_size}: the checkpoint is corrupt")
        layers[name] = QuantizedTensor(codes, checkpoint.half_scales(scales.T.contiguous(), path, name), zeros,
                                       group_index(k, group_size), 4, group_size, False)
    rules = checkpoint.rules_read(layers, state, 4, group_size)  # modules_to_not_convert, held in float
    # rules go with RTN and GPTQ grids (AWQ's search takes one setting): a mixed checkpoint reads as the
    # grids its tensors are
    qconfig = QuantConfig("gptq" if rules else "awq", 4, group_size, sym=False, rules=rules)
    return checkpoint.model(path, cfg, state, layers, qconfig, packed)
