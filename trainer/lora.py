"""LoRA (Hu et al. 2021) on frozen linears, float or our NF4, with DoRA (Liu et al. 2024) and
rsLoRA scaling; adapters saved and read in PEFT's format (adapter_config.json written by PEFT's own
LoraConfig, adapter_model.safetensors with PEFT's key names)."""
from __future__ import annotations

import hashlib
import json
import math
import os
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save as serialize

from quantkit.errors import QuantkitError, option, untrusted
from quantkit.layers import LINEARS
from quantkit.qlinear import NF4Linear, QuantLinear
from quantkit.quantizers import nf4

from .config import TrainConfig

PREFIX = "base_model.model."  # PEFT's path to the wrapped model
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


class Dropout(torch.nn.Module):
    """Dropout whose mask for each example depends only on that example's seed and this layer's
    salt (from its name): the masks are the same however a batch is split over processes or padded, so two
    processes repeat one. The loop sets `examples` (a seed and a length each) before each forward."""

    def __init__(self, p: float, salt: int):
        super().__init__()
        self.p, self.salt = p, salt
        self.examples: list[tuple[int, int]] = []

    @torch.compiler.disable  # seeding a generator breaks torch.compile's graph at every example anyway
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        if len(self.examples) != x.shape[0]:
            raise RuntimeError(f"dropout has seeds for {len(self.examples)} examples, the batch holds {x.shape[0]}")
        keep = torch.zeros(x.shape, dtype=torch.bool, device=x.device)  # saved for backward: a byte a value
        for row, (seed, length) in zip(keep, self.examples):
            key = hashlib.blake2b(f"{seed}/{self.salt}".encode(), digest_size=8).digest()
            g = torch.Generator(x.device).manual_seed(int.from_bytes(key, "little") >> 1)
            row[:length] = torch.rand(length, x.shape[-1], generator=g, device=x.device) >= self.p  # real tokens only
        return x * keep / (1 - self.p)


def seed_examples(layers: dict[str, "LoraLinear"], examples: list[tuple[int, int]]) -> None:
    """The (seed, length) of each example of the next forward, for every layer's dropout."""
    for layer in layers.values():
        if isinstance(layer.dropout, Dropout):
            layer.dropout.examples = examples


