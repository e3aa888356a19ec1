"""ExLlamaV2's EXL2 checkpoint layout (quant_method "exl2"; the loader finds it by `.q_weight`).

Per quantized linear (rows are inputs, taken in the order of q_invperm's inverse):
q_weight int32 [sum of rows_g*b_g/32, N_pad] (each group's rows one little-endian b_g-bit stream per
column, N padded to 32 with code 2^(b-1)), q_scale int32 [groups, N_pad/8] (4-bit scale codes minus
one, element i at bit 4i), q_scale_max fp16 [groups], q_groups int16 [2*groups] (width, first packed
row), q_invperm int32 [K]. W[n, perm[r]] = (q - 2^(b-1)) * (c+1)^2 * q_scale_max[g] / 256.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from quantkit import __version__, measurement
from quantkit.config import QuantConfig
from quantkit.errors import QuantkitError, option
from quantkit.layers import shapes_by_name
from quantkit.modelio import Model, load_tokenizer
from quantkit.packing import pack, unpack
from quantkit.qtensor import QuantizedTensor
from quantkit.quantizers import exl2

from . import checkpoint
from .shards import DEFAULT_MAX_SIZE

PARTS = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")


def check(module: torch.nn.Module, qconfig: QuantConfig) -> None:
    """Refuse, before any work, what the layout cannot hold."""
    if qconfig.method != "gptq":
        raise QuantkitError(f"EXL2 is filled by GPTQ, not {qconfig.method}: use {option('method', 'gptq')}")
    shapes = shapes_by_name(module)
    for name, (n, k) in shapes.items():
        if k % 32:
            raise QuantkitError(f"{name} has {k} inputs: EXL2 needs a multiple of 32; choose another {option('format')}")
    if qconfig.measurement is None:  # one target for every linear: the range all of them reach
        low = max(exl2.Setting.reach(n, k)[0] for n, k in shapes.values())
        high = min(exl2.Setting.reach(n, k)[1] for n, k in shapes.values())
        if not low <= qconfig.exl2 <= high:
            raise QuantkitError(exl2.outside(option("exl2", qconfig.exl2), "every linear of this model", low, high))
    else:
        measurement.check_target(shapes, qconfig.exl2, exl2.CANDIDATES, "EXL2")
    if qconfig.head_bits is not None:
        cfg = module.config
        if cfg.tie_word_embeddings:
            raise QuantkitError(f"{option('head_bits')}: this model ties its output head to the embedding, which "
                                f"quantkit keeps in float16: drop {option('head_bits')}")
        if cfg.hidden_size % 32:
            raise QuantkitError(f"lm_head has {cfg.hidden_size} inputs: EXL2 needs a multiple of 32; drop "
                                f"{option('head_bits')}")
        try:
            exl2.Setting.for_target(qconfig.head_bits, cfg.vocab_size, cfg.hidden_size)
        except QuantkitError as e:
            raise QuantkitError(f"{option('head_bits')}: {e}") from None


def encode_scales(qt: QuantizedTensor) -> torch.Tensor:
    """The 4-bit codes c (stored c - 1, so 1..16 here) behind qt's scales, checked to give them back."""
    ratio = qt.scales.float() / qt.scale_max.float()[None, :] * 256
    codes = torch.round(torch.sqrt(ratio)).clamp(1, 16)
    if not torch.equal(exl2.scale_values(codes, qt.scale_max[None, :]), qt.scales.half()):
        raise QuantkitError("scales that are not EXL2 codes times a group maximum: quantize with "
                            f"{option('format', 'exl2')}")
    return codes.to(torch.int64)


