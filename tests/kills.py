"""Killing quantkit at random moments. Each scenario (a GPTQ quantization written as shards, a
streamed GGUF quantization, a GGUF export, a GGUF requantization, a training run that checkpoints, an
adapter's merge, the embedded model's cache fill) first runs once whole, as the reference; then it is run again and again, each run
killed (SIGKILL, as `kill -9`) after a random delay within the reference's duration, and run
again after each kill as a user would (train with --resume) until a run finishes. After every
kill, the output either does not exist or is the complete one (equal to the reference), and
nothing else that looks like an output has appeared; every finished run's output equals the
reference and leaves no temporaries behind.

    python -m tests.kills [SCENARIO ...] [--points N] [--seed S] [--root DIR]

prints one JSON line of counts per scenario and exits 1 at the first failure. Runs are forked
from this process, which has imported quantkit already, so a kill point costs the work killed,
not an interpreter start."""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from safetensors.numpy import load_file

from quantkit.modelio import DEFAULT_NAME, cache_dir, default_gguf

POLL = 0.005  # seconds between checks on a run
NAMES = ["quantize", "quantize-gguf", "export", "requantize", "train", "merge", "cache"]


class Failed(Exception):
    pass


@dataclass
class Scenario:
    """A job writing outputs (names in a work directory), the first of them the one a finished run
    must leave; files: what is compared with the reference (default: every file)."""
    job: Callable[[Path, bool], int]  # (work directory, run again after a kill) -> exit status, in a forked child
    outputs: list[str]
    files: list[str] = field(default_factory=list)
    inputs: set[str] = field(default_factory=set)  # names in the work directory that are not outputs
    extra: set[str] = field(default_factory=set)  # hidden names a finished run may leave (a cache's lock)
    kills: int = 0
    finished: int = 0
    resumed: int = 0  # runs that went on from a killed one's progress


def quantkit(*args) -> int:
    from quantkit.command import main

    sys.argv = ["quantkit", *map(str, args)]
    try:
        main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    return 0


def scenarios(root: Path) -> dict[str, Scenario]:
    from tests.conftest import VALID

    model, text = root / "model", root / "text.txt"
    calib = ["--calib-data", VALID, "--calib-samples", 8, "--calib-seqlen", 128]

    def cli(out: str, *args, rerun_args=(), **kw) -> Scenario:
        def job(work: Path, rerun: bool) -> int:
            return quantkit(*args, *(rerun_args if rerun else ()), "--out", work / out)
        return Scenario(job, [out], **kw)

    def requantize(work: Path, rerun: bool) -> int:
        from quantkit import requant

        requant.SAVED_EVERY = 1  # its progress saved after every tensor (a 1 GiB step otherwise): kills land past saves
        return quantkit("export", root / "f32.gguf", "--gguf-type", "Q4_K_M", "--out", work / "r.gguf")

    def fill(work: Path, rerun: bool) -> int:
        from quantkit.modelio import default_model_dir

        if not (work / "wheels").exists():  # the wheel downloaded once, by prepare
            (work / "wheels").symlink_to(cache_dir() / "wheels")
        os.environ["QUANTKIT_CACHE"] = str(work)
        default_model_dir()
        return 0

    gguf = f"{DEFAULT_NAME}.Q4_1.gguf"
    return {
        "quantize": cli("q", "quantize", model, "--method", "gptq", "--group-size", 32, *calib, "--max-shard-size",
                        "100kB"),
        "quantize-gguf": cli("q.gguf", "quantize", model, "--method", "rtn", "--format", "gguf", "--gguf-type", "Q4_K_M"),
        "export": cli("x.gguf", "export", model, "--gguf-type", "Q4_K_M"),
        "requantize": Scenario(requantize, ["r.gguf"]),
        "train": cli("adapter", "train", model, "--data", text, "--steps", 12, "--save-every", 2, "--seqlen", 64,
                     "--batch-size", 4, rerun_args=["--resume"],
                     files=["adapter_model.safetensors", "adapter_config.json"]),
        "merge": cli("m", "merge", root / "adapter", "--max-shard-size", "100kB"),
        "cache": Scenario(fill, [DEFAULT_NAME, gguf], inputs={"wheels"},
                          extra={f".{DEFAULT_NAME}.lock", f".{gguf}.lock"}),
    }


def prepare(root: Path) -> None:
    """The model and data the scenarios use (once per root), and the embedded model's wheel."""
    from tests.conftest import VALID, make_tiny

    if not (root / "model").exists():  # in a child: this process must not start torch's threads (see spawn)
        if attempt(lambda: make_tiny(root / "model", hidden=128, intermediate=256, layers=4) and 0,
                   root / "prepare.log", None)[1]:
            raise Failed(f"could not write the model:\n{(root / 'prepare.log').read_text()[-4000:]}")
    (root / "text.txt").write_text(VALID.read_text()[:100_000])
    if not (root / "f32.gguf").exists():  # what the requantize scenario requantizes
        if attempt(lambda: quantkit("export", root / "model", "--gguf-type", "F32", "--out", root / "f32.gguf"),
                   root / "prepare.log", None)[1]:
            raise Failed(f"could not write the GGUF:\n{(root / 'prepare.log').read_text()[-4000:]}")
    if not (root / "adapter").exists():  # what the merge scenario merges
        args = ["train", root / "model", "--data", root / "text.txt", "--steps", 2, "--seqlen", 64, "--batch-size", 4,
                "--rank", 4, "--warmup", 0, "--out", root / "adapter"]
        if attempt(lambda: quantkit(*args), root / "prepare.log", None)[1]:
            raise Failed(f"could not train the adapter:\n{(root / 'prepare.log').read_text()[-4000:]}")
    default_gguf()  # the wheel is downloaded once, into the user's cache, not under each work directory


