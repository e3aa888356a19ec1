"""Outputs that appear only when complete: written under a hidden sibling name, locked against a
second process writing the same output, renamed into place at the end. The sibling outlives a kill
or a failure, so a resumed run goes on writing it."""
from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, TextIO

from quantkit import errors
from quantkit.errors import QuantkitError, ResumableError


def check_out(out: str | os.PathLike, overwrite: bool = False, directory: bool | None = None,
              option: str = "out", inputs: Iterable[str | os.PathLike | None] = ()) -> None:
    """Fail before any work when out cannot be written; directory: whether out is to be a directory (True)
    or a file (False), where the caller knows; option: the keyword that names out (errors.option spells it
    as the caller does); inputs: the paths the command reads (check_apart)."""
    check_apart(out, inputs, option)  # first: --overwrite, which "already exists" suggests, cannot help
    out = Path(out)
    if out.name in ("", "..") or Path.cwd().resolve().is_relative_to(out.resolve()):  # '', '.', 'x/..', '/', ...
        raise QuantkitError(f"{errors.option(option)} {str(out)!r} names no new file or directory: give the output a "
                            "name of its own, such as out/model")
    if out.exists() and not (out.is_file() or out.is_dir()):  # the commit's rename would replace it
        raise QuantkitError(f"{out} is a pipe, device or socket, not a file or directory this output can be or "
                            f"replace: choose another {errors.option(option)}")
    if directory is False and out.is_dir():
        raise QuantkitError(f"{out} is a directory, and this output is a file: choose another {errors.option(option)}, "
                            f"such as {out / ('base.logits' if option == 'save_base' else 'model.gguf')}")
    if out.exists() and not overwrite and (out.is_file() or any(out.iterdir())):
        raise QuantkitError(f"{out} already exists: choose another {errors.option(option)} or remove it (or pass "
                            f"{errors.option('overwrite', True)})")
    if overwrite and directory is not False and out.is_dir() and not any((out / f).is_file() for f in OURS):
        held = sorted(p.name for p in out.iterdir())
        if held:  # --out models --overwrite, meant models/m: replacing it would delete every model beside
            raise QuantkitError(f"{out} holds {', '.join(held[:3])}{', ...' if len(held) > 3 else ''} and is not a model "
                                f"or adapter directory, which {errors.option('overwrite', True)} replaces: choose "
                                f"another {errors.option(option)}, such as {out / 'model'}, or empty it yourself")
    if not out.parent.is_dir():
        raise QuantkitError(f"{out.parent}: no such directory: create it or choose another {errors.option(option)}")
    check_writable(out.parent, option)


OURS = ("config.json", "adapter_config.json")  # a model directory (any format's export), an adapter


def check_apart(out: str | os.PathLike, inputs: Iterable[str | os.PathLike | None], option: str = "out") -> None:
    """Refuse an output that is, or holds, a path the command reads (inputs; None for none), or that
    would replace a file of an input directory (a model's weights, say): replacing it would delete what
    is being read (with --overwrite, a model directory and everything beside it)."""
    o = Path(out).resolve()
    for p in inputs:
        if p is None:
            continue
        i = Path(p).resolve()
        # an input directory's files may link elsewhere (the hub's cache, into blobs/): what they link to is read too
        try:
            links = [(f, f.resolve()) for f in Path(p).iterdir() if f.is_symlink() and f.is_file()] if i.is_dir() else []
        except OSError:  # a directory that cannot be listed: the load names it
            links = []
        for named, read in [(p, i), *((f"{f} (a link to {t})", t) for f, t in links)]:
            if o == read or read.is_relative_to(o):
                raise QuantkitError(f"{errors.option(option)} {out} {'is' if o == read else 'holds'} {named}, which this "
                                    f"command reads: writing it would delete that; choose another {errors.option(option)}")
        if o.is_file() and o.parent == i:
            raise QuantkitError(f"{errors.option(option)} {out} would replace {o.name} in {p}, which this command "
                                f"reads: choose another {errors.option(option)}")


def check_writable(directory: Path, option: str) -> None:
    """Refuse, before any work, a directory this user cannot create files in (option: the path's keyword)."""
    if not os.access(directory, os.W_OK | os.X_OK):
        raise QuantkitError(f"{directory}: not writable by this user: choose another {errors.option(option)}, or make "
                            "it writable")


def partial_path(out: str | os.PathLike) -> Path:
    """Where out is written until it is complete."""
    out = Path(out)
    return out.with_name(f".{out.name}.partial")


def progress_path(out: str | os.PathLike, rank: int | None = None) -> Path:
    """Where a run writing out saves its progress after each layer (one file per process of a torchrun job)."""
    out = Path(out)
    return out.with_name(f".{out.name}.progress{'' if rank is None else f'-{rank}'}.pt")


NEXT = r"\.next-\d+"  # waiting_path's suffix
PROGRESS = r"\.{name}\.progress(-\d+)?\.pt(" + NEXT + ")?"  # progress_path's names, and their waiting states


