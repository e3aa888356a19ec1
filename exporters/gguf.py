"""GGUF for llama.cpp: metadata, tokenizer, tensor names and the q/k row order llama.cpp expects;
which block type each tensor gets for a named mix (llama-quantize's rules, in quantkit.requant);
the file itself, its header through gguf-py's writer (a GGUF source's key-values copied, as
quantkit.requant copies them), its tensors as they are made, under a temporary name until complete."""
from __future__ import annotations

import json
import math
import os
import warnings
import zlib
from pathlib import Path

import gguf
import numpy as np
import torch

from quantkit.errors import Note, QuantkitError, option, size, untrusted
from quantkit.modelio import Model, adds_bos, adds_eos, stored_state
from quantkit import requant
from quantkit.qtensor import QuantizedTensor
from quantkit.requant import DEFAULT_MIX, MIXES, check_mix, choose, type_70b  # noqa: F401 (DEFAULT_MIX: read as gguf.DEFAULT_MIX)
from quantkit.quantizers import ggml

from quantkit.atomic import Staged, reopened
from .checkpoint import hub_name, source_card
from .shards import crc, regular

ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # model_type -> llama.cpp's architecture
IMATRIX_KEYS = "quantize.imatrix."  # llama-quantize's record of the importance matrix it used
ROPES = ("default", "linear", "yarn", "llama3")  # the rope scalings llama.cpp's converter writes for these
NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",  # Qwen3's per-head norms of q and k
}
EMBED, HEAD = "model.embed_tokens", "lm_head"
TOP = {EMBED: "token_embd", "model.norm": "output_norm", HEAD: "output"}  # the modules outside the layers
ROPE_FREQS = "rope_freqs.weight"
# YaRN's optional parameters: the config's name -> the key after {arch}.rope.scaling.
YARN = {"extrapolation_factor": "yarn_ext_factor", "attention_factor": "yarn_attn_factor",
        "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow"}


def check(module: torch.nn.Module, mix: str) -> None:
    cfg = module.config
    if cfg.model_type not in ARCHS:
        raise QuantkitError(f"GGUF export writes {', '.join(ARCHS)} models, not {cfg.model_type!r}: "
                            f"use {option('format', 'safetensors')}")
    check_mix(mix)
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):  # llama.cpp's graphs for these architectures gate with SiLU whatever the config says
        raise QuantkitError(f"the model's activation is {act!r}, and llama.cpp runs {cfg.model_type} models with SiLU: "
                            f"use {option('format', 'safetensors')}")
    if ARCHS[cfg.model_type] == "qwen3" and getattr(cfg, "attention_bias", False):
        raise QuantkitError("a Qwen3 with attention biases: llama.cpp's qwen3 reads none (it refuses the file): use "
                            f"{option('format', 'safetensors')}")
    window = getattr(cfg, "sliding_window", None)
    if window and window < cfg.max_position_embeddings:  # Mistral v0.1's 4096: a refusal would shut out the model
        warnings.warn(f"the model attends to windows of {window} tokens, and llama.cpp's {ARCHS[cfg.model_type]} to the "
                      f"whole context (as llama.cpp's converter writes it too): past {window} tokens its scores differ "
                      "from transformers'", Note)
    kind = rope(cfg).get("rope_type", "default")
    if kind not in ROPES or kind == "llama3" and ARCHS[cfg.model_type] != "llama":
        raise QuantkitError(f"rope scaling {kind!r} of a {cfg.model_type} model is not written to GGUF: "
                            f"quantkit writes {', '.join(ROPES[1:])} (llama3 for Llama only); use {option('format', 'safetensors')}")


def rope(cfg) -> dict:
    return getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}