def spawn(job: Callable[[], int], log: Path) -> int:
    """job in a forked child with its output in log; the child's pid. This process runs no torch
    computation itself: a child forked after OpenMP's threads have started runs many times slower."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = job()
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def attempt(job: Callable[[], int], log: Path, delay: float | None) -> tuple[bool, int, float]:
    """Run job, killed after delay seconds unless it has finished: (killed, exit status, seconds)."""
    start = time.monotonic()
    pid = spawn(job, log)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if delay is not None and time.monotonic() - start >= delay:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(POLL)
    seconds = time.monotonic() - start
    if os.WIFSIGNALED(status):
        return os.WTERMSIG(status) == signal.SIGKILL, -os.WTERMSIG(status), seconds
    return False, os.WEXITSTATUS(status), seconds


def listing(path: Path) -> dict[str, bytes]:
    """Every file under path (or path itself) by relative name, with its bytes."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def difference(out: Path, ref: Path, files: list[str]) -> str | None:
    """How out differs from the reference; None when it is the same (safetensors files compared by
    value when they are a training run's, which repeats the reference within rounding)."""
    if files:
        for name in files:
            a, b = out / name, ref / name
            if not a.is_file():
                return f"{name} is missing"
            if name.endswith(".safetensors"):
                x, y = load_file(a), load_file(b)
                if x.keys() != y.keys() or not all(np.allclose(x[k], y[k], atol=1e-6) for k in x):
                    return f"{name} differs"
            elif a.read_bytes() != b.read_bytes():
                return f"{name} differs"
        return None
    mine, theirs = listing(out), listing(ref)
    if mine.keys() != theirs.keys():
        return f"files {sorted(mine)} where the reference has {sorted(theirs)}"
    changed = [name for name in mine if mine[name] != theirs[name]]
    return f"{changed[:3]} differ from the reference" if changed else None


def check(s: Scenario, work: Path, ref: Path, killed: bool, log: Path) -> None:
    """After a run: no output unless complete; after a finished run, no temporaries either."""
    visible = {p.name for p in work.iterdir() if not p.name.startswith(".")} - s.inputs
    if visible - set(s.outputs):
        raise Failed(f"something that looks like an output appeared: {sorted(visible - set(s.outputs))}")
    for name in visible:
        diff = difference(work / name, ref / name, s.files)
        if diff:
            raise Failed(f"{work / name} exists but is not the complete output: {diff}")
    if not killed:
        hidden = {p.name for p in work.iterdir() if p.name.startswith(".")} - s.extra
        if hidden or s.outputs[0] not in visible:
            raise Failed(f"a finished run left {sorted(hidden)} (output {'present' if s.outputs[0] in visible else 'missing'})")
    text = log.read_text(errors="replace")
    if "Traceback" in text:
        raise Failed(f"a traceback:\n{text[-4000:]}")


def clear(s: Scenario, work: Path) -> None:
    """Remove a complete output so that the next run starts over."""
    for out in s.outputs:
        shutil.rmtree(work / out) if (work / out).is_dir() else (work / out).unlink(missing_ok=True)


def run(name: str, s: Scenario, points: int, rng: random.Random, root: Path) -> dict:
    work, ref, log = root / name, root / f"{name}.reference", root / f"{name}.log"
    for p in (work, ref):
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir()
    log.write_text("")
    killed, code, whole = attempt(lambda: s.job(ref, False), log, None)
    if code:
        raise Failed(f"{name}: the reference run failed ({code}):\n{log.read_text()[-4000:]}")
    check(s, ref, ref, False, log)
    rerun, attempts = False, 0
    while True:  # after the last kill, its state is run to the end
        attempts += 1
        if attempts > 4 * points + 2:
            raise Failed(f"{name}: {attempts} runs for {s.kills} kills: runs finish before the delays")
        log.write_text("")
        delay = rng.uniform(0, whole) if s.kills < points else None
        killed, code, _ = attempt(lambda: s.job(work, rerun), log, delay)
        text = log.read_text(errors="replace")
        s.resumed += "resuming after" in text
        if killed:
            s.kills += 1
            check(s, work, ref, True, log)
            rerun = not all((work / out).exists() for out in s.outputs)
            if not rerun:  # killed once its output was complete: the user has it, as from a finished run
                clear(s, work)
            continue
        if code == 2 and rerun and "nothing to resume" in text:  # killed before its first checkpoint
            rerun = False
            continue
        if code:
            raise Failed(f"{name}: a run after a kill failed ({code}):\n{text[-4000:]}")
        s.finished += 1
        check(s, work, ref, False, log)
        if s.kills >= points:
            break
        clear(s, work)
        rerun = False
    return {"scenario": name, "kills": s.kills, "finished": s.finished, "resumed": s.resumed,
            "reference_seconds": round(whole, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO", help=f"some of {', '.join(NAMES)} (default: all)")
    parser.add_argument("--points", type=int, default=5, help="kills per scenario")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, help="where the model and the outputs are written")
    args = parser.parse_args()
    unknown = set(args.scenarios) - set(NAMES)
    if unknown:
        parser.error(f"unknown scenario {sorted(unknown)[0]!r}: use some of {', '.join(NAMES)}")
    root = args.root or Path(tempfile.mkdtemp(prefix="quantkit-kills-"))
    root.mkdir(parents=True, exist_ok=True)
    prepare(root)
    rng, all_ = random.Random(args.seed), scenarios(root)
    for name in args.scenarios or NAMES:
        try:
            print(json.dumps(run(name, all_[name], args.points, rng, root)), flush=True)
        except Failed as e:
            print(f"FAILED {name}: {e}", flush=True)
            sys.exit(1)


if __name__ == "__main__":
    main()
