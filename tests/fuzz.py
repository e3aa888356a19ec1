"""Fuzzing the readers of untrusted files. Each kind of input quantkit reads (a float checkpoint,
a sharded one, each packed export, a GGUF file, the quantize progress file, a PEFT adapter, a base's
saved log-probabilities, llama.cpp's importance matrices, an EXL2 measurement) is
written once for a tiny model, then mutated by hypothesis: bit flips, truncation, huge lengths and
counts, other dtypes and shapes in safetensors headers, NaN/Inf values and scales, out-of-range
indices, JSON values replaced, removed or nested deeply. Every mutated input must load (and run a
forward pass, with finite weights) or end in QuantkitError, which the CLI prints as one `error:`
line with exit status 2. Anything else fails: another exception (a traceback), a hang (an alarm),
or an allocation beyond a bound (RLIMIT_DATA).

    python -m tests.fuzz [KIND ...] [--examples N] [--seed S]

prints one JSON line of counts per kind and exits 1 at the first failure, after shrinking it to
a minimal mutation (printed). Without --seed the examples are derandomized (the CI subset)."""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, given, note, seed, settings, strategies as st
from hypothesis.control import currently_in_test_context

from quantkit.errors import QuantkitError

TIMEOUT = 30  # seconds for one input: the tiny model loads in well under one
HEADROOM = 2 << 30  # bytes of heap one input may add
SHOW = False  # print each refusal (--show)
REPORT = sys.stdout  # where counts, failures and refusals are printed

DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
          "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4}
INTS = [0, 1, -1, 2, 7, 255, 256, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**48, 2**63 - 1, 2**63,
        2**64 - 1, -(2**31), -(2**63)]
VALUES = [*INTS, 10**30, -10**30, 0.5, -0.0, math.nan, math.inf, -math.inf, "", "x", "llama", "F16", None, True, False,
          [], {}, [1, 2], {"a": 1}]
DEEP = "[" * 100_000 + "]" * 100_000  # JSON nested beyond Python's recursion limit
FLOATS = {"F32": "<f", "F16": "<e", "F64": "<d"}
SPECIAL = [math.nan, math.inf, -math.inf, 6e4, -6e4, 1e-8, 0.0]


class Hang(BaseException):
    """An input took longer than TIMEOUT (a BaseException: readers catching Exception do not hide it)."""


# the mutations: each draws what it changes from data, applies it to one file, and notes it

def mutate_bytes(data, raw: bytearray, start: int = 0, end: int | None = None) -> bytearray:
    """Generic damage at offsets in [start, end): bit flips, a field overwritten with an interesting
    integer, a cut, bytes inserted or removed."""
    end = len(raw) if end is None else end
    if end <= start:
        return raw
    op = data.draw(st.sampled_from(["flip", "int", "truncate", "insert", "delete"]))
    at = data.draw(st.integers(start, end - 1))
    if op == "flip":
        raw[at] ^= 1 << data.draw(st.integers(0, 7))
    elif op == "int":
        width = data.draw(st.sampled_from([1, 2, 4, 8]))
        value = data.draw(st.sampled_from(INTS)) % (1 << 8 * width)
        raw[at:at + width] = value.to_bytes(width, "little")
    elif op == "truncate":
        del raw[at:]
    elif op == "insert":
        raw[at:at] = bytes(data.draw(st.integers(1, 16)))
    else:
        del raw[at:at + data.draw(st.integers(1, 16))]
    note(f"bytes: {op} at {at}")
    return raw


def paths(tree, prefix=()):
    """Every path to a value in a JSON tree."""
    yield prefix
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from paths(v, (*prefix, i))


def mutate_json(data, text: str) -> str:
    """A value replaced (by an odd one, or deeply nested JSON) or removed, or the text damaged."""
    try:
        tree = json.loads(text)
    except (ValueError, RecursionError):
        return mutate_bytes(data, bytearray(text.encode())).decode(errors="replace")
    where = [p for p in paths(tree) if p]
    if not where or data.draw(st.integers(0, 9)) == 0:
        return mutate_bytes(data, bytearray(text.encode())).decode(errors="replace")
    # the quantization_config and the shapes are what readers trust most: aim there more often
    hot = [p for p in where if p[0] in ("quantization_config", "weight_map") or "size" in str(p[-1])
           or "num_" in str(p[-1])]
    path = data.draw(st.sampled_from(hot if hot and data.draw(st.booleans()) else where))
    parent = tree
    for k in path[:-1]:
        parent = parent[k]
    op = data.draw(st.sampled_from(["replace"] * 4 + ["remove", "deep"]))
    if op == "remove":
        del parent[path[-1]]
    else:
        parent[path[-1]] = "@@DEEP@@" if op == "deep" else data.draw(st.sampled_from(VALUES))
    note(f"json: {op} {list(path)} -> {parent.get(path[-1]) if isinstance(parent, dict) else '...'}")
    return json.dumps(tree).replace('"@@DEEP@@"', DEEP)