def waiting_path(path: Path, layer: int) -> Path:
    """Where a torchrun process's state after layer waits to replace its saved progress at path, until every
    process has written its own (pipeline.quantize_layers)."""
    return path.with_name(f"{path.name}.next-{layer}")


def saved_progress(path: Path) -> list[Path]:
    """A process's saved progress at path (progress_path), and the state a torchrun process wrote to replace it,
    waiting for the others' (pipeline.quantize_layers)."""
    return [path] * path.is_file() + siblings(path, r"{name}" + NEXT)


def tensors_path(out: str | os.PathLike) -> Path:
    """Where a GGUF requantization writing out saves how far its fsynced tensors go (quantkit.requant)."""
    out = Path(out)
    return out.with_name(f".{out.name}.progress.json")


TENSORS = r"\.{name}\.progress\.json"  # tensors_path's name


def progress_files(out: Path) -> list[Path]:
    """Every process's saved progress for out (a requantization's too, and write_text's temporary of one of its
    saves that a kill cut short)."""
    return siblings(out, PROGRESS) + siblings(out, TENSORS) + siblings(out, r"\." + TENSORS + r"\.tmp-\d+")


def siblings(path: Path, pattern: str) -> list[Path]:
    """The files beside path whose whole names match the regular expression pattern, {name} in it
    standing for path's name taken literally. Only the names quantkit makes: a glob's `.m.old-*` took
    `.m.old-b.partial`, the output of another run writing `m.old-b`, and deleted it while it ran."""
    whole = re.compile(pattern.format(name=re.escape(path.name)))
    return [f for f in path.parent.iterdir() if whole.fullmatch(f.name)] if path.parent.is_dir() else []


