"""The companion trainer: LoRA / QLoRA fine-tuning whose adapters (PEFT's format) merge into the
base and feed the quantization pipeline."""
from .config import TrainConfig
from .loop import TrainResult, train
from .merge import merge

__all__ = ["TrainConfig", "TrainResult", "merge", "train"]
