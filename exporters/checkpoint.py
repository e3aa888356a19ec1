"""What every safetensors checkpoint we write shares: the unquantized tensors, config.json with its
quantization_config, the tokenizer, an atomic directory; and the way back to a model."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from quantkit.errors import QuantkitError
from quantkit.config import QuantConfig
from quantkit.modelio import Model, load_tokenizer
from quantkit.qlinear import QuantLinear

from .atomic import atomic_dir
from .shards import DEFAULT_MAX_SIZE, ShardWriter


def plain_tensors(model: Model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors that are not quantized linears' weights (a tied lm_head is left out), in dtype."""
    skip = {f"{name}.weight" for name in model.tensors}
    if model.module.config.tie_word_embeddings:
        skip.add("lm_head.weight")
    return {key: t.to(dtype).contiguous() if t.is_floating_point() else t.contiguous()
            for key, t in model.module.state_dict().items() if key not in skip}


def write(model: Model, out: str | Path, overwrite: bool, tensors: dict[str, torch.Tensor], qcfg: dict,
          dtype: torch.dtype, extra: dict[str, dict] | None = None, max_shard_size: int | str = DEFAULT_MAX_SIZE) -> Path:
    """Safetensors shards of at most max_shard_size (with their index when there are several),
    config.json (with qcfg), the tokenizer and generation config, and extra JSON files; written to
    a temporary directory that becomes out when complete."""
    with atomic_dir(out, overwrite) as tmp:
        shards = ShardWriter(tmp, max_shard_size)
        for name, t in tensors.items():
            shards.add(name, t)
        files = shards.close()
        size = sum(f.stat().st_size for f in files)
        print(f"wrote {len(tensors)} tensors in {len(files)} file(s), {size / 2**20:.1f} MiB", file=sys.stderr)
        cfg = model.module.config.to_dict()
        cfg["quantization_config"] = qcfg
        cfg["dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for name, content in (extra or {}).items():
            (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
        if model.module.generation_config is not None:
            model.module.generation_config.save_pretrained(tmp)
        model.tokenizer.save_pretrained(tmp)
    return Path(out)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(f))
    return state


def model(path: Path, cfg, state: dict[str, torch.Tensor], layers: dict[str, QuantLinear], qconfig: QuantConfig,
          packed: bool) -> Model:
    """A Model from a checkpoint's plain tensors and its quantized linears (validated packed layers):
    installed as they are (packed), or unpacked into QuantizedTensors and dequantized float weights."""
    tensors = {}
    if not packed:
        for name, layer in layers.items():
            tensors[name] = layer.to_tensor()
            state[f"{name}.weight"] = tensors[name].dequantize()
            if layer.bias is not None:
                state[f"{name}.bias"] = layer.bias.data
        layers = {}
    return Model(build(path, cfg, state, layers), load_tokenizer(path), str(path), tensors, qconfig)


def build(path: Path, cfg, state: dict[str, torch.Tensor], layers: dict[str, torch.nn.Module]) -> torch.nn.Module:
    """A float32 model from a config (its quantization_config removed), a state dict and the modules
    that replace some linears. Made on the meta device and filled from state, so no weight is
    allocated twice; the buffers checkpoints do not hold (rotary frequencies) are made again."""
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    for name, layer in layers.items():
        module.set_submodule(name, layer)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if m.rsplit(".", 1)[0] not in layers
               and not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise QuantkitError(f"{path}: tensors missing {missing[:3]} / unexpected {unexpected[:3]}: re-export the checkpoint")
    module.tie_weights()
    module.model.rotary_emb = type(module.model.rotary_emb)(config=module.config)
    left = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:
        raise QuantkitError(f"{path}: {left[:3]} were not in the checkpoint: re-export it")
    return module.eval()
