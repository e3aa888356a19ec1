"""The pipeline as plain function calls; the CLI is a thin layer over these."""
from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import torch

from quantkit import calibration, evals, exporters

from .config import QuantConfig
from .modelio import Model, load
from .pipeline import Hessian, awq_layer, quantize_layers
from .qtensor import QuantizedTensor
from .quantizers import gptq, nf4, rtn

PathLike = str | os.PathLike


def quantizer(qconfig: QuantConfig, losses: dict[str, float]):
    """The per-linear core for a method: (name, weight, hessian or None) -> QuantizedTensor; None for
    AWQ, which quantizes whole layers. GPTQ's per-linear losses are recorded in losses."""
    c = qconfig

    def quantize_rtn(name: str, w: torch.Tensor, h: Hessian | None) -> QuantizedTensor:
        return rtn.quantize(w, c.bits, c.group_size, c.sym, c.mse)

    def quantize_gptq(name: str, w: torch.Tensor, h: Hessian | None) -> QuantizedTensor:
        if h is None or h.count == 0:
            warnings.warn(f"{name}: no calibration input reached it, so it was quantized with RTN")
            return quantize_rtn(name, w, h)
        r = gptq.quantize(w, h.matrix(), c.bits, c.group_size, c.sym, damp=c.damp, block_size=c.block_size,
                          act_order=c.act_order, static_groups=c.static_groups, mse=c.mse,
                          group_aware=c.group_aware, name=name)
        losses[name] = r.loss
        return r.tensor

    def quantize_codebook(name: str, w: torch.Tensor, h: Hessian | None) -> QuantizedTensor:
        return nf4.quantize(w, c.method, c.block_size, c.double_quant)

    return {"rtn": quantize_rtn, "gptq": quantize_gptq, "nf4": quantize_codebook, "fp4": quantize_codebook}.get(c.method)


def quantize(
    model: Model | PathLike | None = None,
    method: str = "rtn",
    bits: int = 4,
    group_size: int = 128,
    sym: bool | None = None,
    damp: float = 0.01,
    block_size: int | None = None,
    act_order: bool = False,
    static_groups: bool = False,
    true_sequential: bool = True,
    mse: bool = False,
    group_aware: bool = False,
    double_quant: bool = False,
    duo_scaling: bool = False,
    calib_data: PathLike | None = None,
    calib_samples: int = 128,
    calib_seqlen: int = 512,
    seed: int = 0,
    out: PathLike | None = None,
    format: str = "safetensors",
    overwrite: bool = False,
    progress: bool = True,
) -> Model:
    """Quantize a model (a loaded Model is changed in place; a path or None loads one) and,
    with out, export it. Every check that can fail runs before the long work starts.
    damp, act_order, static_groups, true_sequential and group_aware are GPTQ's; mse (search the
    clipping range) serves RTN and GPTQ; block_size is GPTQ's columns per lazy batch (128) or
    NF4/FP4's values per absmax block (64); double_quant is NF4/FP4's, duo_scaling AWQ's. sym=None
    is asymmetric for AWQ (as AWQ does), symmetric otherwise."""
    qconfig = QuantConfig(method, bits, group_size, sym, damp, block_size, act_order, static_groups, true_sequential,
                          mse, group_aware, double_quant, duo_scaling)
    if out is not None:
        exporters.check_out(out, overwrite)
    m = model if isinstance(model, Model) else load(model)
    if out is not None:
        exporters.check_format(format, m.module, qconfig)
    windows = None
    if qconfig.needs_calibration:
        text = calibration.load_text(calib_data)
        windows = calibration.sample_windows(m.tokenizer, text, calib_samples, calib_seqlen, seed)
    resume = None
    if out is not None and windows is not None:  # saved beside the output: an interrupted run goes on
        key = hashlib.sha256(f"{m.source}|{qconfig}".encode() + windows.numpy().tobytes()).hexdigest()
        resume = (Path(out).with_name(f".{Path(out).name}.progress.pt"), key)
    m.losses = {}
    layer_fn = None
    if qconfig.method == "awq":
        c = qconfig

        def layer_fn(i, layer, batches):
            return awq_layer(layer, batches, c.bits, c.group_size, c.sym, c.duo_scaling, prefix=f"model.layers.{i}.")

    m.tensors = quantize_layers(m, quantizer(qconfig, m.losses), windows, sequential=true_sequential,
                                progress=progress, resume=resume, layer_fn=layer_fn)
    m.qconfig = qconfig
    if out is not None:
        export(m, out, format, overwrite)
        if resume:
            resume[0].unlink(missing_ok=True)
    return m


def evaluate(
    model: Model | PathLike | None = None,
    data: PathLike | None = None,
    protocol: str = "llamacpp",
    ctx: int = 512,
    max_windows: int | None = None,
    progress: bool = True,
) -> evals.Perplexity:
    """Perplexity of a model (or a model path, or the embedded default) on a text file."""
    m = model if isinstance(model, Model) else load(model)
    text = calibration.load_text(data, split="test")
    return evals.perplexity(m.module, m.tokenizer, text, protocol, ctx, max_windows, progress=progress)


def export(model: Model, out: PathLike, format: str = "safetensors", overwrite: bool = False) -> Path:
    return exporters.export(model, out, format, overwrite)
