"""Which real loaders read an export as written: their documented constraints on bits, group size,
symmetry, act-order and shapes, in one table (../shared/docs/FORMATS.md, section 8, names the source).

Each rule returns why its loader refuses the export, or None when it reads it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from .config import CODEBOOK_METHODS, QuantConfig
from .errors import QuantkitError, option
from .layers import fused, linear_shapes

if TYPE_CHECKING:
    import torch

TARGETS = ("vllm", "exllama", "transformers", "llama.cpp")


@dataclass(frozen=True)
class Export:
    """What a loader looks at: the format, the grid, and the (out, in) shape of every quantized linear.
    With --rules, parts holds one Export per setting (the shapes of its linears), split names
    linears a loader fuses (q/k/v, gate/up) that got different settings, and skipped says that
    some linears stay in float."""
    format: str
    method: str
    bits: int
    group_size: int  # NF4/FP4: bitsandbytes' block size
    sym: bool
    g_idx: bool  # a g_idx that is not k // G (act-order without static groups)
    shapes: tuple[tuple[int, int], ...]
    parts: tuple[Export, ...] = ()
    split: str = ""
    skipped: bool = False

    @classmethod
    def of(cls, fmt: str, qconfig: QuantConfig, module: torch.nn.Module) -> Export:
        linears = list(linear_shapes(module))

        def one(c: QuantConfig, shapes) -> Export:
            return cls(fmt, c.method, c.bits, c.block_size if c.method in CODEBOOK_METHODS else c.group_size, c.sym,
                       c.act_order and not c.static_groups, tuple(sorted(set(shapes))))

        whole = one(qconfig, [(n, k) for _, n, k in linears])
        if not qconfig.rules:
            return whole
        settings = {name: qconfig.for_linear(name) for name, _, _ in linears}
        key = {name: c and (c.bits, c.group_size) for name, c in settings.items()}
        by_setting: dict[tuple, tuple[QuantConfig, list]] = {}
        for name, n, k in linears:
            if settings[name] is not None:
                by_setting.setdefault(key[name], (settings[name], []))[1].append((n, k))
        split = next((" / ".join(parts) for parts in fused(key).values() if len({key[p] for p in parts}) > 1), "")
        return replace(whole, parts=tuple(one(c, shapes) for c, shapes in by_setting.values()), split=split,
                       skipped=None in settings.values())


def one_setting(e: Export) -> str | None:
    """transformers 5's dequantize-at-load path decompresses every dense linear with the first config group."""
    return f"{len(e.parts)} settings in one file (it decompresses every linear with the first)" \
        if len(e.parts) > 1 else None


def base_setting(e: Export) -> str | None:
    """transformers' GPTQConfig keeps no `dynamic` (nor lm_head): optimum builds every linear at the
    file's base bits and group size, so other widths fail to load and skipped linears load empty."""
    if e.skipped or any((p.bits, p.group_size) != (e.bits, e.group_size) for p in e.parts):
        return "per-linear settings (its GPTQConfig drops `dynamic` and builds every linear at the base setting)"
    return None


def rows_of_blocks(e: Export) -> str | None:
    """bitsandbytes 0.50's CPU kernel dequantizes blocks within a row: below 2048 the block size must
    divide every linear's inputs (other blocks crash, or give wrong weights without AVX512-BF16)."""
    bad = [k for _, k in e.shapes if e.group_size < 2048 and k % e.group_size]
    return f"blocks of {e.group_size} across rows of {bad[0]} inputs (its CPU kernel needs the block size to " \
        "divide in_features)" if bad else None


def unfused(e: Export) -> str | None:
    return f"{e.split} at different settings (it loads them as one linear)" if e.split else None


def bits_in(*allowed: int) -> Callable[[Export], str | None]:
    return lambda e: None if e.bits in allowed else f"{e.bits}-bit weights (it reads {'/'.join(map(str, allowed))})"


def symmetric(e: Export) -> str | None:
    return None if e.sym else "asymmetric weights"


def marlin(e: Export) -> str | None:
    """vLLM's Marlin kernels: groups of 32/64/128 or per channel, N % 64 and K % 128 (per shard)."""
    if e.group_size not in (-1, 32, 64, 128):
        return f"group size {e.group_size} (it takes 32, 64, 128 or per channel)"
    bad = [(n, k) for n, k in e.shapes if n % 64 or k % 128]
    return f"a linear of {bad[0][0]} outputs and {bad[0][1]} inputs (it needs outputs % 64 == 0 and inputs % 128 == 0)" \
        if bad else None


def k_divisible(e: Export) -> str | None:
    bad = [k for _, k in e.shapes if e.group_size != -1 and k % e.group_size]
    return f"{bad[0]} inputs in groups of {e.group_size} (it needs the group size to divide in_features)" if bad else None


def power_of_two_groups(e: Export) -> str | None:
    g = e.group_size
    return None if g == -1 or g & (g - 1) == 0 else f"group size {g} (it takes powers of two)"


def groups_in(*sizes: int) -> Callable[[Export], str | None]:
    """GPTQModel's kernels (BaseQuantLinear._validate): a group size of the kernel's list, or a
    linear's whole input (one group)."""
    def rule(e: Export) -> str | None:
        bad = [k for _, k in e.shapes if e.group_size not in sizes and e.group_size != k]
        return f"group size {e.group_size} (it takes {', '.join(map(str, sizes[1:]))} or per channel)" if bad else None
    return rule


def raw_zeros(e: Export) -> str | None:
    """ExLlamaV2 turns gptq_v2's zero points (asymmetric exports) into v1's by subtracting 1 from each
    whole int32 word of them: a zero point of 0 borrows from its neighbour (both read wrong, no error)."""
    return None if e.sym else "asymmetric weights (its conversion of their zero points misreads a zero point of 0)"


