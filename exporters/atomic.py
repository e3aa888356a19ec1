from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from quantkit.errors import QuantkitError


def check_out(out: str | os.PathLike, overwrite: bool = False) -> None:
    """Fail before any work when out cannot be written."""
    out = Path(out)
    if out.exists() and not overwrite and (out.is_file() or any(out.iterdir())):
        raise QuantkitError(f"{out} already exists: choose another --out or remove it (or pass --overwrite)")
    if not out.parent.is_dir():
        raise QuantkitError(f"{out.parent}: no such directory: create it or choose another --out")


@contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of out to write into; it becomes out only when the block completes."""
    check_out(out, overwrite)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        tmp.rename(out)


@contextmanager
def atomic_file(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of out to write; it replaces out only when the block completes."""
    check_out(out, overwrite)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(out)
