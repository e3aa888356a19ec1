"""The pipeline as plain function calls; the CLI is a thin layer over these."""
from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import torch

from quantkit import calibration, evals, exporters

from .config import QuantConfig
from .errors import QuantkitError
from .modelio import Model, linear_types, load
from .pipeline import Hessian, awq_layer, quantize_layers
from .qtensor import QuantizedTensor
from .quantizers import ggml, gptq, nf4, rtn

PathLike = str | os.PathLike


def quantizer(qconfig: QuantConfig, losses: dict[str, float], types: dict[str, str] | None = None):
    """The per-linear core for a method: (name, weight, hessian or None) -> QuantizedTensor; None for
    AWQ, which quantizes whole layers. GPTQ's per-linear losses are recorded in losses. types: each
    linear's GGUF type when quantizing for GGUF."""
    c = qconfig
    if types is not None:
        def quantize_ggml(name: str, w: torch.Tensor, h: Hessian | None) -> QuantizedTensor:
            if h is None or h.count == 0:
                if c.needs_calibration:
                    warnings.warn(f"{name}: no calibration input reached it, so it was quantized without it")
                return ggml.quantize(w, types[name])
            hm = h.matrix()
            if c.method == "rtn":
                return ggml.quantize(w, types[name], hm.diagonal())
            r = ggml.gptq(w, hm, types[name], hm.diagonal(), c.damp, name)
            losses[name] = r.loss
            return r.tensor

        return quantize_ggml

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
    gguf_type: str | None = None,
    imatrix: bool = False,
    pure: bool = False,
    calib_data: PathLike | None = None,
    calib_samples: int = 128,
    calib_seqlen: int = 512,
    seed: int = 0,
    out: PathLike | None = None,
    format: str = "safetensors",
    overwrite: bool = False,
    max_shard_size: int | str = exporters.DEFAULT_MAX_SIZE,
    progress: bool = True,
) -> Model:
    """Quantize a model (a loaded Model is changed in place; a path or None loads one) and,
    with out, export it. Every check that can fail runs before the long work starts.
    damp, act_order, static_groups, true_sequential and group_aware are GPTQ's; mse (search the
    clipping range) serves RTN and GPTQ; block_size is GPTQ's columns per lazy batch (128) or
    NF4/FP4's values per absmax block (64); double_quant is NF4/FP4's, duo_scaling AWQ's. sym=None
    is asymmetric for AWQ (as AWQ does), symmetric otherwise. format "gguf" fills llama.cpp's block types
    for the mix gguf_type (default Q4_K_M; pure: every tensor the mix's main type) by RTN (imatrix:
    weighted by the calibration inputs' mean squares) or GPTQ; bits and group_size do not apply.
    max_shard_size: the safetensors layouts' largest shard ("5GB", "500MiB" or bytes)."""
    if format == "gguf" and gguf_type is None:
        gguf_type = exporters.gguf.DEFAULT_MIX
    qconfig = QuantConfig(method, bits, group_size, sym, damp, block_size, act_order, static_groups, true_sequential,
                          mse, group_aware, double_quant, duo_scaling, gguf_type, imatrix)
    if out is not None:
        exporters.check_out(out, overwrite)
        exporters.parse_size(max_shard_size)
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

    types = None
    if gguf_type is not None:
        exporters.gguf.check(m.module, gguf_type)
        types = exporters.gguf.tensor_types(m.module, gguf_type, pure, imatrix)
    m.tensors = quantize_layers(m, quantizer(qconfig, m.losses, types), windows, sequential=true_sequential,
                                progress=progress, resume=resume, layer_fn=layer_fn)
    for name in set(types or ()) - set(m.tensors):  # the embedding (and an untied output matrix)
        weight = m.module.get_submodule(name).weight
        m.tensors[name] = ggml.quantize(weight.data, types[name])
        weight.data.copy_(m.tensors[name].dequantize())
    if types is not None:  # evaluate() then scores with llama.cpp's arithmetic, as it scores the file
        m.gguf_types = linear_types(m.module, {exporters.gguf.gguf_name(f"{n}.weight"): t for n, t in types.items()})
    m.qconfig = qconfig
    if out is not None:
        export(m, out, format, overwrite, max_shard_size)
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
    packed: bool = True,
    device: str | None = None,
) -> evals.Perplexity:
    """Perplexity of a model (or a model path, or the embedded default) on a text file. A quantized
    checkpoint loaded from a path runs packed, its linears reading the exported tensors through
    quantkit.qlinear (Triton on CUDA, torch on the CPU); packed=False evaluates a dequantized copy.
    device: where a model loaded from a path runs (default: CUDA, in float16, when there is a GPU);
    a Model passed in is moved only when device is given."""
    m = model if isinstance(model, Model) else load(model, packed=packed)
    if device is not None or not isinstance(model, Model):
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # float16 on a GPU, except a GGUF scored with llama.cpp's float32 arithmetic
        m.module.to(dev, torch.float16 if dev.type == "cuda" and not m.gguf_types else torch.float32)
    text = calibration.load_text(data, split="test")
    if protocol == "llamacpp" and m.gguf_types:  # GGUF blocks, scored with llama.cpp's arithmetic
        with evals.llamacpp_arithmetic(m.module, m.gguf_types):
            return evals.perplexity(m.module, m.tokenizer, text, protocol, ctx, max_windows, progress=progress)
    return evals.perplexity(m.module, m.tokenizer, text, protocol, ctx, max_windows, progress=progress)


def export(model: Model, out: PathLike, format: str = "safetensors", overwrite: bool = False,
           max_shard_size: int | str = exporters.DEFAULT_MAX_SIZE) -> Path:
    return exporters.export(model, out, format, overwrite, max_shard_size)


def export_gguf(model: Model, out: PathLike, gguf_type: str | None = None, overwrite: bool = False,
                progress: bool = True) -> Path:
    """GGUF of a model: a quantized checkpoint whose grids are GGUF blocks keeps its codes (the other
    weights in F16); a float model is rounded to nearest in gguf_type (F16 by default)."""
    if not model.tensors:
        quantize(model, "rtn", gguf_type=gguf_type or "F16", out=out, format="gguf", overwrite=overwrite,
                 progress=progress)
        return Path(out)
    if gguf_type is not None:
        raise QuantkitError(f"{model.source} is already quantized, so its grids decide the GGUF types: drop --gguf-type")
    tensors = {name: ggml.from_grid(qt, name) for name, qt in model.tensors.items()}
    kinds = sorted({qt.ggml for qt in tensors.values()})
    if len(kinds) != 1:
        raise QuantkitError(f"{model.source}: linears of several GGUF types {kinds}: the checkpoint is inconsistent")
    for name in exporters.gguf.tensor_types(model.module, "F16").keys() - tensors.keys():
        tensors[name] = ggml.quantize(model.module.get_submodule(name).weight.data, "F16")
    qconfig = QuantConfig("rtn", gguf_type=kinds[0])
    return exporters.export(Model(model.module, model.tokenizer, model.source, tensors, qconfig), out, "gguf", overwrite)
