"""The pipeline as plain function calls; the CLI is a thin layer over these."""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
import warnings
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import fields, replace
from pathlib import Path
from typing import Callable

import torch

from quantkit import calibration, evals, exporters
from quantkit.atomic import (NEXT, check_apart, check_out, locked, partial_path, progress_path, saved_progress,
                             siblings, size_on_disk)

from . import blocks, consumers, distributed, measurement
from . import rules as layer_rules
from .config import DTYPES, UNWEIGHTED, QuantConfig, check_fields, check_arguments, refuse_unused
from .errors import COMMAND_LINE, Note, QuantkitError, ResumableError, option, space_for
from .layers import GROUPS, LINEARS, fused, linear_shapes, shapes_by_name
from .modelio import (Checkpoint, GGUFCheckpoint, Model, check_context, fingerprint, linear_types, load,
                      moved)
from .pipeline import (BATCH, Hessian, Layerwise, OtherFn, QuantizeFn, free_bytes, gather_hessians, other_run,
                       quantize_layers)
from .qlinear import QuantLinear
from .qtensor import QuantizedTensor
from .requant import requantized_note
from .quantizers import awq, exl2, ggml, gptq, nf4, rtn

PathLike = str | os.PathLike
FITS = 0.8  # of a device's free memory that a model's weights may take to be scored whole: the rest holds activations


def kept_blocks(source: Checkpoint | None, name: str, kind: str, w: torch.Tensor, check: bool) -> QuantizedTensor | None:
    """A GGUF source's own blocks of a weight already of the type it is quantized to, as llama-quantize
    keeps them (rounded again, 17 of the embedded model's 211 in Q4_K_M came out different); None where there
    are none, or (check: w was in memory before quantizing, as read or changed) w is not what they hold."""
    key = f"{name}.weight"
    if not isinstance(source, GGUFCheckpoint) or key not in source.where or source.type_of(key) != kind or \
            check and not torch.equal(source.tensor(key, "cpu"), w.detach().float().cpu()):
        return None  # the type from the header: a tensor that changes type is not read here
    _, rows = source.blocks(key)
    return ggml.tensor(kind, rows.numpy(), rows.shape[0])


def rounded_again(source: Checkpoint | None, kept: dict[str, str]) -> list[str]:
    """The quantized types of a GGUF source's weights that are rounded again: all but those of a
    weight whose type in kept (by module name) is its own (kept_blocks)."""
    if not isinstance(source, GGUFCheckpoint):
        return []
    kinds = {key: source.type_of(key) for key in source.where if key.endswith(".weight")}
    return sorted({t for key, t in kinds.items()
                   if t not in blocks.FLOAT_TYPES and kept.get(key.removesuffix(".weight")) != t})


def diagonal_only(config: QuantConfig, gguf: bool) -> bool:
    """Whether the quantizer reads only each Hessian's diagonal: RTN onto GGUF types, its importance matrix."""
    return gguf and config.method == "rtn"


def quantizer(qconfig: QuantConfig, losses: dict[str, float], types: dict[str, str] | None = None,
              importance: dict[str, torch.Tensor] | None = None, settings: dict[str, exl2.Setting] | None = None,
              kept: OtherFn | None = None) -> QuantizeFn | None:
    """The per-linear core for a method: (name, weight, hessian or None) -> QuantizedTensor; None for
    AWQ, which quantizes whole layers. GPTQ's per-linear losses are recorded in losses. types: each
    linear's GGUF type when quantizing for GGUF; importance: an importance matrix read from a file, by
    GGUF tensor name; settings: each linear's EXL2 widths (default: the target's, the same for all);
    kept: (name, weight) -> a GGUF source's blocks that RTN keeps, or None (kept_blocks)."""
    c = qconfig
    if c.rules:  # each linear the core of its own settings; None for one left in float
        return lambda name, w, h: None if (mine := c.for_linear(name)) is None else quantizer(mine, losses)(name, w, h)
    if types is not None:
        def quantize_ggml(name: str, w: torch.Tensor, h: Hessian | None) -> QuantizedTensor:
            if c.method == "rtn" and kept is not None and (q := kept(name, w)) is not None:
                return q
            w = w.cpu()  # the block searches pack with numpy
            if importance is not None:
                return ggml.quantize(w, types[name], importance.get(exporters.gguf.gguf_name(f"{name}.weight")))
            if h is None or h.count == 0:
                if c.needs_calibration:
                    warnings.warn(f"{name}: no calibration input reached it, so it was quantized without it")
                return ggml.quantize(w, types[name])
            if diagonal_only(c, gguf=True):  # an importance matrix: the Hessian's diagonal, all that was summed
                return ggml.quantize(w, types[name], h.diagonal().cpu())
            hm = h.matrix().cpu()
            r = ggml.gptq(w, hm, types[name], hm.diagonal(), damp=c.damp, name=name)
            losses[name] = r.loss
            return r.tensor

        return quantize_ggml

    def quantize_rtn(name: str, w: torch.Tensor, h: Hessian | None) -> QuantizedTensor:
        return rtn.quantize(w, bits=c.bits, group_size=c.group_size, sym=c.sym, mse=c.mse, name=name)

    def quantize_gptq(name: str, w: torch.Tensor, h: Hessian | None) -> QuantizedTensor:
        if c.exl2 is not None:  # without calibration input: an identity Hessian, plain rounding onto the grid
            hm = h.matrix() if h is not None and h.count else torch.eye(w.shape[1], device=w.device)
            setting = settings[name] if settings is not None else exl2.Setting.for_target(c.exl2, *w.shape)
            r = exl2.quantize(w, hm, setting, damp=c.damp, block_size=c.block_size, name=name)
            losses[name] = r.loss
            return r.tensor
        if h is None or h.count == 0:
            warnings.warn(f"{name}: no calibration input reached it, so it was quantized with RTN")
            return quantize_rtn(name, w, h)
        r = gptq.quantize(w, h.matrix(), c.bits, c.group_size, c.sym, damp=c.damp, block_size=c.block_size,
                          act_order=c.act_order, static_groups=c.static_groups, mse=c.mse,
                          group_aware=c.group_aware, name=name)
        losses[name] = r.loss
        return r.tensor

    def quantize_codebook(name: str, w: torch.Tensor, h: Hessian | None) -> QuantizedTensor:
        return nf4.quantize(w, c.method, block_size=c.block_size, double_quant=c.double_quant, name=name)

    return {"rtn": quantize_rtn, "gptq": quantize_gptq, "nf4": quantize_codebook, "fp4": quantize_codebook}.get(c.method)


