"""What to quantize and how: one small dataclass shared by the CLI, the API and the exports."""
from __future__ import annotations

import collections.abc
import difflib
import math
import os
import types
import typing
from dataclasses import asdict, dataclass, fields, replace

from . import blocks
from . import rules as layer_rules
from .errors import COMMAND_LINE, QuantkitError, option
from .requant import check_mix, parse_overrides

METHODS = ("rtn", "gptq", "awq", "nf4", "fp4")
CODEBOOK_METHODS = ("nf4", "fp4")  # 4-bit code tables in flat blocks, bitsandbytes' layout
AWQ_LOSSES = ("block", "descent", "output")  # what judges AWQ's scale candidates (QuantConfig.awq_loss)
DTYPES = ("float32", "bfloat16", "float16")  # the activations' dtypes evaluation runs in (api.ready)


GPTQ_ONLY = ("damp", "act_order", "static_groups", "true_sequential", "group_aware")
GRID_OPTIONS = ("group_size", "sym", "mse", "act_order", "static_groups", "group_aware")  # what shapes a GPTQ/RTN grid


def refuse_unused(given: dict[str, str], method: str, fmt: str, target_bpw: bool = False) -> None:
    """Refuse an option given that the method or format does not read: it would be ignored, and the
    export would not be what was asked for (--bits 8 with --format gguf writes the mix). given: the
    options' names, each as the user wrote it (the CLI's flags, the API's keywords)."""
    check_method(method)  # a mistyped method first: every option would seem not to belong to it
    as_method, as_format = option("method", method), option("format", fmt)
    for name, flag in given.items():
        if fmt == "exl2" and name in GRID_OPTIONS:
            raise QuantkitError(f"{flag} does not apply to {as_format}, whose measured mix of group sizes and bits "
                                "per linear sets the grids: drop it")
        if target_bpw and name in ("bits", "group_size") and fmt != "exl2":
            raise QuantkitError(f"{flag} does not apply with {option('target_bpw')}, which chooses "
                                "each linear's bits and group size: drop it")
        if fmt == "gguf" and name == "max_shard_size":
            raise QuantkitError(f"{flag} does not apply to {as_format}, which writes one file: drop it")
        if fmt != "gguf" and name == "gguf_type":
            raise QuantkitError(f"{flag} chooses a GGUF mix, and {as_format} is not GGUF: add "
                                f"{option('format', 'gguf')}, or drop it")
        if fmt == "gguf" and name in ("bits", "block_size", *GRID_OPTIONS):
            raise QuantkitError(f"{flag} does not apply to {as_format}, whose {option('gguf_type')} mix sets the "
                                f"blocks: drop it, or choose the types with {option('gguf_type')} and "
                                f"{option('tensor_type')}")
        if name in GPTQ_ONLY and method != "gptq" or name == "mse" and method not in ("rtn", "gptq") or \
                name == "block_size" and method not in ("gptq", *CODEBOOK_METHODS) or \
                name in ("group_size", "sym") and method in CODEBOOK_METHODS:
            raise QuantkitError(f"{flag} is not an option of {as_method}: drop it, or use a method it belongs to "
                                f"(see {'quantkit quantize --help' if COMMAND_LINE.get() else 'QuantConfig'})")


def check_method(method: object) -> None:
    if method not in METHODS:
        raise QuantkitError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")


def check_fields(cls: type, config: object, options: dict, what: str) -> None:
    """Refuse a config that is not a cls, and a keyword that is not one of cls's fields (naming the
    closest); what: the function they were passed to."""
    if config is not None and not isinstance(config, cls):
        raise QuantkitError(f"config is a {type(config).__name__}: pass a {cls.__name__}, or its fields as keywords")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=1)
        raise QuantkitError(f"{what} takes no option {unknown[0]!r}" + (f" (did you mean {close[0]!r}?)" if close
                            else "") + f": its options are {cls.__name__}'s fields")


