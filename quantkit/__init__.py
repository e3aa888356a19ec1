"""quantkit: post-training quantization and export for large language models."""
__version__ = "0.1.0"

from .api import compare, evaluate, export, lm_eval, quantize  # noqa: E402
from .config import QuantConfig  # noqa: E402
from .errors import QuantkitError  # noqa: E402
from .modelio import Model, load  # noqa: E402
from .qtensor import QuantizedTensor  # noqa: E402
from .trainer import TrainConfig, merge, train  # noqa: E402

__all__ = ["Model", "QuantConfig", "QuantizedTensor", "QuantkitError", "TrainConfig", "compare", "evaluate", "export", "lm_eval", "load",
           "merge", "quantize", "train"]
