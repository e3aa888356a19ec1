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


def __getattr__(name: str) -> object:
    if name in API:
        return getattr(import_module(API[name], __name__), name)
    try:  # a submodule (quantkit.api, ...) read as an attribute before anything imported it
        return import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
