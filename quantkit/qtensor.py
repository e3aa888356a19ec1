"""The one quantized-tensor type every quantizer returns and every exporter consumes."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from .errors import QuantkitError, option


def per_slice(width: int) -> int:
    """How many lines (rows or columns) of width values make a slice of about 4M values (16 MiB of
    float32), at least one: operations on large matrices go a slice at a time to bound temporaries."""
    return max(1, 2**22 // max(width, 1))


BITS = (2, 3, 4, 8)
EXL2_BITS = (2, 3, 4, 5, 6, 8)


def whole(v) -> bool:
    """v is a whole number as a setting must be: 4.0 and True pass `in (2, 3, 4, 8)` and comparisons,
    then break shifts and indexing far from where they came in."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_bits_group(bits: int, group_size: int, named: bool = False) -> None:
    """named: the values are the caller's options, and the refusal names them so (--bits 5, bits=5)."""
    if not whole(bits) or bits not in BITS:
        said = f"{option('bits', bits)} is an unsupported bit width" if named else f"unsupported bit width {bits!r}"
        raise QuantkitError(f"{said}: use one of {', '.join(map(str, BITS))}")
    if not whole(group_size) or group_size != -1 and not 1 <= group_size < 2**31:  # g_idx is int32
        said = option("group_size", group_size) if named else f"group size {group_size!r}"
        raise QuantkitError(f"{said} is invalid: use -1 (per channel) or a positive whole size such as 128")


def check_scales(w: torch.Tensor, scales: torch.Tensor, name: str = "a weight") -> None:
    """Scales (as stored) that are not finite come from NaN or Inf in w, or from values past what a
    float16 scale can step to: refused here, since the export would be refused when read back as damaged."""
    if torch.isfinite(scales).all():
        return
    if not torch.isfinite(w).all():
        raise QuantkitError(f"{name} contains NaN or Inf: the checkpoint is damaged; re-download or re-export it")
    raise QuantkitError(f"{name} holds values up to {float(w.abs().max()):.3g}, too large for float16 scales: "
                        f"use NF4 (float32 scales), or with RTN or GPTQ leave it in float (a {option('rules')} entry with skip)")


def group_index(in_features: int, group_size: int) -> torch.Tensor:
    """g_idx without act-order: column k belongs to group k // G (the last group may be shorter)."""
    g = in_features if group_size == -1 else group_size
    return torch.arange(in_features, dtype=torch.int32) // g