def no_g_idx(e: Export) -> str | None:
    return f"act-order with a g_idx (use {option('static_groups', True)})" if e.g_idx else None


@dataclass(frozen=True)
class Consumer:
    name: str
    target: str  # the --for name
    format: str  # the export format it reads ("safetensors" here means the GPTQ layout)
    rules: tuple[Callable[[Export], str | None], ...] = ()  # each setting of the export
    note: str = ""
    whole: tuple[Callable[[Export], str | None], ...] = ()  # the export as one (its mix of settings)

    def refuses(self, e: Export) -> str | None:
        return next((r for rule in self.whole if (r := rule(e)) is not None), None) or \
            next((r for part in (e.parts or (e,)) for rule in self.rules if (r := rule(part)) is not None), None)


CONSUMERS = (
    Consumer("vLLM gptq_marlin", "vllm", "safetensors", (bits_in(4, 8), symmetric, marlin), whole=(unfused,)),
    # vLLM's gptq and awq create_weights: "The input size is not aligned with the quantized weight shape"
    Consumer("vLLM gptq", "vllm", "safetensors", (bits_in(2, 3, 4, 8), k_divisible), "slow kernel, float16 only",
             (unfused,)),
    Consumer("transformers + GPTQModel (torch kernel)", "transformers", "safetensors",
             (bits_in(2, 3, 4, 8), groups_in(-1, 16, 32, 64, 128, 256, 512, 1024)),
             "backend=\"torch\"; float16/bfloat16", (base_setting,)),
    Consumer("GPTQModel default CPU kernel", "transformers", "safetensors",
             (bits_in(4), groups_in(-1, 16, 32, 64, 128), k_divisible), "", (base_setting,)),
    Consumer("ExLlamaV2", "exllama", "safetensors", (bits_in(4), power_of_two_groups, raw_zeros)),
    Consumer("vLLM awq_marlin", "vllm", "awq", (marlin,)),
    Consumer("vLLM awq", "vllm", "awq", (k_divisible,), "float16"),
    Consumer("transformers + GPTQModel (AWQ)", "transformers", "awq", (groups_in(-1, 16, 32, 64, 128),)),
    Consumer("vLLM compressed-tensors (Marlin)", "vllm", "compressed-tensors",
             (bits_in(4, 8), lambda e: None if e.sym or e.bits == 4 else "asymmetric 8-bit weights", marlin, no_g_idx),
             whole=(unfused,)),
    Consumer("transformers + compressed-tensors (dequantized at load)", "transformers", "compressed-tensors",
             (k_divisible, no_g_idx), "CompressedTensorsConfig(dequantize=True)", (one_setting,)),
    # asymmetric: its model expects a zero point per row where the format packs them (size mismatch at load)
    Consumer("transformers + compressed-tensors (compressed)", "transformers", "compressed-tensors",
             (k_divisible, no_g_idx, symmetric), "the package's forward"),
    Consumer("transformers + bitsandbytes (CUDA)", "transformers", "bitsandbytes"),
    Consumer("transformers + bitsandbytes (CPU)", "transformers", "bitsandbytes", (rows_of_blocks,)),
    Consumer("ExLlamaV2", "exllama", "exl2"),
    Consumer("llama.cpp", "llama.cpp", "gguf"),
    Consumer("transformers (GGUF)", "transformers", "gguf", (), "dequantizes at load"),
)


def layout(fmt: str, method: str) -> str:
    """The table's format name: the safetensors format holds NF4/FP4 in bitsandbytes' layout."""
    return "bitsandbytes" if fmt == "safetensors" and method in CODEBOOK_METHODS else fmt


def verdicts(e: Export) -> list[tuple[Consumer, str | None]]:
    """Every loader of the export's format, with why it refuses the export (None: it reads it)."""
    fmt = layout(e.format, e.method)
    return [(c, c.refuses(e)) for c in CONSUMERS if c.format == fmt]


def check_readers(fmt: str, method: str, targets: tuple[str, ...]) -> None:
    """Refuse, before any work, a named target that is unknown or has no loader of the format at all
    (check_targets judges the settings, once the format has judged them)."""
    for target in targets:
        if target not in TARGETS:
            raise QuantkitError(f"unknown consumer {target!r} for {option('targets')}: use one of {', '.join(TARGETS)}")
        if not any(c.target == target and c.format == layout(fmt, method) for c in CONSUMERS):
            readers = sorted({c.format for c in CONSUMERS if c.target == target} - {"bitsandbytes"})
            raise QuantkitError(f"{target} does not read the {layout(fmt, method)} format as quantkit writes "
                                f"it: use {option('format', *readers)}"
                                + (f" with {option('method', 'rtn', 'gptq')}" if method in CODEBOOK_METHODS else ""))


def check_targets(e: Export, targets: tuple[str, ...]) -> None:
    """Refuse, before quantizing, an export that no loader of each named target reads."""
    check_readers(e.format, e.method, targets)
    for target in targets:
        mine = [(c, why) for c, why in verdicts(e) if c.target == target]
        if all(why is not None for _, why in mine):
            reasons = "; ".join(f"{c.name} refuses {why}" for c, why in mine)
            raise QuantkitError(f"{target} cannot load this export: {reasons}: change those settings or drop "
                                f"{option('targets')}")


def summary(e: Export) -> list[str]:
    """One line per loader: who reads the export as written, and who refuses it and why."""
    lines = []
    for c, why in verdicts(e):
        lines.append(f"  {'yes' if why is None else 'no '}  {c.name}" + (f" ({c.note})" if c.note and why is None else "")
                     + (f": refuses {why}" if why else ""))
    return lines
