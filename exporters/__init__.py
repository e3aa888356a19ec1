"""Exporters: translate QuantizedTensors into on-disk formats, and read them back."""
from __future__ import annotations

import os
from pathlib import Path

from quantkit.errors import QuantkitError

from .atomic import atomic_dir, check_out

FORMATS = ("safetensors",)  # safetensors: the GPTQ checkpoint layout


def check_format(fmt: str, module, bits: int) -> None:
    """Refuse, before quantizing, a format that cannot hold this model at this bit width."""
    if fmt not in FORMATS:
        raise QuantkitError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    from . import gptq

    gptq.check_shapes(module, bits)


def export(model, out: str | os.PathLike, fmt: str = "safetensors", overwrite: bool = False) -> Path:
    check_format(fmt, model.module, model.qconfig.bits if model.qconfig else 4)
    from . import gptq

    return gptq.write(model, out, overwrite)


__all__ = ["FORMATS", "atomic_dir", "check_format", "check_out", "export"]
