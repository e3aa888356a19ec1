"""Exporters: translate QuantizedTensors into on-disk formats, and read them back."""
from __future__ import annotations

import os
from pathlib import Path

from quantkit.config import CODEBOOK_METHODS, QuantConfig
from quantkit.errors import QuantkitError

from . import gguf
from .atomic import atomic_dir, check_out
from .shards import DEFAULT_MAX_SIZE, parse_size

# safetensors: the GPTQ checkpoint layout for integer grids, bitsandbytes' 4-bit layout for NF4/FP4;
# awq: AutoAWQ's GEMM layout (4-bit, group-wise); gguf: llama.cpp's file, blocks of its types
FORMATS = ("safetensors", "awq", "gguf")


def check_format(fmt: str, module, qconfig: QuantConfig) -> None:
    """Refuse, before quantizing, a format that cannot hold this model quantized this way."""
    if fmt not in FORMATS:
        raise QuantkitError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    if (fmt == "gguf") != (qconfig.gguf_type is not None):
        raise QuantkitError("a GGUF type goes with --format gguf and --format gguf needs one: pass both or neither")
    if fmt == "gguf":
        gguf.check(module, qconfig.gguf_type)
    elif fmt == "awq":
        from . import awq

        if qconfig.method in CODEBOOK_METHODS:
            raise QuantkitError(f"the AWQ layout holds integer grids, not {qconfig.method}: use --format safetensors")
        awq.check(module, qconfig)
    elif qconfig.method not in CODEBOOK_METHODS:
        from . import gptq

        gptq.check_shapes(module, qconfig.bits)


def export(model, out: str | os.PathLike, fmt: str = "safetensors", overwrite: bool = False,
           max_shard_size: int | str = DEFAULT_MAX_SIZE) -> Path:
    """Write a quantized model; the safetensors layouts in shards of at most max_shard_size bytes
    of tensor data ("5GB", "500MiB", or an int)."""
    if model.qconfig is None or not model.tensors:
        raise QuantkitError("the model is not quantized: quantize it before exporting")
    check_format(fmt, model.module, model.qconfig)
    if fmt == "gguf":
        return gguf.write(model, out, model.qconfig.gguf_type, overwrite)
    if fmt == "awq":
        from . import awq

        return awq.write(model, out, overwrite, max_shard_size)
    if model.qconfig.method in CODEBOOK_METHODS:
        from . import bnb

        return bnb.write(model, out, overwrite, max_shard_size)
    from . import gptq

    return gptq.write(model, out, overwrite, max_shard_size)


__all__ = ["DEFAULT_MAX_SIZE", "FORMATS", "gguf", "atomic_dir", "check_format", "check_out", "export", "parse_size"]