@dataclass
class QuantizedTensor:
    """Integer grids (RTN, GPTQ, AWQ): W[n, k] = scales[n, g_idx[k]] * (codes[n, k] - zeros[n, g_idx[k]]).
    Codebook formats (NF4, FP4): W.flatten()[i] = scales[i // G] * codebook[codes.flatten()[i]], the
    blocks of G running over the row-major flattened weight as bitsandbytes' do (flat).

    codes are kept in the original column order; act-order (a permutation of the columns
    during quantization) shows only in g_idx, as in the GPTQ checkpoint format.

    GGUF block types (ggml: "Q4_K", ...): codes are the blocks' bytes as llama.cpp stores them,
    [N, bytes per row]; scales, zeros and g_idx are None (the blocks hold their own).
    """

    codes: torch.Tensor  # uint8 [N, K], 0 .. 2^bits - 1
    scales: torch.Tensor  # float16 [N, ng]; flat: float32 [ceil(N*K/G)], bitsandbytes' absmax
    zeros: torch.Tensor | None  # uint8 [N, ng]; symmetric: 2^(bits-1); None with a codebook
    g_idx: torch.Tensor | None  # int32 [K]; None when flat
    bits: int
    group_size: int  # -1: one group per row
    sym: bool
    codebook: torch.Tensor | None = None  # float32 [2^bits]: the value of each code
    flat: bool = False
    nested: QuantizedTensor | None = None  # double quantization: scales = nested.dequantize() + offset
    offset: float = 0.0
    ggml: str | None = None
    # EXL2: widths mixed within the tensor, group_bits[g] the width of group g (bits is the widest);
    # scales are ((c + 1)^2 / 256) * scale_max[g] for a 4-bit code c per row and group
    group_bits: torch.Tensor | None = None  # uint8 [ng]
    scale_max: torch.Tensor | None = None  # float16 [ng]

    def __post_init__(self) -> None:
        if self.ggml is not None:
            if self.ggml not in GGMLQuantizationType.__members__:
                raise QuantkitError(f"unknown GGUF tensor type {self.ggml!r}")
            if self.codes.dtype != torch.uint8 or self.codes.dim() != 2 or self.codes.shape[1] % self.block_bytes:
                raise QuantkitError(f"{self.ggml} rows must be whole blocks of {self.block_bytes} bytes")
            return
        if self.group_bits is None:
            check_bits_group(self.bits, self.group_size)
        elif not set(self.group_bits.tolist()) <= set(EXL2_BITS) or int(self.group_bits.max()) != self.bits:
            raise QuantkitError(f"group widths {sorted(set(self.group_bits.tolist()))} must be among "
                                f"{', '.join(map(str, EXL2_BITS))} with {self.bits} the widest")
        n, k = self.codes.shape
        ng = self.n_groups
        if self.flat:
            if self.codebook is None or self.scales.shape != (ng,):
                raise QuantkitError(f"a flat-block tensor needs a codebook and {ng} scales, got {tuple(self.scales.shape)}")
            return
        if self.scales.shape != (n, ng) or self.zeros.shape != (n, ng):
            raise QuantkitError(
                f"quantized tensor of shape {(n, k)} with group size {self.group_size} needs scales and zeros "
                f"of shape {(n, ng)}, got {tuple(self.scales.shape)} and {tuple(self.zeros.shape)}"
            )
        if self.g_idx.shape != (k,) or (k and int(self.g_idx.max()) >= ng):
            raise QuantkitError(f"g_idx must have {k} entries below {ng}, got shape {tuple(self.g_idx.shape)}")

    def to(self, device: str | torch.device) -> QuantizedTensor:
        """The same tensor with its parts on device."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        nested = self.nested.to(device) if self.nested is not None else None
        return replace(self, **moved, nested=nested)

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[GGMLQuantizationType[self.ggml]][1]

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.codes.shape
        if self.ggml is not None:
            return n, k // self.block_bytes * self.group_size
        return n, k

    @property
    def n_groups(self) -> int:
        n, k = self.codes.shape
        if self.flat:
            return math.ceil(n * k / self.group_size)
        return 1 if self.group_size == -1 else math.ceil(k / self.group_size)

    @property
    def act_order(self) -> bool:
        return not self.flat and not torch.equal(self.g_idx, group_index(self.codes.shape[1], self.group_size)
                                                 .to(self.g_idx.device))

    @property
    def bits_per_weight(self) -> float:
        """Storage per weight: codes, scales (or their double quantization) and zero points."""
        if self.ggml is not None:
            return 8 * self.block_bytes / self.group_size
        if self.group_bits is not None:  # 4-bit scale codes and a float16 maximum per group; no zeros
            n, k = self.codes.shape
            codes = int(self.group_bits.long()[self.g_idx.long()].sum()) * n
            return (codes + self.scales.numel() * 4 + self.scale_max.numel() * 16) / self.codes.numel()
        scales = self.nested.bits_per_weight * self.nested.codes.numel() + 32 if self.nested is not None \
            else self.scales.numel() * self.scales.element_size() * 8
        zeros = self.zeros.numel() * self.bits if self.zeros is not None else 0
        return self.bits + (scales + zeros) / self.codes.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.ggml is not None:
            w = quants.dequantize(self.codes.numpy(), GGMLQuantizationType[self.ggml])
            return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(dtype)
        if self.flat:
            n, k = self.codes.shape
            s = self.scales.float().repeat_interleave(self.group_size)[: n * k].view(n, k)
            # index_select: indexing's kernel runs small gathers on threads left spinning after it, which
            # took cores from the compiled NF4 codes that follow it in double quantization
            values = self.codebook.index_select(0, self.codes.reshape(-1).long()).view(n, k)
            return (values * s).to(dtype)
        w = self.codes.to(torch.float32)  # s * (q - z) in place
        zeros, scales = self.zeros.to(torch.float32), self.scales.to(torch.float32)
        n, k = w.shape
        if self.act_order:  # each column's group gathered, a slice of rows at a time
            g, rows = self.g_idx.long(), per_slice(k)
            for r in range(0, n, rows):
                w[r:r + rows].sub_(zeros[r:r + rows, g]).mul_(scales[r:r + rows, g])
            return w.to(dtype)
        size = k if self.group_size == -1 else self.group_size  # groups of adjacent columns: broadcast
        whole = k // size
        w[:, :whole * size].view(n, whole, size).sub_(zeros[:, :whole, None]).mul_(scales[:, :whole, None])
        w[:, whole * size:].sub_(zeros[:, whole:]).mul_(scales[:, whole:])  # a shorter last group
        return w.to(dtype)
