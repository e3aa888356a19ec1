"""Exporters: translate QuantizedTensors into on-disk formats, and read them back."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from quantkit import lazy
from quantkit.atomic import check_apart
from quantkit.config import CODEBOOK_METHODS, QuantConfig
from quantkit.errors import QuantkitError, option, space_for

from .shards import DEFAULT_MAX_SIZE, parse_size

# safetensors: the GPTQ checkpoint layout for integer grids, bitsandbytes' 4-bit layout for NF4/FP4;
# awq: AutoAWQ's GEMM layout (4-bit, group-wise); gguf: llama.cpp's file, blocks of its types;
# compressed-tensors: llm-compressor's pack-quantized checkpoints (vLLM); exl2: ExLlamaV2's mixed widths
FORMATS = ("safetensors", "awq", "gguf", "compressed-tensors", "exl2")


def check_out_name(out: str | os.PathLike, fmt: str) -> None:
    if fmt != "gguf" and str(out).lower().endswith(".gguf"):  # else a directory named .gguf, holding safetensors
        raise QuantkitError(f"{option('out')} {out} names a GGUF file, and {option('format', fmt)} writes a directory: "
                            f"add {option('format', 'gguf')}, or choose an {option('out')} without .gguf")


def check_format_name(fmt: str) -> None:
    if fmt not in FORMATS:
        raise QuantkitError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")


def check_format(fmt: str, module, qconfig: QuantConfig) -> None:
    """Refuse, before quantizing, a format that cannot hold this model quantized this way."""
    check_format_name(fmt)
    if (fmt == "gguf") != (qconfig.gguf_type is not None):
        raise QuantkitError(f"a GGUF type goes with {option('format', 'gguf')} and {option('format', 'gguf')} needs "
                            f"one: pass both or neither ({option('gguf_type')})")
    if (fmt == "exl2") != (qconfig.exl2 is not None):
        raise QuantkitError(f"{option('format', 'exl2')} takes a target bits per weight ({option('exl2', 4.125)}) and "
                            f"only it does: pass a whole {option('bits')} for the other formats")
    if qconfig.rules and fmt not in ("safetensors", "compressed-tensors"):
        raise QuantkitError(f"{option('rules')} (or a checkpoint read with settings per linear) mixes settings per "
                            f"linear in the safetensors (GPTQ) and compressed-tensors formats; quantkit writes one in "
                            f"the {fmt} layout: use one of those formats")
    if qconfig.target_bpw is not None and fmt not in ("safetensors", "compressed-tensors", "gguf"):
        raise QuantkitError(f"{option('target_bpw')} mixes settings per linear in the safetensors (GPTQ), "
                            f"compressed-tensors and GGUF formats; the {fmt} layout holds one: use one of those "
                            "formats")
    if fmt == "gguf":
        from . import gguf

        gguf.check(module, qconfig.gguf_type)
    elif qconfig.target_bpw is not None:
        return  # the grids it chooses from are checked one by one (api.grids)
    elif fmt == "exl2":
        from . import exl2

        exl2.check(module, qconfig)
    elif fmt == "awq":
        from . import awq

        if qconfig.method in CODEBOOK_METHODS:
            raise QuantkitError(f"the AWQ layout holds integer grids, not {qconfig.method}: use "
                                f"{option('format', 'safetensors')}")
        awq.check(module, qconfig)
    elif fmt == "compressed-tensors":
        from . import compressed

        compressed.check(module, qconfig)
    elif qconfig.method not in CODEBOOK_METHODS:
        from . import gptq

        gptq.check_shapes(module, qconfig)


def expected_size(module, fmt: str, qconfig: QuantConfig, types: dict[str, str] | None = None) -> int:
    """About how many bytes an export of module takes, from below (a free-space check must not refuse
    what fits): GGUF's tensor data exactly, from its types' blocks; the safetensors layouts each
    decoder linear at its bits plus a 16-bit scale per group (8 bits per block for NF4/FP4), every
    other tensor in 16 bits."""
    from quantkit.modelio import stored_state

    from . import gguf

    if fmt == "gguf":
        return sum(gguf.nbytes(shape, kind) for shape, kind in gguf.plan(module, types).values())
    total = 0
    for key, t in stored_state(module, keep_vars=True).items():
        c = qconfig.for_linear(key.removesuffix(".weight")) if ".layers." in key and t.dim() == 2 else None
        if key == "lm_head.weight" and qconfig.head_bits is not None:
            total += int(t.numel() * qconfig.head_bits / 8)
        elif c is not None:
            if c.method in CODEBOOK_METHODS:
                bits = 4 + 8 / c.block_size
            else:
                bits = (c.exl2 or c.bits) + 16 / (c.group_size if c.group_size > 0 else t.shape[1])
            total += int(t.numel() * bits / 8)
        else:
            total += t.numel() * 2
    return total


def open_writer(model, out: str | os.PathLike, fmt: str, qconfig: QuantConfig, overwrite: bool = False,
                max_shard_size: int | str = DEFAULT_MAX_SIZE, types: dict[str, str] | None = None):
    """The writer (quantkit.pipeline.Writer) of a format, for a model quantized with qconfig; types:
    each 2-D weight's GGUF type by module name, for GGUF. Nothing is written before start()."""
    check_format(fmt, model.module, qconfig)
    if fmt == "gguf":
        from . import gguf

        return gguf.Writer(model, out, qconfig.gguf_type, types, overwrite)
    if fmt == "awq":
        from . import awq as layout
    elif fmt == "compressed-tensors":
        from . import compressed as layout
    elif fmt == "exl2":
        from . import exl2 as layout
    elif qconfig.method in CODEBOOK_METHODS:
        from . import bnb as layout
    else:
        from . import gptq as layout
    return layout.writer(model, out, qconfig, overwrite, max_shard_size)


