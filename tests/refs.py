"""Reference implementations used by tests and benchmarks, never by quantkit itself."""
import importlib
import importlib.util
import sys
import types
from contextlib import contextmanager
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


def autoawq(module: str):
    """A module of autoawq 0.2.9 without its package __init__ (which loads every model family):
    a stand-in top package, and a stand-in `datasets` when it is absent (only its calibration
    loader, which we do not use, needs it)."""
    if "awq" not in sys.modules:
        spec = importlib.util.find_spec("awq")
        if spec is None:
            raise ImportError("autoawq is a test dependency: pip install --no-deps --no-build-isolation autoawq==0.2.9")
        pkg = types.ModuleType("awq")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["awq"] = pkg
        if importlib.util.find_spec("datasets") is None:
            sys.modules["datasets"] = types.SimpleNamespace(load_dataset=None)
    return importlib.import_module(f"awq.{module}")


@contextmanager
def cpu_snapshots_copied():
    """autoawq snapshots a block with .cpu() and then scales its weights in place: on a GPU .cpu()
    copies, on the CPU it returns the same tensor and the search drifts. Make it copy, as on a GPU."""
    cpu = torch.Tensor.cpu
    torch.Tensor.cpu = lambda t, *a, **k: t.clone() if t.device.type == "cpu" else cpu(t, *a, **k)
    try:
        yield
    finally:
        torch.Tensor.cpu = cpu
