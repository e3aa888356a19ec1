"""GGUF block types (llama.cpp's ggml quants): round-to-nearest with llama.cpp's own search,
optionally weighted by an importance matrix, and GPTQ error feedback onto the same block grid.

A block type is fitted one block at a time (32 values for the legacy types, 256 for the K-quants)
into a `Fit`: per sub-block an effective scale and min (value = scale * (code - off) - min), the
codes, and the fields the block stores (float16 d, integer sub-scales, ...). `pack` lays those
out as ggml-common.h's structs. The searches are llama.cpp's (ggml-quants.c: make_qx_quants,
make_q3_quants, make_qkx2/qkx3_quants, make_qp_quants) over all blocks of a tensor at once.
Plain round-to-nearest (no importance matrix; Q8_0 takes none) runs compiled where it was built
(quantkit.blocks: the same searches in C, the same bytes), else through gguf-py for the 32-value
types; the float types always through gguf-py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from .. import blocks as compiled
from ..blocks import BITS, FLOAT_TYPES, K_TYPES, LEGACY_TYPES, TYPES, check, sizes  # noqa: F401 (read as ggml.*)
from ..errors import QuantkitError, option
from ..qtensor import QuantizedTensor
from .gptq import GPTQResult, inverse_factor, prepare, push_error

F32 = np.float32
EPS = 1e-15  # GROUP_MAX_EPS: a block this small is all zeros


@dataclass
class Fit:
    scale: torch.Tensor  # [R, nsub] float32, as llama.cpp computes it (float16 d times the integer sub-scale)
    min: torch.Tensor | None  # [R, nsub]; None for symmetric types
    off: int  # symmetric types: value = scale * (code - off)
    nmax: int
    codes: torch.Tensor  # [R, B] the type's own rounding (kept where a sub-block's scale is 0)
    fields: dict[str, torch.Tensor] = field(default_factory=dict)

    def nearest(self, x: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        """Codes of x on the grid of scale s and min m (broadcast against x)."""
        safe = torch.where(s == 0, 1.0, s)
        q = nearest_int(x / safe) + self.off if m is None else nearest_int((x + m) / safe)
        return q.clamp_(0, self.nmax)

    def round(self, x: torch.Tensor, sub: int) -> torch.Tensor:
        """Codes of x [R] in sub-block sub (GPTQ's step)."""
        return self.nearest(x, self.scale[:, sub], None if self.min is None else self.min[:, sub])

    def value(self, q: torch.Tensor, sub: int) -> torch.Tensor:
        v = self.scale[:, sub] * (q - self.off)
        return v if self.min is None else v - self.min[:, sub]


# ---- llama.cpp's searches over many blocks at once ----
# They take x [R, n] (a block or sub-block per row) but work on its transpose [n, R], so that a sum
# over a block runs down contiguous rows, left to right in float32 as llama.cpp's loops add:
# where two candidates nearly tie, the last bit of a sum decides.

def f32(v: float) -> float:
    return float(F32(v))


def cols(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous()


def largest(x: torch.Tensor) -> torch.Tensor:
    """The signed value of largest magnitude in each column (the first one on ties; +0 where all are
    zeros, as llama.cpp's running maximum from 0 leaves it)."""
    m = x.gather(0, x.abs().argmax(dim=0, keepdim=True)).squeeze(0)
    return torch.where(m == 0, 0.0, m)


def nearest_int(t: torch.Tensor) -> torch.Tensor:
    """llama.cpp's nearest_int: half to even through the bits of t + 1.5 * 2^23 (exact below 2^22; the
    value it gives beyond, and +0 for a zero of either sign, kept: a degenerate block's bytes are its)."""
    bits = (t + 12582912.0).view(torch.int32)
    return ((bits & 0x7FFFFF) - 0x400000).float()


def total(t: torch.Tensor) -> torch.Tensor:
    """Column sums, accumulated row by row in float32."""
    acc = t[0].clone()
    for row in t[1:]:
        acc += row
    return acc


def row_total(t: torch.Tensor) -> torch.Tensor:
    return total(cols(t))


def largest_in_row(t: torch.Tensor) -> torch.Tensor:
    return largest(t.t())


def sqrt(t: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root (torch's vectorized one can be 1 ulp off sqrtf)."""
    return torch.sqrt(t.double()).float()


def over(a: float, t: torch.Tensor) -> torch.Tensor:
    """a / t divided in float32 (torch computes number / tensor as a reciprocal times the number)."""
    return torch.full_like(t, a) / t


def nonzero(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t == 0, 1.0, t)


def make_qx(x: torch.Tensor, nmax: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants (weighted least squares over 19 scales around -nmax/max): scale, codes 0..2nmax-1."""
    x, w = cols(x), cols(w)
    mx = largest(x)
    zero = mx.abs() < EPS
    mx = nonzero(mx)

    def trial(c: float):
        l = nearest_int(over(-c, mx) * x).clamp_(-nmax, nmax - 1)
        return l, total(w * x * l), total(w * l * l)

    codes, slx, sl2 = trial(f32(nmax))
    scale = torch.where(sl2 > 0, slx / nonzero(sl2), 0.0)
    best = scale * slx
    for i in range(-9, 10):
        if i:
            l, a, b = trial(f32(F32(nmax) + F32(0.1) * F32(i)))
            better = (b > 0) & (a * a > best * b)
            codes = torch.where(better, l, codes)
            scale = torch.where(better, a / nonzero(b), scale)
            best = torch.where(better, scale * a, best)
    return torch.where(zero, 0.0, scale), torch.where(zero, 0.0, codes + nmax).t()


def refine(x: torch.Tensor, w: torch.Tensor, codes: torch.Tensor, lo: int, hi: int, need_sl2: bool) -> tuple:
    """The coordinate descent of make_q3_quants / make_qp_quants (on [n, R]): move one code at a time
    while the weighted least-squares fit improves, 5 sweeps."""
    slx, sl2 = total(w * x * codes), total(w * codes * codes)
    for _ in range(5):
        for xi, wi, li in zip(x, w, codes):
            a, b = slx - wi * xi * li, sl2 - wi * li * li
            ok = (a > 0) & (b > 0) if need_sl2 else a > 0
            new = nearest_int(xi * b / nonzero(a)).clamp_(lo, hi)
            a2, b2 = a + wi * xi * new, b + wi * new * new
            take = ok & (new != li) & (a2 * a2 * sl2 > slx * slx * b2)
            if not need_sl2:
                take &= b2 > 0
            li.copy_(torch.where(take, new, li))
            slx, sl2 = torch.where(take, a2, slx), torch.where(take, b2, sl2)
    return torch.where(sl2 > 0, slx / nonzero(sl2), 0.0), codes


def make_q3(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_q3_quants with rmse: weights x^2, codes refined one at a time; scale, codes 0..2nmax-1."""
    x = cols(x)
    mx = largest(x)
    zero = mx.abs() < EPS
    codes = nearest_int(over(-nmax, nonzero(mx)) * x).clamp_(-nmax, nmax - 1)
    scale, codes = refine(x, x * x, codes, -nmax, nmax - 1, need_sl2=False)
    return torch.where(zero, 0.0, scale), torch.where(zero, 0.0, codes + nmax).t()


def make_qkx(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
             mad: bool = False, v3: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_qkx2_quants (v3: make_qkx3_quants): scale and min by weighted least squares over a grid of
    nstep + 1 scales; returns scale, min (to subtract), codes 0..nmax."""
    x, w = cols(x), cols(w)
    lo = x.min(dim=0).values.clamp(max=0)
    hi = x.max(dim=0).values
    flat = hi <= lo
    sw, sx = total(w), total(w * x)

    def dist(d):
        return d.abs() if mad else d * d

    iscale = over(nmax, nonzero(hi - lo))
    scale = over(1, iscale)
    codes = nearest_int(iscale * (x - lo)).clamp_(0, nmax)
    err = total(w * dist(scale * codes + lo - x))
    for i in range(nstep + 1):
        iscale = over(f32(F32(rmin) + F32(rdelta) * F32(i) + F32(nmax)), nonzero(hi - lo))
        v = iscale * (x - lo)
        l = torch.where(v > 0, nearest_int(v.clamp(max=nmax)), 0.0) if v3 else nearest_int(v).clamp_(0, nmax)
        wl = w * l
        sl, sl2, sxl = total(wl), total(wl * l), total(wl * x)
        det = sw * sl2 - sl * sl
        ts = (sw * sxl - sx * sl) / nonzero(det)
        tm = (sl2 * sx - sl * sxl) / nonzero(det)
        pos = tm > 0
        tm = torch.where(pos, 0.0, tm)
        ts = torch.where(pos, sxl / nonzero(sl2), ts)
        cur = total(w * dist(ts * l + tm - x))
        better = (det > 0) & (cur < err) & ~flat
        codes = torch.where(better, l, codes)
        err, scale, lo = torch.where(better, cur, err), torch.where(better, ts, scale), torch.where(better, tm, lo)
    return torch.where(flat, 0.0, scale), -lo, torch.where(flat, 0.0, codes).t()


def make_qp(x: torch.Tensor, nmax: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qp_quants: non-negative values (sub-block scales or mins) onto 0..nmax, weighted."""
    x, w = cols(x), cols(w)
    mx = x.max(dim=0).values
    zero = mx < EPS
    mx = nonzero(mx)
    iscale = over(nmax, mx)
    diff = x - over(1, iscale) * nearest_int(iscale * x)
    best = total(w * diff * diff)
    for i in range(-4, 5):
        if i:
            isi = over(f32(F32(0.1) * F32(i) + F32(nmax)), mx)
            diff = x - over(1, isi) * nearest_int(isi * x).clamp_(max=nmax)
            mse = total(w * diff * diff)
            better = mse < best
            best, iscale = torch.where(better, mse, best), torch.where(better, isi, iscale)
    codes = nearest_int(iscale * x).clamp_(max=nmax)
    scale, codes = refine(x, w, codes, -(2**31), nmax, need_sl2=True)
    return torch.where(zero, 0.0, scale), torch.where(zero, 0.0, codes).t()


def as_u8(t: torch.Tensor) -> torch.Tensor:
    """An integer code as the byte llama.cpp stores it holds it (uint8_t l = nearest_int(...))."""
    return (t.long() & 255).float()


def as_i8(t: torch.Tensor) -> torch.Tensor:
    return (((t.long() + 128) & 255) - 128).float()


def to_half(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float16 as stored, its float32 value)."""
    h = t.half()
    return h, h.float()


def requantize(x: torch.Tensor, f: Fit, sub: int) -> torch.Tensor:
    """The K-quants' last step: every code again from the final (float16-rounded) sub-block scales."""
    r = x.shape[0]
    s = f.scale[:, :, None]
    q = f.nearest(x.reshape(r, -1, sub), s, None if f.min is None else f.min[:, :, None])
    return torch.where(s == 0, f.codes.reshape(r, -1, sub), q).reshape(r, -1)


# ---- fits: x [R, B] (one block per row), qw [R, B] importance or None, sigma2 [R] for the legacy types ----

def fit_q8_0(x, qw, sigma2) -> Fit:
    d = x.abs().amax(dim=1) / 127
    inv = torch.where(d > 0, over(1, nonzero(d)), 0.0)
    v = x * inv[:, None]
    codes = torch.sign(v) * torch.floor(v.abs() + 0.5) + 128  # roundf: half away from zero
    h, df = to_half(d)
    return Fit(df[:, None], None, 128, 255, codes, {"d": h})


def fit_sym32(nmax: int):
    """Q4_0 (nmax 8) and Q5_0 (16): d = max / -nmax; with an importance matrix make_qx_quants."""

    def fit(x, qw, sigma2) -> Fit:
        if qw is None:
            d = largest_in_row(x) / -nmax
            inv = torch.where(d != 0, over(1, nonzero(d)), 0.0)
            codes = torch.trunc(x * inv[:, None] + (nmax + 0.5)).clamp_(max=2 * nmax - 1)
        else:
            d, codes = make_qx(x, nmax, qw * sqrt(sigma2[:, None] + x * x))
        h, df = to_half(d)
        return Fit(df[:, None], None, nmax, 2 * nmax - 1, codes, {"d": h})

    return fit


def fit_min32(nmax: int):
    """Q4_1 (nmax 15) and Q5_1 (31): d = (max - min) / nmax; with an importance matrix make_qkx3_quants."""

    def fit(x, qw, sigma2) -> Fit:
        if qw is None:
            lo, hi = x.amin(dim=1), x.amax(dim=1)
            d = (hi - lo) / nmax
            inv = torch.where(d != 0, over(1, nonzero(d)), 0.0)
            codes = torch.trunc((x - lo[:, None]) * inv[:, None] + 0.5).clamp_(max=nmax)
            m = lo
        else:
            d, the_min, codes = make_qkx(x, qw * sqrt(sigma2[:, None] + x * x), nmax, -0.9, 0.05, 36, v3=True)
            m = -the_min
        dh, df = to_half(d)
        mh, mf = to_half(m)
        return Fit(df[:, None], -mf[:, None], 0, nmax, codes, {"d": dh, "m": mh})

    return fit


def positive_max(t: torch.Tensor) -> torch.Tensor:
    """Each row's largest value, or +0 where none is above 0 (llama.cpp's running max from 0: an
    all-zero block's mins are -0.0, and its dmin is stored as +0)."""
    m = t.amax(dim=1)
    return torch.where(m > 0, m, 0.0)


def superblock_sigma2(x: torch.Tensor, factor: float) -> torch.Tensor:
    return (factor * row_total(x * x) / x.shape[1])[:, None]


def fit_q2_k(x, qw, sigma2) -> Fit:
    r = x.shape[0]
    xs = x.reshape(r * 16, 16)
    if qw is None:
        sc, mn, codes = make_qkx(xs, xs.abs(), 3, -0.5, 0.1, 15, mad=True)
        sc, mn = sc.reshape(r, 16), mn.reshape(r, 16)
        ms, mm = positive_max(sc), positive_max(mn)
        ls = torch.where(ms[:, None] > 0, nearest_int(over(15, nonzero(ms))[:, None] * sc), 0.0)
        lm = torch.where(mm[:, None] > 0, nearest_int(over(15, nonzero(mm))[:, None] * mn), 0.0)
        byte = (ls.long() | (lm.long() << 4)) & 255  # as stored: the scale below the min's nibble
        ls, lm = (byte & 15).float(), (byte >> 4).float()
        d, dmin = ms / 15, mm / 15
    else:
        w = (qw * sqrt(superblock_sigma2(x, 1.0) + x * x)).reshape(r * 16, 16)
        sc, mn, codes = make_qkx(xs, w, 3, -0.9, 0.05, 36, v3=True)
        sw = row_total(w).view(r, 16)
        d, ls = make_qp(sc.reshape(r, 16), 15, sw)
        dmin, lm = make_qp(mn.reshape(r, 16), 15, sw)
    dh, df = to_half(d)
    mh, mf = to_half(dmin)
    f = Fit(df[:, None] * ls, mf[:, None] * lm, 0, 3, codes.reshape(r, 256), {"d": dh, "dmin": mh, "sc": ls, "m": lm})
    f.codes = requantize(x, f, 16)
    return f


def fit_q3_k(x, qw, sigma2) -> Fit:
    r = x.shape[0]
    xs = x.reshape(r * 16, 16)
    if qw is None:
        sc, codes = make_q3(xs, 4)
        sc = sc.reshape(r, 16)
        mx = largest_in_row(sc)
        iscale = over(-32, nonzero(mx))
        ls = torch.where(mx[:, None] != 0, nearest_int(iscale[:, None] * sc).clamp_(-32, 31) + 32, 0.0)
        d = torch.where(mx != 0, over(1, iscale), 0.0)
    else:
        w = (qw * sqrt(superblock_sigma2(x, 2.0) + x * x)).reshape(r * 16, 16)
        sc, codes = make_qx(xs, 4, w)
        d, ls = make_qx(sc.reshape(r, 16), 32, row_total(w).view(r, 16))
    dh, df = to_half(d)
    f = Fit(df[:, None] * (ls - 32), None, 4, 7, codes.reshape(r, 256), {"d": dh, "sc": ls})
    f.codes = requantize(x, f, 16)
    return f


def fit_k32(nmax: int, rmin: float, nstep: int):
    """Q4_K (nmax 15) and Q5_K (31): 8 sub-blocks of 32 with 6-bit scales and mins."""

    def fit(x, qw, sigma2) -> Fit:
        r = x.shape[0]
        xs = x.reshape(r * 8, 32)
        if qw is None:
            w = sqrt(row_total(xs * xs) / 32)[:, None] + xs.abs()
            sc, mn, codes = make_qkx(xs, w, nmax, rmin, 0.1, nstep)
            sc, mn = sc.reshape(r, 8), mn.reshape(r, 8)
            ms, mm = positive_max(sc), positive_max(mn)
            ls = as_u8(nearest_int(torch.where(ms > 0, over(63, nonzero(ms)), 0.0)[:, None] * sc)).clamp_(max=63)
            lm = as_u8(nearest_int(torch.where(mm > 0, over(63, nonzero(mm)), 0.0)[:, None] * mn)).clamp_(max=63)
            d, dmin = ms / 63, mm / 63
        else:
            w = (qw * sqrt(superblock_sigma2(x, 2.0) + x * x)).reshape(r * 8, 32)
            sc, mn, codes = make_qkx(xs, w, nmax, -0.9, 0.05, 36, v3=True)
            sw = row_total(w).view(r, 8)
            d, ls = make_qp(sc.reshape(r, 8), 63, sw)
            dmin, lm = make_qp(mn.reshape(r, 8), 63, sw)
        dh, df = to_half(d)
        mh, mf = to_half(dmin)
        f = Fit(df[:, None] * ls, mf[:, None] * lm, 0, nmax, codes.reshape(r, 256),
                {"d": dh, "dmin": mh, "sc": ls, "m": lm})
        f.codes = requantize(x, f, 32)
        return f

    return fit


def fit_q6_k(x, qw, sigma2) -> Fit:
    r = x.shape[0]
    xs = x.reshape(r * 16, 16)
    sc, codes = make_qx(xs, 32, xs * xs if qw is None else qw.reshape(r * 16, 16))
    sc = sc.reshape(r, 16)
    mx = largest_in_row(sc)
    zero = mx.abs() < EPS
    iscale = over(-128, nonzero(mx))
    ls = torch.where(zero[:, None], 0.0, as_i8(nearest_int(iscale[:, None] * sc).clamp_(max=127)))
    dh, df = to_half(torch.where(zero, 0.0, over(1, iscale)))
    codes = torch.where(zero[:, None], 0.0, codes.reshape(r, 256))
    f = Fit(df[:, None] * ls, None, 32, 63, codes, {"d": dh, "sc": ls})
    f.codes = requantize(x, f, 16)
    return f


# ---- packing: codes and fields -> bytes, as ggml-common.h lays the blocks out ----

def u8(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.int64).numpy().astype(np.uint8)


def half_bytes(h: torch.Tensor) -> np.ndarray:
    return h.numpy().view(np.uint8).reshape(-1, 2)


def nibbles(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return (lo & 15) | ((hi & 15) << 4)


def bits_at(hi: np.ndarray, axis: int) -> np.ndarray:
    """OR of hi's slices along axis, slice k shifted left by k * (width of one code)."""
    n = hi.shape[axis]
    width = 8 // n
    out = np.zeros(np.delete(hi.shape, axis), dtype=np.uint8)
    for k in range(n):
        out |= np.take(hi, k, axis=axis) << (width * k)
    return out


def qh32(q: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit j of a little-endian uint32 is code j's fifth bit."""
    hi = ((q >> 4) & 1).astype(np.uint32)
    return (hi << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32).view(np.uint8).reshape(-1, 4)


def scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: eight 6-bit scales and mins in 12 bytes (get_scale_min_k4's inverse)."""
    return np.concatenate([ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                           nibbles(ls[:, 4:], lm[:, 4:])], axis=1)


def pack(t: str, f: Fit) -> np.ndarray:
    q = u8(f.codes)
    r = q.shape[0]
    g = {k: half_bytes(v) if v.dtype == torch.float16 else u8(v) for k, v in f.fields.items()}
    if t == "Q8_0":
        parts = [g["d"], q - np.uint8(128)]
    elif t == "Q4_0":
        parts = [g["d"], nibbles(q[:, :16], q[:, 16:])]
    elif t == "Q4_1":
        parts = [g["d"], g["m"], nibbles(q[:, :16], q[:, 16:])]
    elif t == "Q5_0":
        parts = [g["d"], qh32(q), nibbles(q[:, :16], q[:, 16:])]
    elif t == "Q5_1":
        parts = [g["d"], g["m"], qh32(q), nibbles(q[:, :16], q[:, 16:])]
    elif t == "Q2_K":
        parts = [nibbles(g["sc"], g["m"]), bits_at(q.reshape(r, 2, 4, 32), 2).reshape(r, 64), g["d"], g["dmin"]]
    elif t == "Q3_K":
        sc = g["sc"]
        hmask = bits_at((q >> 2).reshape(r, 8, 32), 1)
        low = bits_at((q & 3).reshape(r, 2, 4, 32), 2).reshape(r, 64)
        packed = np.concatenate([nibbles(sc[:, :8], sc[:, 8:]), bits_at((sc >> 4).reshape(r, 4, 4), 1)], axis=1)
        parts = [hmask, low, packed, g["d"]]
    elif t in ("Q4_K", "Q5_K"):
        q4 = q.reshape(r, 4, 2, 32)
        parts = [g["d"], g["dmin"], scales_k4(g["sc"], g["m"])]
        if t == "Q5_K":
            parts.append(bits_at((q4 >> 4).reshape(r, 8, 32), 1))
        parts.append(nibbles(q4[:, :, 0], q4[:, :, 1]).reshape(r, 128))
    elif t == "Q6_K":
        q6 = q.reshape(r, 2, 4, 32)
        ql = np.concatenate([nibbles(q6[:, :, 0], q6[:, :, 2]), nibbles(q6[:, :, 1], q6[:, :, 3])], axis=2)
        parts = [ql.reshape(r, 128), bits_at(q6 >> 4, 2).reshape(r, 64),
                 f.fields["sc"].to(torch.int8).numpy().view(np.uint8), g["d"]]
    else:
        raise QuantkitError(f"no packer for {t}")
    return np.concatenate(parts, axis=1)


FITS: dict[str, Callable] = {
    "Q8_0": fit_q8_0, "Q4_0": fit_sym32(8), "Q5_0": fit_sym32(16), "Q4_1": fit_min32(15), "Q5_1": fit_min32(31),
    "Q2_K": fit_q2_k, "Q3_K": fit_q3_k, "Q4_K": fit_k32(15, -1.0, 20), "Q5_K": fit_k32(31, -0.5, 15), "Q6_K": fit_q6_k,
}


def fit_blocks(t: str, w: torch.Tensor, importance: torch.Tensor | None) -> Fit:
    """Fit every block of w [N, K] (blocks run along rows)."""
    n, k = w.shape
    b = sizes(t)[0]
    x = w.reshape(-1, b)
    qw = None if importance is None else importance.float().reshape(1, k // b, b).expand(n, -1, -1).reshape(-1, b)
    sigma2 = row_sigma2(t, w, importance)
    return FITS[t](x, qw, None if sigma2 is None else sigma2.repeat_interleave(k // b))


def row_sigma2(t: str, w: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor | None:
    """Each row's mean square: what the legacy types' importance weighting adds x^2 to (the K-quants
    take theirs per block; nothing else needs it)."""
    return row_total(w * w) / w.shape[1] if t in LEGACY_TYPES and importance is not None else None


CHUNK = 2**21  # values quantized at a time: the block searches' temporaries are many times this


def tensor(t: str, blocks: np.ndarray, n: int) -> QuantizedTensor:
    raw = np.ascontiguousarray(blocks).view(np.uint8).reshape(n, -1)
    return QuantizedTensor(codes=torch.from_numpy(raw), scales=None, zeros=None,
                           g_idx=None, bits=BITS[t], group_size=sizes(t)[0], sym=False, ggml=t)


def quantize(w: torch.Tensor, t: str, importance: torch.Tensor | None = None) -> QuantizedTensor:
    """Round-to-nearest of w [N, K] into GGUF type t, as llama.cpp's quantize does (importance: its imatrix,
    the mean squared input of each of the K columns)."""
    check(t, w.shape[1])
    rows = []
    for chunk in w.detach().cpu().split(max(1, CHUNK // w.shape[1])):  # rows are independent: bounded temporaries
        chunk = chunk.float()
        plain = importance is None or t == "Q8_0"  # Q8_0 takes no importance
        blocks = compiled.quantize(chunk.numpy(), t) if plain and t not in FLOAT_TYPES else None
        if blocks is None and (t in FLOAT_TYPES or plain and t in LEGACY_TYPES):  # not compiled: gguf-py's
            blocks = gguf.quants.quantize(chunk.numpy(), GGMLQuantizationType[t])  # (llama.cpp's but a zero's sign)
        if blocks is None:
            blocks = pack(t, fit_blocks(t, chunk, importance))
        rows.append(np.ascontiguousarray(blocks).view(np.uint8).reshape(len(chunk), -1))
    return tensor(t, np.concatenate(rows), w.shape[0])


def gptq(w: torch.Tensor, h: torch.Tensor, t: str, importance: torch.Tensor | None = None, damp: float = 0.01,
         name: str = "layer") -> GPTQResult:
    """GPTQ onto the GGUF grid: at each block's first column the block is fitted as llama.cpp would fit
    it (with the columns as updated so far), then its columns are rounded one at a time onto that
    fit, each rounding error pushed onto the columns not yet quantized through the inverse Hessian."""
    check(t, w.shape[1], name)
    if t in FLOAT_TYPES:
        return GPTQResult(quantize(w, t), 0.0)
    n, k = w.shape
    b = sizes(t)[0]
    sub = {"Q4_K": 32, "Q5_K": 32}.get(t, 16 if t in K_TYPES else b)
    w, _ = prepare(w.detach(), h)
    if importance is not None:  # often H's diagonal, which the factor below overwrites while it lasts
        importance = importance.clone()
    fits, codes, loss = [], torch.zeros(n, k), 0.0
    with inverse_factor(h, damp, name) as hinv:
        for c0 in range(0, k, b):
            w1 = w[:, c0:c0 + b].clone()
            err = torch.zeros_like(w1)
            hinv1 = hinv[c0:c0 + b, c0:c0 + b].contiguous()  # its rows are read one by one
            qw = None if importance is None else importance[c0:c0 + b].float().expand(n, -1)
            f = FITS[t](w1, qw, row_sigma2(t, w, importance))
            for i in range(b):
                q = f.round(w1[:, i], i // sub)
                codes[:, c0 + i] = q
                e = (w1[:, i] - f.value(q, i // sub)) / hinv1[i, i]
                w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
                err[:, i] = e
            loss += float(err.square().sum()) / 2
            push_error(w, err, hinv, c0, c0 + b)
            f.codes = torch.where((f.scale == 0).repeat_interleave(sub, dim=1), f.codes, codes[:, c0:c0 + b])
            fits.append(pack(t, f))
    return GPTQResult(tensor(t, np.stack(fits, axis=1).reshape(n, -1), n), loss)


GRID_TYPES = {(8, True): "Q8_0", (4, True): "Q4_0", (4, False): "Q4_1"}


def from_grid(qt: QuantizedTensor, name: str = "tensor") -> QuantizedTensor:
    """The same codes as GGUF blocks where the grids agree: groups of 32 in column order, 8-bit
    symmetric -> Q8_0 and 4-bit symmetric -> Q4_0 (exact), 4-bit with zero points -> Q4_1, whose min
    (-scale * zero) is stored in float16 (off by at most 2^-11 of it)."""
    kind = GRID_TYPES.get((qt.bits, qt.sym))
    if qt.ggml is not None:
        return qt
    if qt.flat or kind is None or qt.group_size != 32 or qt.act_order:
        grid = f"{qt.bits}-bit {'symmetric' if qt.sym else 'asymmetric'} grid in groups of {qt.group_size}"
        fix = f"{option('sym', True)} (8 bits have no asymmetric GGUF type)" if qt.bits == 8 and not qt.flat and \
            not qt.sym and qt.group_size == 32 and not qt.act_order else \
            f"{option('bits', 4, 8)} and {option('group_size', 32)}, without act-order"
        grid += " with act-order" if not qt.flat and qt.act_order else ""
        raise QuantkitError(f"{name}: {'an' if qt.bits == 8 else 'a'} {grid} has no GGUF block type: quantize with "
                            f"{fix}, or for GGUF directly ({option('format', 'gguf')})")
    n, k = qt.shape
    check(kind, k, name)
    fields = {"d": qt.scales.reshape(-1)}
    if kind == "Q4_1":
        fields["m"] = (-qt.scales.float() * qt.zeros.float()).reshape(-1).half()
    f = Fit(qt.scales.float(), None, 0, 2**qt.bits - 1, qt.codes.reshape(-1, 32).float(), fields)
    return tensor(kind, pack(kind, f), n)


# llama.cpp's CPU matmul rounds the activations to the weight type's partner before the dot product
VEC_DOT = {**{t: "Q8_0" for t in LEGACY_TYPES}, **{t: "Q8_K" for t in K_TYPES}, "F16": "F16", "BF16": "BF16"}


def round_activations(x: torch.Tensor, weight_type: str) -> torch.Tensor:
    """x [..., K] as llama.cpp's x86 CPU backend hands it to a matmul with a weight of weight_type:
    8-bit blocks of 32 with a float16 scale (Q8_0, Q8_1) for the 32-value types, of 256 with a
    float32 scale (Q8_K) for the K-quants, float16 or bfloat16 for those weights."""
    kind = VEC_DOT.get(weight_type)
    if kind in ("F16", "BF16"):
        return x.to(torch.float16 if kind == "F16" else torch.bfloat16).to(x.dtype)
    if kind is None:
        return x
    rows = x.detach().float().reshape(-1, 32 if kind == "Q8_0" else 256)
    if kind == "Q8_0":  # the x86 SIMD rows: times 127 / amax, rounded half to even
        amax = rows.abs().amax(dim=1, keepdim=True)
        q = torch.round(rows * torch.where(amax > 0, over(127, nonzero(amax)), 0.0))
        return ((amax / 127).half().float() * q).reshape(x.shape).to(x.dtype)
    mx = largest_in_row(rows)[:, None]
    iscale = torch.where(mx == 0, 0.0, over(-127, nonzero(mx)))
    q = torch.round(iscale * rows).clamp_(max=127)
    return (torch.where(mx == 0, 0.0, over(1, nonzero(iscale))) * q).reshape(x.shape).to(x.dtype)
