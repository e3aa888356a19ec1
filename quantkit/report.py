"""`quantkit report`: a sweep of methods and sizes over one model, each point quantized, exported,
measured (size, bits per weight, perplexity, divergence from the base, optional lm-eval scores,
time, peak memory) and drawn against bits per weight.

The base's log-probabilities are computed once (DIR/base.logits) and every point is compared with
them on the same windows; the calibration windows are the same seeded sample for every point.
Each point runs in a child process (its own peak memory; a crash costs one point) and leaves
DIR/points/NAME.json when it succeeds: run the same command again and it goes on with the points
still missing. A failed point is recorded with its error and the sweep goes on."""
from __future__ import annotations

import ctypes
import fcntl
import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
import warnings
from contextlib import AbstractContextManager
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable

from . import atomic, errors
from .errors import QuantkitError, count, setting, space_for
from .requant import check_mix

if TYPE_CHECKING:
    import torch

FAMILIES = ("rtn", "gptq", "awq", "nf4", "gguf", "exl2")
BITS = (3, 4, 8)
EXL2_TARGETS = (3.0, 4.125, 5.0)
GGUF_TYPES = ("Q2_K", "Q3_K_M", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
EMBEDDING_PREFIXES = ("model.embed_tokens.", "lm_head.", "token_embd.", "output.")  # HF's names and GGUF's


@dataclass
class Point:
    name: str
    method: str  # rtn, gptq (EXL2's too), awq, nf4
    format: str  # safetensors, awq, gguf, exl2
    bits: int | None = None  # rtn, gptq, awq: the integer width
    gguf_type: str | None = None
    exl2: float | None = None  # the target bits per weight of an EXL2 point

    def config(self, group_size: int) -> dict:
        """QuantConfig's fields: the report's group size where the point's grids take one."""
        c = {"method": self.method}
        for key in ("bits", "gguf_type", "exl2"):
            if getattr(self, key) is not None:
                c[key] = getattr(self, key)
        if self.method in ("rtn", "gptq", "awq") and self.format not in ("gguf", "exl2"):
            c["group_size"] = group_size
        return c


def points(methods: list[str], bits: list[int], gguf_types: list[str],
           exl2_targets: list[float] = list(EXL2_TARGETS)) -> list[Point]:
    """The sweep's points, each once, in the order given."""
    out = []
    methods, bits, gguf_types, exl2_targets = (list(dict.fromkeys(v)) for v in (methods, bits, gguf_types, exl2_targets))
    for family in methods:
        if family not in FAMILIES:
            raise QuantkitError(f"unknown method {family!r} in --methods: use some of {', '.join(FAMILIES)}")
        if family in ("rtn", "gptq", "awq"):
            # AWQ's own layout holds 4 bits; other widths go in the GPTQ layout, which holds any integer grid
            out += [Point(f"{family}-w{b}", family, "awq" if family == "awq" and b == 4 else "safetensors", b)
                    for b in bits]
        elif family == "nf4":
            out.append(Point("nf4", "nf4", "safetensors"))
        elif family == "exl2":
            # short where that names the target exactly (4.125, 4); else every digit (4.123456 and 4.123457)
            out += [Point(f"exl2-{t:g}" if float(f"{t:g}") == t else f"exl2-{t!r}", "gptq", "exl2", exl2=t)
                    for t in exl2_targets]
        else:
            named = dict.fromkeys(check_mix(t, "--gguf-types") for t in gguf_types)  # q4_k is Q4_K_M
            out += [Point(f"gguf-{t}", "rtn", "gguf", gguf_type=t) for t in named]
    return out


@dataclass
class Settings:
    """What every point shares; a report directory holds one set."""
    model: str
    data: str
    calib_data: str | None
    calib_samples: int
    group_size: int
    windows: int
    ctx: int
    tasks: list[str] = field(default_factory=list)
    lm_eval_limit: float | None = None
    lm_eval_fewshot: int | None = None  # None: each task's own
    lm_eval_max_length: int | None = None  # None: the model's context
    lm_eval_chat: bool = False  # prompts in the tokenizer's chat template
    lm_eval_data_dir: str | None = None  # where local tasks read (harness.prepare's default)
    exl2_measured: bool = False  # EXL2 points spend the target by one measurement, OUT/exl2-measurement.json
    calib_seqlen: int = 512
    weights: str = ""  # the model's files as modelio.fingerprint gives them: a report goes on only with the same
    texts: str = ""  # the same of --data and --calib-data: text edited at its path is another report's


FILES = {"weights": "the model's files", "texts": "the --data or --calib-data file"}  # fingerprints, named not shown


def tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes of each tensor of an export (safetensors shards or a GGUF file)."""
    if path.suffix == ".gguf":
        from .modelio import gguf_header

        return {t.name: t.nbytes for t in gguf_header(path)[1].tensors}
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with open(shard, "rb") as f:  # an 8-byte length, then the JSON header with each tensor's byte range
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        out.update({k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"})
    return out


def weight_bytes(path: Path) -> int:
    """The size of a model's weight files (a GGUF file; a directory's safetensors shards): the base and
    the points alike, without the tokenizer and config files beside them."""
    from .modelio import shard_files

    return sum(f.stat().st_size for f in shard_files(path)) if path.is_dir() else path.stat().st_size


def bits_per_weight(sizes: dict[str, int], params: int, linear_params: int) -> tuple[float, float]:
    """(all tensors over all parameters, decoder linears' tensors over their weights): the second
    leaves out the embedding, the output head and the norms."""
    linear = sum(b for k, b in sizes.items() if not k.startswith(EMBEDDING_PREFIXES) and "norm" not in k)
    return 8 * sum(sizes.values()) / params, 8 * linear / linear_params


def parameter_counts(module: torch.nn.Module) -> tuple[int, int]:
    """(every parameter once, the decoder linears' weights)."""
    import torch

    total = sum(p.numel() for p in module.parameters())  # a tied weight is yielded once
    linear = sum(m.weight.numel() for n, m in module.named_modules()
                 if isinstance(m, torch.nn.Linear) and ".layers." in f".{n}")
    return total, linear


def run_point(spec: dict) -> dict:
    """One point, in this process: quantize and export, then measure."""
    from quantkit import exporters

    from . import api
    from .config import QuantConfig
    from .modelio import load
    from .pipeline import peak_rss

    p, s, out = Point(**spec["point"]), Settings(**spec["settings"]), Path(spec["out"])
    export = export_path(out, p)
    m = load(s.model or None)
    measurement = str(out / "exl2-measurement.json") if p.exl2 and s.exl2_measured else None
    config = QuantConfig(measurement=measurement, **p.config(s.group_size))
    fmt = p.format
    if fmt == "awq":  # AWQ's own layout where it holds this model, else the GPTQ layout
        try:
            exporters.check_format("awq", m.module, config)
        except QuantkitError:
            fmt = "safetensors"
    start = time.perf_counter()
    api.quantize(m, config, calib_data=s.calib_data, calib_samples=s.calib_samples, calib_seqlen=s.calib_seqlen,
                 out=export, format=fmt, overwrite=True, keep=True)  # its progress into the point's log
    seconds = time.perf_counter() - start
    peak = peak_rss()
    params, linear = parameter_counts(m.module)
    sizes = tensor_bytes(export)
    bpw, bpw_linear = bits_per_weight(sizes, params, linear)
    file_bytes = weight_bytes(export)
    d = api.compare(m, out / "base.logits", s.data, s.ctx, s.windows)
    result = {**asdict(p), "format": fmt, "status": "ok", "bytes": file_bytes, "bpw": bpw, "bpw_linear": bpw_linear,
              "perplexity": d.perplexity, "perplexity_unc": d.perplexity_unc, "ppl_ratio": d.ppl_ratio,
              "ppl_ratio_unc": d.ppl_ratio_unc, "kld_mean": d.kld_mean, "kld_mean_unc": d.kld_unc,
              "kld_p99": d.kld_percentiles[99.0], "same_top": d.same_top, "same_top_unc": d.same_top_unc,
              "delta_p_rms": d.delta_p_rms, "dtype": d.dtype, "device": d.device,  # what it was scored in
              "quantize_s": seconds, "peak_rss": peak}
    if s.tasks:
        try:
            result["lm_eval"] = lm_scores(m, s)
        except Exception as e:  # the point's measurements stand; the sweep names the scores missing, and runs it again
            result["lm_eval_error"] = (str(e).strip().splitlines() or [type(e).__name__])[0][:500]
    if not spec.get("keep_exports"):
        atomic.remove(export)
    return result


# report's flags for what it passes on to lm-eval, which its errors name
LM_EVAL_FLAGS = MappingProxyType({"limit": "--lm-eval-limit", "num_fewshot": "--lm-eval-fewshot",
                                  "max_length": "--lm-eval-max-length", "chat": "--lm-eval-chat",
                                  "data_dir": "--lm-eval-data-dir"})


# report's flags for what each point passes on to quantize
POINT_FLAGS = MappingProxyType({"method": "--methods", "exl2": "--exl2-bits", "gguf_type": "--gguf-types",
                                "max_windows": "--windows"})


def lm_eval_flags() -> AbstractContextManager[None]:
    return errors.renamed(LM_EVAL_FLAGS)


def lm_scores(model: object, s: Settings) -> dict[str, dict[str, float]]:
    """lm-eval's results for the base or a point, all run alike."""
    from . import api

    with lm_eval_flags(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".* rolling windows of plain text")  # check() said it once
        return api.lm_eval(model, s.tasks, limit=s.lm_eval_limit, num_fewshot=s.lm_eval_fewshot,
                           max_length=s.lm_eval_max_length, data_dir=s.lm_eval_data_dir, chat=s.lm_eval_chat)


def check(todo: list[Point], settings: Settings, out: Path) -> None:
    """Refuse, before the report directory is made, what would fail every point or the whole sweep."""
    from quantkit import calibration

    from . import api
    from .config import QuantConfig
    from .modelio import load

    if not todo:
        raise QuantkitError("the sweep has no points: name some of " + ", ".join(FAMILIES) + " in --methods, "
                            "with widths in --bits, --gguf-types or --exl2-bits for them")
    calibrates = False
    for p in todo:
        if p.exl2 is not None and not (math.isfinite(p.exl2) and p.exl2 > 0):
            raise QuantkitError(f"--exl2-bits {p.exl2:g} is not a target: give bits per weight, such as 4.125")
        calibrates |= QuantConfig(**p.config(settings.group_size)).needs_calibration  # widths, group size
    if calibrates and (settings.calib_samples < 1 or settings.calib_seqlen < 2):
        raise QuantkitError(f"{settings.calib_samples} calibration windows of {settings.calib_seqlen} tokens: pass "
                            "--calib-samples 1 or more and --calib-seqlen 2 or more")
    m = load(settings.model or None)
    if calibrates:  # the text's faults (records, length), or the hub's default without the network: once here,
        # not in every point after the base was scored
        api.calibration_windows(m, settings.calib_data, settings.calib_samples, settings.calib_seqlen)
    elif settings.calib_data is not None:  # a setting of the report, even where this sweep does not use it
        calibration.load_text(settings.calib_data)
    if settings.tasks:
        from quantkit.evals import harness

        harness.documents(settings.lm_eval_limit, f"--lm-eval-limit {settings.lm_eval_limit}")
        for option, value, least in (("--lm-eval-fewshot", settings.lm_eval_fewshot, 0),
                                     ("--lm-eval-max-length", settings.lm_eval_max_length, 2)):
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
                raise QuantkitError(f"{option} {value!r}: pass a whole number of at least {least}")
        with lm_eval_flags():  # lm-eval would find these after the base was scored
            tasks = harness.prepare(settings.tasks, settings.lm_eval_data_dir)  # a wrong name or missing data
            harness.check_settings(m.module.config, m.tokenizer, settings.lm_eval_max_length, settings.lm_eval_chat)
            harness.check_prompts(tasks, settings.lm_eval_fewshot, settings.lm_eval_chat)  # its note: once, here
    if out.is_dir() and any(out.iterdir()) and not (out / "settings.json").is_file():
        raise QuantkitError(f"{out} holds other files, not a quantkit report: choose another --out")
    if out.exists() and not out.is_dir():
        raise QuantkitError(f"{out} is a file: --out names the report's directory; choose another")
    atomic.check_writable(next(d for d in [out, *out.parents] if d.exists()), "out")  # where mkdir starts


def duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def write_json(path: Path, value) -> None:
    atomic.write_text(path, json.dumps(value, indent=1))


def strict_json(value, indent: int | None = None) -> str:
    """JSON that jq and a browser read: a figure past float's range (inf, nan) is null, as JavaScript
    writes it; Python's `Infinity` and `NaN` are not JSON, and those refuse the whole text."""
    def finite(v):
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return None if isinstance(v, float) and not math.isfinite(v) else v
    return json.dumps(finite(value), indent=indent, allow_nan=False)


def read_json(path: Path):
    """One of the report's own files; a damaged one named (it was a traceback)."""
    try:
        value = json.loads(path.read_text())
        if not isinstance(value, dict):
            raise ValueError("not an object")
        return value
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise damaged(path) from None


def damaged(path: Path) -> QuantkitError:
    return QuantkitError(f"{path} is damaged, not what quantkit report wrote: remove it (a point's file: the point "
                         "runs again) or choose another --out")


FIGURES = ("name", "format", "bytes", "bpw", "bpw_linear", "perplexity", "ppl_ratio", "kld_mean", "kld_p99", "same_top",
           "quantize_s", "peak_rss")  # what the table shows of a measured point


def read_point(path: Path) -> dict:
    """A point's file, with what the table shows of it (a bare {"status": "ok"} from an earlier run was
    a KeyError there; one of this sweep's points without them runs again)."""
    point = read_json(path)
    if not set(FIGURES if point.get("status") == "ok" else ("name", "status", "error")) <= point.keys():
        raise damaged(path)
    return point


@dataclass
class Sweep:
    """Which points: method families, the integer widths of rtn/gptq/awq, the GGUF mixes, the EXL2 targets."""
    methods: list[str] = field(default_factory=lambda: list(FAMILIES))
    bits: list[int] = field(default_factory=lambda: list(BITS))
    gguf_types: list[str] = field(default_factory=lambda: list(GGUF_TYPES))
    exl2_targets: list[float] = field(default_factory=lambda: list(EXL2_TARGETS))
    keep_exports: bool = False


def report(out: str | os.PathLike, settings: Settings, sweep: Sweep | None = None,
           echo: Callable[[str], None] = print) -> dict:
    """Run (or go on with) the sweep in out; returns the report (also out/report.json, report.md,
    perplexity.png, kld.png)."""
    from quantkit import calibration, evals
    from quantkit.evals.harness import default_data_dir, documents

    from . import api
    from .modelio import default_model_dir, fingerprint, load

    sweep = sweep or Sweep()
    todo = points(sweep.methods, sweep.bits, sweep.gguf_types, sweep.exl2_targets)
    check(todo, settings, Path(out))
    s = settings  # paths as absolute: a resumed run from elsewhere is the same report
    settings = replace(s, model=str(Path(s.model).resolve()) if s.model else "", data=str(Path(s.data).resolve()),
                       calib_data=str(Path(s.calib_data).resolve()) if s.calib_data else None,
                       # where the local tasks read, found now: a resumed run elsewhere (another $QUANTKIT_DATA)
                       # scores its points on the same records or is refused
                       lm_eval_data_dir=str(Path(s.lm_eval_data_dir or default_data_dir()).resolve())
                       if s.tasks else None,
                       lm_eval_limit=documents(s.lm_eval_limit, "") if s.tasks else s.lm_eval_limit,  # 1e30: every one
                       weights=fingerprint(s.model or default_model_dir()),
                       texts=" ".join(fingerprint(t) for t in (s.data, s.calib_data) if t))
    model, data, windows, ctx = settings.model or None, settings.data, settings.windows, settings.ctx
    out = Path(out)
    fresh = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    lock = atomic.open_lock(out / ".lock")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise QuantkitError(f"{out} is being written by another quantkit report: wait for it or choose another --out") from None
    saved = out / "settings.json"
    # a setting added since the report began is its default there
    defaults = {f.name: f.default for f in fields(Settings) if f.default is not MISSING}
    before = {**defaults, **read_json(saved)} if saved.exists() else {}
    for k in ("lm_eval_data_dir", "texts"):  # a report begun before these were saved: the ones found now
        if before and not before[k]:
            before[k] = getattr(settings, k)
    if before and before != asdict(settings):
        changed = "; ".join(f"{FILES[k]} changed since the report began (name, size or time)" if k in FILES else
                            f"{setting(k, v) if k != 'model' else f'the model {v}'} here, "
                            f"{setting(k, before.get(k)) if k != 'model' else before.get(k)} in the report"
                            for k, v in asdict(settings).items()
                            if before.get(k) != v) or "a setting this version does not have"
        raise QuantkitError(f"{out} holds a report of other settings ({changed}): run with its settings to go on, or "
                            "choose another --out")
    write_json(saved, asdict(settings))
    for sub in ("points", "logs", "exports"):
        (out / sub).mkdir(exist_ok=True)
    base = out / "base.logits"

    def abandon() -> None:  # a report this run began, refused on bad input: nothing worth keeping
        if fresh:
            lock.close()
            atomic.remove(out)

    # base.json is written after base.logits: both are there or the base is redone, as it is when base.logits
    # (large, a GB for a 49k vocabulary) was deleted once a report was done; its lm-eval scores are kept
    kept = read_json(out / "base.json") if (out / "base.json").exists() else None
    if kept is None or not base.is_file():
        echo(f"base: scoring {count(windows, 'window')} of {ctx} on the float model" + (
            f" again ({base} is gone)" if kept is not None else ""))
        try:
            m = load(model)
            ppl = api.write_base(m, base, calibration.load_text(data, split="test", tokenizer=m.tokenizer), ctx,
                                 windows, overwrite=True)  # the report's own, from a run stopped before base.json
        except QuantkitError:  # bad input (the model, the text, ctx): nothing of this run is worth keeping
            abandon()
            raise
        params, linear = parameter_counts(m.module)
        source = Path(m.source)
        scored = evals.BaseFile(base)
        if scored.n < windows:
            echo(f"base: the text gives {count(scored.n, 'window')} of {ctx}, fewer than --windows {windows}")
        # exact, as the points' perplexities are (the saved rows floor a target 16 nats under the top)
        write_json(out / "base.json", {**(kept or {}), "perplexity": ppl, "windows": scored.n, "params": params,
                                       "linear_params": linear, "bytes": weight_bytes(source)})
        del m
    if settings.tasks and "lm_eval" not in (based := read_json(out / "base.json")):  # the scores' float row
        echo(f"base: lm-eval {', '.join(settings.tasks)} on the float model")
        try:
            based["lm_eval"] = lm_scores(load(model), settings)  # a Model stays on the CPU in float32, as the points'
        except QuantkitError:  # lm-eval's bad input (too many few-shot examples): the corrected run starts afresh
            abandon()
            raise
        write_json(out / "base.json", based)

    def finished(p: Point) -> bool:  # measured by an earlier run, its lm-eval scores too (else it runs again)
        done = out / "points" / f"{p.name}.json"
        return done.exists() and (kept := read_json(done)).get("status") == "ok" and set(FIGURES) <= kept.keys() \
            and "lm_eval_error" not in kept

    left = [p for p in todo if not finished(p)]
    began = time.monotonic()
    for k, p in enumerate(left):
        done, log = out / "points" / f"{p.name}.json", out / "logs" / f"{p.name}.log"
        eta = f", about {duration((time.monotonic() - began) / k * (len(left) - k))} left" if k else ""
        echo(f"[{todo.index(p) + 1}/{len(todo)}] {p.name} (log: {log}{eta})")
        spec = {"point": asdict(p), "settings": asdict(settings), "out": str(out), "keep_exports": sweep.keep_exports,
                "parent": os.getpid(), "command_line": errors.COMMAND_LINE.get()}
        try:
            with atomic.created(log) as f:
                r = subprocess.run([sys.executable, "-m", "quantkit.report", json.dumps(spec)], stdout=f, stderr=f)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM
            echo(f"stopped: the points finished so far are kept in {out}: run the same command to go on")
            raise
        if not done.exists() or r.returncode != 0:
            drop(export_path(out, p))  # half written, or measured before it failed: not what was asked to be kept
            error = failure(log.read_text(), r.returncode)
            write_json(done, {**asdict(p), "status": "failed", "error": error[:500], "returncode": r.returncode})
            echo(f"    failed: {error[:200]} (log: {log})")
        elif "lm_eval_error" in (point := read_point(done)):
            echo(f"    lm-eval failed: {point['lm_eval_error'][:200]}")
        else:
            echo(f"    {point['bpw_linear']:.3f} bits per linear weight, perplexity {point['perplexity']:.3f}, KLD "
                 f"{point['kld_mean']:.4f}, quantized in {point['quantize_s']:.0f} s")
    names = [p.name for p in todo]
    # points an earlier run of other --methods, --bits, ... made with these settings stay in the report
    earlier = sorted(f.stem for f in (out / "points").glob("*.json") if f.stem not in names)
    if earlier:
        echo(f"also in the report, from earlier runs into {out}: {', '.join(earlier)}")
    result = {"settings": asdict(settings), "base": read_json(out / "base.json"),
              "points": [read_point(out / "points" / f"{n}.json") for n in names + earlier]}
    with space_for(out, None, "the report's tables and plots", "run the same command again (its points are kept)"):
        atomic.write_text(out / "report.json", strict_json(result, indent=1))  # for jq and the like; points/ is read back here only
        atomic.write_text(out / "report.md", table(result))
        plot(result, out)
    if not sweep.keep_exports and not any((out / "exports").iterdir()):  # each point's export measured, then dropped
        (out / "exports").rmdir()
    lock.close()
    return result


def export_path(out: Path, p: Point) -> Path:
    return out / "exports" / (p.name + (".gguf" if p.format == "gguf" else ""))


def drop(export: Path) -> None:
    """A point's export, and what a quantize killed or failed while writing it leaves beside it."""
    for f in [export, atomic.partial_path(export), *atomic.progress_files(export),
              *atomic.siblings(export, r"\.{name}\.(lock|old-\d+)")]:
        atomic.remove(f)


def failure(log: str, returncode: int) -> str:
    """Why a point's process failed, from its log and exit status: its error line, else the signal
    that ended it without a word (the out-of-memory killer's SIGKILL, say), else the log's last line."""
    lines = [line for line in log.splitlines() if line.strip()]
    error = next((line for line in reversed(lines) if line.startswith("error:")), None)
    if error is None and returncode < 0:
        error = f"killed by {signal.Signals(-returncode).name}" + " (out of memory?)" * (returncode == -signal.SIGKILL)
    return error or (lines[-1] if lines else f"exit status {returncode}")


KLD_FLOOR = 1e-6  # the KLD plot's log axis holds no zero


def scored_windows(r: dict) -> int:
    """The windows every point was scored on: the base's (a short text gives fewer than --windows)."""
    return r["base"].get("windows", r["settings"]["windows"])


def plus_minus(p: dict, key: str, form: str, scale: float = 1, suffix: str = "_unc") -> str:
    """A point's figure with its uncertainty (under key + suffix) where the point has one (points from
    before it was kept do not)."""
    unc = p.get(key + suffix)
    return format(scale * p[key], form) + ("" if unc is None else " ± " + format(scale * unc, form))


def scores(p: dict, tasks: list[str]) -> list[str]:
    """A point's lm-eval scores ("task:metric" each), with their standard errors where lm-eval gives them."""
    cells = []
    for t in tasks:
        task, metric = t.split(":")
        values = p.get("lm_eval", {}).get(task, {})
        cells.append("" if metric not in values else plus_minus(values, metric, ".4f", suffix="_stderr"))
    return cells


def table(r: dict) -> str:
    tasks = sorted({f"{t}:{k}" for p in [*r["points"], r["base"]] for t, v in p.get("lm_eval", {}).items()
                    for k in v if not k.endswith("_stderr") and k != "sample_len"})
    head = ["point", "format", "MiB", "bpw", "bpw linears", "PPL", "PPL/base", "KLD mean", "KLD p99", "same top",
            *tasks, "quantize s", "peak RSS GiB"]
    s, base = r["settings"], r["base"]
    calibrated = any(p.get("method") in ("gptq", "awq") for p in r["points"])
    calib = (f" Calibration: {s.get('calib_samples')} windows of {s.get('calib_seqlen', 512)} tokens of "
             f"{Path(s['calib_data']).name if s.get('calib_data') else 'WikiText-2 train'} (seed 0).") if calibrated else ""
    from quantkit.evals import harness

    shots = s.get("lm_eval_fewshot")
    lm = (" lm-eval: " + ("each task's own few-shot count" if shots is None else f"{shots}-shot")
          + (", prompts in the chat template" if s.get("lm_eval_chat") else "")
          + (f", windows of {s['lm_eval_max_length']} tokens" if s.get("lm_eval_max_length") else "")
          + (f", {harness.documents_said(limit)}" if (limit := s.get("lm_eval_limit")) else "") + ".") \
        if s.get("tasks") else ""
    lines = [f"Model {s['model'] or 'embedded SmolLM2-135M-Instruct'}: {base['bytes'] / 2**20:.1f} MiB, base perplexity "
             f"{base['perplexity']:.4f} on {count(scored_windows(r), 'window')} of {s['ctx']} tokens of {Path(s['data']).name}; "
             f"group size {s['group_size']}.{calib}{lm} bpw: the file's bits per parameter; bpw linears: the decoder "
             "linears' tensors over their weights (no embedding, head or norms). KLD in nats; ± one standard error "
             "as llama-perplexity computes it, tokens taken as independent (the tokens of a window are not: "
             "read small differences with care).",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if "lm_eval" in base:  # the float model's scores, for the points' to be read against
        lines.append("| " + " | ".join(["base (float)", "", f"{base['bytes'] / 2**20:.1f}", "", "",
                                        f"{base['perplexity']:.4f}", "1", "0", "0", "100%",
                                        *scores(base, tasks), "", ""]) + " |")
    for p in r["points"]:
        if p["status"] != "ok":
            error = p["error"].replace("|", "\\|")  # a | would end the cell
            lines.append(f"| {p['name']} | failed: {error} |" + " |" * (len(head) - 2))
            continue
        lines.append("| " + " | ".join([
            p["name"], p["format"], f"{p['bytes'] / 2**20:.1f}", f"{p['bpw']:.3f}", f"{p['bpw_linear']:.3f}",
            plus_minus(p, "perplexity", ".4f"), plus_minus(p, "ppl_ratio", ".4f"), plus_minus(p, "kld_mean", ".4g"),
            f"{p['kld_p99']:.4g}", plus_minus(p, "same_top", ".2f", 100) + "%",
            *scores(p, tasks),
            f"{p['quantize_s']:.1f}", f"{p['peak_rss'] / 2**30:.2f}"]) + " |")
    lines += [f"\n{p['name']}: lm-eval failed ({p['lm_eval_error']}); its scores are missing, the same command runs "
              "it again" for p in r["points"] if "lm_eval_error" in p]
    return "\n".join(lines) + "\n"


def plot(r: dict, out: Path) -> None:
    """Perplexity and KLD against the file's bits per parameter (what is shipped, embedding and head
    included, as it tells formats apart), each point labelled by its full name, with its standard
    error; the failed points and those off the chart named on it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ok = [p for p in r["points"] if p["status"] == "ok"]
    failed = [p["name"] for p in r["points"] if p["status"] != "ok"]
    families = sorted({p["name"].split("-")[0] for p in ok})
    base = r["base"]
    for key, label, name in (("perplexity", "perplexity", "perplexity.png"),
                             ("kld_mean", "mean KL divergence from the base (nats)", "kld.png")):
        fig, ax = plt.subplots(figsize=(10, 5))
        notes, labels = [], []
        for fam in families:  # a KLD of 0 or below (a lossless point, rounding in the base's rows) at the floor
            pts = sorted(ok_points([p for p in ok if p["name"].split("-")[0] == fam], key))
            line = ax.errorbar([x for x, *_ in pts], [y for _, y, _, _ in pts], yerr=[e for *_, e, _ in pts],
                               fmt="o-", capsize=2, label=fam)
            labels += [(x, y, n, line[0].get_color()) for x, y, _, n in pts]
        ax.set_yscale("log")
        ax.margins(x=0.1)  # room for the rightmost point's label
        values = [max(p[key], KLD_FLOOR) for p in ok]
        if key == "perplexity":  # 20, 30, 50, not 2x10^1, 3x10^1, 5x10^1 (and not every minor tick: they crowd)
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
                lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "235" else ""))
            ax.axhline(base["perplexity"], color="gray", ls="--", label=f"float model ({base['perplexity']:.4g})")
            top = 20 * base["perplexity"]  # a broken point would flatten the rest: named instead
            off = [p for p in ok if p[key] > top]
            if off:
                low = min([base["perplexity"], *values]) * 0.9
                ax.set_ylim(low, max(top, low * 10))
                notes.append("above the chart: " + ", ".join(f"{p['name']} ({p[key]:.4g})" for p in off))
        floor = [p["name"] for p in ok if key == "kld_mean" and p[key] < KLD_FLOOR]
        if floor:
            notes.append(f"at {KLD_FLOOR:g} (the floor) with a KLD below it: {', '.join(floor)}")
        if failed:
            notes.append(f"failed (see report.md): {', '.join(failed)}")
        place_labels(fig, ax, labels)
        for i, note in enumerate(notes):
            ax.text(0.01, 0.98 - 0.05 * i, note, transform=ax.transAxes, fontsize=8, va="top")
        ax.set_xlabel("bits per parameter of the file (size x 8 / parameters)")
        ax.set_ylabel(label)
        fig.suptitle(f"{label} against file size, {count(scored_windows(r), 'window')} of {r['settings']['ctx']} tokens")
        ax.grid(True, which="both", alpha=0.3)
        if not ok:
            ax.text(0.5, 0.5, "no point came through: see report.md", transform=ax.transAxes, ha="center")
        if ax.get_legend_handles_labels()[0]:  # nothing labelled: no legend (matplotlib warns of an empty one)
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: it hid points and labels
        fig.tight_layout()
        tmp = out / f".{name}.tmp.png"
        try:
            fig.savefig(tmp, dpi=120)
            os.replace(tmp, out / name)
        finally:  # a disk that filled leaves no part of a plot
            plt.close(fig)
            tmp.unlink(missing_ok=True)


LABEL_OFFSETS = [(5, 4), (5, -10), (5, 14), (5, -20), (5, 24), (5, -30), (5, 34), (5, -40)]  # points from the dot


def place_labels(fig, ax, labels: list[tuple[float, float, str, str]], size: float = 7) -> None:
    """Each (x, y, text, colour) written beside its point at the first offset where it overlaps no label
    placed before (points at one size and close values would print over each other)."""
    fig.canvas.draw()  # the axes' final limits, so that data positions map to where they are drawn
    placed = []  # (left, bottom, right, top) in points
    for x, y, text, colour in sorted(labels):
        px, py = ax.transData.transform((x, y)) * 72 / fig.dpi
        width, height = 0.6 * size * len(text), size
        for dx, dy in LABEL_OFFSETS:
            box = (px + dx, py + dy, px + dx + width, py + dy + height)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
                break
        placed.append(box)
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=size, color=colour)


def ok_points(pts: list[dict], key: str) -> list[tuple[float, float, float, str]]:
    """(x, y, y's standard error, name) of each point; a KLD at least KLD_FLOOR (the log axis has no 0)."""
    out = []
    for p in pts:
        y = max(p[key], KLD_FLOOR) if key == "kld_mean" else p[key]
        unc = p.get(f"{key}_unc") or 0.0
        out.append((p["bpw"], y, min(unc, 0.99 * y), p["name"]))  # an error bar below 0 has no place on a log axis
    return out


def bound_to(parent: int) -> None:
    """End this process with the report that started it: a report killed with SIGKILL cannot stop its point,
    which went on writing while a run of the same command made the point again."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that
        sys.exit(1)


def main(argv: list[str]) -> None:
    """A child process: one point, its result written as DIR/points/NAME.json."""
    spec = json.loads(argv[0])
    bound_to(spec["parent"])
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    errors.COMMAND_LINE.set(spec["command_line"])  # a point's errors in its parent's words
    try:
        with errors.renamed(POINT_FLAGS):
            result = run_point(spec)
    except QuantkitError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # the line the sweep records for the point
        if (line := errors.out_of_memory(e, "report")) is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        sys.exit(2)
    write_json(Path(spec["out"]) / "points" / f"{spec['point']['name']}.json", result)


if __name__ == "__main__":
    main(sys.argv[1:])
