"""`quantkit quantize`, `eval`, `report`, `lm-eval`, `train` and `merge` (and `export`, from quantkit.command):
a thin layer over quantkit.api and quantkit.trainer."""
from __future__ import annotations

import math
import os
import sys
import warnings
from pathlib import Path

import click

from quantkit import exporters
from quantkit.atomic import check_apart, check_out, partial_path, size_on_disk
from quantkit.trainer.config import METHODS as TRAIN_METHODS, OPTIMIZERS, PRECISIONS, TrainConfig, held_out_twice

from . import consumers, launcher
from . import report as report_
from .command import export
from .config import AWQ_LOSSES, DTYPES, METHODS, QuantConfig, refuse_unused
from .errors import QuantkitError, count, renamed, size
from .requant import DEFAULT_MIX


def show(label: str, ppl) -> None:
    click.echo(f"{label}: perplexity {ppl.perplexity:.4f} ± {ppl.perplexity_unc:.4f} ({ppl.protocol}, ctx {ppl.ctx}, "
               f"{count(ppl.windows, 'window')}, "
               f"{ppl.tokens} tokens, {ppl.dtype} on {ppl.device})")


@click.group()
@click.version_option(package_name="quantkit")
def cli() -> None:
    """Quantize, evaluate and export large language models."""
    quiet()


def quiet() -> None:
    """No warnings from transformers and bitsandbytes that a user cannot act on. Neither is imported
    for this: help and bad options are answered without them (transformers reads its level from the
    environment when first imported)."""
    import logging

    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
    # bitsandbytes (imported by peft) warns at import that an optional kernel package is missing
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


@cli.command()
@click.argument("model", required=False)
@click.option("--method", default="rtn", show_default=True, help=f"one of {', '.join(METHODS)}")
@click.option("--bits", type=float, default=4, show_default=True,
              help="bits per weight; --format exl2: a target such as 4.125, widths mixed within each linear")
@click.option("--group-size", type=int, default=128, show_default=True, help="-1: per output channel")
@click.option("--sym/--asym", default=None, help="symmetric grid [default: asym for awq, sym otherwise]")
@click.option("--damp", type=float, default=0.01, show_default=True, help="GPTQ: damping, of the mean Hessian diagonal")
@click.option("--block-size", type=int, help="GPTQ: columns per lazy batch [128]; NF4/FP4: values per absmax block [64]")
@click.option("--act-order/--no-act-order", default=False, show_default=True,
              help="GPTQ: columns by decreasing Hessian diagonal, groups in that order (a permuted g_idx)")
@click.option("--static-groups", is_flag=True, help="GPTQ: group grids fixed before act-order, so g_idx stays plain")
@click.option("--true-sequential/--no-true-sequential", default=True, show_default=True,
              help="GPTQ: q/k/v, o, gate/up, down in turn, each on the inputs of the quantized ones")
@click.option("--mse/--no-mse", default=None, help="search the clipping range (RTN and GPTQ) [default: on for GPTQ]")
@click.option("--group-aware/--no-group-aware", default=None,
              help="GPTQ: act-order within groups, groups by importance; keeps the plain g_idx layout "
                   "[default: on unless --act-order]")
@click.option("--double-quant", is_flag=True, help="NF4/FP4: quantize the absmax values to 8 bits too")
@click.option("--duo-scaling", is_flag=True, help="AWQ: scales from activations and weights (AutoAWQ's default)")
@click.option("--awq-loss", type=click.Choice(AWQ_LOSSES), default=None,
              help="AWQ: descent judges the q/k/v and gate/up scales by their block's output, on a descent from "
                   "the candidate of least output error [default]; output by their own outputs' error alone "
                   "(faster); block by the block's output on every candidate (AutoAWQ's, slowest)")
@click.option("--out", required=True, type=click.Path(), help="export directory (a .gguf file for --format gguf)")
@click.option("--format", "fmt", default="safetensors", show_default=True,
              help="safetensors: GPTQ checkpoint layout (bitsandbytes' for nf4/fp4); awq: AutoAWQ GEMM layout; "
                   "gguf: llama.cpp; compressed-tensors: llm-compressor's pack-quantized (vLLM); exl2: ExLlamaV2")
@click.option("--gguf-type", help="GGUF: the mix (Q4_K_M, Q5_K_M, Q6_K, Q3_K_M, Q2_K, Q8_0, Q4_0, ...) [Q4_K_M]")
@click.option("--imatrix", is_flag=False, flag_value="", metavar="[FILE]",
              help="GGUF with RTN: weight the block search by the calibration inputs, or by llama.cpp's "
                   "importance matrix FILE (llama-imatrix's GGUF or legacy .dat)")