def pack_tensor(name: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
    if qt.group_bits is None or qt.scale_max is None:
        raise QuantkitError(f"{name}: not quantized for EXL2: quantize with {option('format', 'exl2')}")
    n, k = qt.shape
    pad = exl2.padded(n) - n
    perm = torch.argsort(qt.g_idx, stable=True)  # groups in order; any order of rows within one
    rows = qt.codes[:, perm].T.contiguous()  # [K, N] in the file's row order
    widths = qt.group_bits.tolist()
    words, groups, row = [], [], 0
    for g, b in enumerate(widths):
        r = int((qt.g_idx == g).sum())
        groups += [b, sum(w.shape[0] for w in words)]
        words.append(pack(F.pad(rows[row:row + r], (0, pad), value=1 << (b - 1)), b))
        row += r
    q_scale = pack(F.pad(encode_scales(qt) - 1, (0, 0, 0, pad)), 4).T.contiguous()  # along N, element i at bit 4i
    return {"q_weight": torch.cat(words), "q_scale": q_scale,
            "q_scale_max": qt.scale_max.half(), "q_groups": torch.tensor(groups, dtype=torch.int16),
            "q_invperm": torch.argsort(perm).to(torch.int32)}


def quantization_config(qconfig: QuantConfig, bits: float, head_bits: float) -> dict:
    """bits: the decoder linears' bits per weight, as ExLlamaV2 counts them; head_bits: the head's
    (16 when it is kept in float16)."""
    return {"quant_method": "exl2", "version": "0.3.2", "bits": round(bits, 4), "head_bits": round(head_bits, 4),
            "calibration": {"quantizer": f"quantkit:{__version__}", "target": qconfig.exl2, "damp": qconfig.damp,
                            "allocation": "uniform" if qconfig.measurement is None else "measured"}}


class Writer(checkpoint.CheckpointWriter):
    """The checkpoint writer, counting the bits of the decoder linears and of the head apart for the
    config's bits and head_bits."""

    def __init__(self, model: Model, out: str | Path, qconfig: QuantConfig, overwrite: bool,
                 max_shard_size: int | str):
        super().__init__(model, out, dtype=torch.float16, pack=self.pack_counted,
                         quantization_config=self.counted_config, overwrite=overwrite, max_shard_size=max_shard_size,
                         packs_head=True)
        self.qconfig = qconfig
        self.counts = dict.fromkeys(("bits", "weights", "head_bits", "head_weights"), 0)

    def counted_config(self, _) -> dict:
        counts = self.counts
        return quantization_config(self.qconfig, counts["bits"] / max(counts["weights"], 1),
                                   counts["head_bits"] / counts["head_weights"] if counts["head_weights"] else 16)

    def pack_counted(self, name: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
        tensors = pack_tensor(name, qt)
        n, k = qt.shape
        head = "head_" if name == "lm_head" else ""
        self.counts[f"{head}bits"] += sum(t.numel() * t.element_size() * 8 for t in tensors.values())
        self.counts[f"{head}weights"] += n * k
        return tensors

    def start(self, state: dict | None = None, own: str | None = None) -> None:
        super().start(state, own)
        if state is not None:
            self.counts = dict(state["counts"])

    def state(self) -> dict:
        return {**super().state(), "counts": dict(self.counts)}


def writer(model: Model, out: str | Path, qconfig: QuantConfig, overwrite: bool = False,
           max_shard_size: int | str = DEFAULT_MAX_SIZE) -> Writer:
    """Called by exporters.open_writer, which has run check; the other tensors in float16."""
    return Writer(model, out, qconfig, overwrite, max_shard_size)


def unpack_tensor(name: str, parts: dict[str, torch.Tensor], n: int) -> QuantizedTensor:
    """An EXL2 linear's tensors back to a QuantizedTensor of n outputs."""
    invperm = parts["q_invperm"].long()
    k = invperm.shape[0]
    pairs = parts["q_groups"].long().view(-1, 2)
    widths, offsets = pairs[:, 0].tolist(), pairs[:, 1].tolist() + [parts["q_weight"].shape[0]]
    ng = len(widths)
    if parts["q_weight"].dim() != 2 or parts["q_weight"].shape[1] != exl2.padded(n):
        raise QuantkitError(f"{name}: q_weight holds {parts['q_weight'].shape[-1]} columns where the config's {n} "
                            f"outputs take {exl2.padded(n)}: the config and the weights do not agree: fix config.json or "
                            "re-export it")
    rows, sizes = [], []
    for g, b in enumerate(widths):
        words = parts["q_weight"][offsets[g]:offsets[g + 1]]
        r = words.shape[0] * 32 // b
        values = unpack(words, b)[:r]
        if (values[:, n:] != 1 << (b - 1)).any():  # the padding's code is zero: weights there are another shape's
            raise QuantkitError(f"{name}: q_weight holds weights past the config's {n} outputs: the config and the "
                                "weights do not agree: fix config.json or re-export it")
        rows.append(values[:, :n])
        sizes.append(r)
    if sum(sizes) != k or sorted(invperm.tolist()) != list(range(k)):
        raise QuantkitError(f"{name}: q_groups and q_invperm do not describe {k} inputs: the checkpoint is corrupt")
    codes16 = unpack(parts["q_scale"].T.contiguous(), 4)[:n] + 1  # [n, groups]
    scale_max = parts["q_scale_max"].half()
    scales = exl2.scale_values(codes16, scale_max[None, :])
    group_of_row = torch.repeat_interleave(torch.arange(ng), torch.tensor(sizes))
    perm = torch.argsort(invperm)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = group_of_row.to(torch.int32)
    codes = torch.empty(n, k, dtype=torch.uint8)
    codes[:, perm] = torch.cat(rows).T.to(torch.uint8)
    group_bits = torch.tensor(widths, dtype=torch.uint8)
    return QuantizedTensor(codes, scales, exl2.zeros(group_bits, n), g_idx, max(widths), max(sizes), True,
                           group_bits=group_bits, scale_max=scale_max)


def read(path: Path, packed: bool = False) -> Model:
    """Load an EXL2 checkpoint (ours or ExLlamaV2's converter's) with dequantized float weights (no
    EXL2 kernel runs here, so packed is not used)."""
    cfg, qc = checkpoint.config(path)
    state = checkpoint.read_tensors(path)
    tensors = {}
    for key in [k for k in state if k.endswith(".q_weight")]:
        name = key.removesuffix(".q_weight")
        tensors[name] = unpack_tensor(f"{path}: {name}", checkpoint.take(state, path, name, PARTS), out_features(cfg, name))
        state[f"{name}.weight"] = tensors[name].dequantize()
    # the grids are each tensor's own (group_bits); the target, ours or else the bits ExLlamaV2 counted, for a re-export
    qconfig = QuantConfig("gptq", 4, 32, exl2=(qc.get("calibration") or {}).get("target") or qc.get("bits"))
    return Model(checkpoint.build(path, cfg, state, {}), load_tokenizer(path), str(path), tensors, qconfig)


def out_features(cfg, name: str) -> int:
    """A linear's outputs from the model config (the file pads them to 32)."""
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    part = name.rsplit(".", 1)[-1]
    return {"q_proj": cfg.num_attention_heads * head, "k_proj": cfg.num_key_value_heads * head,
            "v_proj": cfg.num_key_value_heads * head, "o_proj": cfg.hidden_size, "gate_proj": cfg.intermediate_size,
            "up_proj": cfg.intermediate_size, "down_proj": cfg.hidden_size, "lm_head": cfg.vocab_size}[part]
