"""Safetensors shards written tensor by tensor, as a streaming export needs: no shard is held in memory.

Each tensor's bytes are appended to a spill file as it arrives; when the next tensor would take the
shard past max_size, the shard is written (8-byte header length, JSON header, the spilled data) and a
new one begins. state() and resume(state) let a killed run go on where the state was taken; the state
holds the CRC of the spilled bytes instead of forcing them to the disk after every layer, so a spill
torn by a power cut is found and the run starts afresh. close() names the shards as transformers does:
`model.safetensors` when there is one, else `model-0000k-of-0000n.safetensors` and
`model.safetensors.index.json` mapping tensors to files.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from quantkit.atomic import reopened
from quantkit.errors import QuantkitError, option

if TYPE_CHECKING:
    import torch

# safetensors' names of torch's dtypes, by torch's name (torch itself is imported where a tensor is written:
# the command line reads this module's sizes before it needs torch)
DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
          "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
          "float8_e5m2": "F8_E5M2"}
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
DEFAULT_MAX_SIZE = "5GB"
INDEX = "model.safetensors.index.json"


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB" (10^9) or "500MiB" (2^20), as transformers reads them."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B|)\s*", str(size), re.IGNORECASE)
        if m is None:
            raise QuantkitError(f"{option('max_shard_size', size)} is not a size: use bytes or a number with a unit, such as 5GB or 500MiB")
        n = int(float(m[1]) * UNITS[m[2].upper()])
    if n < 1:
        raise QuantkitError(f"{option('max_shard_size', size)} is not positive: use a size such as 5GB")
    return n


def shard_name(k: int) -> str:
    """Shard k's name until the writer closes."""
    return f".shard-{k}.safetensors"


def state_intact(directory: Path, state: dict) -> bool:
    """Whether the files a ShardWriter's state refers to are all in directory (a kill while closing
    removes spills) and the open shard's spill holds the bytes it had. The names must be the writer's
    own: a progress file is not trusted to name paths, nor a file that is a symbolic link (resuming writes
    into it)."""
    names = [name for name, _ in state["shards"]]
    spill = directory / f".spill-{len(names)}"
    if names != [shard_name(k) for k in range(len(names))] or not all(regular(directory / n) for n in names):
        return False
    return not state["entries"] or (regular(spill) and spill.stat().st_size >= state["used"]
                                    and crc(spill, state["used"]) == state.get("crc"))


def regular(path: Path) -> bool:
    """A regular file itself, not a symbolic link to one."""
    return path.is_file() and not path.is_symlink()


def crc(path: Path, size: int, start: int = 0) -> int:
    """CRC-32 of size bytes of the file at path from start."""
    value = 0
    with open(path, "rb") as f:
        f.seek(start)
        while size > 0:
            chunk = f.read(min(size, 2**24))
            if not chunk:
                break
            value, size = zlib.crc32(chunk, value), size - len(chunk)
    return value


