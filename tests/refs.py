"""Reference implementations used by tests and benchmarks, never by quantkit itself."""
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import torch


def autogptq(module: str):
    """A module of auto-gptq 0.7.1 without its package __init__, which fails under transformers 5:
    empty stand-in packages, then the one module (its GPTQ and CPU QuantLinear run on the CPU)."""
    if "auto_gptq" not in sys.modules:
        spec = importlib.util.find_spec("auto_gptq")
        if spec is None:
            raise ImportError("auto-gptq is a test dependency: BUILD_CUDA_EXT=0 pip install --no-deps auto-gptq==0.7.1")
        root = Path(spec.submodule_search_locations[0])
        for name in ("auto_gptq", "auto_gptq.nn_modules", "auto_gptq.nn_modules.qlinear", "auto_gptq.quantization"):
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            sys.modules[name] = pkg
        torch.cuda.synchronize = lambda *a, **k: None  # its GPTQ calls this between steps
    return importlib.import_module(f"auto_gptq.{module}")