def grids(m: Model, config: QuantConfig, format: str,
          targets: tuple[str, ...]) -> tuple[measurement.Grid, ...] | tuple[measurement.BlockType, ...]:
    """The candidates of --target-bpw that the format and the named consumers take for this model, so
    that nothing the measurement picks is refused after it (in GGUF, every block type of
    measurement.GGUF_TYPES); the target checked against them."""
    shapes = shapes_by_name(m.module)
    if config.gguf_type is not None:
        kept = measurement.GGUF_TYPES
        if targets:  # a GGUF file's readers take every block type
            consumers.check_targets(consumers.Export.of(format, config, m.module), targets)
        measurement.check_target(shapes, config.target_bpw, kept,
                                 f"the GGUF types {kept[0].type} to {kept[-1].type}, after llama-quantize's fallbacks,")
        return kept

    def fits(g: measurement.Grid) -> bool:
        c = replace(config, bits=g.bits, group_size=g.group_size, target_bpw=None, measurement=None)
        try:
            exporters.check_format(format, m.module, c)
            consumers.check_targets(consumers.Export.of(format, c, m.module), targets)
        except QuantkitError:
            return False
        return True

    kept = tuple(g for g in measurement.GRIDS if fits(g))
    what = f"the {format} format's grids" + (f" that {' and '.join(targets)} load{'s' * (len(targets) == 1)}" if targets else "")
    if not kept:
        raise QuantkitError(f"{option('target_bpw')}: none of {what} fits this model: choose another "
                            f"{option('format')} or drop {option('targets')}")
    if targets and len(kept) > 1:  # each grid alone is loaded; a loader may take no file that mixes them
        units = measurement.grouped(shapes, measurement.GROUP_UNITS).values()
        mixed = spent(config, {name: kept[i % len(kept)] for i, linears in enumerate(units) for name in linears},
                      shapes)
        try:
            consumers.check_targets(consumers.Export.of(format, mixed, m.module), targets)
        except QuantkitError as e:
            raise QuantkitError(f"{option('target_bpw')} gives each group of linears its own grid, and {e}".replace(
                "change those settings or drop", f"drop {option('target_bpw')} for one {option('bits')} and "
                                                 f"{option('group_size')}, or drop")) from None
    measurement.check_target(shapes, config.target_bpw, kept, what)
    return kept


def calibration_windows(m: Model, data: PathLike | None, samples: int, seqlen: int, seed: int = 0,
                        progress: bool = True) -> torch.Tensor:
    """The calibration windows of m from data (WikiText-2 train from the hub by default): its faults
    (records, too little text, windows past the model's context) refused here, before any work."""
    check_context(m.module.config, seqlen, "calib_seqlen")
    text = calibration.load_text(data, tokenizer=m.tokenizer)
    return calibration.sample_windows(m.tokenizer, text, samples, seqlen, seed, progress)


def inputs_bytes(windows: torch.Tensor | None, importance: dict[str, torch.Tensor] | None) -> bytes:
    """What a run's results depend on besides the model and settings, for its key: the calibration
    windows' tokens and the importance matrix's contents (not only its file's name)."""
    data = windows.numpy().tobytes() if windows is not None else b""
    return data + b"".join(name.encode() + v.numpy().tobytes() for name, v in sorted((importance or {}).items()))


def check_progress(out: Path, key: dict | None, layers: int) -> None:
    """Refuse to start afresh over the finished layers of another run writing out (hours of work, not to be
    lost to a changed option or a touched model file): what differs, and how to go on or discard them. key
    None: a run that makes the model it quantizes (train --quantize), which no progress can be of. Under
    torchrun rank 0 looks, holding out's lock: a job writing out now is refused as that, not as progress."""
    with distributed.first_refuses(f"open {out}"):
        if distributed.rank() != 0:
            return
        with locked(out, "out"):
            # one process's progress, or a torchrun job's first; a key without "spent" is checked before a measurement
            found = other_run([progress_path(out), progress_path(out, 0)], key)
            if found is not None and partial_path(out).exists():
                _, theirs, done = found
                why = differences(theirs, key) if key is not None else "this command first makes the model it quantizes"
                raise QuantkitError(f"{partial_path(out)} holds {done} of {layers} layers of another run writing {out} "
                                    f"({why}): run that command again to go on from them, or pass "
                                    f"{option('overwrite', True)} to discard them and start afresh")


LONG = {"header": "GGUF header's record of the importance matrix (quantize.imatrix.*)",  # a key's long values
        "calib_data": "calibration text (calib_data)"}


def differences(theirs, ours: dict) -> str:
    """How another run's progress key differs from this run's, as its user would tell them apart."""
    if isinstance(theirs, dict) and "merge" in theirs:  # trainer.merging's key
        return "it merged an adapter into its base (quantkit merge)"
    if not isinstance(theirs, dict) or theirs.keys() != ours.keys():
        return "it was started by another version of quantkit"
    said = []
    if theirs["model"] != ours["model"]:
        path = theirs["model"].split("|")[0]
        said.append("the model's files changed since it started" if path == ours["model"].split("|")[0]
                    else f"it ran on the model {path}")
    calibration = ours["calibration"] or {}  # none where nothing calibrates
    facts = {**{name: (theirs["settings"].get(name), value) for name, value in ours["settings"].items()},
             **{name: (theirs[name], ours[name]) for name in ("format", "max_shard_size", "device", "processes",
                                                               "header")},
             **{name: ((theirs["calibration"] or {}).get(name), value) for name, value in calibration.items()}}
    changed = [(name, a, b) for name, (a, b) in facts.items() if a != b]
    short = [(n, a, b) for n, a, b in changed if len(repr(a)) + len(repr(b)) < 80]
    if short:
        said.append(f"it ran with {' and '.join(f'{n}={a!r}' for n, a, _ in short)}, this command with "
                    f"{' and '.join(f'{n}={b!r}' for n, _, b in short)}")
    said += [f"its {LONG.get(n, n)} differs" for n, a, b in changed if (n, a, b) not in short]  # by name alone
    if theirs["inputs"] != ours["inputs"] and not any(n in calibration for n, _, _ in changed):
        said.append("its calibration text or importance matrix has changed since it started")
    if theirs.get("spent") != ours.get("spent") and not said:
        said.append(f"its measurement for {option('target_bpw')} gave other settings")
    return "; ".join(said)


def settings_of(config: QuantConfig) -> dict:
    """config's fields as plain data, as a progress key holds them; a file by its resolved path (another
    spelling of it is the same file)."""
    files = {name: os.path.realpath(v) for name in ("imatrix_file", "measurement") if (v := getattr(config, name))}
    return json.loads(json.dumps({**config.to_dict(), **files}, default=str))


MEASURING = r"\.{name}\.progress-measurement(-\d+)?\.pt(" + NEXT + ")?"  # beside the measurement file: its progress


