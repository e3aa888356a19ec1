"""What to quantize and how: one small dataclass shared by the CLI, the API and the exports."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import QuantkitError
from .qtensor import check_bits_group

METHODS = ("rtn",)


@dataclass
class QuantConfig:
    method: str = "rtn"
    bits: int = 4
    group_size: int = 128  # -1: per output channel
    sym: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise QuantkitError(f"unknown method {self.method!r}: use one of {', '.join(METHODS)}")
        check_bits_group(self.bits, self.group_size)

    @property
    def needs_calibration(self) -> bool:
        return self.method != "rtn"

    def to_dict(self) -> dict:
        return asdict(self)