def check_types(config) -> None:
    """Refuse a field of a dataclass given a value of another type than it declares (the API passes on
    what it is given: a string for a number failed deep inside, with a traceback, or was kept)."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        if not fits(value, hints[f.name]):
            raise QuantkitError(f"{f.name}={value!r} is a {type(value).__name__}, where {describe(hints[f.name])} "
                                f"belongs: pass {f.name} as one")


def fits(value, hint) -> bool:
    """Whether value is of the type hint (an int is a float; containers are checked where they are read)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(fits(value, a) for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint in (bool, str, os.PathLike):
        return isinstance(value, hint)
    if hint in (int, float):
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    return True


def describe(hint) -> str:
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return " or ".join("None" if a is type(None) else getattr(a, "__name__", str(a)) for a in args)


def check_arguments(fn, arguments: dict) -> None:
    """Refuse an argument of fn declared a path (str or os.PathLike, or those or a Model) given something
    else, declared a bool given text or a path, or declared a function given something that cannot be
    called: out=5 was a TypeError from pathlib, packed="no" was taken as True (a number or numpy's bool
    is taken as one), checked=5 failed after the long work. None only where it is declared."""
    for name, hint in typing.get_type_hints(fn).items():
        args = set(typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,))
        if name not in arguments or (arguments[name] is None and type(None) in args):
            continue
        value = arguments[name]
        functions = {a for a in args if typing.get_origin(a) is collections.abc.Callable}
        if os.PathLike in args and all(isinstance(a, type) for a in args):
            bad, what = not isinstance(value, tuple(args)), " (a path as str or pathlib.Path)"
        elif bool in args and args <= {bool, type(None)}:
            bad, what = value is None or isinstance(value, (str, bytes, os.PathLike)), ""
        elif functions and args <= functions | {type(None)}:
            bad, what = not callable(value), " (a function)"
        else:
            continue
        if bad and any(a.__name__ == "Model" for a in args if isinstance(a, type)):
            raise not_a_model(name, value)
        if bad:
            raise QuantkitError(f"{name}={value!r} is not {describe(hint)}: pass {name} as one{what}")


def not_a_model(name: str, value: object) -> QuantkitError:
    kind = type(value).__name__  # not its repr: a model object's would fill the screen
    what = "None" if value is None else f"{'an' if kind[0].lower() in 'aeiou' else 'a'} {kind}"
    return QuantkitError(f"{name} is {what}, not a model: pass a model directory (a transformers model: save_pretrained "
                         "it first), a .gguf file, or a quantkit Model")


UNWEIGHTED = (*blocks.FLOAT_TYPES, "Q8_0")  # GGUF types whose blocks take no importance