@click.option("--pure", is_flag=True, help="GGUF: every tensor the mix's main type (llama-quantize --pure)")
@click.option("--tensor-type", multiple=True, metavar="PATTERN=TYPE",
              help="GGUF: tensors whose name matches PATTERN (a regular expression, e.g. blk\\.0\\.ffn_down) get "
                   "TYPE instead of the mix's choice, the first match winning (llama-quantize --tensor-type)")
@click.option("--rules", type=click.Path(dir_okay=False), metavar="FILE",
              help="per-layer mixed precision: a JSON or YAML list of {match: REGEX, bits, group_size} or {match: "
                   "REGEX, skip: true} entries; the first whose pattern is found in a linear's name decides its "
                   "settings (safetensors and compressed-tensors formats, RTN and GPTQ)")
@click.option("--target-bpw", type=float, metavar="X",
              help="RTN and GPTQ: X bits per weight of the decoder linears, spent where a measurement says they "
                   "lose least (see --measurement): in the GPTQ layout each group of linears sharing an input (q/k/v, "
                   "o, gate/up, down) gets a bits and group size (formats safetensors and compressed-tensors); in GGUF "
                   "each linear a block type, Q2_K to Q8_0, as --tensor-type overrides of the mix (which types the "
                   "embedding and output)")
@click.option("--measurement", type=click.Path(dir_okay=False), metavar="FILE",
              help="--target-bpw, EXL2: each candidate setting's error at the output of each attention and MLP block, "
                   "weighted by the loss's gradients, read from FILE when it exists, else measured and saved there "
                   "for other targets (EXL2 without it: the target's two nearest widths in every linear; with it a "
                   "lower KL divergence from 3 bits per weight up, benchmarks/RESULTS.md)")
@click.option("--head-bits", type=float, help="EXL2: the output head's bits per weight, e.g. 6 or 8 (ExLlamaV2's "
              "head_bits; rounded onto its grid without calibration) [kept in float16]")
@click.option("--for", "targets", multiple=True,
              help=f"refuse, before quantizing, settings this consumer cannot load: {', '.join(consumers.TARGETS)}")
@click.option("--overwrite", is_flag=True, help="replace --out if it exists (a file, or a model or adapter directory)")
@click.option("--max-shard-size", default=exporters.DEFAULT_MAX_SIZE, show_default=True,
              help="every format but gguf: the largest safetensors shard, e.g. 5GB or 500MiB; more than one come "
                   "with an index")
@click.option("--calib-data", type=click.Path(), help="text file to calibrate on, or .jsonl/.json chat or instruction "
                                                      "records (rendered by the chat template) [WikiText-2 train from "
                                                      "the hub]")
@click.option("--calib-samples", type=int, default=128, show_default=True, help="calibration windows")
@click.option("--calib-seqlen", type=int, default=512, show_default=True, help="tokens per calibration window")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True,
              help="where the calibration windows are drawn from the text")
@click.option("--eval-data", type=click.Path(), help="also print perplexity before and after on this text file (or "
                                                      "records, as --calib-data takes them)")