def mutate_safetensors(data, raw: bytearray) -> bytearray:
    """The header's entries given other dtypes, shapes, offsets, names; values made NaN/Inf/huge
    (scales included) or integers out of range (indices, codes); or plain byte damage."""
    try:
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        body = raw[8 + n:]
    except (ValueError, struct.error):
        return mutate_bytes(data, raw)
    names = sorted(k for k in header if k != "__metadata__")
    if not names:
        return mutate_bytes(data, raw)
    op = data.draw(st.sampled_from(["bytes", "length", "dtype", "reshape", "shape", "offsets", "drop", "rename",
                                    "value", "value", "int"]))
    if op == "bytes":
        return mutate_bytes(data, raw, 0, 8 + n if data.draw(st.booleans()) else len(raw))
    if op == "length":
        raw[:8] = (data.draw(st.sampled_from(INTS)) % 2**64).to_bytes(8, "little")
        note(f"safetensors: header length {int.from_bytes(raw[:8], 'little')}")
        return raw
    name = data.draw(st.sampled_from(names))
    entry = header[name]
    try:
        start, end = entry["data_offsets"]
        size = end - start
    except (TypeError, ValueError, KeyError):  # damaged by an earlier mutation
        return mutate_bytes(data, raw)
    if op == "dtype":  # reinterpreted as another dtype, the shape made to fit the bytes where it can
        entry["dtype"] = data.draw(st.sampled_from([*DTYPES, "X"]))
        width = DTYPES.get(entry["dtype"], 1)
        if size % width == 0 and entry["shape"] and math.prod(entry["shape"][:-1]):
            rest = math.prod(entry["shape"][:-1])
            entry["shape"] = [*entry["shape"][:-1], size // width // rest] if size // width % rest == 0 else [size // width]
    elif op == "reshape":  # the same values in another shape
        count = math.prod(entry["shape"])
        cut = data.draw(st.sampled_from([d for d in range(1, count + 1) if count % d == 0][:64]))
        entry["shape"] = data.draw(st.sampled_from([[count], [cut, count // cut], [count // cut, cut], [1, count],
                                                    [*entry["shape"][::-1]]]))
    elif op == "shape":
        entry["shape"] = data.draw(st.lists(st.sampled_from(INTS + [3, 64]), max_size=4))
    elif op == "offsets":
        entry["data_offsets"] = data.draw(st.lists(st.sampled_from(INTS + [size]), min_size=0, max_size=3))
    elif op == "drop":
        del header[name]
    elif op == "rename":
        header[data.draw(st.sampled_from([*names, name + "x", name.rsplit(".", 1)[0] + ".qweight", ""]))] = header.pop(name)
    elif op in ("value", "int"):
        kind = entry["dtype"]
        count = (end - start) // DTYPES.get(kind, 1)
        if count == 0:
            return raw
        at = data.draw(st.integers(0, count - 1))
        every = data.draw(st.booleans())  # one element, or all of them
        if op == "value" and kind in (*FLOATS, "BF16"):
            v = data.draw(st.sampled_from(SPECIAL))
            one = struct.pack("<f", v)[2:] if kind == "BF16" else struct.pack(FLOATS[kind], v)
        else:
            width = DTYPES.get(kind, 1)
            one = (data.draw(st.sampled_from(INTS)) % 2**(8 * width)).to_bytes(width, "little")
        for i in range(count) if every else [at]:
            body[start + i * len(one):start + (i + 1) * len(one)] = one
        note(f"safetensors: {name} {kind} {'all' if every else at} <- {one.hex()}")
        return raw[:8 + n] + body
    note(f"safetensors: {op} {name} -> {header.get(name, '(gone)')}")
    text = json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(text)) + text + body)


def mutate_gguf(data, raw: bytearray, header_end: int) -> bytearray:
    """Mostly in the header and metadata (counts, lengths, types, offsets), sometimes in the data."""
    if data.draw(st.integers(0, 3)) == 0:
        return mutate_bytes(data, raw, header_end)
    return mutate_bytes(data, raw, 0, min(header_end, len(raw)))


