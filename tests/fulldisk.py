"""quantkit on a full disk: a small tmpfs, in a mount namespace of its own.

    unshare --user --map-root-user --mount python -m tests.fulldisk ROOT

mounts a tmpfs at ROOT/disk and, for each writer (a sharded GPTQ export, a streamed GGUF, a
checkpoint replaced with --overwrite, a training checkpoint, a merged model, a saved base, the
embedded model's cache entry), runs the command on a disk too small for it and prints one JSON line: the exit
status, the error line, what was left on the disk, and whether the same command, run again once
there is space, wrote what a run on a roomy disk writes. The checks are tests/test_fulldisk.py's."""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from tests.conftest import TEST, VALID, make_tiny

PAGE = 4096


def cli(*args) -> tuple[int, str]:
    """The command line in this process: (exit status, its last line on stderr)."""
    from quantkit.command import main

    sys.argv = ["quantkit", *map(str, args)]
    err = io.StringIO()
    code = 0
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    lines = err.getvalue().replace("\r", "\n").strip().splitlines()
    return code, lines[-1] if lines else ""


def fill(disk: Path, leave: int) -> None:
    """Take all but leave bytes of the disk's free space."""
    filler = disk / "filler"
    filler.unlink(missing_ok=True)
    with open(filler, "wb") as f:
        f.truncate(0)
        n = shutil.disk_usage(disk).free - leave
        if n > 0:
            os.posix_fallocate(f.fileno(), 0, n // PAGE * PAGE)


def left(disk: Path) -> list[str]:
    return sorted(p.name for p in disk.iterdir() if p.name not in ("filler", "wheels"))


def same(a: Path, b: Path) -> bool:
    def files(p: Path) -> dict[str, bytes]:
        return {"": p.read_bytes()} if p.is_file() else {
            str(f.relative_to(p)): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()
            and f.suffix not in (".png",) and f.name != "train_log.json"}
    return files(a) == files(b)


def case(name: str, disk: Path, roomy: Path, command, out: str, leave: int, **extra) -> dict:
    """command(where) -> args: run into roomy (the reference), then into a disk leaving leave bytes
    free, then again once the filler is gone."""
    for p in roomy.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    code, line = cli(*command(roomy))
    assert code == 0, f"{name} on a roomy disk: {line}"
    for p in disk.iterdir():
        if p.name != "wheels":
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    for prepare in extra.get("before", []):
        prepare(disk)
    fill(disk, leave)
    code, line = cli(*command(disk))
    after = left(disk)
    intact = not (disk / out).exists() or same(disk / out, roomy / out)  # absent, or the complete previous one
    (disk / "filler").unlink()
    again, rerun_line = cli(*command(disk), *extra.get("rerun", []))
    return {"case": name, "path": str(disk / out), "code": code, "line": line, "left": after, "intact": intact,
            "rerun_code": again, "rerun_line": rerun_line,
            "rerun_same": again == 0 and same(disk / out, roomy / out), "left_after_rerun": left(disk)}


def main() -> None:
    root = Path(sys.argv[1])
    disk, roomy = root / "disk", root / "roomy"
    disk.mkdir(parents=True, exist_ok=True)
    roomy.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=800m", "tmpfs", str(disk)], check=True)
    model = root / "model"
    if not model.exists():
        make_tiny(model)
    text = root / "text.txt"
    text.write_text(VALID.read_text()[:20_000])
    gptq = ["quantize", model, "--method", "gptq", "--group-size", 32, "--calib-data", VALID, "--calib-samples", 4,
            "--calib-seqlen", 64, "--max-shard-size", "40kB"]
    train = ["train", model, "--data", text, "--steps", 4, "--save-every", 2, "--seqlen", 32, "--batch-size", 2]

    def previous(disk: Path) -> None:  # a good export to be replaced
        assert cli(*gptq, "--out", disk / "q")[0] == 0

    adapter = root / "adapter"
    if not adapter.exists():
        assert cli(*train, "--out", adapter, "--steps", 1)[0] == 0

    cases = [
        # too small from the start: refused before any work
        lambda: case("quantize-refused", disk, roomy, lambda d: [*gptq, "--out", d / "q"], "q", 16 * 1024),
        # room for the export but not for it and its progress file: full in the middle
        lambda: case("quantize-midway", disk, roomy, lambda d: [*gptq, "--out", d / "q"], "q", 160 * 1024),
        lambda: case("gguf-midway", disk, roomy, lambda d: ["quantize", model, "--method", "rtn", "--format", "gguf",
                                                            "--gguf-type", "Q8_0", "--out", d / "q.gguf"],
                     "q.gguf", 128 * 1024),
        lambda: case("overwrite", disk, roomy, lambda d: [*gptq, "--out", d / "q", "--overwrite"], "q", 96 * 1024,
                     before=[previous]),
        # room for the first checkpoint, not for the second beside it
        lambda: case("train-checkpoint", disk, roomy, lambda d: [*train, "--out", d / "adapter"], "adapter",
                     800 * 1024, rerun=["--resume"]),
        # the largest file of a fine-tune's way to a quantized model: a whole float model
        lambda: case("merge", disk, roomy, lambda d: ["merge", adapter, "--out", d / "m"], "m", 64 * 1024),
        # room for the weights, which the check before the work asks for, and not for the tokenizer after them
        lambda: case("merge-midway", disk, roomy, lambda d: ["merge", adapter, "--out", d / "m"], "m",
                     (model / "model.safetensors").stat().st_size + 8 * 1024),
        lambda: case("save-base", disk, roomy, lambda d: ["eval", model, "--base", model, "--data", TEST, "--ctx", 64,
                                                          "--max-windows", 64, "--save-base", d / "base.logits"],
                     "base.logits", 64 * 1024),
    ]
    for run in cases:
        print(json.dumps(run()), flush=True)
    # the embedded model's cache entry (540 MB of float32): the disk has all but a few MB of it
    from quantkit.modelio import DEFAULT_NAME, cache_dir, default_gguf

    wheels = cache_dir() / "wheels"
    default_gguf()
    for p in disk.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    (disk / "wheels").symlink_to(wheels)
    os.environ["QUANTKIT_CACHE"] = str(disk)
    fill(disk, 500 * 10**6)
    code, line = cli("eval", "--max-windows", 1, "--data", TEST)
    print(json.dumps({"case": "cache", "path": str(disk / DEFAULT_NAME), "code": code, "line": line,
                      "left": left(disk)}), flush=True)


if __name__ == "__main__":
    main()