@click.option("--eval-windows", type=click.IntRange(1), default=40, show_default=True)
@click.option("--ctx", type=int, default=512, show_default=True, help="context of the --eval-data perplexity")
@click.option("--device", help="where layers are quantized: cuda or cpu [cuda when there is a GPU]")
def quantize(model, out, fmt, targets, overwrite, max_shard_size, calib_data, calib_samples, calib_seqlen, seed,
             device, eval_data, eval_windows, ctx, **options) -> None:
    """Quantize MODEL (a directory, a .gguf file, or by default the embedded SmolLM2-135M-Instruct).
    Layers stream from disk to --out: memory holds one layer at a time."""
    # options and output path first: a mistake there should not cost a model load
    exporters.check_format_name(fmt)
    refuse_unused(given_options(), options["method"], fmt, options["target_bpw"] is not None)
    if fmt == "gguf" and options["gguf_type"] is None:
        options["gguf_type"] = DEFAULT_MIX
    options["tensor_type"] = tuple(options["tensor_type"])
    rules_file = options["rules"]  # read into the config below: out must not replace it
    options["rules"] = options["rules"] or ()
    imatrix = options.pop("imatrix")
    options.update(imatrix=imatrix == "", imatrix_file=imatrix or None)
    bits = options.pop("bits")
    if not math.isfinite(bits):
        raise QuantkitError(f"--bits {bits} is not a width: pass a number of bits, such as 4")
    if fmt == "exl2":
        options["exl2"] = bits
    elif bits != int(bits):
        raise QuantkitError(f"--bits {bits} is a fraction: only --format exl2 takes a bits-per-weight target; "
                            "pass a whole number of bits")
    else:
        options["bits"] = int(bits)
    config = QuantConfig(**options)
    given = given_options()
    for name in ("calib_data", "calib_samples", "calib_seqlen", "seed"):
        if name in given and not config.needs_calibration:
            raise QuantkitError(f"{given[name]} sets the calibration, and " + (
                "--imatrix FILE reads the importance instead: drop it, or pass --imatrix alone to compute the "
                "importance from the calibration text" if config.imatrix_file else
                f"--method {config.method} quantizes without one: drop it (GPTQ, AWQ, --imatrix and --target-bpw "
                "calibrate)"))
    for name in ("eval_windows", "ctx"):
        if name in given and not eval_data:
            raise QuantkitError(f"{given[name]} sets the perplexity check that --eval-data turns on: add --eval-data "
                                "FILE, or drop it")
    # the libraries once the options are checked: a mistake in them is answered at once
    from . import api, calibration, distributed
    from .modelio import load

    api.device_of(device)
    exporters.check_out_name(out, fmt)
    check_out(out, overwrite, directory=fmt != "gguf",
              inputs=[model, calib_data, eval_data, config.measurement, config.imatrix_file, rules_file])
    exporters.parse_size(max_shard_size)
    m = load(model)
    check_apart(out, [m.source])  # the embedded model, when MODEL is not given
    if eval_data:  # in every process: the first alone scores it, and the others would wait for it in vain
        calibration.chats(eval_data, calibration.load_text(eval_data, split="test"), m.tokenizer)

    def before() -> None:  # once the quantization's checks pass: from the path, as "after", the same device and dtype
        if distributed.rank() == 0:
            show("before", api.evaluate(m.source, eval_data, "llamacpp", ctx, eval_windows, device=device))

    m = api.quantize(m, config, calib_data=calib_data, calib_samples=calib_samples, calib_seqlen=calib_seqlen,
                     seed=seed, out=out, format=fmt, overwrite=overwrite, max_shard_size=max_shard_size, device=device,
                     targets=targets, checked=before if eval_data else None)
    if distributed.rank() != 0:  # under torchrun, rank 0 reports
        return
    exported(out, fmt, m)
    if eval_data:  # the export as it loads, packed (GGUF: dequantized, with llama.cpp's arithmetic)
        show("after", api.evaluate(out, eval_data, "llamacpp", ctx, eval_windows, device=device))


def exported(out: str, fmt: str, m) -> None:
    click.echo(f"exported to {out}")
    click.echo("who loads it, from their documented limits:")  # as written: --target-bpw's settings are chosen by now
    click.echo("\n".join(consumers.summary(consumers.Export.of(fmt, m.qconfig, m.module))))


cli.add_command(export)

def given_options() -> dict[str, str]:
    """The current command's options given on the command line (not defaults): their flags by name."""
    ctx = click.get_current_context()
    return {p.name: "/".join(p.opts + p.secondary_opts) for p in ctx.command.params  # --sym/--asym as one
            if ctx.get_parameter_source(p.name) == click.core.ParameterSource.COMMANDLINE}


@cli.command("eval")
@click.argument("model", required=False)
@click.option("--data", type=click.Path(), help="text file, or .jsonl/.json chat or instruction records (rendered by "
                                                 "the chat template) [WikiText-2 test from the hub]")
@click.option("--protocol", type=click.Choice(["wikitext", "llamacpp"]), default="llamacpp", show_default=True)
@click.option("--ctx", type=int, default=512, show_default=True)
@click.option("--max-windows", type=click.IntRange(1), help="score only the first N windows")
@click.option("--base", help="compare with this model (or a base saved with --save-base): KL divergence, delta-p, "
                             "same top token, as llama-perplexity --kl-divergence")
@click.option("--save-base", type=click.Path(), help="with --base MODEL: save its log-probabilities here for reuse "
                                                     "(llama.cpp's --kl-divergence-base layout)")
@click.option("--overwrite", is_flag=True, help="replace the base saved at --save-base")
@click.option("--max-ppl-increase", type=float, help="gate: fail when PPL(Q)/PPL(base) - 1 is above this")
@click.option("--max-kld", type=float, help="gate: fail when the mean KL divergence is above this")
@click.option("--min-same-top", type=float, help="gate: fail when the top tokens agree less often than this "
                                                  "(a fraction, e.g. 0.9)")
@click.option("--json", "as_json", is_flag=True, help="end with one JSON line")
@click.option("--dequantized", is_flag=True, help="a quantized export: evaluate a dequantized copy, not the packed model")
@click.option("--device", help="cpu or cuda [cuda, in float16 (a .gguf file: float32), when there is a GPU]")
@click.option("--dtype", type=click.Choice(DTYPES), help="the activations' dtype [float16 on a GPU, float32 on "
              "the CPU; a .gguf file: float32 only]; on the CPU, where layers take few rows, bfloat16 runs 4-bit layers in torch's fused int4 matmul "
              "and float32 every layout in quantkit's compiled GEMV")
@click.option("--layerwise/--whole", default=None, help="a float model or .gguf file: run it a decoder layer at a "
              "time over all windows, each layer read from disk once (once a part, where the windows' hidden states "
              "exceed half the free host memory), or whole [a layer at a time when it does not fit the device's free "
              "memory]; the same figures")
