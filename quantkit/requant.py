"""llama-quantize's job, without torch: which GGUF type each tensor of a mix gets (its rules,
src/llama-quant.cpp, shared with the GGUF exporter), and a GGUF file requantized into a mix tensor
by tensor. Nothing here is a model: the metadata and tensor infos are copied from the file's header
as they are, each 2-D weight goes through the compiled block quantizer (quantkit.blocks) a slice
of rows at a time, and the file appears only when complete, as every export does."""
from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import re
import struct
import sys
import warnings
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from tqdm import tqdm

from . import blocks
from .atomic import Staged, size_on_disk, tensors_path, write_behind, write_text
from .errors import Note, QuantkitError, ResumableError, count, option, space_for
from .gguf_constants import GGML_QUANT_VERSION, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, LlamaFileType

if TYPE_CHECKING:
    import numpy as np

# mix -> (general.file_type, the type most tensors get)
MIXES = {
    "F32": (LlamaFileType.ALL_F32, "F32"), "F16": (LlamaFileType.MOSTLY_F16, "F16"),
    "BF16": (LlamaFileType.MOSTLY_BF16, "BF16"), "Q8_0": (LlamaFileType.MOSTLY_Q8_0, "Q8_0"),
    "Q4_0": (LlamaFileType.MOSTLY_Q4_0, "Q4_0"), "Q4_1": (LlamaFileType.MOSTLY_Q4_1, "Q4_1"),
    "Q5_0": (LlamaFileType.MOSTLY_Q5_0, "Q5_0"), "Q5_1": (LlamaFileType.MOSTLY_Q5_1, "Q5_1"),
    "Q2_K": (LlamaFileType.MOSTLY_Q2_K, "Q2_K"), "Q3_K_M": (LlamaFileType.MOSTLY_Q3_K_M, "Q3_K"),
    "Q4_K_M": (LlamaFileType.MOSTLY_Q4_K_M, "Q4_K"), "Q5_K_M": (LlamaFileType.MOSTLY_Q5_K_M, "Q5_K"),
    "Q6_K": (LlamaFileType.MOSTLY_Q6_K, "Q6_K"),
}
DEFAULT_MIX = "Q4_K_M"
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}  # llama-quantize's short names of its _M mixes
# llama-quantize's other mixes: known, so not "unknown", but not written here
OTHER_MIXES = ("Q2_K_S", "Q3_K_S", "Q3_K_L", "Q4_K_S", "Q5_K_S", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
               "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "Q2_0",
               "MXFP4_MOE", "COPY")
# a row that does not fill 256-value blocks takes a 32-value type instead
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")  # blk.N.ROLE.weight
EMBED, OUTPUT = "token_embd.weight", "output.weight"
BLOCK = re.compile(r"blk\.([0-9]{1,9})\.([^.]+)")  # blk.N.ROLE...: a decoder layer's tensor


def block_of(name: str) -> tuple[int, str] | None:
    """(layer, role) of a decoder layer's tensor name, None for the others."""
    m = BLOCK.match(name)
    return (int(m[1]), m[2]) if m else None


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def fit_row(t: str, k: int) -> str:
    """llama-quantize's fallback when rows of k values do not fill t's blocks."""
    if k % blocks.sizes(t)[0] == 0:
        return t
    t = FALLBACK.get(t, t)
    return t if k % blocks.sizes(t)[0] == 0 else "F16"


def parse_overrides(overrides: tuple[str, ...] | list[str]) -> list[tuple[re.Pattern, str]]:
    """llama-quantize's --tensor-type PATTERN=TYPE: a regular expression searched in each GGUF tensor
    name (lower-cased, as llama.cpp reads it) and the type the first match gets."""
    out = []
    for o in overrides:
        pattern, sep, kind = o.partition("=") if isinstance(o, str) else ("", "", "")
        kind = kind.upper()
        if not sep or not pattern:
            raise QuantkitError(f"{option('tensor_type')} {o!r} is not PATTERN=TYPE: write e.g. attn_v=Q8_0")
        if kind not in blocks.TYPES:
            raise QuantkitError(f"{option('tensor_type')} {o!r}: "
                                + refusal(kind, kind in GGMLQuantizationType.__members__, blocks.TYPES))
        try:
            out.append((re.compile(pattern.lower()), kind))
        except re.error as e:
            raise QuantkitError(f"{option('tensor_type')} {o!r}: {pattern!r} is not a regular expression ({e})") from None
    return out


