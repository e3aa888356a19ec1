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
from transformers import BitsAndBytesConfig

from quantkit.config import QuantConfig
from quantkit.errors import QuantkitError
from quantkit.modelio import Model
from quantkit.qlinear import NF4Linear
from quantkit.qtensor import QuantizedTensor
from quantkit.quantizers import nf4

from . import checkpoint
from .shards import DEFAULT_MAX_SIZE


def kind_of(qt: QuantizedTensor) -> str:
    for kind, table in nf4.CODEBOOKS.items():
        if torch.equal(qt.codebook, table):
            return kind
    raise QuantkitError("the bitsandbytes format holds NF4 or FP4 tensors only: quantize with --method nf4 or fp4")


def pack(name: str, qt: QuantizedTensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A quantized linear's tensors by suffix of its name: weight, weight.absmax, ..."""
    kind = kind_of(qt)
    layer = NF4Linear.from_tensor(qt, name=name)
    state = {"quant_type": kind, "blocksize": qt.group_size, "dtype": str(dtype).removeprefix("torch."),
             "shape": list(qt.shape)}
    out = {"weight": layer.packed[:, None], "weight.absmax": layer.absmax,
           "weight.quant_map": layer.quant_map}  # one table per tensor, as bitsandbytes stores it
    if layer.nested_absmax is not None:
        out["weight.nested_absmax"] = layer.nested_absmax
        out["weight.nested_quant_map"] = layer.nested_map
        state |= {"nested_blocksize": layer.nested_blocksize, "nested_dtype": "float32", "nested_offset": layer.offset}
    out[f"weight.quant_state.bitsandbytes__{kind}"] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    return out


def quantization_config(qc: QuantConfig, dtype: torch.dtype) -> dict:
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=qc.method, bnb_4bit_use_double_quant=qc.double_quant,
                              bnb_4bit_compute_dtype=dtype).to_dict()


def writer(model: Model, out: str | Path, qconfig: QuantConfig, overwrite: bool = False,
           max_shard_size: int | str = DEFAULT_MAX_SIZE) -> checkpoint.CheckpointWriter:
    """Called by exporters.open_writer. The other tensors keep the checkpoint's dtype (a model held
    in memory: its own), which is also the dtype the weights dequantize to."""
    dtype = model.checkpoint.dtype if model.checkpoint is not None else model.module.dtype
    return checkpoint.CheckpointWriter(model, out, dtype=dtype, pack=lambda name, qt: pack(name, qt, dtype),
                                       quantization_config=lambda w: quantization_config(qconfig, dtype),
                                       overwrite=overwrite, max_shard_size=max_shard_size)


def stored_bytes(packed: torch.Tensor) -> torch.Tensor:
    """The packed codes as bytes [M, 1]: bnb_4bit_quant_storage (FSDP-QLoRA's bfloat16, say) stores
    them viewed as another dtype."""
    return packed if packed.dtype == torch.uint8 else packed.contiguous().view(-1).view(torch.uint8)[:, None]


def read(path: Path, packed: bool = False) -> Model:
    """Load a bitsandbytes 4-bit checkpoint (ours or transformers'): with dequantized float weights,
    or packed, its linears NF4Linear layers that hold the file's tensors as they are."""
    cfg, qc = checkpoint.config(path)
    if not qc.get("load_in_4bit"):
        raise QuantkitError(f"{path}: an 8-bit bitsandbytes checkpoint: quantkit reads the 4-bit ones")
    state = checkpoint.read_tensors(path)
    layers = {}
    for key in [k for k in state if ".weight.quant_state.bitsandbytes__" in k]:
        p = key.split(".quant_state.")[0]
        name = p.removesuffix(".weight")
        meta = json.loads(bytes(state.pop(key).tolist()))
        try:
            nested = f"{p}.nested_absmax" in state
            layers[name] = NF4Linear(
                stored_bytes(state.pop(p)), state.pop(f"{p}.absmax"), state.pop(f"{p}.quant_map"), tuple(meta["shape"]),
                meta["blocksize"], state.pop(f"{p}.nested_absmax") if nested else None,
                state.pop(f"{p}.nested_quant_map") if nested else None,
                # bitsandbytes' QuantState.from_dict requires both with a nested absmax: a default would guess
                meta["nested_blocksize"] if nested else nf4.NESTED_BLOCK, meta["nested_offset"] if nested else 0.0,
                bias=state.pop(f"{name}.bias", None), name=f"{path}: {name}")
        except (KeyError, ValueError, TypeError) as e:
            raise QuantkitError(f"{path}: {p} is incomplete or inconsistent ({e!r}): re-export the checkpoint") from None
    block_size = next(iter(layers.values())).blocksize if layers else nf4.BLOCK
    qconfig = QuantConfig(qc["bnb_4bit_quant_type"], 4, double_quant=bool(qc.get("bnb_4bit_use_double_quant")),
                          block_size=block_size)
    return checkpoint.model(path, cfg, state, layers, qconfig, packed)
