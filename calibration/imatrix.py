"""llama.cpp's importance-matrix files (what llama-imatrix writes), read for GGUF quantization: the
GGUF layout (`<tensor>.in_sum2` and `<tensor>.counts`, F32, one count per expert) or the legacy .dat
one (entries of name, ncall, nval and nval float32 values holding the mean times ncall). A tensor's
importance is the mean square of each input column, divided out in float32 as llama-quantize does."""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import torch

from quantkit.errors import COMMAND_LINE, QuantkitError, option, untrusted
from quantkit.gguf_constants import is_gguf
from quantkit.requant import Header


def fix() -> str:
    """What to give instead of a file that holds no importance matrix."""
    return (f"give a file llama-imatrix wrote (GGUF or legacy .dat), or {option('imatrix', True)} alone to compute one "
            f"from {option('calib_data')}")


def read_recorded(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str | int]]:
    """(each tensor's importance (float32, one value per input column and expert) by GGUF tensor name,
    the key-values llama-quantize records of the importance matrix it used (quantize.imatrix.*): the
    path as given, the first dataset, the entry count, and the chunks it was computed on)."""
    table, chunks, datasets = parse(path)
    return table, record(str(path), datasets[0] if datasets else None, len(table), chunks)


def record(file: str | None, dataset: str | None, entries: int, chunks: int) -> dict[str, str | int]:
    """llama-quantize's key-values of the importance matrix a file was quantized with (quantize.imatrix.*,
    strings cut to 127 characters); file None for one computed from the calibration text."""
    return {**({"quantize.imatrix.file": file[:127]} if file is not None else {}),
            **({"quantize.imatrix.dataset": dataset[:127]} if dataset else {}),
            "quantize.imatrix.entries_count": entries,
            **({"quantize.imatrix.chunks_count": chunks} if chunks > 0 else {})}


def parse(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], int, list[str]]:
    """(read_recorded's table, the chunk count, the datasets' names), the file checked."""
    path = Path(path)
    if path.is_dir():
        raise QuantkitError(f"{option('imatrix_file', str(path))}: a directory, not an importance matrix: "
                            + ("put MODEL before --imatrix, or " if COMMAND_LINE.get() else "") + fix())
    if not path.exists():
        raise QuantkitError(f"{option('imatrix_file', str(path))}: no such file: {fix()}")
    if not path.is_file():
        raise QuantkitError(f"{option('imatrix_file', str(path))}: not a regular file: {fix()}")
    table, chunks, datasets = from_gguf(path) if is_gguf(path) else legacy(path)
    if not table:
        raise QuantkitError(f"{path}: no importance entries in it: {fix()}")
    bad = next((name for name, v in table.items() if not (torch.isfinite(v).all() and (v >= 0).all())), None)
    if bad is not None:
        raise QuantkitError(f"{path}: the importance of {bad} is negative or not finite: {fix()}")
    return table, chunks, datasets


def from_gguf(path: Path) -> tuple[dict[str, torch.Tensor], int, list[str]]:
    with untrusted(path, "not a readable imatrix GGUF", fix()):
        # quantkit's own reader: gguf-py's builds an object per element of every key-value array (200x
        # the file's size in memory for a long one)
        header = Header(path)
        tensors = {t.name: t for t in header.tensors}
        chunks = int(header.get("imatrix.chunk_count") or 0)
        datasets = header.strings("imatrix.datasets")
        if datasets is None:
            raise ValueError("imatrix.datasets holds other values than names")
        table = {}
        for key, t in tensors.items():
            if not key.endswith(".in_sum2"):
                continue
            name = key.removesuffix(".in_sum2")
            counts = tensors.get(f"{name}.counts")
            if counts is None or {t.type, counts.type} != {"F32"}:
                raise QuantkitError(f"{path}: {name} needs F32 .in_sum2 and .counts tensors: {fix()}")
            sums = header.array(t).reshape(-1)
            n = header.array(counts).reshape(-1)
            if n.size == 0 or sums.size % n.size:
                raise QuantkitError(f"{path}: {name} has {sums.size} sums for {n.size} counts: {fix()}")
            n = np.trunc(n + np.copysign(0.5, n)).astype(np.float32)  # counts are read with lround
            per_expert = sums.reshape(n.size, -1)
            values = np.where(n[:, None] > 0, per_expert / np.where(n > 0, n, 1)[:, None], np.float32(1))
            table[name] = torch.from_numpy(values.astype(np.float32).reshape(-1))
    return table, chunks, datasets


def legacy(path: Path) -> tuple[dict[str, torch.Tensor], int, list[str]]:
    raw = path.read_bytes()
    at, table = 0, {}

    def take(n: int, what: str) -> bytes:
        nonlocal at
        if n < 0 or at + n > len(raw):
            raise QuantkitError(f"{path}: cut short in {what} (byte {at} of {len(raw)}): {fix()}")
        at += n
        return raw[at - n:at]

    (entries,) = struct.unpack("<i", take(4, "the entry count"))
    if entries < 1:
        raise QuantkitError(f"{path}: {entries} entries: {fix()}")
    for i in range(entries):
        (length,) = struct.unpack("<i", take(4, f"entry {i}"))
        name = take(length, f"entry {i}'s name").split(b"\0")[0].decode(errors="replace")
        ncall, nval = struct.unpack("<ii", take(8, f"entry {i}"))
        if nval < 1:
            raise QuantkitError(f"{path}: entry {name} has {nval} values: {fix()}")
        sums = np.frombuffer(take(4 * nval, f"entry {name}'s values"), dtype="<f4").astype(np.float32)
        table[name] = torch.from_numpy(sums / np.float32(ncall) if ncall > 0 else sums.copy())
    chunks, datasets = 0, []
    if at + 4 <= len(raw):  # then, in files that have them, the chunk count and the dataset's name
        (chunks,) = struct.unpack("<i", take(4, "the chunk count"))
        if at + 4 <= len(raw):
            (length,) = struct.unpack("<i", take(4, "the dataset's name"))
            datasets = [take(length, "the dataset's name").decode(errors="replace")]
    return table, chunks, datasets


def check(table: dict[str, torch.Tensor], path: str | os.PathLike, columns: dict[str, int]) -> None:
    """Fail before any work unless the table is for this model: columns, each weight's input width by
    GGUF tensor name; an entry must hold one value per column."""
    known = [name for name in columns if name in table]
    if not known:
        raise QuantkitError(f"{path}: no entry for this model's tensors (it has {next(iter(table))}, the model "
                            f"{next(iter(columns))}): use the imatrix computed for this model")
    for name in known:
        if table[name].numel() != columns[name]:
            raise QuantkitError(f"{path}: {name} has {table[name].numel()} values for {columns[name]} input "
                                "columns: use the imatrix computed for this model")