def layer_type(mix: str, role: str, i: int, n: int, gqa: int, imatrix: bool) -> str | None:
    """llama_tensor_get_type's choices for the mixes we write (None: the mix's main type)."""
    if role == "attn_v":
        if mix == "Q2_K":
            return "Q4_K" if gqa >= 4 else "Q3_K"
        if mix == "Q3_K_M":
            return "Q5_K" if i < 2 else "Q4_K"
        if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
            return "Q6_K"
    elif role == "ffn_down":
        if mix == "Q2_K":
            return "Q3_K"
        if mix == "Q3_K_M":
            return "Q5_K" if i < n // 16 else "Q4_K"
        if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
            return "Q6_K"
        if mix in ("Q4_0", "Q5_0") and imatrix and i < n // 8:
            return "Q4_1" if mix == "Q4_0" else "Q5_1"
    elif role == "attn_output":
        return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K"}.get(mix)
    return None


def check_mix(mix: str, option: str = "") -> str:
    """The mix's name as MIXES spells it: any case, llama-quantize's aliases (Q4_K for Q4_K_M). Refuses
    a mix quantkit does not write (option: the option that named it, for the message)."""
    name = ALIASES.get(mix.upper(), mix.upper())
    if name not in MIXES:
        known = name in OTHER_MIXES
        raise QuantkitError(refusal(name if known else mix, known, tuple(MIXES), f" in {option}" if option else ""))
    return name


def refusal(name: str, known: bool, choices: tuple[str, ...], where: str = "") -> str:
    """Why a GGUF type or mix is refused: llama.cpp has it (known) and quantkit does not write it, or
    nothing has it."""
    if known:
        return f"quantkit does not write {name}{where}: use one of {', '.join(choices)}, or llama-quantize"
    return f"unknown GGUF type {name!r}{where}: use one of {', '.join(choices)}"


def type_70b(arch: str, layers: int, heads: int, kv_heads: int) -> bool:
    """Whether llama.cpp's loader calls the model 70B, which its attn_v rule reads: 80 layers of llama
    with grouped KV heads (without them it is 65B), or of qwen2."""
    return layers == 80 and (arch == "qwen2" or arch == "llama" and heads != kv_heads)