@dataclass
class QuantConfig:
    method: str = "rtn"
    bits: int = 4
    group_size: int = 128  # -1: per output channel
    sym: bool | None = None  # default: asymmetric for AWQ (zero points, as AWQ does), symmetric otherwise
    # GPTQ
    damp: float = 0.01  # of the mean Hessian diagonal
    block_size: int | None = None  # GPTQ: columns per lazy batch (128); NF4/FP4: values per absmax block (64)
    # GPTQ's defaults, from measurements (benchmarks/RESULTS.md): MSE clipping and the group-aware order,
    # which keeps the plain g_idx layout every consumer loads fastest; RTN rounds min-max grids unless asked
    act_order: bool = False
    static_groups: bool = False
    true_sequential: bool = True
    mse: bool | None = None  # search the clipping range (RTN too); default: on for GPTQ
    group_aware: bool | None = None  # act-order inside groups, groups by importance; default: GPTQ without act-order
    double_quant: bool = False  # NF4/FP4: absmax values quantized to 8 bits
    duo_scaling: bool = False  # AWQ: s = mean|x|^a / mean|w|^(1-a) (AutoAWQ's default) instead of mean|x|^a
    # AWQ: what judges the scales of q/k/v and gate/up: their block's output on a descent from the
    # candidate the output loss ranks best ("descent", the default: over six seeds at w4 0.7% lower
    # perplexity and 2.7% lower KLD than "output", and lower KLD at w3), their own outputs through their
    # inputs' Hessian ("output": no forwards per candidate, 0.75-0.89x the descent's time), or their
    # block's output on every candidate ("block", AutoAWQ's); benchmarks/RESULTS.md
    awq_loss: str | None = None
    gguf_type: str | None = None  # GGUF mix (Q4_K_M, Q8_0, ...): blocks of llama.cpp's types instead of our grids
    imatrix: bool = False  # GGUF with RTN: weight the block search by each input's mean square (calibration)
    imatrix_file: str | os.PathLike | None = None  # the same from llama.cpp's importance-matrix file (no calibration)
    pure: bool = False  # GGUF: every tensor the mix's main type (llama-quantize --pure)
    tensor_type: tuple[str, ...] | str = ()  # GGUF: PATTERN=TYPE overrides of the mix (llama-quantize --tensor-type)
    exl2: float | None = None  # EXL2: the linears' target bits per weight, widths mixed within each (GPTQ fills it)
    # RTN and GPTQ: bits per weight of the decoder linears, spent by a measurement: in the GPTQ layout each group of
    # linears sharing an input gets the bits and group size (quantkit.measurement.GRIDS) that lose least overall;
    # in GGUF each linear a block type (measurement.GGUF_TYPES), the embedding and output typed by the mix
    target_bpw: float | None = None
    # EXL2 and target_bpw: the error of each block's output at each candidate setting, kept in
    # this file (read when it exists); EXL2 without one mixes the two widths nearest the target in every linear
    measurement: str | os.PathLike | None = None
    head_bits: float | None = None  # EXL2: lm_head's bits per weight (ExLlamaV2's head_bits); default: float16
    # per-layer mixed precision (quantkit.rules): other bits or group size, or skip, by module name;
    # a rules file's path or a list of {match, bits, group_size, skip} mappings is read here
    rules: tuple[layer_rules.Rule, ...] | list[dict] | str | os.PathLike = ()

    def __post_init__(self) -> None:
        from .qtensor import check_bits_group  # here, not above: the command line reads METHODS without torch
        from .quantizers import nf4

        if isinstance(self.bits, float) and math.isfinite(self.bits) and not self.bits.is_integer():  # EXL2's --bits
            raise QuantkitError(f"bits={self.bits} is not a whole number: the grids take whole bits; for an EXL2 "
                                f"target of {self.bits} bits per weight pass exl2={self.bits} with format='exl2'")
        for name in ("rules", "tensor_type"):  # None, as a pipeline's YAML or JSON settings give an empty one
            if getattr(self, name) is None:
                setattr(self, name, ())
        check_types(self)
        self.imatrix_file, self.measurement = (None if p is None else os.fspath(p)
                                               for p in (self.imatrix_file, self.measurement))
        for name, what in (("tensor_type", "PATTERN=TYPE strings"), ("rules", "a rules file's path or rules")):
            if not isinstance(getattr(self, name), (str, os.PathLike, list, tuple)):
                raise QuantkitError(f"{name}={getattr(self, name)!r} is a {type(getattr(self, name)).__name__}, where "
                                    f"{what} belong: pass {name} as a list of them")
        check_method(self.method)
        check_bits_group(self.bits, self.group_size, named=True)
        if self.sym is None:
            self.sym = self.method != "awq"
        if self.group_aware is None:
            self.group_aware = self.method == "gptq" and not self.act_order
        if self.mse is None:
            self.mse = self.method == "gptq"
        if self.duo_scaling and self.method != "awq":
            raise QuantkitError(f"duo scaling is an AWQ option: use it with {option('method', 'awq')}")
        if self.awq_loss is not None and self.awq_loss not in AWQ_LOSSES:
            raise QuantkitError(f"{option('awq_loss', self.awq_loss)} is not an AWQ loss: use one of {', '.join(AWQ_LOSSES)}")
        if self.awq_loss is not None and self.method != "awq":
            raise QuantkitError(f"{option('awq_loss')} chooses how AWQ judges its scales: use it with "
                                f"{option('method', 'awq')}")
        if self.method == "awq" and self.awq_loss is None:
            self.awq_loss = "descent"
        if self.block_size is None:
            self.block_size = nf4.BLOCK if self.method in CODEBOOK_METHODS else 128
        if self.method in CODEBOOK_METHODS:
            nf4.check(self.method, self.block_size, "block_size")
            if self.bits != 4:
                raise QuantkitError(f"{self.method} is a 4-bit type, not {self.bits}-bit: use {option('bits', 4)} or "
                                    "another method")
        elif self.double_quant:
            raise QuantkitError(f"double quantization is for {option('method', 'nf4', 'fp4')}")
        if not 0 < self.damp < 1:
            raise QuantkitError(f"{option('damp', self.damp)} is out of range: use a fraction such as 0.01")
        if self.act_order and self.group_aware:
            raise QuantkitError("act-order and group-aware ordering exclude each other: choose one")
        if self.gguf_type is not None:  # the name llama-quantize's mixes go by, whatever case or alias was given
            self.gguf_type = check_mix(self.gguf_type, option("gguf_type"))
        if self.gguf_type is not None and self.method not in ("rtn", "gptq"):
            raise QuantkitError(f"GGUF types are filled by RTN or GPTQ, not {self.method}: use "
                                f"{option('method', 'rtn', 'gptq')}")
        if self.imatrix_file is not None and not str(self.imatrix_file):  # the API's; the command line's "" is imatrix
            raise QuantkitError("imatrix_file is empty: give the path of llama-imatrix's file, or imatrix=True to "
                                "compute the importance from the calibration text")
        if self.weighted and (self.gguf_type is None or self.method != "rtn"):
            raise QuantkitError(f"{option('imatrix')} weights GGUF round-to-nearest: use it with "
                                f"{option('method', 'rtn')} {option('format', 'gguf')}"
                                + (" (GPTQ always weighs by the Hessian)" if self.method == "gptq" else ""))
        if self.imatrix and self.imatrix_file:
            raise QuantkitError("an importance matrix is computed from calibration or read from a file, not both: "
                                f"pass {option('imatrix', True)} alone or {option('imatrix_file', 'FILE')}")
        if self.pure and self.gguf_type in (None, *blocks.FLOAT_TYPES):
            raise QuantkitError(f"{option('pure')} chooses among the types of a quantized GGUF mix: use it with "
                                f"{option('format', 'gguf')} and a {option('gguf_type')} such as Q4_K_M")
        self.tensor_type = (self.tensor_type,) if isinstance(self.tensor_type, str) else tuple(self.tensor_type)
        parse_overrides(self.tensor_type)  # each PATTERN=TYPE, before the model loads
        if self.tensor_type and self.gguf_type in (None, *blocks.FLOAT_TYPES):
            raise QuantkitError(f"{option('tensor_type')} overrides the types of a quantized GGUF mix: use it with "
                                f"{option('format', 'gguf')} and a {option('gguf_type')} such as Q4_K_M")
        if self.weighted and self.target_bpw is None and self.gguf_type in UNWEIGHTED and \
                all(t.rpartition("=")[2].upper() in UNWEIGHTED for t in self.tensor_type):
            raise QuantkitError(f"{option('imatrix')} weights the block search of quantized GGUF types, and "
                                f"{self.gguf_type} has none that takes it: drop {option('imatrix')}, or choose a mix "
                                "such as Q4_K_M")
        if self.exl2 is not None and self.method != "gptq":
            raise QuantkitError(f"EXL2 is filled by GPTQ, not {self.method}: use {option('method', 'gptq')}")
        if self.head_bits is not None and self.exl2 is None:
            raise QuantkitError(f"{option('head_bits')} quantizes the output head of an EXL2 export: use it with "
                                f"{option('format', 'exl2')}")
        if self.target_bpw is not None:
            if self.method not in ("rtn", "gptq") or self.exl2 is not None:
                raise QuantkitError(f"{option('target_bpw')} spends bits on RTN and GPTQ grids (the safetensors, "
                                    "compressed-tensors and GGUF formats): for EXL2 pass the target as "
                                    f"{option('exl2')}")
            if self.rules:
                raise QuantkitError(f"{option('target_bpw')} writes its own rules (in GGUF, {option('tensor_type')} "
                                    f"overrides) from the measurement: pass {option('rules')} or "
                                    f"{option('target_bpw')}, not both")
            if self.tensor_type:
                raise QuantkitError(f"{option('target_bpw')} writes its own {option('tensor_type')} overrides from the "
                                    f"measurement: pass {option('tensor_type')} or {option('target_bpw')}, not both")
            if self.gguf_type in blocks.FLOAT_TYPES:
                raise QuantkitError(f"{option('target_bpw')} chooses quantized block types, and the mix "
                                    f"{self.gguf_type} is float: pass a quantized {option('gguf_type')} such as Q4_K_M "
                                    "(it types the embedding and output)")
        if self.measurement is not None and self.exl2 is None and self.target_bpw is None:
            raise QuantkitError(f"{option('measurement')} chooses mixed settings against a target: use it with "
                                f"{option('target_bpw')}, or with {option('format', 'exl2')} and a target such as "
                                f"{option('exl2', 4.125)}")
        if self.block_size < 1:
            raise QuantkitError(f"{option('block_size', self.block_size)} is invalid: use a positive number of columns such as 128")
        if isinstance(self.rules, (str, os.PathLike)):
            self.rules = layer_rules.read(self.rules)
        elif not all(isinstance(r, layer_rules.Rule) for r in self.rules):  # the API's list of mappings
            self.rules = layer_rules.parse(list(self.rules), "rules")
        self.rules = tuple(self.rules)
        if self.rules and (self.method not in ("rtn", "gptq") or self.gguf_type is not None or self.exl2 is not None):
            raise QuantkitError(f"{option('rules')} mixes bits and group sizes of RTN and GPTQ grids in the "
                                "safetensors and compressed-tensors formats: for GGUF use "
                                f"{option('tensor_type')}, for EXL2 its measurement")

    def rule_of(self, name: str) -> int | None:
        """The index of the rule that decides a linear's settings: the first that matches."""
        return next((i for i, r in enumerate(self.rules) if r.matches(name)), None)

    def for_linear(self, name: str) -> QuantConfig | None:
        """The settings of one linear under the rules (the first that matches); None: left in float."""
        at = self.rule_of(name)
        rule = None if at is None else self.rules[at]
        if rule is None:
            return replace(self, rules=())
        if rule.skip:
            return None
        return replace(self, rules=(), bits=rule.bits or self.bits, group_size=rule.group_size or self.group_size)

    @property
    def weighted(self) -> bool:
        """GGUF with an importance matrix, computed or read: llama-quantize's type choices change with one."""
        return self.imatrix or self.imatrix_file is not None

    @property
    def needs_calibration(self) -> bool:
        return self.method not in ("rtn", *CODEBOOK_METHODS) or self.imatrix or self.target_bpw is not None

    def to_dict(self) -> dict:
        return asdict(self)
