"""`quantkit quantize` and `quantkit eval`: a thin layer over quantkit.api."""
from __future__ import annotations

import json
import os
import signal
import sys

import click

from quantkit import exporters
from quantkit.exporters import check_out

from . import api, distributed
from .config import METHODS, QuantConfig
from .errors import QuantkitError
from .modelio import load


def show(label: str, ppl) -> None:
    click.echo(f"{label}: perplexity {ppl.perplexity:.4f} ({ppl.protocol}, ctx {ppl.ctx}, {ppl.windows} windows, {ppl.tokens} tokens)")


@click.group()
@click.version_option(package_name="quantkit")
def cli() -> None:
    """Quantize, evaluate and export large language models."""
    from transformers.utils import logging

    logging.set_verbosity_error()


@cli.command()
@click.argument("model", required=False)
@click.option("--method", default="rtn", show_default=True, help=f"one of {', '.join(METHODS)}")
@click.option("--bits", type=int, default=4, show_default=True)
@click.option("--group-size", type=int, default=128, show_default=True, help="-1: per output channel")
@click.option("--sym/--asym", default=None, help="symmetric grid [default: asym for awq, sym otherwise]")
@click.option("--damp", type=float, default=0.01, show_default=True, help="GPTQ: damping, of the mean Hessian diagonal")
@click.option("--block-size", type=int, help="GPTQ: columns per lazy batch [128]; NF4/FP4: values per absmax block [64]")
@click.option("--act-order/--no-act-order", default=False, show_default=True, help="GPTQ: columns by decreasing Hessian diagonal")
@click.option("--static-groups", is_flag=True, help="GPTQ: group grids fixed before act-order")
@click.option("--true-sequential/--no-true-sequential", default=True, show_default=True,
              help="GPTQ: q/k/v, o, gate/up, down in turn, each on the inputs of the quantized ones")
@click.option("--mse", is_flag=True, help="search the clipping range (RTN and GPTQ)")
@click.option("--group-aware", is_flag=True,
              help="GPTQ: act-order within groups, groups by importance; keeps the plain g_idx layout")
@click.option("--double-quant", is_flag=True, help="NF4/FP4: quantize the absmax values to 8 bits too")
@click.option("--duo-scaling", is_flag=True, help="AWQ: scales from activations and weights (AutoAWQ's default)")
@click.option("--out", required=True, type=click.Path(), help="export directory (a .gguf file for --format gguf)")
@click.option("--format", "fmt", default="safetensors", show_default=True,
              help="safetensors: GPTQ checkpoint layout (bitsandbytes' for nf4/fp4); awq: AutoAWQ GEMM layout; "
                   "gguf: llama.cpp")
@click.option("--gguf-type", help="GGUF: the mix (Q4_K_M, Q5_K_M, Q6_K, Q3_K_M, Q2_K, Q8_0, Q4_0, ...) [Q4_K_M]")
@click.option("--imatrix", is_flag=True, help="GGUF with RTN: weight the block search by the calibration inputs")
@click.option("--pure", is_flag=True, help="GGUF: every tensor the mix's main type (llama-quantize --pure)")
@click.option("--overwrite", is_flag=True, help="replace --out if it exists")
@click.option("--max-shard-size", default=exporters.DEFAULT_MAX_SIZE, show_default=True,
              help="safetensors: the largest shard, e.g. 5GB or 500MiB; more than one come with an index")
@click.option("--calib-data", type=click.Path(), help="text file to calibrate on (default: WikiText-2 train from the hub)")
@click.option("--calib-samples", type=int, default=128, show_default=True)
@click.option("--calib-seqlen", type=int, default=512, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--eval-data", type=click.Path(), help="also print perplexity before and after on this text file")
@click.option("--eval-windows", type=int, default=40, show_default=True)
@click.option("--ctx", type=int, default=512, show_default=True, help="context of the --eval-data perplexity")
@click.option("--device", help="where layers are quantized: cuda or cpu [cuda when there is a GPU]")
def quantize(model, out, fmt, overwrite, max_shard_size, calib_data, calib_samples, calib_seqlen, seed, device,
             eval_data, eval_windows, ctx, **options) -> None:
    """Quantize MODEL (a directory, a .gguf file, or by default the embedded SmolLM2-135M-Instruct).
    Layers stream from disk to --out: memory holds one layer at a time."""
    # options and output path first: a mistake there should not cost a model load
    if fmt == "gguf" and options["gguf_type"] is None:
        options["gguf_type"] = exporters.gguf.DEFAULT_MIX
    config = QuantConfig(**options)
    api.device_of(device)
    check_out(out, overwrite)
    exporters.parse_size(max_shard_size)
    m = load(model)
    if eval_data and int(os.environ.get("RANK", "0")) == 0:
        show("before", api.evaluate(m, eval_data, "llamacpp", ctx, eval_windows))
    api.quantize(m, config, calib_data=calib_data, calib_samples=calib_samples, calib_seqlen=calib_seqlen, seed=seed,
                 out=out, format=fmt, overwrite=overwrite, max_shard_size=max_shard_size, device=device)
    if distributed.rank() != 0:  # under torchrun, rank 0 reports
        return
    click.echo(f"exported to {out}")
    if eval_data:  # the export as it loads, packed (GGUF: dequantized, with llama.cpp's arithmetic)
        show("after", api.evaluate(out, eval_data, "llamacpp", ctx, eval_windows))


@cli.command()
@click.argument("model", required=False)
@click.option("--out", required=True, type=click.Path(), help="the .gguf file to write")
@click.option("--gguf-type", help="for a float model: the mix to round to nearest (F16, Q8_0, Q4_K_M, ...) [F16]")
@click.option("--overwrite", is_flag=True, help="replace --out if it exists")
def export(model, out, gguf_type, overwrite) -> None:
    """Write MODEL as GGUF: a quantkit checkpoint whose grids are GGUF blocks (4-bit or 8-bit, groups
    of 32, no act-order) keeps its codes exactly; a float model is rounded to --gguf-type."""
    check_out(out, overwrite)
    api.export_gguf(load(model), out, gguf_type, overwrite)
    click.echo(f"wrote {out}")


@cli.command("eval")
@click.argument("model", required=False)
@click.option("--data", type=click.Path(), help="text file (default: WikiText-2 test from the hub)")
@click.option("--protocol", type=click.Choice(["wikitext", "llamacpp"]), default="llamacpp", show_default=True)
@click.option("--ctx", type=int, default=512, show_default=True)
@click.option("--max-windows", type=int, help="score only the first N windows")
@click.option("--json", "as_json", is_flag=True, help="end with one JSON line")
@click.option("--dequantized", is_flag=True, help="a quantized export: evaluate a dequantized copy, not the packed model")
@click.option("--device", help="cpu or cuda [cuda, in float16, when there is a GPU]")
def evaluate(model, data, protocol, ctx, max_windows, as_json, dequantized, device) -> None:
    """Perplexity of MODEL (a directory, an export, a .gguf file, or the embedded model). A quantized
    export runs packed: Triton kernels on a GPU, a torch fallback on the CPU."""
    ppl = api.evaluate(model, data, protocol, ctx, max_windows, packed=not dequantized, device=device)
    show(model or "embedded model", ppl)
    if as_json:
        click.echo(json.dumps({**ppl.to_dict(), "model": model}))


def terminated(signum, frame) -> None:
    raise KeyboardInterrupt  # unwinds like Ctrl-C: a partial export and its progress stay for a resumed run


def main() -> None:
    signal.signal(signal.SIGTERM, terminated)
    try:
        cli.main(standalone_mode=False)
        distributed.finish()
    except QuantkitError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
