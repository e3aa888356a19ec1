"""gguf-py's constants (the ggml types, their block sizes, llama.cpp's file types) without importing
the gguf package: its __init__ imports numpy, its reader, writer and yaml, about 0.1 s of a `quantkit
export` of a small GGUF file, a command timed against llama-quantize's. gguf/constants.py imports
only the standard library, so it is run alone; where gguf is imported already, its own is used."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def constants() -> ModuleType:
    if "gguf" in sys.modules:
        return sys.modules["gguf"]
    spec = importlib.util.find_spec("gguf")  # finds the package without running its __init__
    path = Path(spec.origin).with_name("constants.py") if spec and spec.origin else None
    if path is None or not path.is_file():  # not installed as plain files: the package, as it comes
        import gguf

        return gguf
    spec = importlib.util.spec_from_file_location("quantkit._gguf_constants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_c = constants()
GGMLQuantizationType = _c.GGMLQuantizationType
LlamaFileType = _c.LlamaFileType
GGML_QUANT_SIZES = _c.GGML_QUANT_SIZES
GGML_QUANT_VERSION = _c.GGML_QUANT_VERSION
GGUF_DEFAULT_ALIGNMENT = _c.GGUF_DEFAULT_ALIGNMENT


def is_gguf(path: str | Path) -> bool:
    """Whether the file starts with GGUF's magic, whatever its name (OSError where it cannot be read)."""
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
