"""quantkit: post-training quantization and export for large language models.

The names below are imported on first use, so that a command that needs no torch starts without it."""
from importlib import import_module

__version__ = "0.1.0"

API = {"compare": ".api", "evaluate": ".api", "export": ".api", "lm_eval": ".api", "quantize": ".api",
       "QuantConfig": ".config", "QuantkitError": ".errors", "Model": ".modelio", "load": ".modelio",
       "QuantizedTensor": ".qtensor", "TrainConfig": ".trainer", "merge": ".trainer", "train": ".trainer",
       # what evaluate, compare and train return, for type hints in the caller's code
       "Divergence": ".evals", "Perplexity": ".evals", "TrainResult": ".trainer"}
__all__ = sorted(API)


def lazy(package: str, names: dict[str, str], name: str) -> object:
    """A package's attribute imported on first use: name from the module names maps it to, or else the
    submodule name (read as an attribute before anything imported it)."""
    if name in names:
        return getattr(import_module(names[name], package), name)
    try:
        return import_module(f".{name}", package)
    except ModuleNotFoundError as e:
        if e.name != f"{package}.{name}":
            raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None


def __getattr__(name: str) -> object:
    return lazy(__name__, API, name)