def evaluate(model, data, protocol, ctx, max_windows, base, save_base, overwrite, max_ppl_increase, max_kld,
             min_same_top, as_json, dequantized, device, dtype, layerwise) -> None:
    """Perplexity of MODEL (a directory, an export, a .gguf file, or the embedded model). A quantized
    export runs packed: Triton kernels on a GPU; on the CPU a compiled GEMV or torch's int4 matmul for
    few rows (see --dtype), else a slice of the weight dequantized at a time. With --base, its
    divergence from the base; with the gate limits, exit 1 when one is broken."""
    limits = {"max_ppl_increase": max_ppl_increase, "max_kld": max_kld, "min_same_top": min_same_top}
    given = [f"--{k.replace('_', '-')}" for k, v in limits.items() if v is not None]
    if base is None and (given or save_base):
        needing = given + ["--save-base"] * bool(save_base)
        raise QuantkitError(f"{', '.join(needing)} {'needs' if len(needing) == 1 else 'need'} a base model to compare "
                            "with: add --base BASE")
    from quantkit.evals import kld  # once the options are checked, as in quantize

    from . import api

    kld.check_limits(**limits)
    if max_ppl_increase is not None and max_ppl_increase >= 1:  # 5 meant as 5%
        warnings.warn(f"--max-ppl-increase {max_ppl_increase:g} passes a perplexity up to {1 + max_ppl_increase:g} "
                      "times the base's: the limit is a fraction (0.05 for 5%)")
    kld.check_save_path(save_base, overwrite)
    if base is not None and protocol != "llamacpp":
        raise QuantkitError("--base compares under the llamacpp protocol (the second half of each window): drop --protocol")
    if base is None:
        ppl = api.evaluate(model, data, protocol, ctx, max_windows, packed=not dequantized, device=device, dtype=dtype,
                           layerwise=layerwise)
        show(model or "embedded model", ppl)
        if as_json:
            click.echo(report_.strict_json({**ppl.to_dict(), "model": model, "data": data}))
        return
    d = api.compare(model, base, data, ctx, max_windows, save_base, packed=not dequantized, device=device,
                    dtype=dtype, overwrite=overwrite, layerwise=layerwise)
    click.echo(f"{model or 'embedded model'} against {base}: {count(d.windows, 'window')} of {d.ctx}, {d.tokens} predictions, "
               f"{d.dtype} on {d.device}")
    click.echo(d.report())
    if save_base:
        click.echo(f"base log-probabilities saved to {save_base} ({size(size_on_disk(Path(save_base)))})")
    gate = d.gate(**limits)
    for kept, text in gate:
        if kept:
            click.echo(f"pass: {text}")
    if as_json:  # the last line
        click.echo(report_.strict_json({**d.to_dict(), "model": model, "base": base, "data": data}))
    failed = [text for kept, text in gate if not kept]
    if failed:
        click.echo(f"fail: {'; '.join(failed)}", err=True)
        sys.exit(1)


@cli.command("lm-eval")
@click.argument("model", required=False)
@click.option("--tasks", required=True, help="comma-separated lm-eval task names; offline: wikitext, dolly_mc")
@click.option("--limit", type=click.FloatRange(0, min_open=True), help="at most N documents per task (a fraction below 1)")
@click.option("--num-fewshot", type=click.IntRange(0))
@click.option("--batch-size", type=click.IntRange(1), default=4, show_default=True)
@click.option("--max-length", type=click.IntRange(2), help="tokens per window [the model's context]")
@click.option("--data-dir", type=click.Path(), help="where the local tasks read [$QUANTKIT_DATA, else ../shared/data, else the "
              "shared data beside the quantkit checkout]")
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), help="every seed lm-eval takes [lm-eval's own: "
              "the few-shot examples `lm_eval` picks]")
@click.option("--apply-chat-template", "chat", is_flag=True,
              help="each prompt in the tokenizer's chat template (lm-eval's --apply_chat_template) [plain prompts]")
@click.option("--json", "as_json", is_flag=True, help="end with one JSON line: the results by task and the settings "
              "they were scored with (lm-eval's results and config)")
@click.option("--dequantized", is_flag=True, help="a quantized export: evaluate a dequantized copy, not the packed model")
@click.option("--device", help="cpu or cuda [cuda, in float16 (a .gguf file: float32), when there is a GPU]")
@click.option("--dtype", type=click.Choice(DTYPES), help="the activations' dtype [float16 on a GPU, float32 on the CPU; "
              "a .gguf file: float32 only]")
@click.option("--layerwise/--whole", default=None, help="a float model or .gguf file: run all requests of a kind "
              "through it together a decoder layer at a time, each layer read from disk once a kind (and a part, where "
              "their hidden states exceed half the free host memory), or whole [a layer at a time when it does not fit "
              "the device's free memory, unless a task generates text]; the same scores")