class ShardWriter:
    """Safetensors shards in directory, each holding at most max_size bytes of tensor data (a tensor
    larger than that gets a shard of its own); metadata: strings for each shard's header."""

    def __init__(self, directory: Path, max_size: int | str = DEFAULT_MAX_SIZE, metadata: dict[str, str] | None = None):
        self.dir, self.max_size = Path(directory), parse_size(max_size)
        self.metadata = {"format": "pt", **(metadata or {})}
        self.shards: list[tuple[Path, list[str]]] = []  # written, under temporary names
        self.entries: dict[str, dict] = {}  # the open shard's header
        self.names: set[str] = set()  # every tensor written so far
        self.spill = None
        self.used = 0  # data bytes in the open shard
        self.crc = 0  # of those bytes
        self.total = 0
        self.saved_shards = 0  # shards when state() was last taken

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.names:
            raise ValueError(f"tensor {name} written twice")
        import torch

        kind = DTYPES.get(str(tensor.dtype).removeprefix("torch."))
        if kind is None:
            raise QuantkitError(f"tensor {name} has dtype {tensor.dtype}, which safetensors cannot hold")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if self.entries and self.used + data.numel() > self.max_size:
            self.flush()
        if self.spill is None:
            self.spill = open(self.dir / f".spill-{len(self.shards)}", "w+b")
        self.spill.write(data.numpy().data)
        self.crc = zlib.crc32(data.numpy().data, self.crc)
        self.entries[name] = {"dtype": kind, "shape": list(tensor.shape),
                              "data_offsets": [self.used, self.used + data.numel()]}
        self.names.add(name)
        self.used += data.numel()
        self.total += data.numel()

    def state(self) -> dict:
        """What resume needs, with everything it refers to on disk."""
        if self.spill is not None:
            self.spill.flush()  # the kernel has it: a kill loses nothing; the CRC tells a power cut's loss
        # a spill is needed until a state past its shard has been saved: the one before this, at the latest
        for k in range(self.saved_shards):
            (self.dir / f".spill-{k}").unlink(missing_ok=True)
        self.saved_shards = len(self.shards)
        return {"shards": [[p.name, names] for p, names in self.shards], "entries": self.entries,
                "used": self.used, "crc": self.crc, "total": self.total}

    def resume(self, state: dict) -> None:
        """Go on from a state taken by state(): what was written after it is dropped."""
        self.shards = [(self.dir / name, names) for name, names in state["shards"]]
        self.entries, self.used, self.crc, self.total = state["entries"], state["used"], state["crc"], state["total"]
        self.names = {n for _, names in self.shards for n in names} | set(self.entries)
        self.saved_shards = len(self.shards)
        spill = self.dir / f".spill-{len(self.shards)}"
        if self.entries:
            self.spill = reopened(spill)
            self.spill.truncate(self.used)
            self.spill.seek(self.used)

    def flush(self) -> None:
        """Write the open shard: header, then its spilled data."""
        header = json.dumps({"__metadata__": self.metadata, **self.entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        path = self.dir / shard_name(len(self.shards))
        try:
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", len(header)) + header)
                if self.spill is not None:
                    self.spill.seek(0)
                    shutil.copyfileobj(self.spill, f, 2**24)
                f.flush()
                os.fsync(f.fileno())  # once a shard (GBs), not per layer: its spill goes once a later state is saved
        except OSError:  # a full disk: the shard is written again on resume
            path.unlink(missing_ok=True)
            raise
        if self.spill is not None:
            self.spill.close()  # removed once no saved state can need it
        self.shards.append((path, list(self.entries)))
        self.entries, self.spill, self.used, self.crc = {}, None, 0, 0

    def close(self) -> list[Path]:
        """Write the last shard, give the shards their final names and write the index; the files.
        The final names are hard links: the temporary names and the spills a saved state refers to stay
        until the commit (scratch), so a run killed before it resumes instead of starting afresh."""
        if self.entries or not self.shards:
            self.flush()
        for done in [*self.dir.glob("model*.safetensors"), self.dir / INDEX]:  # a killed close's
            done.unlink(missing_ok=True)
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        for (path, _), name in zip(self.shards, names):
            try:
                os.link(path, self.dir / name)
            except OSError:  # a file system without hard links: a kill from here on starts the run afresh
                path.rename(self.dir / name)
        files = [self.dir / name for name in names]
        if n > 1:
            weight_map = {t: name for (_, tensors), name in zip(self.shards, names) for t in tensors}
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
            files.append(self.dir / INDEX)
        return files

    def release(self) -> None:
        """Close the open spill when the run fails: its files stay for the abort to keep or remove, and a
        failure kept with its traceback (a notebook's) would hold a removed spill's space until it goes."""
        try:
            if self.spill is not None:
                self.spill.close()
        except OSError:  # its buffer's flush, on the full disk that failed the run: the abort goes on
            pass
        finally:
            self.spill = None

    def scratch(self) -> list[Path]:
        """The files only a resumed run needs: the commit removes them."""
        return [*self.dir.glob(".spill-*"), *self.dir.glob(".shard-*.safetensors")]
