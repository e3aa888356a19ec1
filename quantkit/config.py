"""What to quantize and how: one small dataclass shared by the CLI, the API and the exports."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import QuantkitError
from .qtensor import check_bits_group

METHODS = ("rtn", "gptq")


@dataclass
class QuantConfig:
    method: str = "rtn"
    bits: int = 4
    group_size: int = 128  # -1: per output channel
    sym: bool = True
    # GPTQ
    damp: float = 0.01  # of the mean Hessian diagonal
    block_size: int = 128  # columns per lazy batch
    act_order: bool = False
    static_groups: bool = False
    true_sequential: bool = True
    mse: bool = False  # search the clipping range (RTN too)
    group_aware: bool = False  # act-order inside groups, groups by importance; no g_idx permutation

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise QuantkitError(f"unknown method {self.method!r}: use one of {', '.join(METHODS)}")
        check_bits_group(self.bits, self.group_size)
        if not 0 < self.damp < 1:
            raise QuantkitError(f"damping {self.damp} is out of range: use a fraction such as 0.01")
        if self.act_order and self.group_aware:
            raise QuantkitError("act-order and group-aware ordering exclude each other: choose one")
        if self.block_size < 1:
            raise QuantkitError(f"block size {self.block_size} is invalid: use a positive number of columns such as 128")

    @property
    def needs_calibration(self) -> bool:
        return self.method != "rtn"

    def to_dict(self) -> dict:
        return asdict(self)
