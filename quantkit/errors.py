import errno
import re
import shutil
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from types import MappingProxyType
from typing import Iterator, Mapping


class QuantkitError(Exception):
    """Bad input: the message names the problem and how to fix it.

    The CLI prints it as one line and exits with status 2.
    """


# True while the command line runs: options are named as its flags (--calib-seqlen 4096), else as the
# API's keywords (calib_seqlen=4096)
COMMAND_LINE: ContextVar[bool] = ContextVar("COMMAND_LINE", default=False)
# the flags not named after their keyword
FLAGS = {"imatrix_file": "--imatrix", "targets": "--for", "exl2": "--bits", "chat": "--apply-chat-template"}
# a command's own flags for the keywords it passes on (report's --lm-eval-fewshot is lm-eval's num_fewshot)
RENAMED: ContextVar[Mapping[str, str]] = ContextVar("RENAMED", default=MappingProxyType({}))


@contextmanager
def renamed(flags: Mapping[str, str]) -> Iterator[None]:
    """Within: options named by flags, a command's own names for the keywords it passes on."""
    token = RENAMED.set(MappingProxyType(dict(flags)))
    try:
        yield
    finally:
        RENAMED.reset(token)


def option(name: str, value: object = ..., *values: object) -> str:
    """An option as its caller writes it: option("method", "awq") is --method awq on the command line and
    method='awq' in the API; option("pure", True) is --pure or pure=True, option("pure") --pure or pure;
    further values are a choice of them."""
    if COMMAND_LINE.get():
        flag = RENAMED.get().get(name) or FLAGS.get(name, "--" + name.replace("_", "-"))
        if value is ... or value is True:
            return flag
        return f"{flag} " + " or ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in (value, *values))
    if value is ...:
        return name
    # a float as %g: a limit of 1.0 reads as 1
    return " or ".join(f"{name}={v:g}" if isinstance(v, float) else f"{name}={v!r}" for v in (value, *values))


def setting(name: str, value: object) -> str:
    """An option with its value as the caller would have passed it: none (or off) named as "no --flag"."""
    if value is None or value is False:
        return f"no {option(name)}"
    return option(name, ",".join(map(str, value)) if isinstance(value, list) else value)


class Note(UserWarning):
    """Advice on a choice that works but costs something; the command line prints it as `note:`."""


class ResumableError(QuantkitError):
    """A failure outside the input (a full disk): what was finished stays, and the same command resumes."""


def one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."


@contextmanager
def untrusted(path, what: str, fix: str):
    """Around another library's parsing of a file we were given (a config, a tokenizer, a GGUF's
    metadata): whatever it raises on bad contents becomes a QuantkitError naming the file. Running
    out of memory is not bad contents, so it is not caught."""
    try:
        yield
    except (QuantkitError, MemoryError):
        raise
    except Exception as e:
        raise QuantkitError(f"{path}: {what} ({type(e).__name__}: {one_line(e)}): {fix}") from None


# what each command can lower when memory runs out: (on a GPU, on the CPU)
LESS_MEMORY = {
    "quantize": ("quantize on the CPU (--device cpu) or calibrate on fewer tokens (--calib-samples, --calib-seqlen)",
                 "calibrate on fewer tokens (--calib-samples, --calib-seqlen) or use a machine with more memory"),
    "train": ("lower --batch-size or --seqlen, or pass --gradient-checkpointing",) * 2,
    "eval": ("score on the CPU (--device cpu), or above 2048 tokens a shorter --ctx",
             "score a shorter --ctx (above 2048 tokens), or use a machine with more memory"),
    "lm-eval": ("lower --batch-size or --max-length, or score on the CPU (--device cpu)",
                "lower --batch-size or --max-length, or use a machine with more memory"),
    "report": ("calibrate on fewer tokens (--calib-samples, --calib-seqlen) or, above 2048 tokens, score a shorter "
               "--ctx: the points finished are kept, and the same command goes on with the rest",) * 2,
}


def out_of_memory(e: BaseException, command: str) -> str | None:
    """One line for e when it says that memory ran out (torch's GPU allocator, its CPU allocator, or
    Python's), naming what command can lower; else None."""
    torch = sys.modules.get("torch")  # export starts without it: then only Python's MemoryError
    gpu = torch is not None and isinstance(e, torch.OutOfMemoryError)
    if not (gpu or isinstance(e, MemoryError) or isinstance(e, RuntimeError) and "can't allocate memory" in str(e)):
        return None
    asked = re.search(r"tried to allocate (\d+) bytes", str(e)) or re.search(r"(?i)tried to allocate ([\d.]+ \w+)", str(e))
    what = f" (it asked for {size(int(asked[1])) if asked[1].isdigit() else asked[1]} more)" if asked else ""
    advice = LESS_MEMORY.get(command, ("free some GPU memory or run on the CPU (--device cpu)",
                                       "use a machine with more memory"))[0 if gpu else 1]
    return f"out of {'GPU ' if gpu else ''}memory{what}: {advice}"


def count(n: int, noun: str) -> str:
    """n and the noun, plural unless n is 1 ("1 window", "40 windows")."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def size(n: float) -> str:
    """Bytes as people read them (1.4 GB)."""
    for unit in ("bytes", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000


def free_space(path) -> int:
    """Bytes free on the file system that holds path (or would: its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


NO_ROOM = (errno.ENOSPC, errno.EDQUOT)  # a full disk, or the user's quota of a shared one (a cluster's usual way)
# the file system refused a write: a file over its (or ulimit's) largest, a failing disk, one gone read-only
REFUSED = (errno.EFBIG, errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM)


def refused(e: OSError, path, then: str) -> str:
    """One line for a write the file system refused (e.errno in REFUSED)."""
    where = f"{e.filename}: " if e.filename and str(e.filename) != str(path) else ""  # a file of its own, or one read
    return f"could not write {path} ({where}{e.strerror}): fix that and {then}"


@contextmanager
def space_for(path, needed: int | None, what: str, then: str):
    """Around writing path (needed bytes more, about, when known): refuses at once when the disk has
    less free, and turns running out of space while writing into one line naming path and the sizes,
    as it does a write the file system refuses (REFUSED). All are ResumableErrors, so that what a run
    finished stays; then: what to do once there is space (or the write can be made)."""
    free = free_space(path)
    need = f"{what} needs about {size(needed)}" if needed is not None else f"{what} did not fit"
    if needed is not None and free < needed:
        raise ResumableError(f"{path}: {need} and {size(free)} is free there: free some space or write it elsewhere")
    try:
        yield
    except OSError as e:
        if e.errno in NO_ROOM:
            raise ResumableError(f"out of disk space{' (quota)' if e.errno == errno.EDQUOT else ''} writing {path}: "
                                 f"{need}, {size(free_space(path))} is free now: free some space and {then}") from None
        if e.errno in REFUSED:
            raise ResumableError(refused(e, path, then)) from None
        raise

