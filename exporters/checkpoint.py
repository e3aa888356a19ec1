"""What every safetensors checkpoint we write shares: shards written as tensors arrive, config.json
with its quantization_config, the tokenizer, the base's licence and a model card, a directory that
appears when complete; and the way back to a model."""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from quantkit.errors import QuantkitError, option, size
from quantkit.config import QuantConfig
from quantkit.layers import LINEARS
from quantkit import __version__
from quantkit.modelio import (DEFAULT_NAME, Model, cache_dir, check_config, finite, load_tokenizer, reading,
                              shard_files, stored_state)
from quantkit.qlinear import GPTQLinear, QuantLinear
from quantkit.qtensor import QuantizedTensor
from quantkit.rules import Rule, exact

from quantkit.atomic import Staged
from .shards import DEFAULT_MAX_SIZE, ShardWriter, state_intact


class CheckpointWriter:
    """A safetensors checkpoint written as results arrive (quantkit.pipeline.Writer): shards of at most
    max_shard_size (with their index when there are several); at close, config.json (with the
    quantization_config), the tokenizer, the generation config, and config_copies: more JSON files
    holding the quantization_config alone. pack turns one quantized linear into its tensors by suffix;
    the other tensors are stored in dtype. quantization_config makes the config from the writer once
    every tensor is in (act_order, head); qconfig: the rules that leave linears in float (--rules).
    A quantized lm_head (read from a checkpoint that has one) is packed where the layout's consumers
    load one (packs_head), and written dequantized where they take lm_head in float."""

    def __init__(self, model: Model, out: str | Path, *, dtype: torch.dtype,
                 pack: Callable[[str, QuantizedTensor], dict[str, torch.Tensor]],
                 quantization_config: Callable[[CheckpointWriter], dict], config_copies: tuple[str, ...] = (),
                 overwrite: bool = False, max_shard_size: int | str = DEFAULT_MAX_SIZE, packs_head: bool = False,
                 qconfig: QuantConfig | None = None):
        self.staged = Staged(out, overwrite)
        self.qconfig = qconfig
        self.model, self.dtype, self.pack = model, dtype, pack
        self.quantization_config, self.config_copies = quantization_config, config_copies
        self.max_shard_size, self.packs_head = max_shard_size, packs_head
        self.shards: ShardWriter | None = None
        self.act_order = False
        self.head: tuple[int, int] | None = None  # the packed lm_head's bits and group size
        self.summary = ""

    @property
    def written(self) -> int:
        return self.shards.total if self.shards else 0

    def start(self, state: dict | None = None, own: str | None = None) -> None:
        if state is None:
            self.check_range()
            self.staged.fresh(own)
        self.shards = ShardWriter(self.staged.path, self.max_shard_size)
        if state is not None:
            self.shards.resume(state["shards"])
            self.act_order = state["act_order"]
            self.head = tuple(state["head"]) if state.get("head") else None

    def resumable(self, state: dict) -> bool:
        path = self.staged.path  # resuming writes into it: a symbolic link planted there is not resumed
        return path.is_dir() and not path.is_symlink() and state_intact(path, state["shards"])

    def check_range(self) -> None:
        """Before any layer is quantized: what the layout keeps in float (norms, biases, the embedding,
        the head, the linears rules skip) within the dtype this one stores it in."""
        if not self.narrow():
            return
        cp = self.model.checkpoint
        state = stored_state(self.model.module) if cp is None else None
        for key in cp.where if cp is not None else state:
            if self.floats(key):
                self.check(key, state[key] if cp is None else cp.read({key: cp.shapes[key]})[key])

    def floats(self, key: str) -> bool:
        """Whether the tensor at key is stored in float, not quantized."""
        name = key.removesuffix(".weight")
        return not name.endswith(LINEARS) or (self.qconfig is not None and key.endswith(".weight")
                                              and self.qconfig.for_linear(name) is None)

    def narrow(self) -> bool:
        """Whether the stored dtype is narrower than a checkpoint's (float16; float32 and bfloat16 hold all)."""
        return torch.finfo(self.dtype).max < 1e38

    def check(self, key: str, tensor: torch.Tensor) -> None:
        """A finite tensor stored as inf would be refused as damaged when the export is read."""
        if tensor.is_floating_point() and self.narrow() and any(c.to(self.dtype).isinf().any() for c in tensor.reshape(-1).split(2**24)) \
                and finite(tensor):
            skipped = f"quantize it (the rules skip it: {option('rules')}), or " if key.removesuffix(".weight").endswith(LINEARS) else ""
            raise QuantkitError(f"{key} holds values up to {float(tensor.abs().max()):.3g}, past what {self.dtype} "
                                f"holds, the dtype this layout stores what it does not quantize in: {skipped}use NF4 "
                                "(its layout keeps the checkpoint's dtype) or GGUF")

    def add(self, key: str, tensor: torch.Tensor) -> None:
        self.check(key, tensor)
        self.shards.add(key, tensor.to(self.dtype) if tensor.is_floating_point() else tensor)

    def add_quantized(self, name: str, qt: QuantizedTensor) -> None:
        if name == "lm_head" and not self.packs_head:
            self.add("lm_head.weight", qt.dequantize())
            return
        if name == "lm_head":
            self.head = (qt.bits, qt.group_size)
        self.act_order |= qt.act_order
        for suffix, t in self.pack(name, qt).items():
            self.shards.add(f"{name}.{suffix}", t)

    def state(self) -> dict:
        return {"shards": self.shards.state(), "act_order": self.act_order, "head": self.head}

    def close(self) -> Path:
        self.staged.check()  # before the last shard is written: a resumed run can still use the spill
        tmp = self.staged.path
        files = self.shards.close()
        self.summary = f"wrote {len(self.shards.names)} tensors in {len(files)} file(s), " \
                       f"{size(sum(f.stat().st_size for f in files))}"
        qcfg = self.quantization_config(self)
        # the keys save_pretrained writes: to_dict adds the source's local path (_name_or_path) and base defaults
        cfg = self.model.module.config.to_diff_dict()
        # a config saved without a model lacks it, and ExLlamaV2's loader (among others) needs it
        cfg["architectures"] = cfg.get("architectures") or [type(self.model.module).__name__]
        legacy_rope(cfg)
        cfg["quantization_config"] = qcfg
        cfg["dtype"] = str(self.dtype).removeprefix("torch.")
        # top-level keys sorted; nested ones as made: dynamic's rules are read first match first
        (tmp / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
        for name in self.config_copies:
            (tmp / name).write_text(json.dumps(qcfg, indent=2) + "\n")
        if self.model.module.generation_config is not None:
            self.model.module.generation_config.save_pretrained(tmp)
        self.model.tokenizer.save_pretrained(tmp)
        for f in licences(self.model.source):
            shutil.copy2(f, tmp / f.name)
        (tmp / "README.md").write_text(card(self.model.source, qcfg))
        return self.staged.commit(self.shards.scratch())

    def abort(self, keep: bool = False) -> None:
        if self.shards is not None:
            self.shards.release()
        self.staged.abort(keep)


LICENCES = re.compile(r"(LICEN[CS]E|NOTICE|USE_POLICY)([.-][\w.-]*)?", re.IGNORECASE)  # a model's terms of use


def licences(source: str | os.PathLike) -> list[Path]:
    """The licence files beside a model's weights (LICENSE, NOTICE, Llama's USE_POLICY.md): its terms go
    with every copy of the weights, quantized too."""
    d = Path(source)
    return sorted(f for f in d.iterdir() if f.is_file() and LICENCES.fullmatch(f.name)) if d.is_dir() else []


EMBEDDED = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded model's (modelio.default_model_dir) name on the Hub
LICENSING = ("license", "license_name", "license_link")  # a model card's fields that name its terms


def card(source: str, qcfg: dict) -> str:
    """README.md of an export: a model card that says what it is and, in the metadata the Hub reads,
    keeps the source's licence and names the model it was quantized from (base_model, with
    base_model_relation quantized: the Hub lists it among that model's quantizations). The base is
    known where the source's path or card names it: the Hub's cache (models--org--name), the
    embedded model, a quantized source's own card."""
    from huggingface_hub import ModelCardData

    data = source_card(source)
    base = data.get("base_model") if data.get("base_model_relation") == "quantized" else hub_name(source)
    fields = {k: data[k] for k in LICENSING if data.get(k)}
    if base:
        fields.update(base_model=base, base_model_relation="quantized")
    layout = qcfg["quant_method"]
    layout = getattr(layout, "value", layout)  # bitsandbytes' config gives an enum, json a string
    meta = ModelCardData(library_name="transformers", tags=["quantkit", layout], **fields)
    bits = qcfg.get("bits") or (4 if qcfg.get("load_in_4bit") else None)
    of = f" of [{base}](https://huggingface.co/{base})" if base else ""
    title = f"{base.split('/')[-1]}, quantized" if base else "A quantized model"  # no path's name: copies are alike
    grid = f"{bits:g}-bit " if bits else ""
    return (f"---\n{meta.to_yaml()}\n---\n\n# {title}\n\nA {grid}quantization{of} in the {layout} layout, "
            f"made by quantkit {__version__}: config.json's quantization_config holds its settings.\n")


def source_card(source: str) -> dict:
    """The metadata of the model card beside a model's weights ({} without one)."""
    from huggingface_hub import ModelCard

    readme = Path(source) / "README.md"
    try:
        return ModelCard.load(readme).data.to_dict() if readme.is_file() else {}
    except Exception:  # a card this parser does not read: an export's says what it knows without it
        return {}


def hub_name(source: str) -> str | None:
    """The Hub's name of the model at source, where its path says it."""
    p = Path(source).resolve()
    if p == (cache_dir() / DEFAULT_NAME).resolve():
        return EMBEDDED
    for part in reversed(p.parts):
        if m := re.fullmatch(r"models--([\w.-]+)--([\w.-]+)", part):
            return f"{m[1]}/{m[2]}"
    return None


def legacy_rope(cfg: dict) -> None:
    """Add rope_theta (and rope_scaling for a scaled rope) beside transformers 5's rope_parameters:
    ExLlamaV2 and loaders on transformers 4 read only those, and without them run a base of 10000."""
    rope = cfg.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope:  # none, or one per layer type
        return
    cfg.setdefault("rope_theta", rope["rope_theta"])
    if rope.get("rope_type", "default") != "default" and not cfg.get("rope_scaling"):
        # rope_type alone: ExLlamaV2 refuses a rope_scaling holding both type and rope_type
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}


