"""What every safetensors checkpoint we write shares: the unquantized tensors, config.json with its
quantization_config, the tokenizer, an atomic directory; and the way back to a model."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from quantkit.errors import QuantkitError
from quantkit.modelio import Model

from .atomic import atomic_dir


def plain_tensors(model: Model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors that are not quantized linears' weights (a tied lm_head is left out), in dtype."""
    skip = {f"{name}.weight" for name in model.tensors}
    if model.module.config.tie_word_embeddings:
        skip.add("lm_head.weight")
    return {key: t.to(dtype).contiguous() if t.is_floating_point() else t.contiguous()
            for key, t in model.module.state_dict().items() if key not in skip}


def write(model: Model, out: str | Path, overwrite: bool, tensors: dict[str, torch.Tensor], qcfg: dict,
          dtype: torch.dtype, extra: dict[str, dict] | None = None) -> Path:
    """One model.safetensors, config.json (with qcfg), the tokenizer and generation config, and
    extra JSON files; written to a temporary directory that becomes out when complete."""
    with atomic_dir(out, overwrite) as tmp:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        size = (tmp / "model.safetensors").stat().st_size
        print(f"wrote model.safetensors ({size / 2**20:.1f} MiB, {len(tensors)} tensors)", file=sys.stderr)
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


def build(path: Path, cfg, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A float32 model from a config (its quantization_config removed) and a full state dict."""
    module = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = module.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise QuantkitError(f"{path}: tensors missing {missing[:3]} / unexpected {unexpected[:3]}: re-export the checkpoint")
    module.tie_weights()
    return module.eval()
