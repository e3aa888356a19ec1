"""EXL2 (ExLlamaV2): GPTQ onto ExLlamaV2's grid, with bit widths mixed within a linear.

Input columns are taken in act-order (decreasing Hessian diagonal) and cut into groups of
group_size; the first groups, the most important inputs, get the widest codes. Codes are symmetric
around 2^(b-1); each group's scale per output row is ((c + 1)^2 / 256) * scale_max for a 4-bit code
c, scale_max the group's largest scale, searched (times p in [0.7, 1.2]) for the least error in the
3.5-norm, as ExLlamaV2's converter does.

Each linear gets the target's two nearest widths (Setting.for_target), or, with a measurement
(quantkit.measurement), one of CANDIDATES per attention and MLP block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import QuantkitError
from ..qtensor import EXL2_BITS, QuantizedTensor, check_scales
from .gptq import GPTQResult, prepare, run

P_MIN, P_MAX, P_STEPS = 0.7, 1.2, 96
MAX_FLOOR = 2.0**-16  # the least scale_max whose scales (c^2 / 256 of it, in float16) are not 0


@dataclass(frozen=True)
class Setting:
    """One linear's layout: widths (non-increasing) over fractions of its inputs in act-order."""
    bits: tuple[int, ...]
    props: tuple[float, ...]
    group_size: int = 32

    def __post_init__(self) -> None:
        if list(self.bits) != sorted(self.bits, reverse=True) or not set(self.bits) <= set(EXL2_BITS):
            raise QuantkitError(f"EXL2 widths {self.bits} must come widest first, from {EXL2_BITS}")
        if len(self.props) != len(self.bits) or abs(sum(self.props) - 1) > 1e-6 or min(self.props) <= 0:
            raise QuantkitError(f"EXL2 proportions {self.props} must be positive and sum to 1")
        if self.group_size % 32:
            raise QuantkitError(f"EXL2 groups of {self.group_size} rows: use a multiple of 32")

    def group_bits(self, k: int) -> list[int]:
        """The width of each group of k inputs: each width takes the groups of its share, rounded up."""
        out, left = [], k
        for b, p in zip(self.bits, self.props):
            g = math.ceil(max(min(k * p, left), 0) / self.group_size - 1e-9)
            out += [b] * g
            left -= g * self.group_size
        return out

    def total_bits(self, n: int, k: int) -> int:
        """Storage of an n x k linear: codes and 4-bit scales of its outputs padded to whole 32s (as the file
        holds them), scale maxima and q_groups, q_invperm."""
        widths, m = self.group_bits(k), padded(n)
        rows = [min(self.group_size, k - i * self.group_size) for i in range(len(widths))]
        return sum(r * m * b for r, b in zip(rows, widths)) + len(widths) * (m * 4 + 16 + 32) + k * 32

    @staticmethod
    def overhead(n: int, k: int, group_size: int = 32) -> float:
        """Bits per weight of an n x k linear besides its codes: scales, q_groups, q_invperm."""
        return (math.ceil(k / group_size) * (4 * padded(n) + 48) + 32 * k) / (n * k)

    @classmethod
    def reach(cls, n: int, k: int, group_size: int = 32) -> tuple[float, float]:
        """The least and most bits per weight an n x k linear can be stored in."""
        overhead, stretch = cls.overhead(n, k, group_size), padded(n) / n
        return EXL2_BITS[0] * stretch + overhead, EXL2_BITS[-1] * stretch + overhead

    @classmethod
    def for_target(cls, bpw: float, n: int, k: int, group_size: int = 32) -> Setting:
        """The two widths nearest the code bits that leave bpw bits per weight of an n x k linear
        after its scales and permutation (and the padding of its outputs), the wider on the first inputs."""
        bits = (bpw - cls.overhead(n, k, group_size)) * n / padded(n)  # a code bit per padded output
        if not EXL2_BITS[0] <= bits <= EXL2_BITS[-1]:
            raise QuantkitError(outside(f"{bpw} bits per weight", f"a {n}x{k} linear", *cls.reach(n, k, group_size)))
        lo = max(b for b in EXL2_BITS if b <= bits)
        hi = min(b for b in EXL2_BITS if b >= bits)
        wide = math.floor(k * (bits - lo) / (hi - lo) / group_size) if hi > lo else 0  # whole groups, not over
        if wide == 0:
            return cls((lo,), (1.0,), group_size)
        p = wide * group_size / k
        return cls((hi, lo), (p, 1 - p), group_size) if p < 1 else cls((hi,), (1.0,), group_size)