class LoraLinear(torch.nn.Module):
    """y = base(x) + scale * B A dropout(x); with DoRA the whole weight W + scale*BA is renormalized
    per output row to a trained magnitude m: y = m / ||W + scale*BA|| * (W x + scale*BA x) + bias, the
    norm detached (DoRA section 4.3), as PEFT computes it."""

    def __init__(self, base: torch.nn.Module, rank: int, scale: float, dropout: float = 0.0, dora: bool = False,
                 salt: int = 0):
        super().__init__()
        self.base, self.scale = base, scale
        base.requires_grad_(False)
        w = self.weight()
        self.lora_A = torch.nn.Linear(base.in_features, rank, bias=False, device=w.device)
        self.lora_B = torch.nn.Linear(rank, base.out_features, bias=False, device=w.device)
        torch.nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's init: B = 0, so BA = 0
        torch.nn.init.zeros_(self.lora_B.weight)
        self.dropout = Dropout(dropout, salt) if dropout else torch.nn.Identity()
        self.magnitude = torch.nn.Parameter(w.norm(dim=1)) if dora else None

    def weight(self) -> torch.Tensor:
        """The frozen base weight, float32 (NF4: dequantized)."""
        return self.base.dequantize() if isinstance(self.base, QuantLinear) else self.base.weight.float()

    def delta(self) -> torch.Tensor:
        return self.scale * (self.lora_B.weight.float() @ self.lora_A.weight.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        h = self.dropout(x)
        lora = self.lora_B(self.lora_A(h)) * self.scale
        if self.magnitude is None:
            return y + lora
        with torch.no_grad():  # in float32, as the magnitudes were taken: at BA = 0 the ratio is 1 under autocast too
            norm = (self.weight() + self.delta()).norm(dim=1)
        ratio = self.magnitude / norm
        # through the base: F.linear(h, W) kept W (QLoRA: dequantized) in the graph until the backward
        plain = y if isinstance(self.dropout, torch.nn.Identity) else self.base(h)
        bias = self.base.bias
        return y + (ratio - 1) * (plain - bias if bias is not None else plain) + ratio * lora


def merged(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, magnitude: torch.Tensor | None = None) -> torch.Tensor:
    """The weight a LoRA layer computes with: W + scale*BA, for DoRA renormalized per output row to
    the magnitudes; float32."""
    w = w.float() + scale * (b.float() @ a.float())
    return w if magnitude is None else w * (magnitude.float() / w.norm(dim=1))[:, None]


def quantize_nf4(linear: torch.nn.Linear, block: int) -> NF4Linear:
    """QLoRA's frozen base: NF4 with double quantization, bitsandbytes' bytes exactly."""
    qt = nf4.quantize(linear.weight.detach().float(), "nf4", block, double_quant=True)
    return NF4Linear.from_tensor(qt, linear.bias)


def decoder_linears(module: torch.nn.Module) -> list[str]:
    return [f"model.layers.{i}.{name}" for i in range(len(module.model.layers)) for name in LINEARS]


def targets(module: torch.nn.Module, target: list[str]) -> list[str]:
    """The linears that target names: all-linear (every decoder linear, not lm_head, as PEFT), or
    module names matched as PEFT does (the whole name, or its last parts)."""
    linears = decoder_linears(module)
    if "all-linear" in target:  # beside other names too: they are among all
        return linears
    found = [n for n in linears if any(n == t or n.endswith("." + t) for t in target)]
    missing = [t for t in target if not any(n == t or n.endswith("." + t) for n in linears)]
    if missing:
        kinds = sorted({n.split(".")[-1] for n in linears})
        raise QuantkitError(f"{option('target', ','.join(missing))} matches no linear of this model: use all-linear or some "
                            f"of {', '.join(kinds)}")
    return found


def check(module: torch.nn.Module, config: TrainConfig) -> list[str]:
    """The linears config targets, each big enough for its rank (works on a meta skeleton)."""
    names = targets(module, config.target)
    for name in names:
        base = module.get_submodule(name)
        most = min(base.in_features, base.out_features)
        if not config.rank <= most:
            raise QuantkitError(f"{option('rank', config.rank)} is larger than {name} ({base.out_features}x"
                                f"{base.in_features}): use a rank of at most {most}")
    return names


def inject(module: torch.nn.Module, config: TrainConfig, names: list[str]) -> dict[str, LoraLinear]:
    """Replace the named linears by LoRA layers (QLoRA: on NF4 copies of them), frozen but for the adapter."""
    layers = {}
    for name in names:
        base = module.get_submodule(name)
        if config.method == "qlora":
            base = quantize_nf4(base, config.nf4_block)
        layers[name] = LoraLinear(base, config.rank, config.scale, config.dropout, config.dora,
                                   salt=zlib.crc32(name.encode())).train(module.training)  # as its model is
        module.set_submodule(name, layers[name])
    return layers


def parameters(layers: dict[str, LoraLinear]) -> dict[str, torch.nn.Parameter]:
    """The trained parameters under PEFT's names."""
    params = {}
    for name, layer in layers.items():
        params[f"{PREFIX}{name}.lora_A.weight"] = layer.lora_A.weight
        params[f"{PREFIX}{name}.lora_B.weight"] = layer.lora_B.weight
        if layer.magnitude is not None:
            params[f"{PREFIX}{name}.lora_magnitude_vector"] = layer.magnitude
    return params


def adapter_state(layers: dict[str, LoraLinear]) -> dict[str, torch.Tensor]:
    """The trained tensors under PEFT's names, float32 on the CPU: copies, since early stopping keeps
    the best step's while training goes on. Under FSDP every process must call it (it gathers)."""
    return {k: whole(v).detach().to("cpu", torch.float32, copy=True) for k, v in parameters(layers).items()}


def whole(t: torch.Tensor) -> torch.Tensor:
    """t itself, or all of a tensor FSDP shards over the processes (gathered)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """t (whole) as p holds it: p's shard of it under FSDP."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    return distribute_tensor(t.to(p.device), p.device_mesh, p.placements) if isinstance(p, DTensor) else t


def load_state(layers: dict[str, LoraLinear], state: dict[str, torch.Tensor], source: str) -> None:
    """Copy an adapter's tensors into layers; every key used, every shape right."""
    params = parameters(layers)
    if set(params) != set(state):
        extra, missing = sorted(set(state) - set(params)), sorted(set(params) - set(state))
        raise QuantkitError(f"{source} does not fit this model: {len(missing)} tensors missing (first: "
                            f"{(missing or ['-'])[0]}), {len(extra)} unexpected (first: {(extra or ['-'])[0]}): "
                            "use the base model and settings it was trained with")
    for key, p in params.items():
        if state[key].shape != p.shape:
            raise QuantkitError(f"{source}: {key} is {tuple(state[key].shape)}, but this model needs {tuple(p.shape)}: "
                                "use the base model it was trained on")
        with torch.no_grad():
            p.copy_(like(state[key], p))


def peft_config(config: TrainConfig, names: list[str], linears: list[str], base: str):
    """PEFT's LoraConfig for LoRA layers on names (of the model's decoder linears): target_modules
    as kinds (q_proj, ...) when every linear of those kinds has one, else as full names."""
    from peft import LoraConfig

    kinds = sorted({n.split(".")[-1] for n in names})
    every = [n for n in linears if n.split(".")[-1] in kinds] == names
    return LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                      target_modules=kinds if every else names,
                      use_rslora=config.rslora, use_dora=config.dora, task_type="CAUSAL_LM",
                      base_model_name_or_path=base, inference_mode=True)


