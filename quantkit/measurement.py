"""EXL2's measurement: each decoder block's relative output error at each candidate setting
(quantizers.exl2.CANDIDATES, quantizers.exl2.measure_layer), gathered by a pass of the pipeline and
saved as JSON, so that one
measurement serves any number of targets (ExLlamaV2's converter keeps its measurement.json too).
A file is tied to its model and calibration by a key; one of another run is refused."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from .errors import QuantkitError, untrusted
from .quantizers import exl2

FORMAT = "quantkit-exl2-measurement/2"  # 1 held errors per linear


def candidates() -> list[dict]:
    return [{"bits": list(s.bits), "props": list(s.props)} for s in exl2.CANDIDATES]


class Recorder:
    """The pipeline's writer during a measurement: it writes nothing, and its progress state is
    the errors measured so far, so that a killed measurement resumes after its last layer."""
    written = 0

    def __init__(self):
        self.errors: dict[str, list[float]] = {}

    def add(self, key: str, tensor: torch.Tensor) -> None:
        pass

    def add_quantized(self, name: str, qt) -> None:
        pass

    def start(self, state: dict | None) -> None:
        self.errors = dict(state["errors"]) if state else {}

    def resumable(self, state: dict) -> bool:
        return True

    def state(self) -> dict:
        return {"errors": dict(self.errors)}


def blocks(shapes: dict[str, tuple[int, int]]) -> dict[str, dict[str, tuple[int, int]]]:
    """The linears' shapes grouped by the block a measurement scores them in."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for name, shape in shapes.items():
        out.setdefault(exl2.block_of(name), {})[name] = shape
    return out


def check_path(path: str | os.PathLike) -> None:
    """Refuse, before any work, a measurement path that can be neither read nor written."""
    path = Path(path)
    if path.is_dir():
        raise QuantkitError(f"{path} is a directory: pass --measurement a file name, such as {path / 'measurement.json'}")
    if not path.exists() and not path.parent.is_dir():
        raise QuantkitError(f"{path.parent}: no such directory: create it or choose another --measurement")


def save(path: str | os.PathLike, key: str, source: str, shapes: dict[str, tuple[int, int]],
         errors: dict[str, list[float]]) -> None:
    """The measurement at path, complete or not at all."""
    path = Path(path)
    body = {"format": FORMAT, "key": key, "model": source, "candidates": candidates(),
            "blocks": {block: {"linears": {name: list(shape) for name, shape in linears.items()}, "errors": errors[block]}
                       for block, linears in blocks(shapes).items()}}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(body, indent=1))
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read(path: str | os.PathLike, key: str, shapes: dict[str, tuple[int, int]]) -> dict[str, list[float]]:
    """The errors of a saved measurement, checked to be of this model, calibration and candidates."""
    path = Path(path)
    with untrusted(path, "not a measurement file", "pass the file a quantkit --format exl2 run saved, or a new path "
                   "to measure into"):
        body = json.loads(path.read_text())
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ValueError(f"its format is not {FORMAT}")
        if body.get("key") != key:
            raise QuantkitError(f"{path} is the measurement of another model or calibration ({body.get('model')}): "
                                "measure this one into a new --measurement path, or calibrate as that run did")
        if body.get("candidates") != candidates():
            raise QuantkitError(f"{path} was measured over other candidate settings (another quantkit version): "
                                "measure again into a new --measurement path")
        entries = body["blocks"]
        errors = {}
        for block, linears in blocks(shapes).items():
            entry = entries[block]
            values = [float(v) for v in entry["errors"]]
            if entry["linears"] != {name: list(shape) for name, shape in linears.items()} or \
                    len(values) != len(exl2.CANDIDATES) or not all(math.isfinite(v) and v >= 0 for v in values):
                raise ValueError(f"its entry for {block} does not fit the model")
            errors[block] = values
        return errors