def size_on_disk(path: Path) -> int:
    """Bytes of the file at path, or of the files under it (0 when there is none)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_behind(f: BinaryIO, start: int) -> None:
    """Start writing f's bytes from start to where it stands to the disk, without waiting for them:
    the commit's fsync then finds little left to flush (a large file's last seconds, or a small
    file's share of the command's time)."""
    f.flush()
    end = f.tell()
    if hasattr(os, "posix_fadvise") and end > start:  # Linux: DONTNEED starts the writeback, drops what is written
        try:
            os.posix_fadvise(f.fileno(), start, end - start, os.POSIX_FADV_DONTNEED)
        except OSError:  # a file system without it: the commit's fsync does all the flushing
            pass


def sync(path: Path, skip: set[Path] = frozenset()) -> None:
    """Flush a file, or every file under a directory but those in or under skip and the directory itself,
    to the disk: a rename that says an output is complete must not reach the disk before its contents (a
    power cut)."""
    for f in [path] if path.is_file() else [*path.rglob("*"), path]:
        if f not in skip and skip.isdisjoint(f.parents):
            fsync(f)


def remove(path: Path) -> None:
    if path.is_symlink():  # the link, never what it points to
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def open_lock(path: Path) -> TextIO:
    """The lock file at path, created if need be, not through a symbolic link planted there (which would
    create its target)."""
    try:
        return os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644), "a+")
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise QuantkitError(f"{path} is a symbolic link, not quantkit's lock: remove it") from None
        raise


def reopened(path: Path) -> BinaryIO:
    """The file at path, open to be written where it is (a resumed run's), not through a symbolic link
    planted there."""
    return os.fdopen(os.open(path, os.O_RDWR | os.O_NOFOLLOW), "r+b")


def created(path: Path) -> TextIO:
    """A new file at path, open for writing text: what was there (a symbolic link planted there too) is
    removed first, so that nothing is written through a link."""
    path.unlink(missing_ok=True)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w")


def write_text(path: Path, text: str) -> None:
    """A small file (a report's JSON, a measurement) at path, complete or not at all, and on the disk
    before its name says so: a power cut leaves the old file or the new one, not an empty one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with created(tmp) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync(path.parent)
    finally:  # none left by a write that failed
        tmp.unlink(missing_ok=True)


def lock(path: Path, option: str) -> tuple[Path, TextIO]:
    """Hold the lock of the output at path (.{name}.lock beside it, removed when done), or refuse: another
    quantkit process is writing it. The lock's path and its open file."""
    lock_path = path.with_name(f".{path.name}.lock")
    while True:  # the lock file is removed when done: hold it only if it is still the one at lock_path
        try:
            f = open_lock(lock_path)
        except OSError as e:  # /proc passes os.access as root, and takes no file
            raise QuantkitError(f"{path.parent}: cannot create files there ({e.strerror}): choose another "
                                f"{errors.option(option)}") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise QuantkitError(f"{path} is being written by another quantkit process: wait for it to "
                                f"finish or choose another {errors.option(option)}") from None
        try:
            if os.stat(lock_path).st_ino == os.fstat(f.fileno()).st_ino:
                return lock_path, f
        except FileNotFoundError:
            pass
        f.close()


@contextmanager
def locked(path: Path, option: str) -> Iterator[None]:
    """Within: path is this process's to write (lock)."""
    lock_path, f = lock(path, option)
    try:
        yield
    finally:
        lock_path.unlink(missing_ok=True)
        f.close()


CHECKPOINT = "checkpoint"  # trainer.loop.Checkpoints' directory in a training run's partial output
STOPPED = {"layers": "the finished layers of a quantize, export or merge", "checkpoint": "a training checkpoint",
           "tensors": "the finished tensors of a GGUF requantization"}


class Staged:
    """out (a directory, or a file) under construction at .{name}.partial beside it."""

    def __init__(self, out: str | os.PathLike, overwrite: bool = False, directory: bool = True, option: str = "out"):
        check_out(out, overwrite, directory, option)
        self.out, self.directory, self.overwrite, self.option = Path(out), directory, overwrite, option
        self.path = partial_path(self.out)
        self.refused = False  # fresh() found another run's work here
        self.lock_path, self.lock = lock(self.out, option)

    def fresh(self, own: str | None = None) -> Path:
        """Start over: an empty directory (or no file) at path; no progress of an earlier run, no
        previous output left aside by a commit that was killed: where that commit had moved the output aside
        and not yet put the new one in place, the output is put back first. A stopped run's finished work
        (stopped_work) goes only with overwrite, or where own names its kind: the caller checked that
        work to be its own run's, and of no use."""
        work = [(kind, p) for kind, paths in self.stopped_work().items() if kind != own for p in paths]
        if work and not self.overwrite:
            self.refused = True  # abort() leaves that work where it is
            again = errors.option("overwrite", True)
            kind, path = work[0]
            raise QuantkitError(f"{path} holds the finished work of another run writing {self.out} ({STOPPED[kind]}), "
                                f"stopped: run that command again to go on from it, or pass {again} to discard it (or "
                                f"choose another {errors.option(self.option)})")
        aside = siblings(self.out, r"\.{name}\.old-\d+")
        if aside and not self.out.exists() and not self.out.is_symlink():
            max(aside, key=lambda p: p.stat().st_mtime_ns).rename(self.out)
            if not self.overwrite:
                again = errors.option("overwrite", True)
                raise QuantkitError(f"{self.out} is back in place: a run with {again} was stopped while putting its "
                                    f"output there, after moving this one aside: pass {again} to replace it, or "
                                    f"choose another {errors.option(self.option)}")
        remove(self.path)
        # also the temporary of a save killed in a job of another world size (its own path's run clears it)
        for stale in [*progress_files(self.out),
                      *siblings(self.out, PROGRESS + r"\.tmp-\d+"),
                      *siblings(self.out, r"\.{name}\.old-\d+")]:
            remove(stale)
        if self.directory:
            self.path.mkdir()
        return self.path

    def stopped_work(self) -> dict[str, list[Path]]:
        """A stopped run's finished work for out, by kind (STOPPED): quantize's or merge's layers (their progress),
        a requantization's tensors, a training checkpoint (trainer.loop.Checkpoints: the latest, or the one a killed
        save left aside)."""
        saved = [self.path / CHECKPOINT, self.path / f".{CHECKPOINT}.old"]
        return {"layers": siblings(self.out, PROGRESS), "tensors": siblings(self.out, TENSORS),
                "checkpoint": [p for p in saved if (p / "state.pt").is_file()]}

    def check(self) -> None:
        """Refuse an output that appeared since the start (written by something else). Resumable: a run
        that saved its progress keeps it, so a writer checks before it finishes its files, while they
        still match that progress."""
        try:
            check_out(self.out, self.overwrite, self.directory)
        except QuantkitError:
            if not self.out.exists():
                raise
            raise ResumableError(f"{self.out} appeared while this run was writing it: move it away (or pass "
                                 f"{errors.option('overwrite', True)}) and run the same command again") from None

    def commit(self, scratch: list[Path] = ()) -> Path:
        """Put the output in place; scratch: files or directories under it that only a resumed run needs,
        removed from the output once the rest is on the disk and in place: a kill until then leaves a run
        that resumes, and a kill after, the output (with the scratch in it)."""
        self.check()
        sync(self.path, set(scratch))
        inside = [f.relative_to(self.path) for f in scratch]
        if not self.directory:
            os.replace(self.path, self.out)
        elif self.out.exists():
            old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
            self.out.rename(old)
            self.path.rename(self.out)
        else:
            self.path.rename(self.out)
        # also an old one a commit killed here left; and every process's progress, before the lock goes: a
        # kill after it left a file as big as the calibration's activations beside the finished output
        for stale in [*siblings(self.out, r"\.{name}\.old-\d+"), *progress_files(self.out)]:
            remove(stale)
        for f in inside:  # last: a kill from here leaves only scratch in the finished output, which loaders skip
            remove(self.out / f)
        fsync(self.out.parent)  # the rename itself
        self.unlock()
        return self.out

    def abort(self, keep: bool = False) -> None:
        """Give up; keep leaves the partial output and every process's progress for a resumed run
        (cleared before unlocking, so that no other run takes progress without its output)."""
        if not keep and not self.refused:
            for stale in [self.path, *progress_files(self.out)]:
                remove(stale)
        self.unlock()

    def unlock(self) -> None:
        if not self.lock.closed:
            self.lock_path.unlink(missing_ok=True)
            self.lock.close()