def lm_eval(model, tasks, limit, num_fewshot, batch_size, max_length, data_dir, seed, chat, as_json, dequantized,
            device, dtype, layerwise) -> None:
    """Run EleutherAI's lm-evaluation-harness tasks on MODEL (any model quantkit loads: float, a packed
    export, a .gguf file; by default the embedded model), through lm-eval's HFLM wrapper around the loaded model."""
    import torch

    from quantkit.evals import harness

    from . import api
    from .command import gguf_magic

    names = [t.strip() for t in tasks.split(",") if t.strip()]
    limit = harness.documents(limit, f"--limit {limit}")
    results = api.lm_eval(model, names, limit=limit, num_fewshot=num_fewshot, batch_size=batch_size,
                          max_length=max_length, data_dir=data_dir, seed=seed, chat=chat, packed=not dequantized,
                          device=device, dtype=dtype, layerwise=layerwise)
    where = torch.device(api.default_device(model, device))  # where lm_eval ran it, and in what (api.runnable)
    ran = api.runs_in(where, dtype, model is not None and os.path.isfile(model) and gguf_magic(model))
    config = {"model": model, "tasks": names, "limit": limit, "num_fewshot": num_fewshot, "max_length": max_length,
              "batch_size": batch_size, "seed": seed, "chat": chat,
              "data_dir": str(Path(data_dir or harness.default_data_dir()).resolve()),
              "dtype": str(ran).removeprefix("torch."), "device": where.type}
    settings = [f"{config['dtype']} on {config['device']}",
                "every document per task" if limit is None else harness.documents_said(limit),
                "each task's few-shot count" if num_fewshot is None else f"{num_fewshot}-shot",
                "prompts in the chat template" if chat else "plain prompts",
                "windows of the model's context" if max_length is None else f"windows of {max_length}",
                "lm-eval's seeds" if seed is None else f"seed {seed}"]
    click.echo(f"{model or 'embedded model'}: {', '.join(settings)}")
    for task, values in results.items():
        shown = ", ".join(f"{k} {v:.4f}" + (f" ± {values[k + '_stderr']:.4f}" if k + "_stderr" in values else "")
                          for k, v in values.items() if not k.endswith("_stderr") and k != "sample_len")
        click.echo(f"{task}: {shown}")
    if as_json:
        click.echo(report_.strict_json({"results": results, "config": config}))