def rope_factors(cfg) -> np.ndarray | None:
    """Llama 3's rope: the divisor of each rotary frequency (llama.cpp's rope_freqs tensor, as its
    converter computes it from the config); None for the other ropes."""
    r = rope(cfg)
    if r.get("rope_type") != "llama3":
        return None
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (r.get("rope_theta", 10000.0) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = r.get("factor", 8.0), r.get("low_freq_factor", 1.0), r.get("high_freq_factor", 4.0)
    context = r.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            out.append(1.0)
        elif wavelen > context / low:
            out.append(factor)
        else:  # between the two: a smooth step from 1 to factor
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def tensor_types(module: torch.nn.Module, mix: str, *, pure: bool = False, weighted: bool = False,
                 overrides: tuple[str, ...] = ()) -> dict[str, str]:
    """The GGUF type of each 2-D weight (by module name) for a mix, as llama-quantize chooses it
    (quantkit.requant.choose, on the names the file gives them); weighted: with an importance matrix."""
    cfg = module.config
    names = {gguf_name(f"{name}.weight"): name for name, mod in module.named_modules()
             if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)) and not (name == HEAD and cfg.tie_word_embeddings)}
    weights = [(key, module.get_submodule(name).weight.shape[1]) for key, name in names.items()]
    types = choose(weights, mix, cfg.num_hidden_layers, cfg.num_attention_heads // cfg.num_key_value_heads,
                   pure, weighted, overrides, type_70b(ARCHS.get(cfg.model_type, cfg.model_type), cfg.num_hidden_layers,
                                                       cfg.num_attention_heads, cfg.num_key_value_heads))
    return {names[key]: t for key, t in types.items()}