def choose(weights: list[tuple[str, int]], mix: str, layers: int, gqa: int, pure: bool = False,
           imatrix: bool = False, overrides: tuple[str, ...] = (), is_70b: bool = False) -> dict[str, str]:
    """The GGUF type of each 2-D weight for a mix, as llama-quantize chooses it. weights: (GGUF name,
    row length) in the file's order; the output matrix is output.weight, or token_embd.weight where
    there is none (tied). pure: every tensor the mix's main type (--pure). imatrix: the rules
    llama-quantize applies when it has an importance matrix. overrides: --tensor-type PATTERN=TYPE, as
    llama-quantize applies them to a quantized mix: the first match wins over the mix's rules, and the
    layer count those rules read skips the tensors it took (llama.cpp counts the attn_v and ffn_down
    tensors it decides). is_70b: type_70b's, whose attn_v gets Q5_K where the mix gives Q3_K or Q4_K."""
    mix = check_mix(mix)
    default = MIXES[mix][1]
    if default in blocks.FLOAT_TYPES and (pure or overrides):  # llama-quantize ignores both there
        raise QuantkitError(f"{option('pure') if pure else option('tensor_type')} chooses among the types of a quantized "
                            f"mix, and {mix} stores every weight as {default}: pass a quantized {option('gguf_type')} "
                            "such as Q4_K_M")
    manual = parse_overrides(overrides)
    tied = OUTPUT not in dict(weights)
    decided = dict.fromkeys(ROLES, 0)  # per role, the tensors the mix's rules have typed
    types, unfit, fallen = {}, [], []
    unmatched = {pattern.pattern for pattern, _ in manual}
    for name, k in weights:
        hits = [(pattern.pattern, kind) for pattern, kind in manual if pattern.search(name)]
        unmatched -= {pattern for pattern, _ in hits}
        t = hits[0][1] if hits else None  # the first match wins
        role = (block_of(name) or (None, None))[1]
        if t is not None or default in blocks.FLOAT_TYPES or pure:
            t = t or default
        elif name == OUTPUT or (name == EMBED and tied):
            t = "Q8_0" if k % blocks.sizes(default)[0] or default == "Q8_0" else "Q6_K"
        elif role in decided:
            t = layer_type(mix, role, decided[role], layers, gqa, imatrix) or default
            decided[role] += 1
            if is_70b and role == "attn_v" and t in ("Q3_K", "Q4_K"):  # 8 heads share each: more bits cost little
                t = "Q5_K"
        else:
            t = default
        types[name] = fit_row(t, k)
        if types[name] == "F16" != t:
            unfit.append((name, k, t))
        elif types[name] != t:
            fallen.append((name, k, t))
    if unmatched:  # a misspelt name would leave the mix's type silently
        names = f"its names run from {weights[0][0]} to {weights[-1][0]}" if weights else "it has no 2-D weights"
        raise QuantkitError(f"{option('tensor_type')} pattern {sorted(unmatched)[0]!r} matches no quantized tensor of this model "
                            f"({names}): fix the pattern")
    if unfit:  # a file larger than its mix says; llama-quantize refuses one without a fallback type
        name, k, t = unfit[0]
        why = f"fill neither {t}'s blocks of {blocks.sizes(t)[0]} nor {FALLBACK[t]}'s of " \
              f"{blocks.sizes(FALLBACK[t])[0]} (llama-quantize writes F16 there too)" if t in FALLBACK else \
              f"do not fill {t}'s blocks of {blocks.sizes(t)[0]} (llama-quantize refuses such a file)"
        warnings.warn(f"{count(len(unfit), 'weight')} written as F16: rows of {k} values ({name}) {why}", Note)
    if fallen:  # as llama-quantize says it: the file is larger than the mix's name suggests
        name, k, t = fallen[0]
        bits = {u: 8 * blocks.sizes(u)[1] / blocks.sizes(u)[0] for u in (t, FALLBACK[t])}
        warnings.warn(f"{len(fallen)} of {count(len(weights), 'weight')} take llama-quantize's fallback types: rows of {k} "
                      f"values ({name}) do not fill {t}'s blocks of {blocks.sizes(t)[0]}, so {FALLBACK[t]} "
                      f"({bits[FALLBACK[t]]:g} bits a weight where {t} has {bits[t]:g})", Note)
    return types


# ---- the file: GGUF v2/v3, little-endian (gguf-py's reader parses the vocabulary too slowly) ----

SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
LENGTH = struct.Struct("<Q")  # a string's
FILE_TYPE, QUANT_VERSION, ALIGNMENT = "general.file_type", "general.quantization_version", "general.alignment"


@dataclass
class Tensor:
    name: str
    dims: tuple[int, ...]  # ggml's order: dims[0] is the row length
    type: str
    offset: int  # from the start of the data


