"""The `quantkit` command's entry: the error handling every subcommand shares, and `export`, which
starts without torch when it requantizes a GGUF file (llama-quantize's job, at its speed: a user
times the whole command). The other subcommands are in quantkit.cli, imported only for them."""
from __future__ import annotations

import os
import signal
import sys
import warnings

import click

from . import launcher
from .errors import COMMAND_LINE, Note, QuantkitError, out_of_memory, size


@click.command()
@click.argument("model", required=False)
@click.option("--out", required=True, type=click.Path(), help="the .gguf file to write")
@click.option("--gguf-type", help="the mix (F16, Q8_0, Q4_K_M, ...) a float model is rounded to, or a GGUF file "
                                   "requantized into [F16]; a quantkit checkpoint keeps its own grids")
@click.option("--pure", is_flag=True, help="a GGUF file: every weight in the mix's main type (llama-quantize --pure)")
@click.option("--tensor-type", "overrides", multiple=True, metavar="PATTERN=TYPE",
              help="a GGUF file: this type for the weights whose names match (llama-quantize --tensor-type)")
@click.option("--overwrite", is_flag=True, help="replace --out if it exists")
def export(model, out, gguf_type, pure, overrides, overwrite) -> None:
    """Write MODEL (by default the embedded model) as GGUF: a quantkit checkpoint whose grids are GGUF
    blocks (4-bit, or 8-bit symmetric; groups of 32, no act-order) keeps its codes exactly; a float model is rounded to --gguf-type; a GGUF file
    is requantized into that mix tensor by tensor, its metadata kept, as llama-quantize does."""
    from .atomic import check_out

    check_out(out, overwrite, directory=False, inputs=[model])
    if model is not None and os.path.isfile(model) and (model.lower().endswith(".gguf") or gguf_magic(model)):
        from .requant import requantize

        requantize(model, out, "F16" if gguf_type is None else gguf_type, overwrite, pure=pure, overrides=overrides)
    elif pure or overrides:
        raise QuantkitError(f"{'--pure' if pure else '--tensor-type'} requantizes a GGUF file: for a model directory, "
                            "quantkit quantize MODEL --format gguf takes it")
    else:
        from . import api
        from .cli import quiet
        from .modelio import load

        quiet()
        api.export_gguf(load(model), out, gguf_type, overwrite)
    click.echo(f"wrote {out} ({size(os.path.getsize(out))})")


def gguf_magic(path: str) -> bool:
    from .gguf_constants import is_gguf

    try:
        return is_gguf(path)
    except OSError:  # load() names the problem
        return False


def terminated(signum, frame) -> None:
    # unwinds like Ctrl-C: a partial export and its progress stay for a resumed run. torchrun's agent
    # stops the survivors of a process that died, often before their collective notices
    if launcher.launched() > 1:
        from . import distributed

        raise distributed.Stopped(", or the job was killed (SIGTERM)")
    raise KeyboardInterrupt


ONE_PROCESS = ("export", "eval", "lm-eval", "report", "merge")  # under torchrun each process would run it whole


def warning_line(message, category, filename, lineno, line=None) -> str:
    """A warning as the command prints it: one line, without the source line that raised it."""
    return f"{'note' if issubclass(category, Note) else 'warning'}: {message}\n"


def close_bars() -> None:
    """End the progress bars a library left open when it raised (lm-eval's), so that the error line
    starts a line of its own."""
    from tqdm import tqdm

    for bar in list(tqdm._instances):
        bar.close()


def main() -> None:
    signal.signal(signal.SIGTERM, terminated)
    warnings.formatwarning = warning_line
    spelling = COMMAND_LINE.set(True)  # errors name the command line's flags
    try:
        if sys.argv[1:2] and sys.argv[1] in ONE_PROCESS and "--help" not in sys.argv[2:] and \
                (size := launcher.launched()) > 1:
            launcher.check(size)  # WORLD_SIZE inherited without torchrun: unset it
            raise QuantkitError(f"quantkit {sys.argv[1]} runs in one process, and under torchrun every process would run "
                                "it whole and write the same output: run it without torchrun (quantize and train share "
                                "their work across processes)")
        if sys.argv[1:2] == ["export"]:
            export.main(sys.argv[2:], prog_name="quantkit export", standalone_mode=False)
        else:
            from .cli import cli

            cli.main(standalone_mode=False)
            if (job := sys.modules.get("quantkit.distributed")) is not None:  # imported by a command that ran a job
                job.finish()
    except QuantkitError as e:
        close_bars()
        # under torchrun the first process's bar may be open on the same terminal: a line of its own
        job = sys.modules.get("quantkit.distributed")  # not imported: no job (export runs without torch)
        lead = "\n" if job is not None and job.rank() > 0 else ""  # a log file holds the bar's line unended too
        click.echo(f"{lead}error: {e}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.exceptions.NoArgsIsHelpError as e:  # `quantkit` alone: its message is the whole help
        click.echo(f"error: no command given: pass one of {', '.join(e.ctx.command.list_commands(e.ctx))} (see quantkit "
                   "--help)", err=True)
        sys.exit(2)
    except click.ClickException as e:  # a usage error (2): one line, as every other bad input
        ctx = getattr(e, "ctx", None)
        click.echo(f"error: {e.format_message()}{f' (see {ctx.command_path} --help)' if ctx else ''}", err=True)
        sys.exit(e.exit_code)
    except Exception as e:  # after click's, which re-raising here would pass by
        if (line := out_of_memory(e, sys.argv[1] if sys.argv[1:] else "")) is None:
            raise
        close_bars()
        click.echo(f"error: {line}", err=True)
        sys.exit(2)
    finally:
        COMMAND_LINE.reset(spelling)  # the tests run it in their own process, then call the API
