"""How to fine-tune: one dataclass shared by `quantkit train`, quantkit.train and the saved checkpoints."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from quantkit.config import check_types
from quantkit.errors import QuantkitError, option

METHODS = ("lora", "qlora")
OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw")
PRECISIONS = ("auto", "bf16", "fp16", "fp32")


def held_out_twice(fraction: float) -> QuantkitError:
    """The error for both ways of naming the held-out data at once."""
    return QuantkitError(f"{option('eval_fraction', fraction)} holds out part of {option('data')}, and "
                         f"{option('eval_data')} gives the held-out data instead: drop one of them")


@dataclass
class TrainConfig:
    method: str = "lora"  # qlora: the frozen base linears held as NF4 with double quantization
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    target: list[str] = field(default_factory=lambda: ["all-linear"])  # module names, or all-linear: every decoder linear
    dora: bool = False  # weight-decomposed: a trained magnitude per output row
    rslora: bool = False  # scale alpha / sqrt(rank) instead of alpha / rank
    lora_plus: float | None = None  # B's learning rate this many times A's
    # the run's length: steps or epochs; neither: one epoch
    steps: int | None = None
    epochs: float | None = None
    seqlen: int = 256
    batch_size: int = 4  # sequences per micro-batch, over all processes
    grad_accum: int = 1
    lr: float = 2e-4
    warmup: int = 10  # steps of linear warmup, then cosine decay to 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    optimizer: str = "adamw"
    precision: str = "auto"  # auto: bf16 where the device has it, else fp16 with a gradient scaler on a GPU, fp32 on a CPU
    gradient_checkpointing: bool = False
    compile: bool = False
    fsdp: bool = False  # shard the frozen base, the adapter and its optimizer state over torchrun's processes
    eval_fraction: float = 0.05  # held out from --data when there is no --eval-data
    eval_every: int = 50
    patience: int | None = None  # stop after this many evaluations without a better held-out loss
    save_every: int = 50
    nf4_block: int | None = None  # QLoRA base: values per absmax block [nf4.BLOCK, bitsandbytes' default]

    def __post_init__(self) -> None:
        from quantkit.quantizers import nf4  # here, not above: the command line's help reads the defaults without torch

        check_types(self)
        if self.nf4_block is None:
            self.nf4_block = nf4.BLOCK
        # 0 from Python and 0.0 from the command line are one setting (the resume key hashes them)
        for name in ("alpha", "dropout", "lr", "weight_decay", "max_grad_norm", "eval_fraction", "epochs", "lora_plus"):
            if getattr(self, name) is not None:
                setattr(self, name, float(getattr(self, name)))
        if self.method not in METHODS:
            raise QuantkitError(f"unknown training method {self.method!r}: use one of {', '.join(METHODS)}")
        if self.optimizer not in OPTIMIZERS:
            raise QuantkitError(f"unknown optimizer {self.optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
        if self.precision not in PRECISIONS:
            raise QuantkitError(f"unknown precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        if isinstance(self.target, str):
            self.target = [t.strip() for t in self.target.split(",") if t.strip()]
        if isinstance(self.target, tuple):
            self.target = list(self.target)
        if not isinstance(self.target, list) or not all(isinstance(t, str) for t in self.target):
            raise QuantkitError(f"{option('target', self.target)} is invalid: name the modules, a list of strings such "
                                "as ['q_proj', 'v_proj'], or all-linear")
        if not self.target:
            raise QuantkitError(f"no {option('target')} modules: name some (q_proj,v_proj) or use all-linear")
        if self.rank < 1:
            raise QuantkitError(f"{option('rank', self.rank)} is invalid: use a positive rank such as 16")
        if not 0 <= self.dropout < 1:
            raise QuantkitError(f"{option('dropout', self.dropout)} is out of range: use a fraction in [0, 1)")
        if self.lora_plus is not None and not (0 < self.lora_plus < math.inf):  # NaN too
            raise QuantkitError(f"{option('lora_plus', self.lora_plus)} is invalid: use a positive ratio such as 16")
        if self.seqlen < 2:  # a window of one token predicts nothing: every loss would be 0/0
            raise QuantkitError(f"{option('seqlen', self.seqlen)} leaves no token to predict: use 2 or more, such as 256")
        if self.steps is not None and self.epochs is not None:
            raise QuantkitError(f"{option('steps')} and {option('epochs')} both set the run's length: pass one of them")
        for name in ("batch_size", "grad_accum", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise QuantkitError(f"{option(name, getattr(self, name))} is invalid: use a positive number")
        if self.steps is not None and self.steps < 1 or self.epochs is not None and not self.epochs > 0:
            raise QuantkitError(f"{option('steps')} and {option('epochs')} must be positive")
        if self.epochs is not None and not math.isfinite(self.epochs):  # inf: a traceback; 1e300 ran without end
            raise QuantkitError(f"{option('epochs', self.epochs)} is invalid: use a finite number of epochs, such as 3")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise QuantkitError(f"learning rate {option('lr', self.lr)} is invalid: use a positive number such as 2e-4")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):  # 0: the adapter adds nothing and never trains
            raise QuantkitError(f"{option('alpha', self.alpha)} is invalid: use a positive number such as 32")
        if not self.max_grad_norm > 0:  # 0 zeroes every gradient, a negative one flips it, NaN poisons it
            raise QuantkitError(f"{option('max_grad_norm', self.max_grad_norm)} is invalid: use a positive norm such as 1.0 "
                                "(inf: no clipping)")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise QuantkitError(f"{option('weight_decay', self.weight_decay)} is invalid: use 0 or a small positive number such "
                                "as 0.01")
        if self.patience is not None and self.patience < 1:  # 0 would stop at the first evaluation
            raise QuantkitError(f"{option('patience', self.patience)} is invalid: use a number of evaluations, 1 or more")
        if not 0 <= self.eval_fraction < 1:
            raise QuantkitError(f"{option('eval_fraction', self.eval_fraction)} is out of range: use a fraction such as 0.05")
        if self.warmup < 0:
            raise QuantkitError(f"{option('warmup', self.warmup)} is invalid: use a number of steps, 0 or more")
        if not 0 <= self.seed < 2**32:  # the data order's generators take seed * 100003 + epoch in 64 bits
            raise QuantkitError(f"{option('seed', self.seed)} is out of range: use a number from 0 to {2**32 - 1}")
        if self.fsdp and self.method == "qlora":
            raise QuantkitError(f"{option('fsdp', True)} shards a float base; QLoRA's NF4 base is not sharded: use "
                                f"{option('method', 'lora')} with {option('fsdp', True)}, or QLoRA without it")
        if self.fsdp and self.optimizer != "adamw":
            raise QuantkitError(f"{option('optimizer', self.optimizer)} cannot step sharded parameters (bitsandbytes "
                                f"has no FSDP support): use {option('optimizer', 'adamw')} with {option('fsdp', True)}")
        nf4.check("nf4", self.nf4_block, "nf4_block")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def to_dict(self) -> dict:
        return asdict(self)