# where older AutoGPTQ and AutoAWQ checkpoints keep their quantization config, config.json having none
SIDE_CONFIGS = {"quantize_config.json": "gptq", "quant_config.json": "awq"}


def side_config(path: Path) -> dict | None:
    """The quantization config of an older AutoGPTQ or AutoAWQ checkpoint, from its own file beside
    config.json, with its quant_method; None where there is none."""
    for name, method in SIDE_CONFIGS.items():
        if (path / name).is_file():
            qc = json.loads((path / name).read_text())
            if not isinstance(qc, dict):
                raise ValueError(f"{name} is not an object")
            return {"quant_method": method, **qc}
    return None


def config(path: Path) -> tuple[object, dict]:
    """A quantized checkpoint's model config, its quantization config taken out (transformers would
    hand that to the quantizer's own library), and that quantization config (side_config's where
    config.json has none)."""
    cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)
    qc = getattr(cfg, "quantization_config", None)
    if qc is None:
        return cfg, side_config(path)
    del cfg.quantization_config
    return cfg, qc


def rules_read(layers: dict[str, GPTQLinear | QuantizedTensor], state: dict[str, torch.Tensor], bits: int,
               group_size: int) -> tuple[Rule, ...]:
    """Rules by exact name under which a model read from a checkpoint exports again as it was read:
    one per setting other than the run's (bits, group size), for the decoder linears read at it, and
    one skipping the decoder linears held in float (GPTQModel's dynamic, AutoAWQ's
    modules_to_not_convert, compressed-tensors' ignore)."""
    other: dict[tuple[int, int], list[str]] = {}
    for name, layer in layers.items():
        if ".layers." in name and (layer.bits, layer.group_size) != (bits, group_size):
            other.setdefault((layer.bits, layer.group_size), []).append(name)
    floats = [k.removesuffix(".weight") for k in state
              if k.endswith(".weight") and ".layers." in k and k.removesuffix(".weight").endswith(LINEARS)]
    rules = [Rule(exact(names), b, g) for (b, g), names in other.items()]
    return tuple(rules + ([Rule(exact(floats), skip=True)] if floats else []))