def measured(m: Model, config: QuantConfig, windows: torch.Tensor, dev: torch.device, progress: bool,
             settings: tuple, importance: dict[str, torch.Tensor] | None = None, overwrite: bool = False
             ) -> dict[str, exl2.Setting | measurement.Grid | measurement.BlockType]:
    """Each linear's setting for the run's target among settings: EXL2's widths, one per attention
    and MLP block; --target-bpw's bits and group size, one per group of linears sharing an input; or
    in GGUF its block type, one per linear (importance: an importance matrix read from a file). From
    the measurement file config.measurement when it exists, else from a measurement pass, saved
    there when there is one (a killed pass resumes after its last layer; another run's progress there is
    refused, unless overwrite)."""
    exl2_run, gguf_run = config.exl2 is not None, config.gguf_type is not None
    units = measurement.BLOCK_UNITS if exl2_run else measurement.LINEAR_UNITS if gguf_run else measurement.GROUP_UNITS
    target = config.exl2 if exl2_run else config.target_bpw
    shapes = shapes_by_name(m.module)
    hessian = exl2_run or config.method == "gptq" or config.imatrix
    # what the candidates' quantization depends on, besides their own settings
    quantizer_settings = ("exl2", config.damp, config.block_size) if exl2_run else \
        ("gguf", config.method, config.imatrix) + ((config.damp,) if config.method == "gptq" else ()) if gguf_run else (config.method, config.sym, config.mse) \
        + ((config.damp, config.block_size, config.act_order, config.static_groups, config.group_aware) if hessian else ())
    key = hashlib.sha256(f"{fingerprint(m.source)}|{quantizer_settings}".encode()
                         + inputs_bytes(windows, importance)).hexdigest()
    path = Path(config.measurement) if config.measurement is not None else None
    if path is not None and path.exists():
        errors = measurement.read(path, key, shapes, units, settings)
    else:
        if m.checkpoint is None:
            raise QuantkitError(f"{m.source}: the measurement pass reads layers from a checkpoint: quantize a model "
                                "loaded from its directory")
        rank = f"-{distributed.rank()}" if distributed.world() > 1 else ""
        # the candidates (by format and --for) are in the key: a pass of other ones starts afresh, not mixed in
        resume = (path.with_name(f".{path.name}.progress-measurement{rank}.pt"),
                  f"{key}|{settings}|{distributed.world()}") if path is not None else None
        with ExitStack() as held:  # another run measuring into the same file would take or remove this one's progress
            with distributed.first_refuses(f"lock {path}"):
                if path is not None and distributed.rank() == 0:
                    held.enter_context(locked(path, "measurement"))
                    if path.exists():  # saved by a run that held the lock since this one looked
                        raise QuantkitError(f"{path} was written by another run while this one started: run the "
                                            "command again to use it")
                    found = None if overwrite else other_run(  # hours of a large model's measurement: kept
                        [path.with_name(f".{path.name}.progress-measurement{r}.pt") for r in ("", "-0")], resume[1])
                    if found is not None:
                        raise QuantkitError(
                            f"{found[0]} holds {found[2]} of {len(m.layers)} layers of another run measuring into "
                            f"{path} (another model, calibration, quantizer settings, candidates or number of "
                            f"processes): run that command again to go on from them, or pass "
                            f"{option('overwrite', True)} to discard them and measure afresh")
            weights = measurement.fisher(m, windows, dev, progress and distributed.rank() == 0)
            labels = None  # what each candidate makes of each linear, where two can make the same
            if exl2_run:
                cores = [lambda name, w, h, s=s: exl2.quantize(w, h.matrix(), s, damp=config.damp,
                                                               block_size=config.block_size, name=name).tensor
                         for s in settings]
            elif gguf_run:
                plain = replace(config, target_bpw=None, measurement=None)
                labels = [{name: t.of(k) for name, (_, k) in shapes.items()} for t in settings]
                cores = [quantizer(plain, {}, types, importance) for types in labels]
            else:
                cores = [quantizer(replace(config, bits=g.bits, group_size=g.group_size, target_bpw=None,
                                           measurement=None), {}) for g in settings]
            recorder = measurement.Recorder()

            def measure(i: int, layer: torch.nn.Module, batches: list) -> dict[str, QuantizedTensor]:
                prefix = f"model.layers.{i}."
                hessians = gather_hessians(layer, batches, GROUPS, diagonal=diagonal_only(config, gguf_run))[0] \
                    if hessian else dict.fromkeys(LINEARS)
                sq = measurement.measure_layer(layer, batches, hessians, cores,
                                               torch.stack([weights[prefix + b] for b in measurement.BLOCKS]), units,
                                               prefix=prefix, labels=labels)
                # every batch's figures, from the process that ran it, summed in one order: a single process's sums
                sq = distributed.gather_rows(sq).sum(0)
                for u, unit in enumerate(units):  # in nats: the predicted rise of the mean loss
                    recorder.errors[prefix + unit] = (sq[u] / (2 * windows.numel())).tolist()
                return {}

            if path is not None:  # its progress, saved after each layer, is as large as the calibration's activations
                held.enter_context(space_for(path, None, "the measurement's progress", "run the same command again: "
                                             "the measurement resumes after its last finished layer"))
            quantize_layers(m, None, windows, device=dev, writer=recorder, keep=False,
                            progress=progress and distributed.rank() == 0, resume=resume, layer_fn=measure,
                            desc=f"measuring {len(settings)} settings of each "
                                 f"{'block' if exl2_run else 'linear' if gguf_run else 'group of linears'}")
            if path is not None and distributed.rank() == 0:
                measurement.save(path, key, m.source, shapes, units, recorder.errors, settings)
            # every process keeps its progress until the file is saved
            distributed.agree(0, "min", "saving the measurement")
            if resume is not None:
                resume[0].unlink(missing_ok=True)
                if distributed.rank() == 0:  # a killed job's of another world size too (and killed saves'), now stale
                    for stale in siblings(path, MEASURING + r"(\.tmp-\d+)?"):
                        stale.unlink(missing_ok=True)
        errors = recorder.errors
    grouped = measurement.grouped(shapes, units)
    chosen = measurement.allocate({unit: list(linears.values()) for unit, linears in grouped.items()}, errors, target,
                                  settings)
    return {name: chosen[measurement.unit_of(name, units)] for name in shapes}


def spent(config: QuantConfig, settings: dict, shapes: dict[str, tuple[int, int]]) -> QuantConfig:
    """The run's settings with --target-bpw spent. GGUF: a --tensor-type override per linear, by its
    exact tensor name, of the type its rows take. Otherwise a rule per group of linears, by exact
    names, with the one linear vLLM fuses them into (its `dynamic` is matched against that name)."""
    if config.gguf_type is not None:
        overrides = tuple(f"^{re.escape(exporters.gguf.gguf_name(f'{name}.weight'))}$={t.of(shapes[name][1])}"
                          for name, t in settings.items())
        return replace(config, target_bpw=None, measurement=None, tensor_type=overrides)
    rules = []
    one = {part: name for name, parts in fused(shapes).items() for part in parts}  # the fused linear of each part
    for linears in measurement.grouped(shapes, measurement.GROUP_UNITS).values():
        first = next(iter(linears))
        names = [*linears, *([one[first]] if first in one else [])]
        g = settings[first]
        rules.append(layer_rules.Rule(layer_rules.exact(names), g.bits, g.group_size))
    return replace(config, target_bpw=None, measurement=None, rules=tuple(rules))


def gguf_types(m: Model, config: QuantConfig) -> dict[str, str]:
    """Each 2-D weight's GGUF type for config's mix and its overrides."""
    return exporters.gguf.tensor_types(m.module, config.gguf_type, pure=config.pure, weighted=config.weighted,
                                       overrides=config.tensor_type)


