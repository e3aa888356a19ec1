"""The packed integer layouts the exports use, in torch: the GPTQ bit stream and bitsandbytes' nibbles.

GPTQ stream: values are packed along dim 0, each run of 32 values one 32*bits-bit little-endian
stream in `bits` int32 words, value i at bit bits*i (3-bit values 10 and 21 straddle two words).
"""
from __future__ import annotations

import torch

from .qtensor import per_slice


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [R, C] (R*bits a multiple of 32) -> int32 [R*bits/32, C]; columns are packed
    a slice at a time, since the int64 arithmetic takes 8 bytes per value."""
    r, c = values.shape
    if r * bits % 32:
        raise ValueError(f"{r} values of {bits} bits do not fill whole 32-bit words")
    step = per_slice(r)
    if c > step:
        return torch.cat([pack(values[:, j:j + step], bits) for j in range(0, c, step)], dim=1)
    v = torch.cat([values.long(), values.new_zeros((-r) % 32, c, dtype=torch.long)]).view(-1, 32, c)
    out = torch.zeros(v.shape[0], bits, c, dtype=torch.long, device=values.device)
    for i in range(32):
        word, off = divmod(bits * i, 32)
        out[:, word] |= (v[:, i] << off) & 0xFFFFFFFF
        if off + bits > 32:
            out[:, word + 1] |= v[:, i] >> (32 - off)
    words = out.view(-1, c)[: r * bits // 32]
    return (words - (words >> 31 << 32)).to(torch.int32)  # as signed 32-bit words


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack: int32 [W, C] -> int32 values [W*32/bits, C]."""
    w, c = packed.shape
    mask = (1 << bits) - 1
    if 32 % bits == 0:  # whole values per word: an arithmetic shift's sign bits are masked off
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
        return ((packed[:, None, :] >> shifts[:, None]) & mask).reshape(-1, c)
    p = packed.long().reshape(-1, bits, c) & 0xFFFFFFFF
    out = torch.empty(p.shape[0], 32, c, dtype=torch.int32, device=packed.device)
    for i in range(32):
        word, off = divmod(bits * i, 32)
        x = p[:, word] >> off
        if off + bits > 32:
            x |= p[:, word + 1] << (32 - off)
        out[:, i] = x & mask
    return out.view(-1, c)


def pack_nibbles(codes: torch.Tensor, pad: int) -> torch.Tensor:
    """4-bit codes, flattened row-major, two per byte, the first in the high nibble; an odd count
    is padded with the code pad. Returns uint8 [ceil(n/2)] (bitsandbytes' order)."""
    c = codes.reshape(-1).to(torch.uint8)
    if c.numel() % 2:
        c = torch.cat([c, c.new_tensor([pad])])
    return (c[::2] << 4) | c[1::2]


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack_nibbles: the first n codes, uint8."""
    p = packed.reshape(-1)
    return torch.stack([p >> 4, p & 15], dim=1).reshape(-1)[:n]