class Header:
    """A GGUF file's header: each key-value's bytes as they are (to copy) and the values of its
    scalars (to read), the tensor infos, and where the data starts."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            raise QuantkitError(f"{path}: no such file: give a .gguf file")
        try:
            with open(path, "rb") as f:
                self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # an empty file: ValueError
        except OSError as e:
            raise QuantkitError(f"{path}: cannot read it ({e.strerror}): check its permissions") from None
        except ValueError:
            raise QuantkitError(f"{path} is empty: give a complete .gguf file") from None
        try:
            self.parse()
        except (struct.error, UnicodeDecodeError, KeyError, ValueError, OverflowError):
            raise QuantkitError(f"{path}: not a GGUF file, or its header is cut short or damaged: "
                                "give a complete .gguf file") from None

    def take(self, fmt: str) -> int | float | bool | tuple:
        v = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v

    def string(self) -> str:
        n = self.take("Q")
        s = self.buf[self.pos:self.pos + n]
        if len(s) != n:
            raise ValueError("cut short")
        self.pos += n
        return s.decode()

    def value(self, kind: int) -> str | int | float | bool | None:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            sub, n = self.take("IQ")
            if sub == STRING:  # the vocabulary: skipped, not decoded
                length, buf, pos = LENGTH.unpack_from, self.buf, self.pos
                for _ in range(n):
                    pos += 8 + length(buf, pos)[0]
                self.pos = pos
            else:
                self.pos += n * struct.calcsize(SCALARS[sub])
            return None
        return self.take(SCALARS[kind])

    def parse(self) -> None:
        self.pos = 0
        check_version(self.path, self.buf)
        n_tensors, n_kv = struct.unpack_from("<QQ", self.buf, 8)
        self.pos = 24
        self.kv: dict[str, tuple[int, int, object]] = {}  # key -> (start, end, scalar value or None)
        for _ in range(n_kv):
            start = self.pos
            key = self.string()
            value = self.value(self.take("I"))
            self.kv[key] = (start, self.pos, value)
        self.tensors = []
        for _ in range(n_tensors):
            name = self.string()
            n = self.take("I")
            if n > 4:  # GGML_MAX_DIMS
                raise ValueError("dims")
            dims = struct.unpack_from(f"<{n}Q", self.buf, self.pos)
            self.pos += 8 * n
            kind, offset = self.take("IQ")
            self.tensors.append(Tensor(name, dims, type_name(self.path, name, kind), offset))
        self.alignment = self.get(ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(self.alignment, int) or self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError("alignment")
        self.data = pad(self.pos, self.alignment)
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise QuantkitError(f"{self.path}: two tensors have the same name: the file is damaged; convert it again")
        for t in self.tensors:
            if t.offset % self.alignment:
                raise QuantkitError(f"{self.path}: tensor {t.name} is not at a multiple of the file's alignment "
                                    f"({self.alignment} bytes), as llama.cpp requires: convert it again")
            if not t.dims or min(t.dims) < 1 or t.dims[0] % blocks.sizes(t.type)[0]:
                raise QuantkitError(f"{self.path}: tensor {t.name} has the shape {list(t.dims)}, which its type "
                                    f"{t.type} cannot hold: the file is damaged; convert it again")
            if self.data + t.offset + nbytes(t.dims, t.type) > len(self.buf):
                raise QuantkitError(f"{self.path}: tensor {t.name} runs past the end of the file: the file is "
                                    "cut short; download or convert it again")
        check_offsets(self.path, [(t.name, t.offset, nbytes(t.dims, t.type)) for t in self.tensors], self.alignment)

    def get(self, key: str, default: object = None) -> object:
        return self.kv[key][2] if key in self.kv else default

    def __contains__(self, key: str) -> bool:
        return key in self.kv

    def strings(self, key: str, most: int = 16) -> list[str] | None:
        """The first `most` strings of the array at key ([] where there is no key; None where it is not
        an array of strings): the header skips arrays, this reads only what is asked for."""
        if key not in self.kv:
            return []
        pos = self.kv[key][0]
        pos += LENGTH.size + LENGTH.unpack_from(self.buf, pos)[0]  # the key's name
        kind, sub, n = struct.unpack_from("<IIQ", self.buf, pos)
        if kind != ARRAY or sub != STRING:
            return None
        pos += 16
        out = []
        for _ in range(min(n, most)):
            length = LENGTH.unpack_from(self.buf, pos)[0]
            out.append(bytes(self.buf[pos + LENGTH.size:pos + LENGTH.size + length]).decode())
            pos += LENGTH.size + length
        return out

    def array(self, t: Tensor, start: int = 0, stop: int | None = None) -> np.ndarray:
        """t's values [rows, row length], rows start to stop (default: all): a view of the file's float32 or
        float16 (both quantize as they are), float32 for the other types (made a slice of rows at a time
        by the callers: a 70B model's embedding is 8 GB in float32)."""
        import gguf
        import numpy as np

        k, n = t.dims[0], math.prod(t.dims[1:])
        stop = n if stop is None else min(stop, n)
        row = nbytes((k,), t.type)
        raw = np.frombuffer(self.buf, np.uint8, (stop - start) * row, self.data + t.offset + start * row)
        if t.type == "F32":
            return raw.view(np.float32).reshape(-1, k)
        if t.type == "F16":
            return raw.view(np.float16).reshape(-1, k)
        if t.type == "BF16":
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(-1, k)
        try:
            return gguf.quants.dequantize(raw.reshape(stop - start, -1),
                                          gguf.GGMLQuantizationType[t.type]).reshape(-1, k)
        except NotImplementedError:
            raise QuantkitError(f"{self.path}: tensor {t.name} is {t.type}, which gguf-py cannot read: requantize "
                                "it with llama-quantize --allow-requantize") from None


def check_offsets(path: Path, tensors: list[tuple[str, int, int]], alignment: int) -> None:
    """llama.cpp's rule for the tensors' (name, offset, bytes), in the file's order: each one's data
    starts where the one before it ends, padded to the alignment. Tensors that overlap read another's
    bytes as their own: a damaged file that would load and score."""
    at = 0
    for name, offset, size in tensors:
        if offset != at:
            raise QuantkitError(f"{path}: tensor {name} starts at byte {offset} of the data, where the tensor before "
                                f"it ends at {at}, as llama.cpp requires: the file is damaged; convert it again")
        at += pad(size, alignment)


def check_hyperparameters(path: Path, arch: str, metadata: dict | Header) -> None:
    """The hyperparameters llama.cpp's loader requires: else transformers' defaults would stand in for
    them, and llama.cpp refuses the file."""
    missing = [f"{arch}.{key}" for key in REQUIRED if f"{arch}.{key}" not in metadata]
    if missing:
        raise QuantkitError(f"{path} has no {', '.join(missing)}: the file is damaged; convert the model again")


def check_version(path: Path, buf: bytes | mmap.mmap) -> None:
    """Refuse a file that is not a little-endian GGUF of version 2 or 3, by what it is (buf: its start)."""
    if buf[:4] != b"GGUF":
        raise ValueError("it does not start with GGUF")
    version = struct.unpack_from("<I", buf, 4)[0]
    if version >> 24 in (2, 3) and not version & 0xffffff:
        raise QuantkitError(f"{path}: a big-endian GGUF: quantkit and llama.cpp on this machine read "
                            "little-endian files; convert the model again without --bigendian")
    if version not in (2, 3):
        raise QuantkitError(f"{path}: GGUF version {version}: quantkit reads versions 2 and 3 "
                            "(convert it again with a current llama.cpp)")


def type_name(path: Path, tensor: str, kind: int) -> str:
    """The name of a tensor's ggml type. A type newer than the installed gguf-py is not damage: a
    llama.cpp that knows it can requantize the file."""
    try:
        return GGMLQuantizationType(kind).name
    except ValueError:
        raise QuantkitError(f"{path}: tensor {tensor} has GGML type {kind}, which quantkit does not read: requantize "
                            "the file to Q8_0 or F16 with llama-quantize --allow-requantize first") from None


def requantized_note(src: str | os.PathLike, kinds: list[str], mix: str | None = None) -> str:
    """What requantizing weights of these quantized types (into a GGUF mix) costs (export and quantize say it
    alike)."""
    if mix is not None and MIXES[check_mix(mix)][1] in blocks.FLOAT_TYPES:
        return (f"{src} holds weights already quantized ({', '.join(kinds)}): written as {mix}, they keep that "
                "rounding error, in a larger file than the source; convert from the original checkpoint for "
                "the float weights")
    return (f"{src} holds weights already quantized ({', '.join(kinds)}): requantized, they keep that "
            "rounding error and add the new type's; requantize from an F16 or F32 file where you have one")


def pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def nbytes(dims: tuple[int, ...], kind: str) -> int:
    block, size = blocks.sizes(kind)
    return math.prod(dims) // block * size


def u32_kv(key: str, value: int) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<II", 4, value)


def str_kv(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IQ", 8, len(v)) + v


def order(tensors: list[Tensor]) -> list[Tensor]:
    """llama-quantize's order: by name, the tensors outside the blocks first, then block by block."""
    def key(t: Tensor) -> tuple[int, str]:
        return (block_of(t.name) or (-1,))[0], t.name

    return sorted(tensors, key=key)


def metadata(h: Header, mix: str, dropped: tuple[str, ...] = ()) -> list[bytes]:
    """The key-values of a file of the mix made from h's, as llama-quantize writes them: every one of
    the source's as it is, then the quantization version and file type. dropped: more keys the new
    file sets itself."""
    # a split's keys go (a one-part split is the only one read): llama-quantize writes one file
    kv = [h.buf[start:end] for key, (start, end, _) in h.kv.items()
          if key not in (FILE_TYPE, QUANT_VERSION, *dropped) and not key.startswith("split.")]
    return kv + [u32_kv(QUANT_VERSION, GGML_QUANT_VERSION), u32_kv(FILE_TYPE, int(MIXES[mix][0]))]  # last, as there


def tensor_info(name: str, dims: tuple[int, ...], kind: str, offset: int) -> bytes:
    """A tensor's entry in the header (dims in ggml's order; offset from the start of the data)."""
    b = name.encode()
    return struct.pack(f"<Q{len(b)}sI{len(dims)}QIQ", len(b), b, len(dims), *dims, int(GGMLQuantizationType[kind]),
                       offset)


def header(kv: list[bytes], infos: list[bytes], alignment: int) -> bytes:
    """A GGUF v3 header of these key-values and tensor infos, padded to where the data starts."""
    head = b"".join([b"GGUF", struct.pack("<IQQ", 3, len(infos), len(kv)), *kv, *infos])
    return head + bytes(pad(len(head), alignment) - len(head))


def header_bytes(h: Header, types: dict[str, str], mix: str) -> tuple[bytes, dict[str, int]]:
    """The new header as llama-quantize writes it: the source's metadata (metadata()); the same tensors
    in its order, of their new types. And each tensor's offset."""
    infos, offsets, offset = [], {}, 0
    for t in order(h.tensors):
        kind = types.get(t.name, t.type)
        infos.append(tensor_info(t.name, t.dims, kind, offset))
        offsets[t.name] = offset
        offset += pad(nbytes(t.dims, kind), h.alignment)
    return header(metadata(h, mix), infos, h.alignment), offsets


CHUNK = 2**22  # values handed to the quantizer at a time
ARCHS = ("llama", "qwen2", "qwen3")  # the GGUF architectures quantkit reads and requantizes (Mistral's say llama)
# the hyperparameters a GGUF must give (after "{arch}."), as llama.cpp's loader requires them
REQUIRED = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
            "attention.layer_norm_rms_epsilon")


def requantize(src: str | os.PathLike, out: str | os.PathLike, mix: str = "F16", overwrite: bool = False,
               progress: bool = True, pure: bool = False, overrides: tuple[str, ...] = ()) -> Path:
    """src (a GGUF file) into the mix at out, as llama-quantize would write it: the same tensor bytes,
    the source's metadata with the new file type. pure, overrides: llama-quantize's --pure and
    --tensor-type (choose)."""
    mix = check_mix(mix)
    h = Header(Path(src))
    arch = h.get("general.architecture")
    if arch is None:
        raise QuantkitError(f"{src} has no general.architecture: the file is damaged; convert the model again")
    if arch not in ARCHS:
        raise QuantkitError(f"{src}: a {arch!r} GGUF: quantkit requantizes {', '.join(ARCHS)} files; use llama-quantize")
    if h.get("split.count") not in (None, 0, 1):
        raise QuantkitError(f"{src} is one of {h.get('split.count')} parts of a split GGUF: merge them first "
                            "(llama-gguf-split --merge)")
    check_hyperparameters(h.path, arch, h)
    if h.get(f"{arch}.expert_count") or any(len(t.dims) > 2 for t in h.tensors):
        raise QuantkitError(f"{src}: a mixture-of-experts GGUF ({h.get(f'{arch}.expert_count')} experts): quantkit "
                            "requantizes dense models, not llama-quantize's rules for experts; use llama-quantize")
    # typed in llama-quantize's order: its layer rules count the tensors they decide in that order
    weights = [(t.name, t.dims[0]) for t in order(h.tensors) if len(t.dims) == 2 and t.name.endswith(".weight")]
    layers, heads = h.get(f"{arch}.block_count"), h.get(f"{arch}.attention.head_count")
    kv_heads = h.get(f"{arch}.attention.head_count_kv", heads)
    if not all(isinstance(v, int) and v > 0 for v in (layers, heads, kv_heads)):
        raise QuantkitError(f"{src}: {arch}.block_count, .attention.head_count and .head_count_kv are not all "
                            "positive numbers: the file is damaged; convert it again")
    gqa = heads // kv_heads
    types = choose(weights, mix, layers, gqa, pure, overrides=overrides,
                   is_70b=type_70b(arch, layers, heads, kv_heads))
    again = sorted({t.type for t in h.tensors if t.type not in blocks.FLOAT_TYPES and types.get(t.name, t.type) != t.type})
    if again:  # llama-quantize asks for --allow-requantize
        warnings.warn(requantized_note(src, again, mix), Note)
    head, offsets = header_bytes(h, types, mix)
    total = len(head) + sum(pad(nbytes(t.dims, types.get(t.name, t.type)), h.alignment) for t in h.tensors)
    staged = Staged(out, overwrite, directory=False)
    saved, tensors = tensors_path(out), order(h.tensors)
    st = os.stat(src)  # what the progress must match: the same source (as a quantize's key holds the model), settings
    key = {"source": [os.path.realpath(src), st.st_size, st.st_mtime_ns], "mix": mix, "pure": pure,
           "overrides": list(overrides), "header": zlib.crc32(head)}
    try:
        state = resumed(staged, saved, key, head, len(tensors), overwrite)
        # a killed run's partial is replaced or gone on with: its bytes count as free; the commit's fsyncs can find
        # the disk full too
        with space_for(out, total - size_on_disk(staged.path), "the GGUF",
                       "run it again" + (": it resumes after the last saved tensor" if total > SAVED_EVERY else "")):
            if state is None:
                saved.unlink(missing_ok=True)  # this command's own, of another state of the file: of no use
                staged.fresh()
            with open(staged.path, "r+b" if state else "wb") as f, \
                    mapped(src) as base, tqdm(total=total, desc=f"requantizing to {mix}", unit="B", unit_scale=True,
                                              disable=not progress, file=sys.stderr) as bar:
                if state is None:
                    f.write(head)
                else:
                    f.truncate(state["at"])
                    print(f"resuming after tensor {state['next']}/{len(tensors)} from {saved}", file=sys.stderr)
                bar.update(len(head))
                written = 0  # since the last save
                for i, t in enumerate(tensors):
                    kind = types.get(t.name)
                    if state is None or i >= state["next"]:
                        start = len(head) + offsets[t.name]
                        f.seek(start)
                        write_tensor(f, h, t, kind, base)
                        write_behind(f, start)
                        written += f.tell() - start
                    bar.update(pad(nbytes(t.dims, kind or t.type), h.alignment))
                    if written >= SAVED_EVERY and i + 1 < len(tensors):  # what it records is on the disk first
                        os.fsync(f.fileno())
                        write_text(saved, json.dumps({"key": key, "next": i + 1, "at": f.tell()}))
                        written = 0
                f.truncate(total)
            return staged.commit()
    except BaseException as e:
        # the saved tensors stay for the same command, unless the source is at fault: it would fail the same way
        keep = saved.is_file() and not (isinstance(e, QuantkitError) and not isinstance(e, ResumableError))
        staged.abort(keep=keep)
        if isinstance(e, KeyboardInterrupt) and keep:  # Ctrl-C, SIGTERM
            print(f"stopped: the finished tensors are kept beside {out} ({saved.name}): run the same command to go on "
                  "from them", file=sys.stderr)
        raise


SAVED_EVERY = 2**30  # bytes written between saves of the progress (each after an fsync): none for a smaller file


def resumed(staged: Staged, saved: Path, key: dict, head: bytes, tensors: int, overwrite: bool) -> dict | None:
    """The progress of a killed run of the same command to go on from (its tensors fsynced in the partial
    file, which starts with the same header), or None. Another requantization's is refused without overwrite."""
    try:
        state = json.loads(saved.read_text()) if saved.is_file() and not saved.is_symlink() else None
        next_, at = state["next"], state["at"]
        if state["key"] != key and not overwrite:
            staged.refused = True  # abort() leaves that work where it is
            raise QuantkitError(f"{saved} holds {next_} of {tensors} tensors of another requantization writing "
                                f"{staged.out} ({differences(state['key'], key)}): run that command again to go on "
                                f"from them, or pass {option('overwrite', True)} to discard them and start afresh")
    except (OSError, ValueError, TypeError, KeyError):  # none, or damaged: start afresh
        return None
    path = staged.path
    if state["key"] != key or not isinstance(next_, int) or not isinstance(at, int) or not 0 < next_ < tensors \
            or not path.is_file() or path.is_symlink() or path.stat().st_size < at or at < len(head):
        return None
    with open(path, "rb") as f:
        if f.read(len(head)) != head:
            return None
    return state


def differences(theirs: dict, ours: dict) -> str:
    """How another requantization's key differs from this one's, as its user would tell them apart."""
    if not isinstance(theirs, dict) or theirs.keys() != ours.keys():
        return "it was started by another version of quantkit"
    if theirs["source"] != ours["source"]:
        return "it read another source file, or this one changed since"
    changed = [f"{name}={theirs[name]!r}" for name in ("mix", "pure", "overrides") if theirs[name] != ours[name]]
    return f"it ran with {' and '.join(changed)}" if changed else "its header differs"


def write_tensor(f, h: Header, t: Tensor, kind: str | None, base: int | None) -> None:
    """Tensor t of the source, in kind (None: as it is), at f's position."""
    k, n = t.dims[0], math.prod(t.dims[1:])
    step = max(1, CHUNK // k)
    try:
        if kind is None or kind == t.type:  # norms, biases and what keeps its type: as they are
            check_source(h, t, base)
            f.write(h.buf[h.data + t.offset:h.data + t.offset + nbytes(t.dims, t.type)])
        elif base is not None and t.type in ("F32", "F16") and kind not in blocks.FLOAT_TYPES and \
                blocks.library():  # checked as quantized
            for r in range(0, n, step):
                f.write(blocks.quantize_at(base + h.data + t.offset + nbytes((k, r), t.type), t.type == "F16",
                                           min(step, n - r), k, kind))
        else:  # to a float type, from a quantized one, or without the compiled quantizer
            check_source(h, t, base)
            for r in range(0, n, step):
                f.write(quantize_rows(h.array(t, r, r + step), kind))
    except blocks.Invalid as e:  # llama-quantize refuses these too
        raise QuantkitError(f"{h.path}: tensor {t.name} {e}: the file is damaged, or the model diverged; convert it "
                            "again from a sound checkpoint") from None


@contextmanager
def mapped(path: str | os.PathLike) -> Iterator[int | None]:
    """The address of a read-only map of the file, for the compiled quantizer to read: Python's mmap
    gives no address of a read-only map, and numpy, which does, takes 0.08 s to import (a small
    file's requantization is timed against llama-quantize's as a whole command). None where libc
    has no mmap."""
    try:
        if os.name != "posix":
            raise OSError("no libc mmap")
        libc = ctypes.CDLL(None)
        libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                                  ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        yield None
        return
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        base = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    if base in (None, ctypes.c_void_p(-1).value):  # MAP_FAILED: the numpy path instead
        yield None
        return
    try:
        yield base
    finally:
        libc.munmap(base, size)


def check_source(h: Header, t: Tensor, base: int | None) -> None:
    """Refuse a source tensor as llama-quantize's loader does: a float one holding NaN or infinity, a
    quantized one with such a scale."""
    if base is not None and blocks.library() and t.type in blocks.TYPES:  # the compiled check knows these
        bad = blocks.invalid(base + h.data + t.offset, t.type, math.prod(t.dims))
    else:  # numpy's view of the file (IQ types too), rows at a time; a quantized tensor's scales show in its values
        import numpy as np

        n, step = math.prod(t.dims[1:]), max(1, CHUNK // t.dims[0])
        bad = not all(np.isfinite(h.array(t, r, r + step)).all() for r in range(0, n, step))
    if bad:
        raise blocks.Invalid("holds NaN or infinite values" if t.type in blocks.FLOAT_TYPES else
                             "holds a block whose float16 scale is NaN or infinite")


def quantize_rows(x: np.ndarray, kind: str) -> np.ndarray:
    import gguf
    import numpy as np

    if kind in blocks.FLOAT_TYPES:
        with np.errstate(over="ignore"):  # refused below
            q = gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), gguf.GGMLQuantizationType[kind])
        if kind == "F16" and not np.isfinite(q).all():  # the source is finite (check_source)
            raise blocks.Invalid("holds values too large for F16 (above 65504)")
        return q
    q = blocks.quantize(x, kind)
    if q is None:  # not compiled at install: the same bytes from the torch searches, slower
        import torch

        from .quantizers import ggml

        q = ggml.quantize(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), kind).codes.numpy()
    return q