def half_scales(scales: torch.Tensor, path: Path, name: str) -> torch.Tensor:
    """A checkpoint's scales as float16, as a QuantizedTensor holds them. bfloat16 ones (llm-compressor's
    for a bfloat16 model) and float32 ones round to within 2^-11 of themselves inside float16's normal
    range; outside it they lose more, or overflow, and are named."""
    half = scales.half()
    if scales.dtype != torch.float16:
        f = scales.float()
        a = f.abs()
        out = (a > torch.finfo(torch.float16).max) | ((a > 0) & (a < torch.finfo(torch.float16).tiny))
        if out.any():
            worst = ((half.float() - f).abs() / a.clamp(min=1e-30)).max().item()
            warnings.warn(f"{path}: {int(out.sum())} of {name}'s {str(scales.dtype).removeprefix('torch.')} scales lie "
                          f"outside float16's normal range ({a[out].min().item():.3g} to {a[out].max().item():.3g}), where "
                          f"quantkit holds them: they move by up to {worst:.2g} of themselves, and their weights alike")
    return half


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's files (modelio.shard_files); a name found in two files is refused,
    since which one a loader takes is then a matter of file order."""
    state = {}
    for f in shard_files(path):
        with reading(f):
            tensors = load_file(f)
        twice = sorted(state.keys() & tensors.keys())
        if twice:
            raise QuantkitError(f"{path}: tensor {twice[0]} is in {f.name} and in another file: remove the file "
                                "that does not belong to this checkpoint")
        state.update(tensors)
    return state


def take(state: dict[str, torch.Tensor], path: Path, name: str, parts: Sequence[str]) -> dict[str, torch.Tensor]:
    """The tensors {name}.{part} of a packed linear, taken out of state; a missing one is refused."""
    missing = next((p for p in parts if f"{name}.{p}" not in state), None)
    if missing is not None:
        raise QuantkitError(f"{path}: {name} lacks {name}.{missing}: the checkpoint is incomplete; re-export it")
    return {p: state.pop(f"{name}.{p}") for p in parts}


def model(path: Path, cfg, state: dict[str, torch.Tensor], layers: dict[str, QuantLinear | QuantizedTensor],
          qconfig: QuantConfig, packed: bool) -> Model:
    """A Model from a checkpoint's plain tensors and its quantized linears: validated packed layers, or
    the grids of a layout the kernels do not read (AWQ's, compressed-tensors'; their biases left in
    state). Packed: the layers installed as they are, the grids repacked into GPTQ layers where that
    layout holds them and held in float where it does not (inputs not a multiple of 32: those formats
    take any whole groups). Else: all unpacked into QuantizedTensors and dequantized float weights."""
    tensors = {}
    for name, layer in list(layers.items()):
        if packed and isinstance(layer, QuantizedTensor):
            if layer.shape[1] % 32 == 0 and layer.shape[0] * layer.bits % 32 == 0:
                layers[name] = GPTQLinear.from_tensor(layer, state.pop(f"{name}.bias", None), name=f"{path}: {name}")
            else:
                state[f"{name}.weight"] = layers.pop(name).dequantize()
        elif not packed:
            tensors[name] = layer if isinstance(layer, QuantizedTensor) else layer.to_tensor()
            state[f"{name}.weight"] = tensors[name].dequantize()
            if isinstance(layer, QuantLinear) and layer.bias is not None:
                state[f"{name}.bias"] = layer.bias.data
    return Model(build(path, cfg, state, {} if not packed else layers), load_tokenizer(path), str(path), tensors, qconfig)


def build(path: Path, cfg, state: dict[str, torch.Tensor], layers: dict[str, torch.nn.Module]) -> torch.nn.Module:
    """A float32 model from a config (its quantization_config removed), a state dict and the modules
    that replace some linears. Made on the meta device and filled from state, so no weight is
    allocated twice; the buffers checkpoints do not hold (rotary frequencies) are made again."""
    # older checkpoints hold the rotary frequencies, which are made again here (transformers ignores them)
    for k in [k for k in state if k.endswith("rotary_emb.inv_freq")]:
        del state[k]
    head, embed = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if cfg.tie_word_embeddings and ("lm_head" in layers or head is not None and (
            embed is None or head.shape != embed.shape or not torch.equal(head, embed))):
        # a head of its own (ExLlamaV2's converter quantizes a tied one): run it, as its consumers do, not the embedding
        cfg.tie_word_embeddings = False
    shapes = {k: tuple(v.shape) for k, v in state.items()} | \
        {f"{name}.weight": (layer.out_features, layer.in_features) for name, layer in layers.items()}
    check_config(cfg, shapes, path)
    for name, t in [*state.items(), *((f"{n}.{k}", t) for n, layer in layers.items() for k, t in layer.state_dict().items())]:
        if not finite(t):
            raise QuantkitError(f"{path}: {name} contains NaN or Inf: the checkpoint is damaged; re-export it")
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    for name, layer in layers.items():
        made = module.get_submodule(name)
        if (made.out_features, made.in_features) != (layer.out_features, layer.in_features):
            raise QuantkitError(f"{path}: {name} holds {layer.out_features} x {layer.in_features} weights where "
                                f"config.json makes it {made.out_features} x {made.in_features}: the config and the "
                                "weights do not agree: fix config.json or re-export it")
        module.set_submodule(name, layer)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if m.rsplit(".", 1)[0] not in layers
               and not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise QuantkitError(f"{path}: tensors missing {missing[:3]} / unexpected {unexpected[:3]}: re-export the checkpoint")
    module.tie_weights()
    module.model.rotary_emb = type(module.model.rotary_emb)(config=module.config)
    if (path / "generation_config.json").is_file():  # from_config makes a default one: sampling settings lost
        module.generation_config = GenerationConfig.from_pretrained(path)
    left = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:
        raise QuantkitError(f"{path}: {left[:3]} were not in the checkpoint: re-export it")
    return module.eval()