def export(model, out: str | os.PathLike, fmt: str = "safetensors", overwrite: bool = False,
           max_shard_size: int | str = DEFAULT_MAX_SIZE, progress: bool = True) -> Path:
    """Write a quantized model held in memory; the safetensors layouts in shards of at most
    max_shard_size bytes of tensor data ("5GB", "500MiB", or an int). progress: say what was written."""
    if model.qconfig is not None and not model.tensors and model.streamed_to is not None:
        raise QuantkitError(f"this model's quantized layers were written to {model.streamed_to} and not kept in "
                            "memory: that is its export; to write another format, quantize with keep=True")
    if model.qconfig is None or not model.tensors:
        raise QuantkitError("the model is not quantized: quantize it before exporting")
    mixed = any(qt.group_bits is not None for qt in model.tensors.values())  # EXL2's widths, mixed within linears
    if mixed != (fmt == "exl2"):
        raise QuantkitError(f"{model.source}: " + ("EXL2's linears mix widths, which only its own layout holds: export "
                            "it with format='exl2'" if mixed else "the EXL2 layout holds what an EXL2 quantization "
                            f"made, and this model is quantized as {model.qconfig.method}: quantize with format='exl2'"))
    from quantkit.modelio import stored_state

    check_symmetry(model, fmt)
    check_apart(out, [model.source])
    types = {name: qt.ggml for name, qt in model.tensors.items()} if fmt == "gguf" else None
    writer = open_writer(model, out, fmt, model.qconfig, overwrite, max_shard_size, types)
    try:
        with space_for(out, expected_size(model.module, fmt, model.qconfig, types), "the export", "export again"):
            writer.start()
            for name, qt in model.tensors.items():
                writer.add_quantized(name, qt)
            for key, t in stored_state(model.module).items():
                if key.removesuffix(".weight") not in model.tensors:
                    writer.add(key, t)
            path = writer.close()
            if progress:
                print(writer.summary, file=sys.stderr)
            return path
    except BaseException:
        writer.abort()
        raise


def check_symmetry(model, fmt: str) -> None:
    """The GPTQ and compressed-tensors layouts state one symmetry for their linears (GPTQ's zero points
    are stored minus one or not by it, compressed-tensors' are left out by it): a checkpoint read with
    some linears of the other symmetry would be written with wrong zero points. AWQ stores every zero
    point as it is."""
    if fmt not in ("safetensors", "compressed-tensors") or model.qconfig.method in CODEBOOK_METHODS:
        return
    sym = model.qconfig.sym
    odd = next((name for name, qt in model.tensors.items() if qt.codebook is None and qt.ggml is None
                and qt.sym != sym), None)
    if odd is not None:
        kinds = ("asymmetric", "symmetric") if sym else ("symmetric", "asymmetric")
        raise QuantkitError(f"{model.source}: {odd} is {kinds[0]} where the model's other linears are {kinds[1]}, and "
                            f"the {fmt} layout as quantkit writes it holds one symmetry: export it with "
                            f"{option('format', 'awq')} or {option('format', 'gguf')}, or quantize the float model again")


def __getattr__(name: str) -> object:
    """A format's module (exporters.gguf, ...) imported when first read: gguf's writer imports transformers,
    which the command line's help and option checks do without."""
    return lazy(__name__, {}, name)


__all__ = ["DEFAULT_MAX_SIZE", "FORMATS", "gguf", "check_format", "check_format_name", "expected_size", "export", "open_writer", "parse_size"]