def mutate_progress(data, path: Path) -> None:
    """The state's entries replaced by other types and shapes, or the file's bytes damaged."""
    try:
        saved = torch.load(path, weights_only=True)
        state = saved["state"]
    except Exception:
        saved = None
    where = [p for p in paths(state) if p] if saved is not None else []
    if not where or data.draw(st.booleans()):
        path.write_bytes(mutate_bytes(data, bytearray(path.read_bytes())))
        return
    pathway = data.draw(st.sampled_from(where))
    parent = state
    for k in pathway[:-1]:
        parent = parent[k]
    odd = [None, 0, -1, 2**62, "x", [], {}, torch.zeros(0), torch.full((3,), math.nan), torch.zeros(2, 2, dtype=torch.int64)]
    if isinstance(parent, (dict, list)) and data.draw(st.booleans()):
        parent[pathway[-1]] = data.draw(st.sampled_from(odd))
    elif isinstance(parent, dict):
        del parent[pathway[-1]]
    else:
        state = data.draw(st.sampled_from(odd))
    note(f"progress: {list(pathway)}")
    torch.save({**saved, "state": state}, path)


def mutate_base(data, raw: bytearray) -> bytearray:
    """A saved base: its header's counts, a row's scale or offset made NaN/Inf/huge, or byte damage."""
    op = data.draw(st.sampled_from(["header", "row", "bytes"]))
    if op == "header":  # the counts after the magic
        return mutate_bytes(data, raw, 8, min(20, len(raw)))
    if op == "row" and len(raw) >= 20:
        ctx, n_vocab, n = struct.unpack("<iii", raw[8:20])
        rows = 20 + n * ctx * 4
        width = (2 * ((n_vocab + 1) // 2) + 4) * 2
        k = data.draw(st.integers(0, max((len(raw) - rows) // width - 1, 0))) if width > 0 else 0
        at = rows + k * width + data.draw(st.sampled_from([0, 4]))
    if op != "row" or len(raw) < 20 or not 20 <= at <= len(raw) - 4:  # the header is damaged already
        return mutate_bytes(data, raw)
    raw[at:at + 4] = struct.pack("<f", data.draw(st.sampled_from(SPECIAL)))
    note(f"base: row {k} {'scale' if (at - rows) % width == 0 else 'offset'} <- {raw[at:at + 4].hex()}")
    return raw


def mutate_file(data, path: Path, header_ends: dict[str, int]) -> None:
    raw = bytearray(path.read_bytes())
    if path.suffix == ".json":
        path.write_text(mutate_json(data, raw.decode()))
    elif path.suffix == ".safetensors":
        path.write_bytes(mutate_safetensors(data, raw))
    elif path.suffix == ".gguf":
        path.write_bytes(mutate_gguf(data, raw, header_ends[path.name]))
    elif path.name.endswith(".progress.pt"):
        mutate_progress(data, path)
    elif path.suffix == ".logits":
        path.write_bytes(mutate_base(data, raw))
    else:
        path.write_bytes(mutate_bytes(data, raw))


# the seeds: one input of each kind, for a tiny model

PACKED = {  # kind -> quantize options
    "gptq": ["--method", "rtn", "--group-size", "32"],
    "gptq-act-order": ["--method", "gptq", "--act-order", "--group-size", "32"],
    "awq": ["--method", "rtn", "--format", "awq", "--group-size", "32"],
    "nf4": ["--method", "nf4"],
    "compressed-tensors": ["--method", "rtn", "--format", "compressed-tensors", "--group-size", "32", "--asym"],
    "exl2": ["--method", "gptq", "--format", "exl2", "--bits", "4.125"],
}
GPTQ = ["--method", "gptq", "--group-size", "32"]
KINDS = ("float", "sharded", *PACKED, "gguf", "progress", "adapter", "base", "imatrix", "measurement")
BASE = ["--ctx", 64, "--max-windows", 3]  # the saved base's windows


def quantkit(*args) -> int:
    """The command line, in this process: its exit status."""
    from quantkit.command import main

    sys.argv = ["quantkit", *map(str, args)]
    try:
        main()
    except SystemExit as e:
        return e.code or 0
    return 0


def succeed(*args) -> None:
    if quantkit(*args):
        raise RuntimeError(f"quantkit {' '.join(map(str, args))} failed")


def calib() -> list:
    from tests.conftest import VALID

    return ["--calib-data", VALID, "--calib-samples", 4, "--calib-seqlen", 64]


def make_seed(kind: str, root: Path) -> Path:
    """The input of a kind, written for the tiny model (once per root)."""
    from tests.conftest import VALID, make_tiny

    tiny = root / "tiny"
    if not tiny.exists():
        make_tiny(tiny)
    out = root / kind
    if out.exists():
        return out
    if kind == "float":
        shutil.copytree(tiny, out)
    elif kind == "sharded":
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(tiny).save_pretrained(out, max_shard_size="100KB")
        for f in tiny.glob("tokenizer*"):
            shutil.copy(f, out)
    elif kind in PACKED:
        succeed("quantize", tiny, *PACKED[kind], *(calib() if "gptq" in PACKED[kind] else ()), "--out", out)
    elif kind == "gguf":
        out.mkdir()
        succeed("quantize", tiny, "--format", "gguf", "--gguf-type", "Q8_0", "--out", out / "model.gguf")
    elif kind == "progress":  # the progress file of a GPTQ run stopped after its first layer
        from quantkit.atomic import progress_path

        import quantkit.pipeline as pipeline

        real = pipeline.save_progress

        def save_then_stop(path, state):
            real(path, state)
            raise KeyboardInterrupt

        pipeline.save_progress = save_then_stop
        out.mkdir()
        try:
            quantkit("quantize", tiny, *GPTQ, *calib(), "--out", out / "q")  # interrupted
        finally:
            pipeline.save_progress = real
        assert progress_path(out / "q").is_file()
    elif kind == "adapter":
        text = root / "text.txt"
        text.write_text(VALID.read_text()[:20_000])
        succeed("train", tiny, "--data", text, "--steps", 2, "--seqlen", 32, "--batch-size", 2, "--out", out)
    elif kind == "base":
        out.mkdir()
        succeed("eval", tiny, "--data", VALID, *BASE, "--base", tiny, "--save-base", out / "base.logits")
    elif kind == "measurement":  # an EXL2 measurement, read by the next run with the same calibration
        out.mkdir()
        succeed("quantize", tiny, *PACKED["exl2"], *calib(), "--measurement", out / "m.json", "--out", out / "q")
        shutil.rmtree(out / "q")
    elif kind == "imatrix":  # both of llama-imatrix's layouts
        from tests.test_imatrix import importance, write_gguf, write_legacy

        out.mkdir()
        table = importance(tiny)
        write_legacy(out / "m.dat", table)
        write_gguf(out / "m.gguf", table)
    return out


def requantized(path: Path, tokens: torch.Tensor) -> None:
    """A GGUF file requantized as quantkit export does it (its own header reader): refused, or a file
    that loads; either way the file goes on to quantkit's loader."""
    from quantkit.modelio import load
    from quantkit.requant import requantize

    try:
        requantize(path, path.with_name("re.gguf"), "Q4_0", overwrite=True, progress=False)
    except QuantkitError:
        return
    m = load(path.with_name("re.gguf"))
    m.materialize()
    with torch.no_grad():
        m.module(tokens)


def attempt(kind: str, path: Path, root: Path) -> str:
    """Read a (mutated) input as quantkit does: 'loaded' or 'refused' (QuantkitError)."""
    from quantkit.modelio import load

    tokens = torch.arange(8)[None]
    try:
        if kind == "base":  # the tiny model compared with it: every figure finite
            from quantkit.api import compare
            from tests.conftest import VALID

            figures = compare(root / "tiny", path / "base.logits", VALID, ctx=BASE[1], progress=False).to_dict()
            bad = [k for k, v in figures.items() if isinstance(v, float) and not math.isfinite(v)]
            if bad:
                raise AssertionError(f"compared with non-finite figures: {bad[:3]}")
            return "loaded"
        if kind == "imatrix":  # a GGUF quantization weighted by each file, which must then load
            from quantkit.api import quantize

            for f in ("m.dat", "m.gguf"):
                quantize(root / "tiny", method="rtn", format="gguf", gguf_type="Q4_0", imatrix_file=str(path / f),
                         out=path / f"{f}.q.gguf", progress=False)
            targets = [path / "m.dat.q.gguf", path / "m.gguf.q.gguf"]
        elif kind == "measurement":  # the allocation read from it, then the export
            code = quantkit("quantize", root / "tiny", *PACKED["exl2"], *calib(), "--measurement", path / "m.json",
                            "--out", path / "q")
            if code:
                raise QuantkitError("exit 2") if code == 2 else AssertionError(f"quantize exited with {code}")
            targets = [path / "q"]
        elif kind == "progress":
            code = quantkit("quantize", root / "tiny", *GPTQ, *calib(), "--out", path / "q")
            if code:
                raise QuantkitError("exit 2") if code == 2 else AssertionError(f"quantize exited with {code}")
            targets = [path / "q"]
        elif kind == "adapter":
            from quantkit.trainer import merge

            targets = [merge(path, path.parent / "merged", base=root / "tiny")]
        else:
            if kind == "gguf":
                requantized(path / "model.gguf", tokens)
            targets = [path / "model.gguf" if kind == "gguf" else path]
        for target, packed in [(t, p) for t in targets for p in ((False, True) if kind in PACKED else (False,))]:
            m = load(target, packed=packed)
            m.materialize()
            if not packed:
                bad = [n for n, p in m.module.named_parameters() if not p.isfinite().all()]
                if bad:
                    raise AssertionError(f"loaded with non-finite weights in {bad[:3]}")
            with torch.no_grad():
                m.module(tokens)
    except QuantkitError as e:
        if currently_in_test_context():
            note(f"refused: {e}")
        if SHOW:
            print(f"  refused: {e}", file=REPORT, flush=True)
        return "refused"
    return "loaded"


def alarm(signum, frame):
    raise Hang(f"no result within {TIMEOUT} s")


def run(kind: str, examples: int, seed_value: int | None, root: Path) -> dict:
    source = make_seed(kind, root)
    files = [f for f in sorted(source.rglob("*")) if f.is_file() and not f.name.endswith(".png")]
    if kind == "progress":
        from quantkit.atomic import progress_path

        files = [progress_path(source / "q")]
    header_ends = {}
    for f in files:
        if f.suffix == ".gguf":
            import gguf

            header_ends[f.name] = gguf.GGUFReader(f).data_offset
    with tempfile.TemporaryDirectory(dir=root) as work:  # on a copy: a progress file is used up
        shutil.copytree(source, Path(work) / source.name)
        attempt(kind, Path(work) / source.name, root) == "loaded" or sys.exit(f"the unmutated {kind} input does not load")
    counts = {"kind": kind, "examples": 0, "loaded": 0, "refused": 0}

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed_value is None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink])
    @given(st.data())
    def case(data):
        work = Path(tempfile.mkdtemp(dir=root))
        try:
            copy = work / source.name
            shutil.copytree(source, copy)
            for _ in range(data.draw(st.integers(1, 3))):
                target = data.draw(st.sampled_from(files))
                mutated = copy / target.relative_to(source)
                if mutated.exists():
                    note(f"file: {mutated.relative_to(copy)}")
                    mutate_file(data, mutated, header_ends)
            signal.alarm(TIMEOUT)
            try:
                outcome = attempt(kind, copy, root)
            finally:
                signal.alarm(0)
            counts["examples"] += 1
            counts[outcome] += 1
        finally:
            shutil.rmtree(work, ignore_errors=True)

    if seed_value is not None:
        case = seed(seed_value)(case)
    start = time.perf_counter()
    case()
    counts["seconds"] = round(time.perf_counter() - start, 1)
    return counts


def bound_heap() -> None:
    """Allow one input HEADROOM bytes of heap beyond what the process holds now."""
    with open("/proc/self/status") as f:
        data = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    limit = data + HEADROOM
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kinds", nargs="*", metavar="KIND", help=f"some of {', '.join(KINDS)} (default: all)")
    parser.add_argument("--examples", type=int, default=100, help="mutated inputs per kind")
    parser.add_argument("--seed", type=int, help="a seed for a run other than CI's derandomized one")
    parser.add_argument("--root", type=Path, help="where the seeds are written (and reused)")
    parser.add_argument("--show", action="store_true", help="print each refusal's message")
    args = parser.parse_args()
    global SHOW
    SHOW = args.show
    unknown = set(args.kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kind {sorted(unknown)[0]!r}: use some of {', '.join(KINDS)}")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    root = args.root or Path(tempfile.mkdtemp(prefix="quantkit-fuzz-"))
    root.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGALRM, alarm)
    global REPORT
    REPORT = os.fdopen(os.dup(1), "w")  # the counts and failures; the commands' output (some written from
    with open(root / "stderr.log", "ab") as log:  # Rust, past sys.stdout) and progress bars go to a log
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    kind = "seeds"
    try:
        for kind in args.kinds or KINDS:
            make_seed(kind, root)
        bound_heap()
        for kind in args.kinds or KINDS:
            print(json.dumps(run(kind, args.examples, args.seed, root)), file=REPORT, flush=True)
    except BaseException as e:
        print(f"FAILED {kind}:", file=REPORT, flush=True)
        traceback.print_exception(e, file=REPORT)
        REPORT.flush()
        sys.exit(1)


if __name__ == "__main__":
    main()