def listed(value: str, kind=str, option: str = "") -> list:
    try:
        return [kind(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError:
        raise QuantkitError(f"{option} {value!r}: give comma-separated numbers, such as {option} 3,4") from None


@cli.command("report")
@click.argument("model", required=False)
@click.option("--out", required=True, type=click.Path(), help="the report directory (run again to go on)")
@click.option("--data", required=True, type=click.Path(), help="the evaluation text")
@click.option("--methods", default=",".join(report_.FAMILIES), show_default=True)
@click.option("--bits", default=",".join(map(str, report_.BITS)), show_default=True, help="rtn, gptq and awq widths")
@click.option("--gguf-types", default=",".join(report_.GGUF_TYPES), show_default=True)
@click.option("--exl2-bits", default=",".join(map(str, report_.EXL2_TARGETS)), show_default=True,
              help="EXL2 targets, bits per weight")
@click.option("--exl2-measured", is_flag=True, help="EXL2 widths per block from one measurement, kept in "
              "OUT/exl2-measurement.json (quantize --measurement)")
@click.option("--group-size", type=int, default=128, show_default=True)
@click.option("--calib-data", type=click.Path(), help="calibration text or records (default: WikiText-2 train from "
                                                      "the hub)")
@click.option("--calib-samples", type=int, default=128, show_default=True, help="calibration windows")
@click.option("--calib-seqlen", type=int, default=512, show_default=True, help="tokens per calibration window")
@click.option("--windows", type=click.IntRange(1), default=40, show_default=True, help="evaluation windows")
@click.option("--ctx", type=int, default=512, show_default=True)
@click.option("--tasks", default="", help="also run these lm-eval tasks on each point (comma-separated)")
@click.option("--lm-eval-limit", type=float, help="documents per lm-eval task (below 1: a share of each task's)")
@click.option("--lm-eval-fewshot", type=click.IntRange(0), help="few-shot examples per lm-eval prompt [each task's own]")
@click.option("--lm-eval-max-length", type=click.IntRange(2), help="tokens per lm-eval window [the model's context]")
@click.option("--lm-eval-chat", is_flag=True, help="lm-eval prompts in the tokenizer's chat template")
@click.option("--lm-eval-data-dir", type=click.Path(), help="where local lm-eval tasks read [$QUANTKIT_DATA, else "
              "../shared/data, else the shared data beside the quantkit checkout]")
@click.option("--keep-exports", is_flag=True, help="keep each point's export under OUT/exports")
def report(model, out, data, methods, bits, gguf_types, exl2_bits, exl2_measured, group_size, calib_data, calib_samples,
           calib_seqlen, windows, ctx, tasks, lm_eval_limit, lm_eval_fewshot, lm_eval_max_length, lm_eval_chat,
           lm_eval_data_dir, keep_exports) -> None:
    """Sweep methods and sizes over MODEL (by default the embedded model): for each point the export's size and bits per weight,
    perplexity, divergence from the base, time and peak memory; a markdown table, JSON and plots."""
    if not os.path.isfile(data):
        raise QuantkitError(f"{data}: no such file: pass --data with the evaluation text")
    given, families = given_options(), set(listed(methods))
    for name, needs in (("bits", {"rtn", "gptq", "awq"}), ("gguf_types", {"gguf"}), ("exl2_bits", {"exl2"}),
                        ("exl2_measured", {"exl2"}), ("lm_eval_limit", None), ("lm_eval_fewshot", None),
                        ("lm_eval_max_length", None), ("lm_eval_chat", None), ("lm_eval_data_dir", None)):
        if name in given and (not families & needs if needs else not tasks):
            raise QuantkitError(f"{given[name]} sets " + (f"the {', '.join(sorted(needs))} points, and --methods has none: "
                                                          "add them to --methods, or drop it" if needs else
                                                          "the lm-eval runs, and there are no --tasks: add some, or drop it"))
    settings = report_.Settings(model=model or "", data=data, calib_data=calib_data, calib_samples=calib_samples,
                                calib_seqlen=calib_seqlen, group_size=group_size, windows=windows, ctx=ctx,
                                tasks=listed(tasks), lm_eval_limit=lm_eval_limit, lm_eval_fewshot=lm_eval_fewshot,
                                lm_eval_max_length=lm_eval_max_length, lm_eval_chat=lm_eval_chat,
                                lm_eval_data_dir=lm_eval_data_dir, exl2_measured=exl2_measured)
    sweep = report_.Sweep(methods=listed(methods), bits=listed(bits, int, "--bits"), gguf_types=listed(gguf_types),
                          exl2_targets=listed(exl2_bits, float, "--exl2-bits"), keep_exports=keep_exports)
    r = report_.report(out, settings, sweep, echo=lambda line: click.echo(line, err=True))  # stdout: the result
    failed = [p["name"] + " (lm-eval)" * ("lm_eval_error" in p) for p in r["points"] if p["status"] != "ok" or
              "lm_eval_error" in p]
    click.echo(f"report in {out}: report.md, report.json, perplexity.png, kld.png"
               + (f"; failed: {', '.join(failed)}" if failed else ""))
    if failed:  # as a failed gate: a script running the sweep sees it
        sys.exit(1)


T = TrainConfig  # its fields' defaults, shown in --help (read from the class: nothing is checked or imported)


# train --quantize METHOD: quantize's --method; a GGUF's per-tensor types are quantize's, on the merged model
QUANTIZE_FLAGS = {"method": "--quantize", "out": "--quantize-out",
                  "tensor_type": "--tensor-type (of quantkit quantize OUT-merged)"}


@cli.command()
@click.argument("model", required=False)
@click.option("--data", required=True, type=click.Path(),
              help="plain text (packed windows, every token scored) or .jsonl of chats / instruction records "
                   "(messages; instruction+response; prompt+completion: only the replies scored)")
@click.option("--out", required=True, type=click.Path(), help="the adapter directory (PEFT's format)")
@click.option("--eval-data", type=click.Path(), help="held-out data [default: --eval-fraction of --data]")
@click.option("--eval-fraction", type=float, default=T.eval_fraction, show_default=True)
@click.option("--method", type=click.Choice(TRAIN_METHODS), default=T.method, show_default=True,
              help="qlora: the frozen base held as NF4 with double quantization")
@click.option("--rank", type=int, default=T.rank, show_default=True)
@click.option("--alpha", type=float, default=T.alpha, show_default=True)
@click.option("--dropout", type=float, default=T.dropout, show_default=True)
@click.option("--target", default="all-linear", show_default=True, help="comma-separated module names, or all-linear")
@click.option("--dora", is_flag=True, help="weight-decomposed LoRA: a trained magnitude per output row")
@click.option("--rslora", is_flag=True, help="scale by alpha/sqrt(rank) instead of alpha/rank")
@click.option("--lora-plus", type=float, help="train B at RATIO times A's learning rate")
@click.option("--steps", type=int, help="optimizer steps [default: --epochs, else one epoch]")
@click.option("--epochs", type=float)
@click.option("--seqlen", type=int, default=T.seqlen, show_default=True)
@click.option("--batch-size", type=int, default=T.batch_size, show_default=True, help="sequences per micro-batch, over all processes")
@click.option("--grad-accum", type=int, default=T.grad_accum, show_default=True)
@click.option("--lr", type=float, default=T.lr, show_default=True)
@click.option("--warmup", type=int, default=T.warmup, show_default=True, help="steps of linear warmup before the cosine decay")
@click.option("--weight-decay", type=float, default=T.weight_decay, show_default=True)
@click.option("--max-grad-norm", type=float, default=T.max_grad_norm, show_default=True)
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=T.seed, show_default=True)
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default=T.optimizer, show_default=True)
@click.option("--precision", type=click.Choice(PRECISIONS), default=T.precision, show_default=True,
              help="auto: bf16 autocast where the device has it, else on a GPU fp16 with a gradient scaler, on a "
                   "CPU float32")