def save(directory: Path, module: torch.nn.Module, adapter: dict[str, torch.Tensor], config: TrainConfig, base: str) -> None:
    """adapter_config.json and adapter_model.safetensors (the tensors of adapter_state) in directory (a
    staged output, renamed into place when complete), as PEFT writes them."""
    (directory / WEIGHTS).write_bytes(serialize(adapter, metadata={"format": "pt"}))  # full disk: OSError
    names = [k[len(PREFIX):-len(".lora_A.weight")] for k in adapter if k.endswith(".lora_A.weight")]
    cfg = peft_config(config, names, decoder_linears(module), base).to_dict()
    cfg["target_modules"] = sorted(cfg["target_modules"])
    cfg["peft_type"] = cfg["peft_type"].value  # PeftType, a str enum: its value is what PEFT writes
    (directory / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")


def is_adapter(directory: str | os.PathLike) -> bool:
    """Whether directory holds an adapter's two files (ours or PEFT's)."""
    return (Path(directory) / CONFIG).is_file() and (Path(directory) / WEIGHTS).is_file()


def read(directory: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """An adapter directory (ours or PEFT's): its config as a dict and its tensors under PEFT's names."""
    d = Path(directory)
    if not is_adapter(d):
        raise QuantkitError(f"{d}: no {CONFIG} and {WEIGHTS}: pass a LoRA adapter directory (what quantkit train "
                            "--out or train(out=...) wrote)")
    with untrusted(d, "the adapter is damaged", "train it again or restore it"):
        cfg = json.loads((d / CONFIG).read_text())
        tensors = load_file(d / WEIGHTS)
        kind = cfg.get("peft_type")
    if kind != "LORA":
        raise QuantkitError(f"{d}: a {kind} adapter: quantkit reads LoRA adapters" if kind is not None else
                            f"{d}: its {CONFIG} names no peft_type: pass a PEFT LoRA adapter directory")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and (init.startswith("pissa") or init in ("olora", "corda", "loftq", "lora_ga")):
        # PEFT subtracts these from the base when it loads them: on the base as saved, B A alone is wrong
        raise QuantkitError(f"{d}: the adapter was initialized with {init}, which changes the base weights it goes onto: "
                            "save it with PEFT's conversion to a plain LoRA (save_pretrained with "
                            "path_initial_model_for_weight_conversion), or merge it with PEFT")
    bad = next((k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)
    if bad is not None:
        raise QuantkitError(f"{d}: {bad} holds NaN or Inf (the training diverged): train it again with a lower "
                            "learning rate")
    # PEFT writes ".lora_A.weight"; some older saves keep the adapter name (".lora_A.default.weight")
    tensors = {k.replace(".default.", ".").removesuffix(".default"): v for k, v in tensors.items()}
    return cfg, tensors


def config_of(cfg: dict) -> TrainConfig:
    """The TrainConfig an adapter's PEFT config describes (LoRA settings only). Settings no adapter has
    are a ValueError in PEFT's names: TrainConfig's own refusal would name train's options."""
    target = cfg.get("target_modules") or ["all-linear"]
    if isinstance(target, str):
        target = [target]
    try:
        return TrainConfig(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]),
                           dropout=float(cfg.get("lora_dropout") or 0), target=list(target),
                           dora=bool(cfg.get("use_dora")), rslora=bool(cfg.get("use_rslora")))
    except QuantkitError:
        raise ValueError(f"r={cfg['r']}, lora_alpha={cfg['lora_alpha']}, lora_dropout={cfg.get('lora_dropout')} "
                         "are not LoRA settings") from None
