"""Linear layers that keep their weight packed, as the exports store it, and multiply through it:
Triton kernels on a GPU (quantkit.kernels); on the CPU, for few rows of input, torch's int4 matmul
or our compiled GEMV (quantkit/kernels/gemv.c), and else a torch fallback that dequantizes a slice
of rows at a time. No float copy of the weight is kept between calls, and the weight is not a
parameter: gradients reach the input (and any adapter on top), never the quantized weight.

Every shape and setting is checked when a layer is built, so a checkpoint that disagrees with its
config fails at load time, before any kernel reads out of bounds.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from . import blocks, kernels
from .errors import QuantkitError
from .packing import pack, pack_nibbles, unpack, unpack_nibbles
from .qtensor import BITS, QuantizedTensor, whole
from .quantizers import nf4

BACKENDS = ("auto", "triton", "torch")
CHUNK = 1 << 20  # weights dequantized at a time by the torch fallback (4 MiB of float32: fastest here)
# rows of x up to which the CPU's fused int4 matmul runs: its time grows with the rows, while the
# fallback's dequantization does not; on an AMX machine it took 0.76-1.05 of the fallback's time at
# 128 rows, 1.5-1.6x at 256 and 2.2-2.8x at 512 (benchmarks/RESULTS.md, kernel_bench.py --rows)
FUSED_ROWS = 128
# rows of x up to which the compiled GEMV runs (float32 sums of products: its time grows with the rows);
# at 32 rows it took 0.32-0.63 of the fallback's time on 7B shapes, at 64 rows 0.57-1.11 (kernel_bench.py --rows)
GEMV_ROWS = 32
# the GEMV's work, in one row's weights, from which its outputs are split over the cores: below, handing
# shares to threads costs more than it saves. Each row after the first costs about a third of the
# first (work = weights (rows + 2) / 3); on 2 cores 2^21 was the crossing, 2^20 took 1.2-1.4x one
# thread's time at one row (benchmarks/RESULTS.md, kernel_bench.py --split)
GEMV_SPLIT = 1 << 21
# output rows of the int4 matmul's operands made at a time (a multiple of its blocks of 64: the same
# bytes as made whole, test): whole, a 16384 x 4096 weight took 0.8 GB more at its first call
INT4_SLICE = 1024


class QuantLinear(torch.nn.Module):
    """y = x W^T + b with W held packed. backend: "auto" runs the Triton kernels on CUDA tensors and
    the torch fallback on the CPU; "triton" asks for the kernels anywhere (on the CPU they need
    TRITON_INTERPRET=1); "torch" the fallback anywhere. The packed buffers are read-only: what the
    fused paths make of them on first use (DERIVED) is made again by load_state_dict and .to(), not
    after an edit in place."""

    PACKED: tuple[str, ...] = ()  # buffers that keep their dtype when the model is cast
    DERIVED: tuple[str, ...] = ()  # what is made from the buffers on first use, made again where they change

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.backend = "auto"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend not in BACKENDS:
            raise QuantkitError(f"unknown kernel backend {self.backend!r}: use one of {', '.join(BACKENDS)}")
        if x.shape[-1] != self.in_features or not x.is_floating_point():
            raise QuantkitError(f"input of {x.shape[-1]} features in {x.dtype} for a layer of {self.in_features}: "
                                "pass floats of that width")
        if x.device.type == "cpu" and x.dtype != torch.float64 and torch.is_autocast_enabled("cpu"):
            # as autocast casts a linear's input (a float16 one under bfloat16 too): the fused paths take it, and
            # give autocast's dtype for a row as for many
            x = x.to(torch.get_autocast_dtype("cpu"))
        triton = self.backend == "triton" or (self.backend == "auto" and x.is_cuda and kernels.fits(self))
        if torch.is_grad_enabled() and x.requires_grad:
            y = Frozen.apply(x, self, triton)
        elif triton:
            y = kernels.matmul(x, self)
        else:
            y = self.fused(x) if self.backend == "auto" else None
            if y is None:
                y = self.sliced(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def fused(self, x: torch.Tensor) -> torch.Tensor | None:
        """x W^T by a fused CPU kernel for this layout (no gradient), or None where there is none."""
        return self.gemv(x)

    GEMV_UNIT = 1  # outputs per share of the GEMV's split

    def gemv(self, x: torch.Tensor) -> torch.Tensor | None:
        """x W^T by the compiled GEMV (quantkit/kernels/gemv.c) on the CPU for up to GEMV_ROWS rows, in
        float32 whatever x's dtype (each weight the float32 value of dequantize, only the sums in
        another order), the outputs split over the cores; None where it does not apply or was not built."""
        return self.gemv_run(x) if self.gemv_ready(x) else None

    def gemv_run(self, x: torch.Tensor) -> torch.Tensor:
        """gemv for an x that gemv_ready takes."""
        lib, rows = blocks.library(), x.numel() // self.in_features
        x2 = x.reshape(rows, self.in_features).float().contiguous()
        y = torch.zeros(rows, self.out_features, dtype=torch.float32, device="cpu")  # not torch's default dtype or device
        units = self.out_features // self.GEMV_UNIT

        def share(u0: int, u1: int) -> None:
            self.gemv_share(lib, x2, y, u0 * self.GEMV_UNIT, u1 * self.GEMV_UNIT)

        if self.in_features * self.out_features * (rows + 2) >= 3 * GEMV_SPLIT:
            blocks.split(units, share)
        else:
            share(0, units)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def gemv_ready(self, x: torch.Tensor) -> bool:
        """Whether the compiled GEMV takes x: on the CPU with the layer, a float dtype it rounds from
        float32 without loss of what was asked (not float64), up to GEMV_ROWS rows, a layout it reads,
        and the library built."""
        return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and x.numel() // max(self.in_features, 1) <= GEMV_ROWS
                and all(t.device.type == "cpu" for t in self._buffers.values() if t is not None)
                and self.gemv_fits() and blocks.library() is not None)

    def gemv_fits(self) -> bool:
        """Whether the compiled GEMV reads this layout."""
        return False

    def gemv_share(self, lib, x: torch.Tensor, y: torch.Tensor, start: int, stop: int) -> None:
        """Outputs start:stop of y = x W^T by the compiled GEMV (x float32 [M, K], y zeros [M, N])."""
        raise NotImplementedError

    def sliced(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T by the torch fallback: W dequantized to x's dtype a slice of rows at a time, each
        slice's product written into y (a list of them concatenated would hold y twice)."""
        rows, n = self.rows_per_chunk(), self.out_features
        y = None
        for r in range(0, n, rows):
            part = F.linear(x, self.dequantize(x.dtype, r, min(r + rows, n)))
            if rows >= n:
                return part
            if y is None:  # in the product's dtype: autocast's, where it casts
                y = part.new_empty(*part.shape[:-1], n)
            y[..., r:r + rows] = part
        return y

    def transposed(self, g: torch.Tensor) -> torch.Tensor:
        """g W (the gradient of x from that of x W^T), float32: W dequantized to g's dtype a slice of
        rows at a time, each slice's product (in g's dtype) summed in float32."""
        rows, n = self.rows_per_chunk(), self.out_features
        out = torch.zeros(*g.shape[:-1], self.in_features, dtype=torch.float32, device=g.device)
        for r in range(0, n, rows):
            out += g[..., r:r + rows] @ self.dequantize(g.dtype, r, min(r + rows, n))
        return out

    def rows_per_chunk(self) -> int:
        return max(CHUNK // self.in_features, 1)

    def dequantize(self, dtype: torch.dtype = torch.float32, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start:stop of W [N, K] in dtype, computed in float32 (the kernels' reference)."""
        raise NotImplementedError

    def kernel_args(self, tile_k: int) -> tuple[tuple, dict]:
        """What quantkit.kernels.jit's weight tile reads, for tiles of tile_k inputs: (w0..w4, fparam,
        i0, i1) and the compile-time constants FMT, BITS, NESTED, GROUP, ORDER."""
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        # .to(), .half(), .cuda() move packed buffers but never cast them: fp16 scales would not survive bf16
        self._forget()  # made again from the buffers where they go
        packed = {name: self._buffers.pop(name) for name in self.PACKED if self._buffers.get(name) is not None}
        try:  # the packed buffers first (the large ones: where memory runs out), the bias after them
            moved = {name: t.to(fn(t.new_empty(0)).device) for name, t in packed.items()}
            super()._apply(fn, recurse)
            packed = moved
        finally:  # a move that fails (no such device, out of memory) leaves the layer whole where it was
            for name, t in packed.items():
                self.register_buffer(name, t)
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        self._forget()  # the buffers change under it
        dtypes = {name: t.dtype for name, t in self._buffers.items() if name in self.PACKED and t is not None}
        super()._load_from_state_dict(*args, **kwargs)
        for name, dtype in dtypes.items():  # assign=True installs the state dict's own tensors: the kernels read these dtypes
            self._buffers[name] = self._buffers[name].to(dtype).contiguous()

    def _forget(self) -> None:
        for name in self.DERIVED:
            self.__dict__.pop(name, None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Frozen(torch.autograd.Function):
    """x W^T with a gradient for x only. The backward dequantizes W again (on the CPU a slice at a
    time; with the kernels whole, in one launch, as their forward does): torch's linear would keep
    each layer's dequantized W until the backward, QLoRA's base at bf16's size."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: QuantLinear, triton: bool) -> torch.Tensor:
        ctx.layer, ctx.dtype, ctx.triton = layer, x.dtype, triton
        return kernels.dense(x, layer) if triton else layer.sliced(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        gx = g @ kernels.dequantize(ctx.layer, g.dtype) if ctx.triton else ctx.layer.transposed(g)
        return gx.to(ctx.dtype), None, None


def check_whole(name: str, **values) -> None:
    """Settings read from a checkpoint's JSON that must be whole numbers (qtensor.whole)."""
    for key, v in values.items():
        if not whole(v):
            raise QuantkitError(f"{name}: {key} is {v!r}, not a whole number: the checkpoint's quantization "
                                "config is wrong; re-export it")


def check_groups(g_idx: torch.Tensor, groups: int, name: str) -> None:
    """g_idx indexes the scales and zeros (the GEMV reads them by it): every value must be a group."""
    lo, hi = (int(g_idx.min()), int(g_idx.max())) if g_idx.numel() else (0, 0)
    if not 0 <= lo <= hi < groups:
        raise QuantkitError(f"{name}: g_idx in [{lo}, {hi}] does not fit the GPTQ layout's {groups} groups: "
                            "the checkpoint is corrupt; re-export it")


class GPTQLinear(QuantLinear):
    """The GPTQ checkpoint layout (exporters/gptq.py): qweight int32 [K*b/32, N] and qzeros int32
    [G, N*b/32] packed along K and N, scales fp16 [G, N], g_idx int32 [K];
    W[n, k] = scales[g, n] * (q[k, n] - z[g, n]) with g = g_idx[k]. v1 checkpoints store z - 1."""

    PACKED = ("qweight", "qzeros", "scales", "g_idx")
    DERIVED = ("int4", "order", "grouped", "decoded")
    GEMV_UNIT = 8  # the GEMV reads 8 columns of the packed words at a time

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                 bits: int, group_size: int, v1: bool, sym: bool = True, bias: torch.Tensor | None = None,
                 name: str = "linear"):
        k, n = g_idx.shape[0], scales.shape[-1]
        check_whole(name, bits=bits, group_size=group_size)
        if bits not in BITS:
            raise QuantkitError(f"{name}: {bits}-bit weights are not supported: the kernels read "
                                f"{', '.join(map(str, BITS))}; quantize with one of those")
        if group_size != -1 and group_size < 1:
            raise QuantkitError(f"{name}: group size {group_size} is not supported: use -1 (per channel) or a positive size")
        if g_idx.dim() != 1 or g_idx.is_floating_point() or g_idx.dtype == torch.bool:
            raise QuantkitError(f"{name}: g_idx is {g_idx.dtype} {tuple(g_idx.shape)}, not one integer group index per "
                                "input: the checkpoint is corrupt; re-export it")
        if qweight.dim() != 2 or k * bits != qweight.shape[0] * 32:  # which of the two is wrong, the config tells
            raise QuantkitError(f"{name}: qweight {tuple(qweight.shape)} holds {bits}-bit weights of "
                                f"{qweight.shape[0] * 32 / bits:g} inputs, g_idx {tuple(g_idx.shape)} indexes {k}: they "
                                "must agree: the checkpoint is corrupt; re-export it")
        groups = 1 if group_size == -1 else math.ceil(k / group_size)
        want = {"qweight": (k * bits // 32, n), "qzeros": (groups, n * bits // 32), "scales": (groups, n)}
        got = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
        for key, t in got.items():
            if tuple(t.shape) != want[key] or not (t.is_floating_point() if key == "scales" else t.dtype == torch.int32):
                raise QuantkitError(
                    f"{name}: {key} is {t.dtype} {tuple(t.shape)}, but {bits}-bit weights of {k} inputs and {n} outputs "
                    f"in groups of {group_size} need {'int32' if key != 'scales' else 'float'} {want[key]}: "
                    "the checkpoint is corrupt or its quantization_config is wrong")
        if k % 32 or n * bits % 32:
            raise QuantkitError(f"{name}: {k} inputs and {n} outputs of {bits} bits do not fit the GPTQ layout "
                                "(whole int32 words along both): the checkpoint is corrupt")
        check_groups(g_idx, groups, name)
        super().__init__(n, k, bias)
        self.bits, self.group_size, self.v1, self.sym = bits, group_size, v1, sym
        for key, t in {**got, "g_idx": g_idx.to(torch.int32)}.items():
            self.register_buffer(key, t.contiguous())
        self.plain_order = self._plain_order()

    def _plain_order(self) -> bool:
        """Whether the groups are of whole columns in order (no act-order, K a multiple of the group size)."""
        k, size = self.in_features, self.group_size
        plain = torch.arange(k, dtype=torch.int32, device="cpu") // size
        return size == -1 or (k % size == 0 and torch.equal(self.g_idx.cpu(), plain))

    def _load_from_state_dict(self, *args, **kwargs):
        # the buffers' shapes are checked by torch; g_idx's values, which index the scales, here
        super()._load_from_state_dict(*args, **kwargs)
        check_groups(self.g_idx, self.scales.shape[0], "the state dict")
        self.plain_order = self._plain_order()

    @classmethod
    def from_tensor(cls, qt: QuantizedTensor, bias: torch.Tensor | None = None, name: str = "linear") -> GPTQLinear:
        """Pack an integer grid; symmetric grids as v1 (zero - 1 stored), as exporters/gptq.py writes them."""
        if qt.codebook is not None or qt.ggml is not None:
            raise QuantkitError(f"{name}: the GPTQ layout holds integer grids, not codebook or GGUF blocks")
        n, k = qt.shape
        if k % 32 or n * qt.bits % 32:
            raise QuantkitError(f"{name} is {n}x{k}: the GPTQ layout needs in_features a multiple of 32 "
                                "and out_features*bits a multiple of 32")
        zeros = (qt.zeros.int() - int(qt.sym)) & ((1 << qt.bits) - 1)
        return cls(pack(qt.codes.T, qt.bits), pack(zeros, qt.bits).T.contiguous(), qt.scales.T.contiguous().half(),
                   qt.g_idx, qt.bits, qt.group_size, v1=qt.sym, sym=qt.sym, bias=bias, name=name)

    def packed(self) -> dict[str, torch.Tensor]:
        return {key: getattr(self, key) for key in self.PACKED}

    def zeros(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The zero points of output rows start:stop, int32 [rows, G]: unpacked in whole runs of 32 outputs
        (3 words at 3 bits) from the one that holds start."""
        stop = self.out_features if stop is None else stop
        first, end = start - start % 32, min(-(-stop // 32) * 32, self.out_features)
        words = self.qzeros[:, first * self.bits // 32: math.ceil(end * self.bits / 32)].T.contiguous()
        return (unpack(words, self.bits)[start - first: stop - first] + int(self.v1)) & ((1 << self.bits) - 1)

    def to_tensor(self) -> QuantizedTensor:
        return QuantizedTensor(unpack(self.qweight, self.bits).T.to(torch.uint8).contiguous(),
                               self.scales.T.contiguous().half(), self.zeros().to(torch.uint8), self.g_idx.clone(),
                               self.bits, self.group_size, self.sym)

    def rows_per_chunk(self) -> int:
        return max(super().rows_per_chunk() // 32, 1) * 32  # zeros unpack in whole runs of 32 outputs

    def dequantize(self, dtype: torch.dtype = torch.float32, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Computed as W^T [K, rows], the packed layout's own order, and returned as its transpose."""
        stop = self.out_features if stop is None else stop
        q = unpack(self.qweight[:, start:stop], self.bits)  # [K, rows]
        z = self.zeros(start, stop).T  # [G, rows]
        s = self.scales[:, start:stop].float()
        g = self.in_features if self.group_size == -1 else self.group_size
        if self.plain_order:  # column k in group k // g: broadcast the groups' scales and zeros
            w = (q.view(-1, g, stop - start) - z[:, None]).float().mul_(s[:, None]).view_as(q)
        else:
            idx = self.g_idx.long()
            w = (q - z[idx]).float().mul_(s[idx])
        # torch's CPU float16 matmul takes a transposed weight some 20x slower than a contiguous one
        return w.to(dtype).T.contiguous() if dtype == torch.float16 else w.to(dtype).T

    def fused(self, x: torch.Tensor) -> torch.Tensor | None:
        """4-bit weights in plain group order (or act-order with whole groups, x's columns in `order`),
        bfloat16 activations, up to FUSED_ROWS rows, on the CPU: torch's int4 matmul
        (_weight_int4pack_mm_for_cpu, which reads W = (q - 8) s + (8 - z) s with s and (8 - z) s rounded to
        bfloat16), the inputs padded with zeros to whole kernel groups. Its float32 and float16 paths are
        not vectorized: 4x a dense float32 matmul at batch 1 and 30x at batch 16 (benchmarks/kernel_bench.py).
        Otherwise the compiled GEMV where it applies, act-order with whole groups through the twin in
        group order (`grouped`): its scales and zeros are then read a group at a time, where act-order's
        read all groups' at once and took 1.2-1.6x a dense float32 matmul at batch 1 (kernel_bench.py)."""
        rows = x.numel() // self.in_features
        if x.is_cuda or self.bits != 4 or x.dtype != torch.bfloat16 or rows > FUSED_ROWS or self.int4 is None:
            if not self.gemv_ready(x):  # before the twin is made for it (which would take x alike)
                return None
            x, layer = self.ordered(x)
            return layer.gemv_run(x)
        packed, scales_zeros, group, k = self.int4
        if self.order is not None:
            x = x.index_select(-1, self.order)
        x2 = F.pad(x.reshape(-1, self.in_features), (0, k - self.in_features)).contiguous()  # a zero pad keeps strides
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group, scales_zeros)
        return y[:, :self.out_features].reshape(*x.shape[:-1], self.out_features)

    @functools.cached_property
    def order(self) -> torch.Tensor | None:
        """For act-order weights whose groups are whole (group g's columns, gathered, are group_size of
        them, as GPTQ's act-order writes them): the order of the columns that puts them in plain group
        order, int32 [K] (as the kernels read it). x[..., order] @ W[:, order]^T is x @ W^T, and
        W[:, order] is what the fast paths read. None for plain order (also with a short last group)
        and other groupings."""
        if self.plain_order or self.group_size == -1:
            return None
        order = torch.argsort(self.g_idx, stable=True)
        plain = torch.arange(self.in_features, dtype=torch.int32, device=order.device) // self.group_size
        whole = torch.equal(self.g_idx[order], plain) and not torch.equal(self.g_idx, plain)
        return order.to(torch.int32) if whole else None

    @functools.cached_property
    def grouped(self) -> GPTQLinear | None:
        """This layer with its columns in `order`, made once (the packed weight's size again): plain
        group order, the kernels' fast path. None where there is no such order, or where K is not whole
        groups (the kernels read such a layer as act-order all the same)."""
        if self.order is None or self.in_features % self.group_size:
            return None
        codes = unpack(self.qweight, self.bits)[self.order]  # [K, N] in plain group order
        return GPTQLinear(pack(codes, self.bits), self.qzeros, self.scales, self.g_idx[self.order], self.bits,
                          self.group_size, self.v1, self.sym)

    def ordered(self, x: torch.Tensor) -> tuple[torch.Tensor, GPTQLinear]:
        """x and the layer whose layout the CPU's GEMV multiplies it with (the same product): the twin and
        x's columns in its order where there is one."""
        if self.grouped is None:
            return x, self
        return x.index_select(-1, self.order), self.grouped

    @functools.cached_property
    def int4(self) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
        """The int4 kernel's operands, made once: packed codes, scales and float zeros [K'/G', N', 2],
        its group size G' (the largest of 256/128/64/32 that divides ours; per channel: 128) and K'
        (K padded to whole groups; N' is N padded to the kernel's 16). Act-order weights with whole
        groups give theirs with the columns in `order` (fused() orders x alike); None for other
        groupings, which it cannot read."""
        k, n = self.in_features, self.out_features
        size = k if self.group_size == -1 else self.group_size
        group = 128 if self.group_size == -1 else next((c for c in (256, 128, 64, 32) if size % c == 0), None)
        order = slice(None) if self.order is None else self.order.cpu()
        if self.bits != 4 or group is None or not torch.equal(
                self.g_idx.cpu()[order], torch.arange(k, dtype=torch.int32, device="cpu") // size):
            return None
        padded, rows = -(-k // group) * group, -(-n // 16) * 16
        qweight, parts = self.qweight.cpu(), []
        for r in range(0, rows, INT4_SLICE):  # a slice at a time: its codes unpacked, gathered and transposed are int32
            codes = torch.full((min(INT4_SLICE, rows - r), padded), 8, dtype=torch.int32, device="cpu")  # padding: code 8, scale 0
            codes[:min(n - r, INT4_SLICE), :k] = unpack(qweight[:, r:r + INT4_SLICE], 4)[order].T
            parts.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        ours = torch.arange(0, padded, group, device="cpu") // size  # each kernel group's group
        s = self.scales.cpu().float()[ours]
        z = self.zeros().cpu().T.float()[ours]
        scales_zeros = F.pad(torch.stack([s, (8 - z) * s], -1), (0, 0, 0, rows - n)).bfloat16()
        return torch.cat(parts), scales_zeros, group, padded

    def gemv_fits(self) -> bool:
        return self.out_features % 8 == 0

    @functools.cached_property
    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The GEMV's scales float32 [G, N] and zeros int32 [G, N], made once (1/8 of the 4-bit packed
        weight's size at group 128)."""
        return self.scales.float().contiguous(), self.zeros().T.contiguous()

    def gemv_run(self, x: torch.Tensor) -> torch.Tensor:
        self.decoded  # made here once, not by the first shares on several threads at once
        return super().gemv_run(x)

    def gemv_share(self, lib, x: torch.Tensor, y: torch.Tensor, start: int, stop: int) -> None:
        scales, zeros = self.decoded
        lib.gptq_gemv(x.data_ptr(), x.shape[0], self.in_features, self.qweight.data_ptr(), self.bits,
                      self.g_idx.data_ptr(), scales.data_ptr(), zeros.data_ptr(), self.out_features, start, stop,
                      y.data_ptr())

    def kernel_args(self, tile_k: int) -> tuple[tuple, dict]:
        if self.grouped is not None:  # act-order with whole groups: the twin, x read (and W written) through its order
            args, consts = self.grouped.kernel_args(tile_k)
            return args[:4] + (self.order,) + args[5:], consts | {"ORDER": True}
        # GROUP: the group size where every tile lies in one group, so scales and zeros are read per tile
        group = 0
        if self.plain_order:
            group = kernels.ALL if self.group_size == -1 else self.group_size if self.group_size % tile_k == 0 else 0
        return ((self.qweight, self.qzeros, self.scales, self.g_idx, self.g_idx, 0.0, self.qzeros.shape[1],
                 int(self.v1)), {"FMT": kernels.GPTQ, "BITS": self.bits, "NESTED": False, "GROUP": group, "ORDER": False})

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.bits}-bit, group {self.group_size}"


class NF4Linear(QuantLinear):
    """bitsandbytes' 4-bit layout (exporters/bnb.py): the row-major codes two per byte (first in the
    high nibble), one absmax per block of blocksize values, a 16-entry code table (NF4 or FP4);
    with double quantization the absmax values are uint8 codes of nested_map in blocks of
    nested_blocksize, plus offset. W.flatten()[i] = quant_map[code i] * absmax[i // blocksize]."""

    PACKED = ("packed", "absmax", "quant_map", "nested_absmax", "nested_map")

    def __init__(self, packed: torch.Tensor, absmax: torch.Tensor, quant_map: torch.Tensor, shape: tuple[int, int],
                 blocksize: int, nested_absmax: torch.Tensor | None = None, nested_map: torch.Tensor | None = None,
                 nested_blocksize: int = nf4.NESTED_BLOCK, offset: float = 0.0, bias: torch.Tensor | None = None,
                 name: str = "linear"):
        n, k = shape
        check_whole(name, out_features=n, in_features=k, blocksize=blocksize, nested_blocksize=nested_blocksize)
        if n < 1 or k < 1:
            raise QuantkitError(f"{name}: shape {n}x{k} holds no weights: the checkpoint's quant_state is corrupt; "
                                "re-export it")
        if nested_blocksize < 1 or isinstance(offset, bool) or not isinstance(offset, (int, float)) \
                or not math.isfinite(offset):
            raise QuantkitError(f"{name}: nested block size {nested_blocksize}, offset {offset!r}: the checkpoint's "
                                "quant_state is corrupt; re-export it")
        if blocksize not in nf4.BLOCK_SIZES:
            raise QuantkitError(f"{name}: block size {blocksize} is not one bitsandbytes writes "
                                f"({', '.join(map(str, nf4.BLOCK_SIZES))}): re-export it with one of those")
        nested = nested_absmax is not None
        blocks = math.ceil(n * k / blocksize)
        want = {"packed": ((n * k + 1) // 2, torch.uint8), "absmax": (blocks, torch.uint8 if nested else torch.float32),
                "quant_map": (16, torch.float32)}
        got = {"packed": packed.reshape(-1), "absmax": absmax.reshape(-1), "quant_map": quant_map.reshape(-1)}
        if nested:
            want |= {"nested_absmax": (math.ceil(blocks / nested_blocksize), torch.float32), "nested_map": (256, torch.float32)}
            got |= {"nested_absmax": nested_absmax.reshape(-1), "nested_map": nested_map.reshape(-1)}
        for key, t in got.items():
            if (t.numel(), t.dtype) != want[key]:
                raise QuantkitError(
                    f"{name}: {key} is {t.dtype} with {t.numel()} values, but a {n}x{k} weight in blocks of {blocksize} "
                    f"needs {want[key][1]} with {want[key][0]}: the checkpoint is corrupt or its quant_state wrong")
        super().__init__(n, k, bias)
        self.blocksize, self.nested_blocksize, self.offset = blocksize, nested_blocksize, float(offset)
        for key in self.PACKED:
            self.register_buffer(key, got[key].contiguous() if key in got else None)

    @classmethod
    def from_tensor(cls, qt: QuantizedTensor, bias: torch.Tensor | None = None, name: str = "linear") -> NF4Linear:
        if not qt.flat:
            raise QuantkitError(f"{name}: the bitsandbytes layout holds NF4/FP4 blocks, not {qt.bits}-bit integer grids")
        pad = int(torch.argmin(qt.codebook.abs()))  # an odd count ends with the code of 0
        if qt.nested is None:
            return cls(pack_nibbles(qt.codes, pad), qt.scales.float(), qt.codebook.float().clone(), qt.shape,
                       qt.group_size, bias=bias, name=name)
        return cls(pack_nibbles(qt.codes, pad), qt.nested.codes.reshape(-1), qt.codebook.float().clone(), qt.shape,
                   qt.group_size, qt.nested.scales.float(), qt.nested.codebook.float().clone(), qt.nested.group_size,
                   qt.offset, bias=bias, name=name)

    def to_tensor(self) -> QuantizedTensor:
        n, k = self.out_features, self.in_features
        nested = None
        if self.nested_absmax is not None:
            nested = QuantizedTensor(self.absmax[None].clone(), self.nested_absmax.clone(), None, None, 8,
                                     self.nested_blocksize, True, codebook=self.nested_map.clone(), flat=True)
        codes = unpack_nibbles(self.packed, n * k).view(n, k).clone()
        return QuantizedTensor(codes, self.scales(0, self.absmax.numel()), None, None, 4, self.blocksize, True,
                               codebook=self.quant_map.clone(), flat=True, nested=nested, offset=self.offset)

    def scales(self, first: int, last: int) -> torch.Tensor:
        """The absmax of blocks first:last, float32 (double quantization: decoded, plus the offset)."""
        if self.nested_absmax is None:
            return self.absmax[first:last]
        j = torch.arange(first, last, device=self.absmax.device)
        return (self.nested_map[self.absmax[first:last].long()] * self.nested_absmax[j // self.nested_blocksize]
                + torch.tensor(self.offset, dtype=torch.float32, device=self.absmax.device))

    def dequantize(self, dtype: torch.dtype = torch.float32, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = self.out_features if stop is None else stop
        lo, hi, b = start * self.in_features, stop * self.in_features, self.blocksize
        # both codes of a byte in one lookup: the table's value pair for each of the 256 bytes
        pairs = torch.stack([self.quant_map.repeat_interleave(16), self.quant_map.repeat(16)], dim=1)
        values = pairs[self.packed[lo // 2: (hi + 1) // 2].long()].view(-1)[lo % 2: lo % 2 + hi - lo]
        first, last = lo // b, (hi + b - 1) // b
        if lo % b == 0 and hi % b == 0:  # whole blocks: broadcast each block's absmax
            w = values.view(-1, b) * self.scales(first, last)[:, None]
        else:
            w = values * self.scales(first, last).repeat_interleave(b)[lo - first * b: hi - first * b]
        return w.view(stop - start, self.in_features).to(dtype)

    def gemv_fits(self) -> bool:  # 16 codes at a time, each run within one block
        return self.in_features % 16 == 0 and self.blocksize % 16 == 0

    def gemv_share(self, lib, x: torch.Tensor, y: torch.Tensor, start: int, stop: int) -> None:
        nested = self.nested_absmax is not None
        lib.nf4_gemv(x.data_ptr(), x.shape[0], self.in_features, self.packed.data_ptr(), self.quant_map.data_ptr(),
                     self.blocksize, None if nested else self.absmax.data_ptr(), self.absmax.data_ptr() if nested else None,
                     self.nested_absmax.data_ptr() if nested else None, self.nested_map.data_ptr() if nested else None,
                     self.nested_blocksize, self.offset, start, stop, self.out_features, y.data_ptr())

    def kernel_args(self, tile_k: int) -> tuple[tuple, dict]:
        nested = self.nested_absmax is not None
        # GROUP: the block size where rows are whole blocks and every tile lies in one (jit._weight's WORDS)
        whole = self.in_features % self.blocksize == 0 and self.blocksize % tile_k == 0
        return ((self.packed, self.absmax, self.quant_map, self.nested_absmax if nested else self.absmax,
                 self.nested_map if nested else self.quant_map, self.offset, self.blocksize, self.nested_blocksize),
                {"FMT": kernels.NF4, "BITS": 4, "NESTED": nested, "GROUP": self.blocksize if whole else 0, "ORDER": False})

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, 4-bit codebook, block {self.blocksize}, nested {self.nested_absmax is not None}"


def from_tensor(qt: QuantizedTensor, bias: torch.Tensor | None = None, name: str = "linear") -> QuantLinear:
    return (NF4Linear if qt.flat else GPTQLinear).from_tensor(qt, bias, name)


def install(module: torch.nn.Module, tensors: dict[str, QuantizedTensor]) -> None:
    """Replace each quantized nn.Linear of module (tensors: name -> its quantized weight) by a packed layer."""
    for name, qt in tensors.items():
        linear = module.get_submodule(name)
        module.set_submodule(name, from_tensor(qt, linear.bias, name))