@click.option("--gradient-checkpointing", is_flag=True, help="recompute activations in the backward pass: less memory")
@click.option("--compile", is_flag=True, help="torch.compile the model (training goes on without it if that fails)")
@click.option("--fsdp", is_flag=True, help="under torchrun: shard the base, the adapter and the optimizer state over "
                                           "the processes (FSDP2; LoRA with AdamW)")
@click.option("--eval-every", type=int, default=T.eval_every, show_default=True)
@click.option("--patience", type=int, help="stop after N evaluations without a better held-out loss; keep the best adapter")
@click.option("--save-every", type=int, default=T.save_every, show_default=True, help="steps between checkpoints")
@click.option("--resume", is_flag=True, help="go on from the checkpoint a stopped run of this command left (with "
                                              "--quantize: or from its merge or quantization)")
@click.option("--overwrite", is_flag=True, help="replace --out if it exists (a file, or a model or adapter directory)")
@click.option("--device", help="cuda or cpu [cuda when there is a GPU]")
@click.option("--quantize", "quantize_method", type=click.Choice(METHODS),
              help="then merge the adapter into the base (OUT-merged) and quantize that with this method")
@click.option("--quantize-out", type=click.Path(), help="where --quantize writes [OUT-METHOD, .gguf for --format gguf]")
@click.option("--format", "fmt", default="safetensors", show_default=True, help="--quantize: safetensors, awq, gguf or compressed-tensors")
@click.option("--bits", type=int, default=4, show_default=True, help="--quantize: bits")
@click.option("--group-size", type=int, default=128, show_default=True, help="--quantize: group size")
@click.option("--gguf-type", help="--quantize with --format gguf: the mix [Q4_K_M]")
@click.option("--calib-data", type=click.Path(), help="--quantize: calibration text or records")
@click.option("--calib-samples", type=int, default=128, show_default=True, help="--quantize: calibration windows")
@click.option("--calib-seqlen", type=int, default=512, show_default=True, help="--quantize: tokens per window")
def train(model, data, out, eval_data, resume, overwrite, device, quantize_method, quantize_out, fmt, bits,
          group_size, gguf_type, calib_data, calib_samples, calib_seqlen, **options) -> None:
    """Fine-tune MODEL (a directory, or by default the embedded SmolLM2-135M-Instruct) with LoRA or
    QLoRA; write the adapter, its log and a loss plot to --out. With --quantize, merge and quantize too."""
    config = TrainConfig(**{k: v for k, v in options.items() if v is not None})
    qconfig, merged = None, f"{out}-merged"
    given = given_options()
    if eval_data and "eval_fraction" in given:  # the API cannot tell its default given from taken (trainer.train)
        raise held_out_twice(config.eval_fraction)
    calibrating = ("calib_data", "calib_samples", "calib_seqlen")
    stray = [given[n] for n in ("quantize_out", "fmt", "bits", "group_size", "gguf_type", *calibrating) if n in given]
    if stray and not quantize_method:
        raise QuantkitError(f"{stray[0]} sets the quantization that --quantize METHOD turns on: add --quantize, or "
                            "drop it")
    with renamed(QUANTIZE_FLAGS):  # quantize's errors in train's words: its --method is --quantize
        if quantize_method:
            exporters.check_format_name(fmt)  # before the training, not after it
            if fmt == "exl2":
                raise QuantkitError("--quantize writes safetensors, awq, gguf or compressed-tensors: for EXL2 (a target "
                                    "bits per weight), train, then run quantkit merge OUT --out OUT-merged and quantkit "
                                    "quantize OUT-merged --method gptq --format exl2 --bits 4.125 --out OUT-exl2")
            refuse_unused({n: f for n, f in given.items() if n in ("bits", "group_size")}, quantize_method, fmt)
            if launcher.launched() > 1:
                raise QuantkitError("--quantize runs in one process: train under torchrun, then run quantkit merge and "
                                    "quantkit quantize")
            if fmt == "gguf" and gguf_type is None:
                gguf_type = DEFAULT_MIX
            qconfig = QuantConfig(method=quantize_method, bits=bits, group_size=group_size, gguf_type=gguf_type)
            if (flag := next((given[n] for n in calibrating if n in given), None)) and not qconfig.needs_calibration:
                raise QuantkitError(f"{flag} calibrates --quantize, and --quantize {quantize_method} quantizes "
                                    "without one: drop it (gptq and awq calibrate)")
            quantize_out = quantize_out or f"{out}-{quantize_method}{'.gguf' if fmt == 'gguf' else ''}"
            exporters.check_out_name(quantize_out, fmt)
    # the libraries once the options are checked: a mistake in them is answered at once
    from quantkit import trainer

    from . import api, distributed
    from .modelio import load

    # --resume after a kill in the merge or the quantization: the finished adapter (and merge) are taken as they are;
    # a checkpoint of this run beside out (--overwrite killed in the training) goes on training instead, and a
    # merge of another adapter (an earlier run's) is done again
    trained = bool(resume and quantize_method and not partial_path(out).exists() and trainer.lora.is_adapter(out))
    if trained:
        from quantkit.trainer.merging import merge_key, merged_from

        key = merge_key(out)
        merged_done = key is not None and merged_from(merged) == key
    else:
        merged_done = False
    if qconfig is not None:  # its faults before the training, not after it; against what is quantized (the base
        # may be gone once the merge is done), whose merge has the base's shapes
        with renamed(QUANTIZE_FLAGS):
            quantized = load(merged if merged_done else model)
            exporters.check_format(fmt, quantized.module, qconfig)
            if qconfig.needs_calibration:
                api.calibration_windows(quantized, calib_data, calib_samples, calib_seqlen)
    inputs = [model, data, eval_data, calib_data]
    if resume:
        check_apart(out, inputs)
    else:
        check_out(out, overwrite, directory=True, inputs=inputs)
    if quantize_method:  # OUT-merged: another --out moves it
        if merged_done:
            check_apart(merged, [*inputs, out])
        else:
            check_out(merged, overwrite, directory=True, inputs=[*inputs, out])
        check_out(quantize_out, overwrite, directory=fmt != "gguf", option="quantize_out",
                  inputs=[*inputs, out, merged])
        if not merged_done and not overwrite:  # a merge to come: another run's quantized layers, refused before training
            api.check_progress(Path(quantize_out), None, len(quantized.layers))
    if trained:
        if model is None or os.path.exists(model):  # a base gone since the merge cannot be told apart
            from quantkit.trainer.loop import check_finished

            check_finished(out, model, config, data, eval_data)
        click.echo(f"{out} is a finished adapter: going on to {'quantize' if merged_done else 'merge and quantize'} it")
    else:
        result = trainer.train(model, config, data=data, out=out, eval_data=eval_data, resume=resume,
                               overwrite=overwrite, device=device)
        if distributed.rank() != 0:
            return
        last = result.log[-1]
        held = (f", held-out loss {result.evals[0]['eval_loss']:.4f} -> {result.evals[-1]['eval_loss']:.4f}"
                f" (best at step {result.best_step})") if result.evals else ""
        click.echo(f"adapter written to {out}: {result.steps} steps, loss {last['loss']:.4f}{held}, "
                   f"{result.tokens_per_s:.0f} tokens/s in {result.precision}, {result.peak_memory}")
    if qconfig is not None:
        if not merged_done:
            trainer.merge(out, merged, overwrite=overwrite)
            click.echo(f"merged into {merged} ({size(size_on_disk(Path(merged)))})")
        with renamed(QUANTIZE_FLAGS):
            m = api.quantize(load(merged), qconfig, calib_data=calib_data, calib_samples=calib_samples,
                             calib_seqlen=calib_seqlen, out=quantize_out, format=fmt, overwrite=overwrite, device=device)
        exported(quantize_out, fmt, m)


@cli.command()
@click.argument("adapter")
@click.option("--out", required=True, type=click.Path(), help="the merged model directory")
@click.option("--base", help="the base model [the adapter config's base_model_name_or_path]")
@click.option("--onto-nf4", is_flag=True, help="merge into the NF4-rounded base QLoRA trained against")
@click.option("--overwrite", is_flag=True, help="replace --out if it exists (a file, or a model or adapter directory)")
@click.option("--max-shard-size", default=exporters.DEFAULT_MAX_SIZE, show_default=True)
def merge(adapter, out, base, onto_nf4, overwrite, max_shard_size) -> None:
    """Merge a LoRA ADAPTER (quantkit's or PEFT's) into its base in float32 and write a model
    directory in the base's dtype, ready for quantkit quantize."""
    from quantkit import trainer

    check_out(out, overwrite, directory=True, inputs=[adapter, base])
    trainer.merge(adapter, out, base, onto_nf4=onto_nf4, overwrite=overwrite, max_shard_size=max_shard_size)
    click.echo(f"merged into {out} ({size(size_on_disk(Path(out)))})")