def device_of(device: str | torch.device | None) -> torch.device:
    """Where layers are quantized: the GPU when there is one, unless told otherwise."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise QuantkitError(f"unknown device {device!r}: use cpu or cuda") from None
    if dev.type not in ("cpu", "cuda"):
        raise QuantkitError(f"device {device!r} is not supported: use cpu or cuda")
    if dev.type == "cpu":  # cpu:0 is the CPU (safetensors' reader takes no index)
        return torch.device("cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise QuantkitError(f"{option('device', 'cuda')}, but torch sees no CUDA GPU: use {option('device', 'cpu')}, "
                            "or install a CUDA build of torch and check the driver and CUDA_VISIBLE_DEVICES")
    return dev


def quantize(
    model: Model | PathLike | None = None,
    config: QuantConfig | None = None,
    *,
    calib_data: PathLike | None = None,
    calib_samples: int = 128,
    calib_seqlen: int = 512,
    seed: int = 0,
    out: PathLike | None = None,
    format: str = "safetensors",
    overwrite: bool = False,
    max_shard_size: int | str = exporters.DEFAULT_MAX_SIZE,
    device: str | torch.device | None = None,
    keep: bool | None = None,
    progress: bool = True,
    targets: tuple[str, ...] = (),
    checked: Callable[[], None] | None = None,
    alone: bool = False,
    **options,
) -> Model:
    """Quantize a model (a Model, a path, or None for the embedded one) with config, or with
    QuantConfig's fields given as keywords (method="gptq", bits=4, ...), and with out, export it.

    Layers stream: each is read from the checkpoint, quantized on device (default: the GPU when
    there is one), written to out and dropped, so memory holds one layer. keep (default: when
    there is no out) leaves the quantized model in memory instead, as dequantized float weights
    plus model.tensors. An interrupted export resumes after its last finished layer when run
    again; a call of other settings writing the same out is refused while that progress is there,
    unless overwrite. format: safetensors (GPTQ layout; bitsandbytes' for nf4/fp4), awq, compressed-tensors, exl2,
    or gguf (default mix Q4_K_M); max_shard_size: the safetensors layouts' largest shard ("5GB",
    "500MiB" or bytes).
    targets: consumers (vllm, exllama, transformers, llama.cpp) that must be able to load the export,
    from their documented limits (quantkit.consumers). Every check that can fail runs before the long
    work starts; then checked() is called, if given (the command line's "before" perplexity).
    Under torchrun, or in a torch.distributed process group the caller made, every process makes the
    same call and takes its share of the work; alone=True quantizes in this process by itself (a
    pipeline calling quantize on one rank of its own job)."""
    check_arguments(quantize, locals())
    if config is not None and options:
        raise QuantkitError("pass a QuantConfig or its fields as keywords, not both")
    check_fields(QuantConfig, config, options, "quantize")
    exporters.check_format_name(format)
    if max_shard_size != exporters.DEFAULT_MAX_SIZE:  # not a QuantConfig field: refused as the command line's
        refuse_unused({"max_shard_size": "max_shard_size"}, config.method if config else options.get("method", "rtn"),
                      format)
    if config is None:  # a field set to other than its default that the method or format would ignore
        defaults = {f.name: f.default for f in fields(QuantConfig)}
        try:  # what the method fills in, given as it fills it, is its default (a config's to_dict() passed back)
            filled = QuantConfig(method=options.get("method", "rtn"), bits=options.get("bits", 4),
                                 act_order=options.get("act_order", False))
        except QuantkitError:  # refused below, or by the config itself
            filled = None
        refuse_unused({k: k for k, v in options.items() if k in defaults and v != defaults[k]
                       and (defaults[k] is not None or filled is None or v != getattr(filled, k))},
                      options.get("method", "rtn"), format, options.get("target_bpw") is not None)
        if format == "gguf":  # before the config checks its GGUF options (pure, tensor_type, imatrix)
            options.setdefault("gguf_type", exporters.gguf.DEFAULT_MIX)
    else:  # the same refusal for a QuantConfig built beforehand: its fields set to other than the method's defaults
        plain = QuantConfig(method=config.method, bits=config.bits, act_order=config.act_order)
        refuse_unused({f.name: f.name for f in fields(QuantConfig) if getattr(config, f.name) != getattr(plain, f.name)
                       or f.default is not None and getattr(config, f.name) != f.default},
                      config.method, format, config.target_bpw is not None)
    config = config or QuantConfig(**options)
    if format == "gguf" and config.gguf_type is None:
        config = replace(config, gguf_type=exporters.gguf.DEFAULT_MIX)
    for name, value in (("calib_samples", calib_samples), ("calib_seqlen", calib_seqlen), ("seed", seed)):
        whole(name, value)  # their ranges: where they are used, in the command line's words
    given = targets
    try:
        targets = (targets,) if isinstance(targets, str) else tuple(targets or ())
    except TypeError:  # not iterable
        targets = (targets,)
    if not all(isinstance(t, str) for t in targets):
        raise QuantkitError(f"targets={given!r} is not consumer names: pass a list of them "
                            f"({', '.join(consumers.TARGETS)})")
    with distributed.joined(not alone):
        dev = distributed.init(device_of(device))  # under torchrun: this process's part of the job, on its GPU
        keep = out is None if keep is None else keep
        if not keep and out is None:
            raise QuantkitError("keep=False writes the quantized layers to out and drops them from memory: pass out")
        if out is None:  # the export's options with no export: taken and ignored, the layout never checked
            given = [f"format={format!r}"] * (format in ("awq", "compressed-tensors")) \
                + ["overwrite=True"] * overwrite \
                + [f"max_shard_size={max_shard_size!r}"] * (max_shard_size != exporters.DEFAULT_MAX_SIZE)
            if given:
                raise QuantkitError(f"{', '.join(given)} describe{'s' if len(given) == 1 else ''} the export, and no "
                                    "out is given: pass out (with keep=True the Model is kept too), or export the "
                                    "kept Model with quantkit.export(m, out, ...)")
        if out is not None:
            exporters.check_out_name(out, format)
            rules_file = options.get("rules") if isinstance(options.get("rules"), (str, os.PathLike)) else None
            check_out(out, overwrite, directory=format != "gguf",  # the measurement is read, or written to be kept
                      inputs=[calib_data, None if isinstance(model, Model) else model, config.measurement,
                              config.imatrix_file, rules_file])
            exporters.parse_size(max_shard_size)
        if isinstance(model, Model):
            check_float(model)
        m = model if isinstance(model, Model) else load(model)
        if out is not None:
            check_apart(out, [m.source])
        consumers.check_readers(format, config.method, targets)  # before the GGUF types are chosen, with their notes
        types = None
        if config.gguf_type is not None:
            exporters.gguf.check(m.module, config.gguf_type)
            types = gguf_types(m, config)
        importance, m.imatrix = None, {}
        if config.imatrix_file is not None:
            importance, m.imatrix = calibration.imatrix.read_recorded(config.imatrix_file)
            columns = {exporters.gguf.gguf_name(f"{n}.weight"): m.module.get_submodule(n).weight.shape[1]
                       for n in types}
            calibration.imatrix.check(importance, config.imatrix_file, columns)
            # llama-imatrix leaves out the embedding (and the output, without --process-output): the layers' count
            weighted = [exporters.gguf.gguf_name(f"{n}.weight") for n, t in types.items() if t not in UNWEIGHTED]
            missing = [key for key in weighted if key.startswith("blk.") and key not in importance]
            if missing and distributed.rank() == 0:
                warnings.warn(f"{config.imatrix_file} has no entry for {len(missing)} of the model's "
                              f"{sum(key.startswith('blk.') for key in weighted)} layer weights ({missing[0]}, ...): "
                              "they are quantized without importance; use the imatrix computed for this model")
        if out is not None:
            exporters.check_format(format, m.module, config)
            if format != "gguf" and exporters.gguf.ROPE_FREQS in getattr(m.checkpoint, "infos", {}):
                # loading divided the frequencies by them; a config.json would say a plain rope
                raise QuantkitError(f"{m.source} holds Llama 3's rope as factors (rope_freqs.weight), which a "
                                    f"{format} checkpoint's config cannot give: write it as GGUF "
                                    f"({option('format', 'gguf')}), or quantize the model's Hugging Face directory")
        if config.measurement is not None:
            measurement.check_path(config.measurement)
        if config.rules:
            layer_rules.check(config.rules, [name for name, _, _ in linear_shapes(m.module)], option("rules"))
        candidates = grids(m, config, format, targets) if config.target_bpw is not None else None
        if targets and candidates is None:  # grids checked each candidate: the base grid is none of them
            consumers.check_targets(consumers.Export.of(format, config, m.module), targets)
        windows = None
        if config.needs_calibration:
            windows = calibration_windows(m, calib_data, calib_samples, calib_seqlen, seed, progress)
            if config.imatrix:  # computed from the windows: recorded as a file's is, with no file to name
                # entries: the layers' linears, as llama-imatrix counts them
                entries = sum(exporters.gguf.gguf_name(f"{n}.weight").startswith("blk.") for n in types)
                text = calib_data if calib_data is not None else "{}/{} train".format(*calibration.windows.HUB_DATASET)
                m.imatrix = calibration.imatrix.record(None, str(text), entries, len(windows))
            batches = -(-calib_samples // BATCH)
            if config.method == "awq" and batches < distributed.world():  # a process without one has no statistics
                raise QuantkitError(f"AWQ needs a batch of calibration windows ({BATCH} each) in each of its "
                                    f"{distributed.world()} processes, and "
                                    f"{option('calib_samples', calib_samples)} gives {batches}: pass "
                                    f"{option('calib_samples', BATCH * distributed.world())} or more")
        key = None  # what an interrupted run's progress must match to be gone on from
        if out is not None and not keep:
            key = {"model": fingerprint(m.source), "settings": settings_of(config), "format": format,
                   "max_shard_size": str(max_shard_size), "device": dev.type, "processes": distributed.world(),
                   "inputs": hashlib.sha256(inputs_bytes(windows, importance)).hexdigest(),
                   "calibration": {"calib_data": calib_data and os.path.realpath(calib_data), "calib_samples": calib_samples,
                                   "calib_seqlen": calib_seqlen, "seed": seed} if windows is not None else None,
                   "header": dict(m.imatrix)}  # a GGUF header's record of the importance matrix: written first
            if not overwrite:  # before the long work: another run's finished layers are not thrown away
                check_progress(Path(out), key, len(m.layers))
        if checked is not None:
            with distributed.first_refuses(f"open {out}"):  # another job writing out: refused before checked, not after
                if out is not None and distributed.rank() == 0:
                    with locked(Path(out), "out"):
                        pass
            with distributed.first_refuses("score the model before quantizing"):
                checked()
        if config.target_bpw is not None:  # from here on, a rule per group of linears, or a GGUF type per linear
            shapes = shapes_by_name(m.module)
            with ExitStack() as held:  # out's lock through the measurement: another job writing out is refused now
                with distributed.first_refuses(f"open {out}"):
                    if out is not None and distributed.rank() == 0:
                        held.enter_context(locked(Path(out), "out"))
                config = spent(config, measured(m, config, windows, dev, progress, candidates, importance, overwrite),
                               shapes)
            if types is not None:
                types = gguf_types(m, config)
            if targets:
                consumers.check_targets(consumers.Export.of(format, config, m.module), targets)
        # RTN keeps a GGUF source's blocks of the type they get; the embedding and output matrix are RTN's always
        again = rounded_again(m.checkpoint, {n: t for n, t in (types or {}).items()
                                             if config.method == "rtn" or n in exporters.gguf.TOP})
        if again and m.qconfig is None and distributed.rank() == 0:
            warnings.warn(requantized_note(m.source, again, config.gguf_type), Note)
        settings = None  # EXL2's widths per linear, when measured
        resume = None
        if out is not None and not keep:  # saved beside the output: an interrupted run goes on
            key = {**key, "spent": settings_of(config)}  # what a measurement made of the settings
            resume = (progress_path(out, distributed.rank() if distributed.world() > 1 else None), key)
            if not overwrite and key["settings"]["target_bpw"] is not None:  # checked before, and for what it made
                check_progress(Path(out), key, len(m.layers))
        m.losses = {}
        def awq_layer(i, layer, batches):  # AWQ quantizes a layer whole: scales, folding, clipping
            return awq.quantize_layer(layer, batches, bits=config.bits, group_size=config.group_size, sym=config.sym,
                                      duo=config.duo_scaling, prefix=f"model.layers.{i}.", loss=config.awq_loss)

        read = {n.removesuffix(".weight") for n, p in m.module.named_parameters() if not p.is_meta}

        def kept(name: str, w: torch.Tensor) -> QuantizedTensor | None:  # what is read now is the source's
            return kept_blocks(m.checkpoint, name, types[name], w, check=name in read)

        def other(name: str, w: torch.Tensor) -> QuantizedTensor | None:  # GGUF: the embedding and output matrix too
            if name == "lm_head" and config.head_bits is not None:  # EXL2's head, on the device (minutes on a CPU)
                if progress and distributed.rank() == 0:  # after the layers' bar has ended
                    print(f"quantizing lm_head ({w.shape[0]} x {w.shape[1]}) to {config.head_bits} bits per weight on "
                          f"{dev.type} (minutes on a CPU for a large vocabulary)", file=sys.stderr)
                return exl2.quantize_head(w.to(dev), config.head_bits, config.damp, config.block_size).to("cpu")
            if types is None or name not in types:
                return None
            if (q := kept(name, w)) is not None:
                return q
            key = exporters.gguf.gguf_name(f"{name}.weight")
            return ggml.quantize(w, types[name], importance.get(key) if importance is not None else None)

        writes = out is not None and distributed.rank() == 0  # under torchrun, rank 0 writes
        with distributed.first_refuses(f"open {out}"):  # its lock: another job may be writing it
            writer = exporters.open_writer(m, out, format, config, overwrite, max_shard_size, types) if writes else None
        # the space check counts what a killed run of the same command wrote already
        needed = (exporters.expected_size(m.module, format, config, types) - size_on_disk(partial_path(out))
                  if writes else 0)
        try:
            # under torchrun the other processes write only their progress, beside out
            with space_for(out, needed if writes else None, "the export" if writes else "this process's progress",
                           "run the same command again: it resumes after the last finished layer") if out is not None \
                    else nullcontext():
                if config.exl2 is not None and config.measurement is not None:
                    settings = measured(m, config, windows, dev, progress, exl2.CANDIDATES, overwrite=overwrite)
                # RTN's --target-bpw calibrated its measurement only
                m.tensors = quantize_layers(m, quantizer(config, m.losses, types, importance, settings, kept),
                                            windows if config.needs_calibration else None,
                                            sequential=config.true_sequential, device=dev, writer=writer,
                                            other=other if writes or keep else None, keep=keep,
                                            progress=progress and distributed.rank() == 0, resume=resume,
                                            layer_fn=awq_layer if config.method == "awq" else None,
                                            diagonal=diagonal_only(config, types is not None))
                if writer is not None:
                    writer.close()
                    if progress:
                        print(writer.summary, file=sys.stderr)
                # every process keeps its progress until it is complete
                distributed.agree(0, "min", "writing the output")
        except BaseException as e:
            # what a resumed run needs stays, unless the input is at fault: running again would fail the same way
            # under torchrun, every process's: one that found a fault in the input removed its own before it stopped
            # (and a state waiting to be renamed counts once some process renamed its own)
            saved = [progress_path(out, r if distributed.world() > 1 else None) for r in range(distributed.world())] \
                if resume is not None else []  # none without out (or with keep)
            resumable = resume is not None and all(map(saved_progress, saved)) and any(p.is_file() for p in saved) \
                and not (isinstance(e, QuantkitError) and not isinstance(e, ResumableError))
            if writer is not None:  # the process holding the output's lock clears every process's progress
                writer.abort(keep=resumable)
            if resume is not None and not resumable:
                for f in saved_progress(resume[0]):
                    f.unlink(missing_ok=True)
            if isinstance(e, KeyboardInterrupt) and resumable and distributed.rank() == 0:  # Ctrl-C, SIGTERM
                print(f"stopped: the finished layers are kept beside {out} ({resume[0].name}): run the same command to "
                      "go on from them", file=sys.stderr)
            if isinstance(e, distributed.Stopped) and not resumable and not (  # an EXL2 measurement's progress stays
                    config.measurement is not None and siblings(Path(config.measurement), MEASURING)):
                raise QuantkitError(f"another process of this torchrun job stopped{e.how}: nothing was kept; fix what "
                                    "stopped it (see its error) and run the command again") from None
            raise
        if resume is not None:
            resume[0].unlink(missing_ok=True)
        if types is not None and keep:  # evaluate() then scores with llama.cpp's arithmetic, as it scores the file
            m.gguf_types = linear_types(m.module, {exporters.gguf.gguf_name(f"{n}.weight"): t
                                                   for n, t in types.items()})
        m.qconfig = config
        if not keep and m.checkpoint is not None:
            m.streamed_to = str(out)
        return m


def default_device(given: object, device: str | None) -> str | None:
    """Where ready() puts a model: device; else, for a model loaded from a path, the GPU when there
    is one; a Model passed in stays where it is."""
    if device is not None:
        return str(device_of(device))  # cpu:0 as the CPU, as quantize takes it: the safetensors reader refuses it
    return None if isinstance(given, Model) else "cuda" if torch.cuda.is_available() else "cpu"


def ready(model: Model | PathLike | None, packed: bool | None = None, device: str | None = None,
          dtype: str | None = None) -> Model:
    """A model to score, with every weight in memory (runnable's, whole)."""
    return runnable(model, packed, device, dtype, layerwise=False)[0]


def runnable(model: Model | PathLike | None, packed: bool | None = None, device: str | None = None,
             dtype: str | None = None, layerwise: bool | None = None,
             progress: bool = True, whole_why: str = "as asked") -> tuple[Model, Layerwise | None]:
    """A model to score, and how it runs: whole, with every weight in memory (None), or a layer at a
    time (a Layerwise, showing progress) where layerwise says so (None: where a model read lazily from
    its checkpoint, a float directory or a GGUF file, does not fit the device's free memory). From a
    path: a quantized checkpoint runs packed (its linears reading the exported tensors through
    quantkit.qlinear) unless packed=False, on device
    (default: CUDA, in float16, when there is a GPU; else the CPU in float32); a Model passed in is moved
    only when device or dtype is given. dtype: the activations' and float weights' dtype, one of DTYPES
    (on the CPU, bfloat16 runs 4-bit layers through torch's fused int4 matmul where they take up to
    qlinear.FUSED_ROWS rows, as in decoding, and the other layers, and float32 all, through the compiled
    GEMV up to qlinear.GEMV_ROWS rows; evaluation windows take the sliced fallback). whole_why: why
    layerwise=False, said in the note where the model does not fit."""
    check_dtype(dtype)
    if device is not None:
        device_of(device)  # before loading: a device torch cannot use is named, not a traceback
    if isinstance(model, Model) and packed is not None and model.qconfig is not None and not model.gguf_types:
        holds = any(isinstance(x, QuantLinear) for x in model.module.modules())
        if holds != packed:  # a Model runs as it was made: packed cannot change it
            raise QuantkitError(f"this Model holds {'packed' if holds else 'dequantized'} linears, and packed={packed} "
                                f"asks for the other: load its export with packed={packed}, or leave packed out")
    m = model if isinstance(model, Model) else load(model, packed=packed is not False)
    check_dequantized(m, packed)
    if m.gguf_types and dtype not in (None, "float32"):
        raise QuantkitError(f"a GGUF file is scored in llama.cpp's float32 arithmetic: drop {option('dtype', dtype)}")
    where = default_device(model, device)
    gguf = bool(m.gguf_types)
    dev = torch.device(where or "cpu")  # a lazy Model passed in is read onto the CPU
    run = layer_at_a_time(m, dev, runs_in(dev, dtype, gguf), layerwise, progress, whole_why)
    if run is not None:
        return m, run
    # read onto the device in the dtype it runs in: no float32 copy of the whole model in host memory first
    if where is not None:
        m.materialize(device=dev, dtype=runs_in(dev, dtype, gguf))
    elif any(t.is_meta for t in m.module.state_dict(keep_vars=True).values()):  # a Model not read whole: the CPU's
        m.materialize()  # a Model in memory stays where and as it is (materialize moves the whole model)
    if where is not None or dtype is not None:
        if where is None:  # dtype alone: where the Model is
            dev = next(m.module.parameters()).device
        moved(m.module, dev, runs_in(dev, dtype, gguf))
    return m, None


def layer_at_a_time(m: Model, dev: torch.device, dtype: torch.dtype, layerwise: bool | None,
                    progress: bool = True, whole_why: str = "as asked") -> Layerwise | None:
    """m's Layerwise when layerwise, or (None) when m, read lazily, takes more than FITS of dev's free
    memory; layerwise=False (--whole, or lm-eval's tasks that generate text) runs such a model whole, with
    a note saying whole_why."""
    if not m.lazy:
        if layerwise:
            raise QuantkitError(f"{m.source} is held in memory whole, not read from its checkpoint as it runs: "
                                f"{option('layerwise', True)} scores a float model or a GGUF file a layer at a time; "
                                "drop it")
        return None
    if layerwise is not True:
        need = sum(p.numel() for p in m.module.parameters()) * dtype.itemsize
        free = free_bytes(dev)
        if free is None or need <= FITS * free:
            return None
        where = "on the GPU" if dev.type == "cuda" else "in memory"
        said = f"{m.source} takes {need / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')}, more than " \
            f"{FITS:.0%} of the {free / 2**30:.1f} GiB free {where}"
        if layerwise is False:
            warnings.warn(f"{said}: it runs whole {whole_why}, and may run out of memory", Note)
            return None
        warnings.warn(f"{said}: it is scored a layer at a time, each read from disk once", Note)
    return Layerwise(m, dev, dtype, progress)


def runs_in(dev: torch.device, dtype: str | None, gguf: bool) -> torch.dtype:
    """What a model scores in on dev: dtype; else float16 on a GPU, except a GGUF file, scored in
    llama.cpp's float32, and float32 on the CPU."""
    return getattr(torch, dtype) if dtype else torch.float16 if dev.type == "cuda" and not gguf else torch.float32


def check_dequantized(m: Model, packed: bool | None) -> None:
    """Refuse packed=False (--dequantized) for a model with nothing to dequantize, or none to do
    otherwise (a GGUF file: its blocks dequantized in llama.cpp's arithmetic either way)."""
    flag = "--dequantized" if COMMAND_LINE.get() else "packed=False"
    if packed is False and m.qconfig is None and not m.gguf_types:
        raise QuantkitError(f"{m.source} is a float model: {flag} evaluates a dequantized copy of a quantized export, "
                            "so drop it")
    if packed is False and isinstance(m.checkpoint, GGUFCheckpoint):
        raise QuantkitError(f"{m.source} is a GGUF file, scored with its blocks dequantized as llama.cpp does them "
                            f"either way: {flag} changes nothing, so drop it")


def scoring(m: Model) -> AbstractContextManager:
    """Within: the model computes as its consumer does (a GGUF's linears with llama.cpp's arithmetic,
    under either protocol: the same file is the same model); a Model a bf16 or fp16 training left (its
    frozen base in that dtype, its adapter in float32) under that autocast, as it trained."""
    if m.gguf_types:
        return evals.llamacpp_arithmetic(m.module, m.gguf_types)
    floats = {p.dtype for p in m.module.parameters() if p.is_floating_point()}
    if m.adapter is not None and len(floats) > 1:
        narrowest = min(floats, key=lambda d: torch.finfo(d).bits)
        return torch.autocast(next(m.module.parameters()).device.type, narrowest)
    return nullcontext()


def evaluate(
    model: Model | PathLike | None = None,
    data: PathLike | None = None,
    protocol: str = "llamacpp",
    ctx: int = 512,
    max_windows: int | None = None,
    progress: bool = True,
    packed: bool | None = None,
    device: str | None = None,
    dtype: str | None = None,
    layerwise: bool | None = None,
) -> evals.Perplexity:
    """Perplexity of a model (or a model path, or the embedded default) on a text file. A quantized
    checkpoint loaded from a path runs packed, its linears reading the exported tensors through
    quantkit.qlinear (Triton on CUDA, torch on the CPU); packed=False evaluates a dequantized copy. A Model
    passed in runs as it holds its linears (a packed given for it must agree).
    device, dtype: where and in what a model loaded from a path runs (default: CUDA, in float16, when
    there is a GPU; else float32); a Model passed in is moved only when one is given.
    layerwise: run the model a decoder layer at a time over all windows, reading each layer from the
    checkpoint once, so that a float model or GGUF file larger than the device's memory is scored
    (None: when it takes more than FITS of the free memory; the same figure either way)."""
    check_arguments(evaluate, locals())
    check_windows(ctx, max_windows, protocol)
    text = calibration.load_text(data, split="test")  # before the model loads
    m, forward = runnable(model, packed, device, dtype, layerwise, progress)
    text = calibration.chats(data, text, m.tokenizer)
    with scoring(m):  # a GGUF's blocks, scored with llama.cpp's arithmetic
        return evals.perplexity(m.module, m.tokenizer, text, protocol, ctx, max_windows, progress=progress,
                                forward=forward)


def compare(
    model: Model | PathLike | None,
    base: Model | PathLike,
    data: PathLike | None = None,
    ctx: int = 512,
    max_windows: int | None = None,
    save_base: PathLike | None = None,
    progress: bool = True,
    packed: bool | None = None,
    device: str | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    layerwise: bool | None = None,
) -> evals.Divergence:
    """Divergence of model from base, as `llama-perplexity --kl-divergence` measures it: perplexity of
    both, KL divergence, delta-p and top-token agreement on the second half of each window of data.
    base: a model (a Model, a path), or a file of its log-probabilities saved by save_base (or by
    llama-perplexity --kl-divergence-base), which skips running the base. One model is in memory at a
    time: the base's log-probabilities go to disk (save_base, or a temporary file) first. dtype: both
    models run in it (as in evaluate). overwrite: replace a base saved at save_base. layerwise: each
    model run a layer at a time (as in evaluate)."""
    check_arguments(compare, locals())
    check_windows(ctx, max_windows)
    check_dtype(dtype)
    text = calibration.load_text(data, split="test")
    if device is not None:
        device_of(device)
    saved = base is not None and not isinstance(base, Model) and evals.kld.is_saved_base(base)
    if saved and save_base is not None:
        raise QuantkitError(f"{base} is a saved base already: {option('save_base')} needs {option('base')} to be a "
                            "model")
    evals.kld.check_save_path(save_base, overwrite)
    m = model if isinstance(model, Model) else load(model, packed=packed is not False)
    check_dequantized(m, packed)  # before the base is scored
    text = calibration.chats(data, text, m.tokenizer)
    with tempfile.TemporaryDirectory(prefix="quantkit-base-") as tmp:
        if saved:
            base_file = evals.BaseFile(base)
        else:
            b = base if isinstance(base, Model) else load(base)
            warn_base(b, m)
            if layerwise and not m.lazy and not b.lazy:
                raise QuantkitError(f"neither {m.source} nor the base {b.source} is read from its checkpoint as it "
                                    f"runs: {option('layerwise', True)} scores a float model or a GGUF file a layer at "
                                    "a time; drop it")
            difference = evals.kld.tokenizer_difference(b.tokenizer, m.tokenizer, text)
            if difference:
                raise QuantkitError(f"{b.source} and {m.source} have different tokenizers ({difference}): compare a "
                                    "model with the base it was quantized from")
            path = save_base or Path(tmp) / "base.logits"
            try:
                write_base(b, path, text, ctx, max_windows, default_device(base, device), progress, dtype, overwrite,
                           each(b, layerwise))
            except ResumableError as e:  # "write it elsewhere", of a file the user did not name
                if save_base is not None:
                    raise
                said = str(e).removesuffix(": free some space or write it elsewhere")
                raise QuantkitError(f"{said} (a temporary file): free some space there, pass "
                                    f"{option('save_base', 'FILE')} on a disk with room, set TMPDIR to one, or score "
                                    f"fewer windows ({option('max_windows')})") from None
            del b  # one model in memory at a time
            base_file = evals.BaseFile(path)
        n = base_file.n if max_windows is None else max_windows
        vocab = getattr(m.module.config, "vocab_size", None)
        evals.kld.check_base(base_file, ctx, vocab=vocab)  # before the windows are cut and the model is read
        windows = evals.windows(m.tokenizer, text, "llamacpp", ctx, n, progress)
        evals.kld.check_base(base_file, ctx, windows, vocab)
        m, forward = runnable(m, packed if isinstance(model, Model) else None, default_device(model, device), dtype,
                              layerwise if saved else each(m, layerwise), progress)
        with scoring(m):
            return evals.divergence(m.module, m.tokenizer, windows, base_file, progress=progress, forward=forward)


def each(m: Model, layerwise: bool | None) -> bool | None:
    """compare's layerwise for one of its two models: layerwise=True runs the one read lazily (the float
    base, say) a layer at a time and leaves the other (its quantized export) to the automatic choice."""
    return None if layerwise and not m.lazy else layerwise


def warn_base(base: Model, model: Model) -> None:
    """A base that makes a gate pass for nothing: the model itself, or a quantized one (the figures are
    then the distance from it, not from the float model shipped against)."""
    if base is model or os.path.realpath(base.source) == os.path.realpath(model.source):
        warnings.warn(f"the base is the model itself ({model.source}): every divergence is 0; compare with the float "
                      "model it was quantized from")
    elif base.qconfig is not None or any(t not in blocks.FLOAT_TYPES for t in (base.gguf_types or {}).values()):
        warnings.warn(f"the base {base.source} is quantized: the figures are the model's divergence from it, not from "
                      "the float model; compare with the float model it was quantized from")


def write_base(base: Model, path: PathLike, text: str, ctx: int = 512, max_windows: int | None = None,
               device: str | None = None, progress: bool = True, dtype: str | None = None,
               overwrite: bool = False, layerwise: bool | None = None) -> float:
    """Score the text's windows on the base and save its log-probabilities at path (llama.cpp's layout);
    overwrite: replace a file there; layerwise: as in evaluate. The base's exact perplexity on them."""
    b, forward = runnable(base, device=device, dtype=dtype, layerwise=layerwise, progress=progress)
    with scoring(b):
        windows = evals.windows(b.tokenizer, text, "llamacpp", ctx, max_windows, progress)
        return evals.save_base(b.module, b.tokenizer, windows, path, progress=progress, overwrite=overwrite,
                               forward=forward)


def lm_eval(model: Model | PathLike | None, tasks: list[str], limit: int | float | None = None,
            num_fewshot: int | None = None, batch_size: int = 4, max_length: int | None = None,
            data_dir: PathLike | None = None, seed: int | None = None, packed: bool | None = None,
            device: str | None = None, chat: bool = False, dtype: str | None = None,
            layerwise: bool | None = None) -> dict[str, dict[str, float]]:
    """lm-eval's results by task for a model (a Model, a path, or the embedded default), run through
    lm-eval's HFLM wrapper around the loaded model. Local tasks (wikitext, dolly_mc) read data_dir.
    limit: documents per task, or below 1 a fraction of each; seed: every seed lm-eval takes (None:
    lm-eval's own); chat: prompts in the tokenizer's chat template; device, dtype, layerwise: as in
    evaluate (a model run a layer at a time scores every request of a kind together; tasks that generate
    text run the model whole)."""
    check_arguments(lm_eval, locals())
    from quantkit.evals import harness

    tasks = [tasks] if isinstance(tasks, str) else tasks
    if not isinstance(tasks, (list, tuple)) or not all(isinstance(t, str) for t in tasks):
        raise QuantkitError(f"tasks={tasks!r}: pass lm-eval task names, a string or a list of strings")
    tasks = list(tasks)
    whole("batch_size", batch_size, 1)
    for name, value, least in (("max_length", max_length, 2), ("num_fewshot", num_fewshot, 0), ("seed", seed, 0)):
        if value is not None:
            whole(name, value, least)
    limit = harness.documents(limit, f"limit={limit!r}")
    with harness.kept_state():  # a library call leaves the caller's seeds and loggers as they were
        prepared = harness.prepare(tasks, data_dir)  # a wrong name or missing data fails before the model loads
        harness.check_prompts(prepared, num_fewshot, chat)
        if layerwise:
            harness.check_layerwise(prepared)
        m, forward = runnable(model, packed, device, dtype, False if prepared.generating else layerwise,
                              whole_why=f"because {harness.generating(prepared)}" if prepared.generating
                              else "as asked")
        with scoring(m):
            return harness.run(prepared, m.module, m.tokenizer, limit, num_fewshot, batch_size, max_length, seed,
                               chat, forward)


def export(model: Model, out: PathLike, format: str = "safetensors", overwrite: bool = False,
           max_shard_size: int | str = exporters.DEFAULT_MAX_SIZE, progress: bool = True) -> Path:
    """Write a Model quantized in memory (quantize with keep=True) to out in format; the path written
    (and, with progress, what it holds on stderr). A model on disk needs no export: quantize it with
    out, or requantize a GGUF file with `quantkit export` (quantkit.requant.requantize)."""
    check_arguments(export, locals())
    in_memory(model, "export")
    check_held(model, "export before evaluating with a dtype or device, or quantize again with keep=True")
    exporters.check_format_name(format)  # before out's name is judged against it
    exporters.check_out_name(out, format)
    if format == "gguf" and model.qconfig is not None:
        if model.qconfig.gguf_type is None:
            raise QuantkitError(f"this Model is quantized to {model.qconfig.method}'s grids, not GGUF blocks: quantize "
                                f"the float model with format='gguf' (a gguf_type mix, {exporters.gguf.DEFAULT_MIX} by "
                                "default), with out to write the file, or with keep=True to export it after")
        if max_shard_size != exporters.DEFAULT_MAX_SIZE:
            refuse_unused({"max_shard_size": "max_shard_size"}, model.qconfig.method, format)
    return exporters.export(model, out, format, overwrite, max_shard_size, progress)


def in_memory(model: object, what: str) -> None:
    if not isinstance(model, Model):
        raise QuantkitError(f"{what} writes a Model in memory, not a {type(model).__name__}: quantize a model on disk "
                            "with out (or load it, or quantize it with keep=True, and pass that)")


def check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise QuantkitError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")


def check_windows(ctx: int, max_windows: int | None, protocol: str = "llamacpp") -> None:
    """Refuse windows that cannot be cut (evaluate, compare), before any model loads."""
    whole("ctx", ctx)
    if max_windows is not None:
        whole("max_windows", max_windows)
    evals.check_settings(protocol, ctx, max_windows)


def whole(name: str, value, least: int | None = None) -> None:
    """Refuse an API argument that is not a whole number (of at least least)."""
    if not isinstance(value, int) or isinstance(value, bool) or least is not None and value < least:
        raise QuantkitError(f"{name}={value!r}: pass a whole number" + (f" of at least {least}" if least is not None
                                                                        else ""))


def check_float(m: Model) -> None:
    """Refuse to quantize a Model whose weights in memory are not its checkpoint's: quantized already in
    this process (kept, or streamed to an export), or converted to another dtype (evaluate converts
    the Model it is given to the dtype it runs in). A quantized export loaded from disk is requantized,
    with a warning."""
    again = "quantize quantkit.load(path) again, which reads the float weights"
    if m.adapter is not None:
        raise QuantkitError(f"this Model holds the LoRA adapter {m.adapter} unmerged (trained or attached in this "
                            f"process): quantize the merged model (quantkit.merge({m.adapter!r}, out=...) writes it)")
    if m.streamed_to is not None or (m.qconfig is not None and m.checkpoint is not None):
        raise QuantkitError(f"this Model was quantized already in this process{f' (to {m.streamed_to})' if m.streamed_to else ''}: "
                            f"{again}")
    check_held(m, again)
    if m.qconfig is not None:
        warnings.warn(f"{m.source} is quantized already: quantizing it again keeps its rounding error; quantize the "
                      "float model for the best result")


def check_held(m: Model, again: str) -> None:
    """Refuse a Model whose float weights are not its checkpoint's values: converted in memory to another
    dtype (evaluate with a device or dtype converts the Model it is given); again: what to do instead."""
    held = {p.dtype for p in m.module.parameters() if not p.is_meta and p.is_floating_point()}
    if m.checkpoint is not None and held - {torch.float32, m.checkpoint.dtype}:
        raise QuantkitError(f"this Model's weights were converted to {', '.join(sorted(map(str, held)))} in memory "
                            f"(evaluate with a device or dtype converts the Model it is given): {again}")


def export_gguf(model: Model, out: PathLike, gguf_type: str | None = None, overwrite: bool = False,
                progress: bool = True) -> Path:
    """GGUF of a model: a quantized checkpoint whose grids are GGUF blocks keeps its codes (the other
    weights in F16); a float model is rounded to nearest in gguf_type (F16 by default)."""
    check_arguments(export_gguf, locals())
    in_memory(model, "export_gguf")
    if not model.tensors:  # a copy, so that model stays the float model
        quantize(Model(model.module, model.tokenizer, model.source, gguf_types=model.gguf_types,
                       checkpoint=model.checkpoint),
                 method="rtn", gguf_type="F16" if gguf_type is None else gguf_type, out=out, format="gguf", overwrite=overwrite,
                 progress=progress)
        return Path(out)
    if gguf_type is not None:
        raise QuantkitError(f"{model.source} is already quantized, so its grids decide the GGUF types: drop "
                            f"{option('gguf_type')}")
    tensors = {name: ggml.from_grid(qt, name) for name, qt in model.tensors.items()}
    kinds = sorted({qt.ggml for qt in tensors.values()})
    if len(kinds) != 1:
        raise QuantkitError(f"{model.source}: linears of several GGUF types {kinds}: the checkpoint is inconsistent")
    for name in exporters.gguf.tensor_types(model.module, "F16").keys() - tensors.keys():
        tensors[name] = ggml.quantize(model.module.get_submodule(name).weight.data, "F16")
    qconfig = QuantConfig(method="rtn", gguf_type=kinds[0])
    return exporters.export(Model(model.module, model.tokenizer, model.source, tensors, qconfig), out, "gguf", overwrite,
                            progress=progress)
