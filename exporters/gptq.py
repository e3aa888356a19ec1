"""GPTQ checkpoint format (AutoGPTQ/GPTQModel layout), read by transformers+gptqmodel, vLLM and ExLlama.

Per quantized linear: qweight int32 [K*b/32, N] packed along K, qzeros int32 [ng, N*b/32] packed
along N, scales fp16 [ng, N], g_idx int32 [K]. Symmetric exports are `checkpoint_format: gptq` (v1,
zeros stored minus one); asymmetric ones `gptq_v2` (raw zeros), since a v1 zero of 0 would underflow.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoConfig

from quantkit import __version__
from quantkit.config import METHODS, QuantConfig
from quantkit.errors import QuantkitError
from quantkit.modelio import Model, load_tokenizer
from quantkit.pipeline import LINEARS
from quantkit.qtensor import QuantizedTensor

from . import checkpoint


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned values [R, C] along R: each run of 32 values is one 32*bits-bit little-endian
    stream, value i at bit bits*i (3-bit values 10 and 21 straddle words). Returns int32 [R*bits/32, C]."""
    r, c = values.shape
    v = values.numpy().astype(np.uint64).reshape(r // 32, 32, c)
    out = np.zeros((r // 32, bits, c), dtype=np.uint64)
    for i in range(32):
        word, off = divmod(bits * i, 32)
        out[:, word] |= (v[:, i] << np.uint64(off)) & np.uint64(0xFFFFFFFF)
        if off + bits > 32:
            out[:, word + 1] |= v[:, i] >> np.uint64(32 - off)
    return torch.from_numpy(out.reshape(r // 32 * bits, c).astype(np.uint32).view(np.int32))


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack: int32 [R*bits/32, C] -> uint8 [R, C]."""
    p = packed.numpy().view(np.uint32).astype(np.uint64)
    p = p.reshape(p.shape[0] // bits, bits, p.shape[1])
    out = np.zeros((p.shape[0], 32, p.shape[2]), dtype=np.uint64)
    for i in range(32):
        word, off = divmod(bits * i, 32)
        x = p[:, word] >> np.uint64(off)
        if off + bits > 32:
            x |= p[:, word + 1] << np.uint64(32 - off)
        out[:, i] = x & np.uint64(2**bits - 1)
    return torch.from_numpy(out.reshape(-1, p.shape[2]).astype(np.uint8))


def check_shapes(module: torch.nn.Module, bits: int) -> None:
    """Refuse, before any work, linears the layout cannot pack: K a multiple of 32, N*bits too."""
    for i, layer in enumerate(module.model.layers):
        for name in LINEARS:
            n, k = layer.get_submodule(name).weight.shape
            if k % 32 or (n * bits) % 32:
                raise QuantkitError(
                    f"model.layers.{i}.{name} is {n}x{k}: the GPTQ layout needs in_features a multiple of 32 "
                    f"and out_features*bits a multiple of 32: choose another --format or model"
                )


def quantization_config(qconfig: QuantConfig, act_order: bool) -> dict:
    fmt = "gptq" if qconfig.sym else "gptq_v2"
    return {
        "quant_method": "gptq",
        "bits": qconfig.bits,
        "group_size": qconfig.group_size,
        "desc_act": act_order,
        "static_groups": qconfig.static_groups,
        "true_sequential": qconfig.true_sequential,
        "damp_percent": qconfig.damp,
        "sym": qconfig.sym,
        "lm_head": False,
        "checkpoint_format": fmt,
        "format": fmt,
        "pack_dtype": "int32",
        "meta": {"quantizer": [f"quantkit:{__version__}"], **qconfig.to_dict()},
    }


def tensors_of(model: Model) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint: packed quantized linears, the rest in float16."""
    qc = model.qconfig
    out = {}
    for name, qt in tqdm(model.tensors.items(), desc="packing", unit="linear", file=sys.stderr):
        zeros = qt.zeros.int() - (1 if qc.sym else 0)  # v1 stores zero - 1
        out[f"{name}.qweight"] = pack(qt.codes.T.contiguous(), qt.bits)
        out[f"{name}.qzeros"] = pack(zeros, qt.bits).T.contiguous()
        out[f"{name}.scales"] = qt.scales.T.contiguous()
        out[f"{name}.g_idx"] = qt.g_idx
    return out | checkpoint.plain_tensors(model, torch.float16)


def write(model: Model, out: str | Path, overwrite: bool = False) -> Path:
    """Called by exporters.export, which has checked the model and the shapes."""
    act_order = any(qt.act_order for qt in model.tensors.values())
    qcfg = quantization_config(model.qconfig, act_order)
    return checkpoint.write(model, out, overwrite, tensors_of(model), qcfg, torch.float16,
                            {"quantize_config.json": qcfg})


def read(path: Path) -> Model:
    """Load a GPTQ checkpoint (ours or another tool's) as a Model with dequantized float weights."""
    cfg = AutoConfig.from_pretrained(path)
    qc = cfg.quantization_config
    del cfg.quantization_config  # transformers would hand it to gptqmodel
    bits, group_size, sym = qc["bits"], qc["group_size"], qc.get("sym", True)
    v1 = qc.get("checkpoint_format", qc.get("format", "gptq")) == "gptq"
    state = checkpoint.read_tensors(path)
    tensors = {}
    for key in [k for k in state if k.endswith(".qweight")]:
        name = key[: -len(".qweight")]
        try:
            qweight, qzeros = state.pop(f"{name}.qweight"), state.pop(f"{name}.qzeros")
            scales, g_idx = state.pop(f"{name}.scales"), state.pop(f"{name}.g_idx")
        except KeyError as e:
            raise QuantkitError(f"{path}: {name} lacks {e.args[0]}: the checkpoint is incomplete; re-export it") from None
        k, n = g_idx.shape[0], scales.shape[1]
        if qweight.shape != (k * bits // 32, n) or qzeros.shape != (scales.shape[0], n * bits // 32):
            raise QuantkitError(
                f"{path}: {name} has qweight {tuple(qweight.shape)} and qzeros {tuple(qzeros.shape)}, which do not fit "
                f"{bits}-bit {k}x{n} with {scales.shape[0]} groups: the checkpoint is corrupt or its config wrong"
            )
        zeros = unpack(qzeros.T.contiguous(), bits).int()
        if v1:
            zeros = (zeros + 1) & (2**bits - 1)  # as every v1 loader does
        qt = QuantizedTensor(
            codes=unpack(qweight, bits).T.contiguous(),
            scales=scales.T.contiguous().half(),
            zeros=zeros.to(torch.uint8),
            g_idx=g_idx.int(),
            bits=bits,
            group_size=group_size,
            sym=sym,
        )
        tensors[name] = qt
        state[f"{name}.weight"] = qt.dequantize()
    module = checkpoint.build(path, cfg, state)
    method = qc.get("meta", {}).get("method")
    qconfig = QuantConfig(method if method in METHODS else "gptq", bits, group_size, sym,
                          act_order=bool(qc.get("desc_act")), static_groups=bool(qc.get("static_groups")))
    return Model(module, load_tokenizer(path), str(path), tensors, qconfig)