def padded(n: int) -> int:
    """The outputs the file stores of n: whole 32s (exporters.exl2.pack_tensor)."""
    return -(-n // 32) * 32


def outside(target: str, what: str, low: float, high: float) -> str:
    """The refusal of a target (as its option gives it) outside [low, high], the bounds shown inside it
    (rounded inwards)."""
    return (f"{target} is outside what EXL2 reaches for {what} ({math.ceil(low * 1000) / 1000:.3f} to "
            f"{math.floor(high * 1000) / 1000:.3f}): choose a target in that range")


def scale_values(codes: torch.Tensor, scale_max: torch.Tensor) -> torch.Tensor:
    """float16 scales from 4-bit codes c + 1 (1..16) and their group maxima, computed as ExLlamaV2's
    loader and kernels do: the maximum divided by 256, times the squared code, in float16."""
    return (codes * codes).half() * (scale_max.half() * torch.tensor(1 / 256, dtype=torch.float16,
                                                                    device=scale_max.device))


def zeros(group_bits: torch.Tensor, n: int) -> torch.Tensor:
    """The symmetric zero 2^(b-1) of each group, for n rows: uint8 [n, groups]."""
    return (1 << (group_bits.long() - 1)).to(torch.uint8).expand(n, -1).contiguous()


def grid(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's grid from its columns x [N, r]: (scales [N] as float16 values, the group's scale_max)."""
    maxq = 2**bits - 1
    base = (x.abs().amax(dim=1) + 1e-12) / (maxq / 2)
    top = base.max()
    codes = torch.clamp(torch.round(torch.sqrt(base / top) * 16), 1, 16)
    grid = (codes / 16) ** 2 * top
    # the p that scales the whole grid with the least error in the 3.5-norm
    ps = torch.linspace(P_MIN, P_MAX, P_STEPS + 1, device=x.device)
    best = ps[int(torch.argmin(err(x, grid[None, :] * ps[:, None], bits)))]
    # floored: a group of zeros (32 dead inputs) or of tiny values got scales of 0 in float16, and GPTQ's
    # 0 / 0 then spread NaN over every later group
    scale_max = (top * best).clamp(min=MAX_FLOOR).half()
    return scale_values(codes, scale_max).float(), scale_max


def err(x: torch.Tensor, s: torch.Tensor, bits: int) -> torch.Tensor:
    """The 3.5-norm error of x [N, r] rounded with each row of scales s [P, N]: [P]."""
    z = 2 ** (bits - 1)
    s = s[:, :, None]
    q = torch.clamp(torch.round(x / s) + z, 0, 2**bits - 1)
    a = ((q - z) * s - x).abs_()
    return (a * a * a * a.sqrt()).sum(dim=(1, 2))  # |d|^3.5, cheaper than pow


def quantize(w: torch.Tensor, h: torch.Tensor, setting: Setting, damp: float = 0.01, block_size: int = 128,
             name: str = "layer") -> GPTQResult:
    """GPTQ of w [N, K] (Hessian h [K, K]) onto the EXL2 grid of setting."""
    n, k = w.shape
    if k % 32:
        raise QuantkitError(f"{name} has {k} inputs: EXL2 needs a multiple of 32")
    work, diag = prepare(w, h)
    g = setting.group_size
    widths = setting.group_bits(k)
    scales = torch.zeros(n, len(widths), device=w.device)
    maxima = torch.zeros(len(widths), dtype=torch.float16, device=w.device)

    def fit(span: torch.Tensor, grp: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        b = widths[grp]
        scales[:, grp], maxima[grp] = grid(span, b)
        return scales[:, grp], torch.full((n,), 2.0 ** (b - 1), device=w.device), 2**b - 1

    perm = torch.argsort(diag, descending=True)
    col_group = torch.arange(k, device=w.device) // g
    codes, loss = run(work, h, perm, col_group, fit, damp, block_size, name)
    check_scales(w, maxima, name)
    group_bits = torch.tensor(widths, dtype=torch.uint8, device=codes.device)
    qt = QuantizedTensor(codes, scales.half(), zeros(group_bits, n), col_group[torch.argsort(perm)].to(torch.int32),
                         int(group_bits.max()), g, True, group_bits=group_bits, scale_max=maxima)
    return GPTQResult(qt, loss)


def quantize_head(w: torch.Tensor, bits: float, damp: float = 0.01, block_size: int = 128) -> QuantizedTensor:
    """lm_head w [vocab, hidden] on the EXL2 grid at bits per weight: rounded to nearest (GPTQ with an
    identity Hessian: no calibration reaches the head)."""
    setting = Setting.for_target(bits, *w.shape)
    return quantize(w.float(), torch.eye(w.shape[1], device=w.device), setting, damp, block_size, "lm_head").tensor


# what a measurement tries on each block: every width alone, and half of the inputs at the next wider
CANDIDATES = tuple(Setting((b,), (1.0,)) for b in EXL2_BITS) + tuple(
    Setting((hi, lo), (0.5, 0.5)) for lo, hi in zip(EXL2_BITS, EXL2_BITS[1:]))
