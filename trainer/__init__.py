"""The companion trainer: LoRA / QLoRA fine-tuning whose adapters (PEFT's format) merge into the
base and feed the quantization pipeline.

The names below are imported on first use: the command line's help reads the settings (.config)
without the training loop's libraries."""
from quantkit import lazy

API = {"TrainConfig": ".config", "TrainResult": ".loop", "train": ".loop", "merge": ".merging"}
__all__ = sorted(API)


def __getattr__(name: str) -> object:
    return lazy(__name__, API, name)
