"""bitsandbytes 4-bit checkpoints as transformers saves them (quant_method "bitsandbytes", load_in_4bit).

Per quantized linear P: P.weight uint8 [ceil(N*K/2), 1] (the row-major codes, two per byte, the
first in the high nibble), P.weight.absmax float32 (uint8 codes with double quantization),
P.weight.quant_map float32 [16], with double quantization P.weight.nested_absmax and
P.weight.nested_quant_map, and P.weight.quant_state.bitsandbytes__<type>: the rest as JSON bytes.
The other tensors keep the model's dtype, which is also the dtype the weights dequantize to.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, BitsAndBytesConfig

from quantkit.config import QuantConfig
from quantkit.errors import QuantkitError
from quantkit.modelio import Model, load_tokenizer
from quantkit.qtensor import QuantizedTensor
from quantkit.quantizers import nf4

from . import checkpoint


def pack(qt: QuantizedTensor) -> torch.Tensor:
    """Row-major codes two per byte, first in the high nibble; an odd count is padded with the code of 0."""
    codes = qt.codes.reshape(-1)
    if codes.numel() % 2:
        pad = torch.argmin(qt.codebook.abs()).to(torch.uint8)
        codes = torch.cat([codes, pad[None]])
    return ((codes[::2] << 4) | codes[1::2])[:, None]


def unpack(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    p = packed.reshape(-1)
    codes = torch.stack([p >> 4, p & 15], dim=1).reshape(-1)
    return codes[: shape[0] * shape[1]].view(shape)


def kind_of(qt: QuantizedTensor) -> str:
    for kind, table in nf4.CODEBOOKS.items():
        if torch.equal(qt.codebook, table):
            return kind
    raise QuantkitError("the bitsandbytes format holds NF4 or FP4 tensors only: quantize with --method nf4 or fp4")


def tensors_of(model: Model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for name, qt in model.tensors.items():
        kind = kind_of(qt)
        p = f"{name}.weight"
        state = {"quant_type": kind, "blocksize": qt.group_size, "dtype": str(dtype).removeprefix("torch."),
                 "shape": list(qt.shape)}
        out[p] = pack(qt)
        out[f"{p}.quant_map"] = qt.codebook.float().clone()  # one table per tensor, as bitsandbytes stores it
        if qt.nested is None:
            out[f"{p}.absmax"] = qt.scales.float()
        else:
            out[f"{p}.absmax"] = qt.nested.codes.reshape(-1)
            out[f"{p}.nested_absmax"] = qt.nested.scales.float()
            out[f"{p}.nested_quant_map"] = qt.nested.codebook.float().clone()
            state |= {"nested_blocksize": qt.nested.group_size, "nested_dtype": "float32", "nested_offset": qt.offset}
        out[f"{p}.quant_state.bitsandbytes__{kind}"] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    return out | checkpoint.plain_tensors(model, dtype)


def quantization_config(qc: QuantConfig, dtype: torch.dtype) -> dict:
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=qc.method, bnb_4bit_use_double_quant=qc.double_quant,
                              bnb_4bit_compute_dtype=dtype).to_dict()


def write(model: Model, out: str | Path, overwrite: bool = False) -> Path:
    """Called by exporters.export, which has checked the model."""
    dtype = model.module.dtype
    return checkpoint.write(model, out, overwrite, tensors_of(model, dtype), quantization_config(model.qconfig, dtype), dtype)


def read(path: Path) -> Model:
    """Load a bitsandbytes 4-bit checkpoint (ours or transformers') with dequantized float weights."""
    cfg = AutoConfig.from_pretrained(path)
    qc = cfg.quantization_config
    del cfg.quantization_config
    if not qc.get("load_in_4bit"):
        raise QuantkitError(f"{path}: an 8-bit bitsandbytes checkpoint: quantkit reads the 4-bit ones")
    state = checkpoint.read_tensors(path)
    tensors = {}
    for key in [k for k in state if ".weight.quant_state.bitsandbytes__" in k]:
        p = key.split(".quant_state.")[0]
        meta = json.loads(bytes(state.pop(key).tolist()))
        try:
            packed, absmax, table = state.pop(p), state.pop(f"{p}.absmax"), state.pop(f"{p}.quant_map")
            n, k = meta["shape"]
            nested = None
            if f"{p}.nested_absmax" in state:
                nested = QuantizedTensor(absmax.to(torch.uint8)[None], state.pop(f"{p}.nested_absmax"), None, None, 8,
                                         meta["nested_blocksize"], True, codebook=state.pop(f"{p}.nested_quant_map"),
                                         flat=True)
                absmax = nested.dequantize().view(-1) + torch.tensor(meta["nested_offset"], dtype=torch.float32)
            qt = QuantizedTensor(unpack(packed, (n, k)), absmax.float(), None, None, 4, meta["blocksize"], True,
                                 codebook=table.float(), flat=True, nested=nested,
                                 offset=meta.get("nested_offset", 0.0))
        except (KeyError, ValueError, RuntimeError) as e:
            raise QuantkitError(f"{path}: {p} is incomplete or inconsistent ({e}): re-export the checkpoint") from None
        name = p.removesuffix(".weight")
        tensors[name] = qt
        state[p] = qt.dequantize()
    module = checkpoint.build(path, cfg, state)
    qconfig = QuantConfig(qc["bnb_4bit_quant_type"], 4, double_quant=bool(qc.get("bnb_4bit_use_double_quant")),
                          block_size=next(iter(tensors.values())).group_size if tensors else 64)
    return Model(module, load_tokenizer(path), str(path), tensors, qconfig)