def permute_rows(rows: np.ndarray | torch.Tensor, n_head: int, back: bool = False) -> np.ndarray | torch.Tensor:
    """llama.cpp's rope layout for q/k: within each head, the two halves of the rotary pairs interleave
    (convert_hf_to_gguf's LlamaModel.permute, on whole rows, so on quantized rows too); back: undone."""
    half = rows.shape[0] // n_head // 2
    heads = (n_head, half, 2) if back else (n_head, 2, half)
    return rows.reshape(*heads, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_name(key: str) -> str:
    prefix, _, kind = key.rpartition(".")
    if prefix in TOP and kind == "weight":
        return f"{TOP[prefix]}.weight"
    _, _, i, rest = key.split(".", 3)
    module, _, kind = rest.rpartition(".")
    if module not in NAMES or kind not in ("weight", "bias"):
        raise QuantkitError(f"tensor {key} has no GGUF name: the model has parts llama.cpp's llama, qwen2 and qwen3 lack")
    return f"blk.{i}.{NAMES[module]}.{kind}"


def pre_tokenizer(spec: dict | None) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenization (tokenizer.ggml.pre)."""
    steps = [] if spec is None else spec.get("pretokenizers", [spec]) if spec["type"] == "Sequence" else [spec]
    kinds = [s["type"] for s in steps]
    digits = any(s["type"] == "Digits" and s.get("individual_digits") or
                 s["type"] == "Split" and s["pattern"].get("Regex") == r"\p{N}" for s in steps)
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if len(kinds) == 2 and kinds[1] == "ByteLevel" and digits:
        return "smollm"
    regex = steps[0]["pattern"].get("Regex", "") if kinds == ["Split", "ByteLevel"] else ""
    if r"\p{N}{1,3}" in regex:
        return "llama-bpe"
    if r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|" in regex:  # Qwen2's: single digits, a letter run after one mark
        return "qwen2"
    raise QuantkitError(f"the tokenizer's pre-tokenization {kinds} is not one llama.cpp names here: "
                        "convert this model's tokenizer with llama.cpp's convert_hf_to_gguf.py")


def add_tokenizer(w: gguf.GGUFWriter, model: Model, vocab_size: int) -> None:
    """tokenizer.ggml.* as convert_hf_to_gguf writes them: a byte-level BPE tokenizer's vocabulary
    and merges, or a sentencepiece model's pieces, scores and types (Llama 2, Mistral)."""
    tokenizer = model.tokenizer
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    if spec["model"]["type"] == "BPE" and spec["model"].get("byte_fallback"):
        add_sentencepiece(w, Path(model.source) / "tokenizer.model", tokenizer, vocab_size)
    elif spec["model"]["type"] == "BPE":
        add_bpe(w, spec, tokenizer, vocab_size)
    else:
        raise QuantkitError(f"a {spec['model']['type']} tokenizer is not written to GGUF here, only byte-level BPE and "
                            "sentencepiece BPE: convert this model with llama.cpp's convert_hf_to_gguf.py")
    cfg = model.module.config
    for kind in ("bos", "eos", "unk", "pad"):
        token = getattr(tokenizer, f"{kind}_token")
        # as the converter: the tokenizer's token, else the config's id (Qwen2's bos_token_id with no
        # BOS in its tokenizer; a list of ids, Llama 3 instruct's eos_token_id, it skips)
        i = tokenizer.convert_tokens_to_ids(token) if token is not None else getattr(cfg, f"{kind}_token_id", None)
        if isinstance(i, int) and 0 <= i < vocab_size:
            getattr(w, f"add_{kind}_token_id")(i)
    w.add_add_bos_token(adds_bos(tokenizer))
    if adds_eos(tokenizer):  # llama.cpp's default is not to
        w.add_add_eos_token(True)
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates (transformers reads a list of them as a dict)
        template = [{"name": name, "template": t} for name, t in template.items()]
    if template:
        w.add_chat_template(template)


def add_bpe(w: gguf.GGUFWriter, spec: dict, tokenizer, vocab_size: int) -> None:
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = {a["id"]: a["special"] for a in spec.get("added_tokens", [])}
    tokens, kinds = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            kinds.append(gguf.TokenType.UNUSED)
        else:
            control = i in added and (added[i] or looks_special(by_id[i]))
            tokens.append(by_id[i] if i not in added or control else by_id[i].replace("\u2581", " "))
            kinds.append(gguf.TokenType.NORMAL if i not in added else
                         gguf.TokenType.CONTROL if control else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre_tokenizer(spec.get("pre_tokenizer")))
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_merges(merges)


def looks_special(token: str) -> bool:
    """Added tokens the converter makes control tokens though they are not marked special."""
    return token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or token.startswith("<|") and token.endswith("|>") \
        or token.startswith("<\uff5c") and token.endswith("\uff5c>") or token.startswith("<unused") and token.endswith(">")


def add_sentencepiece(w: gguf.GGUFWriter, path: Path, tokenizer, vocab_size: int) -> None:
    """The pieces, scores and types of the sentencepiece model (llama.cpp's tokenizer merges by the
    scores, which tokenizer.json does not hold), then the tokens added over it, as the converter
    reads them."""
    from sentencepiece import SentencePieceProcessor

    if not path.is_file():
        raise QuantkitError(f"{path} is missing: a sentencepiece tokenizer's GGUF needs its tokenizer.model "
                            "(llama.cpp tokenizes by its scores); copy it from the original model")
    sp = SentencePieceProcessor()
    with untrusted(path, "not a sentencepiece model", "copy the original model's tokenizer.model"):
        sp.LoadFromFile(str(path))
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    kinds = [gguf.TokenType.UNUSED] * vocab_size
    for i in range(min(sp.vocab_size(), vocab_size)):
        tokens[i], scores[i] = sp.IdToPiece(i), sp.GetScore(i)
        kinds[i] = (gguf.TokenType.UNKNOWN if sp.IsUnknown(i) else gguf.TokenType.CONTROL if sp.IsControl(i) else
                    gguf.TokenType.UNUSED if sp.IsUnused(i) else gguf.TokenType.BYTE if sp.IsByte(i) else
                    gguf.TokenType.NORMAL)
    for i, added in tokenizer.added_tokens_decoder.items():
        if i < vocab_size:
            control = added.special or looks_special(added.content)
            tokens[i] = added.content if control else added.content.replace("\u2581", " ")
            scores[i] = -1000.0
            kinds[i] = gguf.TokenType.CONTROL if control else gguf.TokenType.USER_DEFINED
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(kinds)


def add_metadata(w: gguf.GGUFWriter, model: Model, mix: str) -> None:
    """The model's hyperparameters and tokenizer under the keys llama.cpp's converter writes (a model
    directory's: a GGUF's own are copied, Writer.start)."""
    cfg = model.module.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    r = rope(cfg)
    known = hub_name(model.source)  # in the Hub's cache the directory is named by the revision
    w.add_name(known.split("/")[-1] if known else Path(os.path.abspath(model.source)).name)  # "." names its directory
    if terms := source_card(model.source).get("license"):
        w.add_license(terms)
    w.add_file_type(MIXES[mix][0])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(r.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    if r.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(r["factor"])
    elif r.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(r["factor"])
        w.add_rope_scaling_orig_ctx_len(r["original_max_position_embeddings"])
        for name, key in YARN.items():
            if r.get(name) is not None:
                getattr(w, f"add_rope_scaling_{key}")(r[name])
    if ARCHS[cfg.model_type] == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
    if getattr(cfg, "head_dim", None):  # as the converter: when the config names it (Llama's, not Qwen2's)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    add_tokenizer(w, model, cfg.vocab_size)


def source_factors(model: Model) -> np.ndarray | None:
    """Llama 3's rope factors: from its config's rope, or a GGUF source's own rope_freqs tensor (loading
    divides the frequencies by it, and the config says a plain rope)."""
    factors = rope_factors(model.module.config)
    if factors is None and ROPE_FREQS in getattr(model.checkpoint, "infos", {}):
        factors = model.checkpoint.by_name(ROPE_FREQS).numpy()
    return factors


def plan(module: torch.nn.Module, types: dict[str, str], factors: np.ndarray | None = None
         ) -> dict[str, tuple[tuple[int, ...], str]]:
    """The file's tensors: GGUF name -> (shape, type); norms, biases and Llama 3's rope factors in F32
    (factors: a GGUF source's, else from the config), each 2-D weight the type of its module name in types."""
    out = {}
    factors = rope_factors(module.config) if factors is None else factors
    if factors is not None:
        out[ROPE_FREQS] = (factors.shape, "F32")
    for key, t in stored_state(module, keep_vars=True).items():
        kind = "F32" if t.dim() == 1 else types.get(key.removesuffix(".weight"))
        if kind is None:
            raise QuantkitError(f"{key} has no GGUF type: quantize the model for GGUF first")
        out[gguf_name(key)] = (tuple(t.shape), kind)
    return out


class Writer:
    """The GGUF file written as results arrive (quantkit.pipeline.Writer). Metadata and every tensor's info
    (from the model's shapes and types, the GGUF type of each 2-D weight by module name) go first
    through gguf-py's writer; each tensor's data is then written at its offset when it comes, in any
    order, so a resumed run just writes what is missing. The state holds the CRC of the header and of
    each tensor written rather than forcing them to the disk after every layer: a resumed run checks
    them, and a file torn by a power cut is started afresh."""

    def __init__(self, model: Model, out: str | os.PathLike, mix: str, types: dict[str, str], overwrite: bool = False):
        self.imatrix = model.imatrix  # after the other key-values, as llama-quantize writes them
        self.model, self.mix = model, mix
        cfg = model.module.config
        self.arch = ARCHS[cfg.model_type]
        # llama.cpp's llama rotates interleaved pairs, its qwen2 and qwen3 (NeoX rope) the halves as transformers does
        self.heads = {"self_attn.q_proj": cfg.num_attention_heads,
                      "self_attn.k_proj": cfg.num_key_value_heads} if self.arch == "llama" else {}
        self.factors = source_factors(model)
        self.plan = plan(model.module, types, self.factors)
        self.offsets, offset = {}, 0
        for name, (shape, kind) in self.plan.items():
            self.offsets[name] = offset
            offset += gguf.GGUFWriter.ggml_pad(nbytes(shape, kind), gguf.GGUF_DEFAULT_ALIGNMENT)
        self.end = offset
        self.done: dict[str, int] = {}  # name -> CRC of its bytes
        self.file = None
        self.data_start, self.header = 0, 0
        self.summary = ""
        self.staged = Staged(out, overwrite, directory=False)  # last: a failure above leaves no lock behind

    @property
    def written(self) -> int:
        return sum(nbytes(*self.plan[name]) for name in self.done)

    def start(self, state: dict | None = None, own: str | None = None) -> None:
        if state is None:
            self.staged.fresh(own)
            # a GGUF's metadata is copied as quantkit export (llama-quantize) keeps it; a directory's is made anew
            self.data_start = self.copied_header() if Path(self.model.source).is_file() else self.new_header()
            self.header = crc(self.staged.path, self.data_start)
        else:
            self.data_start, self.header, self.done = state["data_start"], state["header"], dict(state["done"])
        self.file = reopened(self.staged.path)
        if ROPE_FREQS in self.plan and ROPE_FREQS not in self.done:  # computed, not read: written first
            self.write(ROPE_FREQS, self.factors)

    def new_header(self) -> int:
        """The header from the model's config and tokenizer (gguf-py's writer); where the data starts."""
        w = gguf.GGUFWriter(self.staged.path, self.arch)
        add_metadata(w, self.model, self.mix)
        for key, value in self.imatrix.items():
            w.add_string(key, value) if isinstance(value, str) else w.add_uint32(key, value)
        for name, (shape, kind) in self.plan.items():
            w.add_tensor_info(name, [shape[0], nbytes(shape, kind) // shape[0]] if len(shape) == 2 else shape,
                              np.dtype(np.uint8) if len(shape) == 2 else np.dtype(np.float32),
                              nbytes(shape, kind), gguf.GGMLQuantizationType[kind])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        start = gguf.GGUFWriter.ggml_pad(w.fout[0].tell(), gguf.GGUF_DEFAULT_ALIGNMENT)
        # the padding written now: the header's CRC covers it, and a resumed run finds the same bytes
        w.fout[0].write(bytes(start - w.fout[0].tell()))
        w.fout[0].flush()
        w.close()
        return start

    def copied_header(self) -> int:
        """The header with the source GGUF's key-values (requant.metadata: all of them but the file type,
        quantization version and split; the alignment is the default, ours) and this file's tensors."""
        h = requant.Header(Path(self.model.source))
        # a new importance matrix's record replaces the source's whole (a computed one names no file)
        stale = [k for k in h.kv if k.startswith(IMATRIX_KEYS)] if self.imatrix else []
        kv = requant.metadata(h, self.mix, (requant.ALIGNMENT, *self.imatrix, *stale))
        kv += [requant.str_kv(k, v) if isinstance(v, str) else requant.u32_kv(k, v) for k, v in self.imatrix.items()]
        infos = [requant.tensor_info(name, shape[::-1], kind, self.offsets[name])
                 for name, (shape, kind) in self.plan.items()]
        head = requant.header(kv, infos, gguf.GGUF_DEFAULT_ALIGNMENT)
        self.staged.path.write_bytes(head)
        return len(head)

    def resumable(self, state: dict) -> bool:
        """Whether the partial file is there with the header and every tensor the state says is done."""
        path, start, done = self.staged.path, state["data_start"], state.get("done")
        if not isinstance(done, dict) or not set(done) <= set(self.plan) or not isinstance(start, int) \
                or start < 0 or not regular(path) \
                or crc(path, start) != state.get("header"):
            return False
        return all(crc(path, nbytes(*self.plan[n]), start + self.offsets[n]) == c for n, c in done.items())

    def write(self, name: str, data: np.ndarray) -> None:
        shape, kind = self.plan[name]
        if data.nbytes != nbytes(shape, kind):
            raise QuantkitError(f"{name}: {data.nbytes} bytes where a {kind} tensor of shape {shape} takes "
                                f"{nbytes(shape, kind)}: quantize it for the same GGUF types")
        self.file.seek(self.data_start + self.offsets[name])
        data = np.ascontiguousarray(data)
        self.file.write(data.data)  # no copy of the bytes
        self.done[name] = zlib.crc32(data.data)

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if tensor.dim() != 1:
            raise QuantkitError(f"{key} has no GGUF type: quantize the model for GGUF first")
        values = tensor.float().cpu().numpy()
        for suffix, n_head in self.heads.items():  # q/k biases (Llama's attention_bias) in their rows' order
            if key.endswith(f"{suffix}.bias"):
                values = permute_rows(values, n_head)
        self.write(gguf_name(key), values)

    def add_quantized(self, name: str, qt: QuantizedTensor) -> None:
        if qt.ggml is None:
            raise QuantkitError(f"{name} is not in GGUF blocks: quantize the model for GGUF (--format gguf)")
        rows = qt.codes.cpu().numpy()
        for suffix, n_head in self.heads.items():
            if name.endswith(suffix):
                rows = permute_rows(rows, n_head)
        key = gguf_name(f"{name}.weight")
        if self.plan[key][1] != qt.ggml:
            raise QuantkitError(f"{name} is {qt.ggml} where the {self.mix} file has {self.plan[key][1]}")
        self.write(key, rows)

    def state(self) -> dict:
        self.file.flush()  # the kernel has it: a kill loses nothing; the CRCs tell a power cut's loss
        return {"data_start": self.data_start, "header": self.header, "done": dict(self.done)}

    def close(self) -> Path:
        missing = [name for name in self.plan if name not in self.done]
        if missing:
            raise QuantkitError(f"{missing[0]} was never written ({len(missing)} tensors missing): the GGUF is incomplete")
        self.staged.check()  # before the file is cut to its end: a resumed run can still use it
        self.file.truncate(self.data_start + self.end)  # the last tensor's padding, as gguf-py writes it
        self.file.close()
        self.summary = f"wrote {len(self.plan)} tensors, {size(self.data_start + self.end)}"
        return self.staged.commit()

    def abort(self, keep: bool = False) -> None:
        if self.file is not None:
            self.file.close()
        self.staged.abort(keep)


def nbytes(shape: tuple[int, ...], kind: str) -> int:
    block, size = ggml.sizes(kind)
    return math.prod(shape[:-1]) * shape[-1] // block * size
