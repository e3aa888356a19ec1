import json
import re
import sys

import torch

import quantkit
from quantkit.command import main

from .conftest import TEST, VALID, cli


def test_a_note_is_a_note_line():
    """quantkit's advice (errors.Note, a warning an API caller can filter) reaches the command line's
    stderr as one `note:` line, other warnings as `warning:` lines."""
    from quantkit.command import warning_line
    from quantkit.errors import Note

    assert warning_line(Note("x costs y"), Note, "f.py", 1) == "note: x costs y\n"
    assert warning_line(UserWarning("z"), UserWarning, "f.py", 1) == "warning: z\n"


def run(args, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["quantkit", *map(str, args)])
    main()


def test_the_api_names_what_it_returns():
    """Every public name resolves, and each public function's return type is among them, so a caller
    can annotate with quantkit.Perplexity instead of reaching into quantkit.evals."""
    import typing

    names = {n: getattr(quantkit, n) for n in quantkit.__all__}
    for n, f in names.items():
        if callable(f) and not isinstance(f, type):
            ret = typing.get_type_hints(f)["return"]
            standard = typing.get_origin(ret) is not None or ret.__module__ in ("builtins", "pathlib")
            assert standard or any(ret is t for t in names.values()), (n, ret)


def test_quantize_then_eval_the_export(tiny_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "q"
    scored = []  # "before" took the loaded model, which stays on the CPU in float32 where "after" (a path)
    evaluate = quantkit.api.evaluate  # goes to the GPU in float16 when there is one: both from a path now
    monkeypatch.setattr(quantkit.api, "evaluate", lambda model, *a, **kw: scored.append(model) or evaluate(model, *a, **kw))
    run(["quantize", tiny_dir, "--bits", 3, "--group-size", 32, "--asym", "--out", out,
         "--eval-data", TEST, "--eval-windows", 2, "--ctx", 128], monkeypatch)
    printed = capsys.readouterr().out
    assert "before: perplexity" in printed and "after: perplexity" in printed
    assert [str(m) for m in scored] == [str(tiny_dir), str(out)]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["checkpoint_format"] == "gptq_v2"
    run(["eval", out, "--data", TEST, "--ctx", 128, "--max-windows", 3, "--json"], monkeypatch)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["windows"] == 3 and result["tokens"] == 3 * 63 and result["protocol"] == "llamacpp"
    # the CLI's figure is the API's figure on the reloaded export, which runs packed
    api = quantkit.evaluate(quantkit.load(out, packed=True), TEST, "llamacpp", 128, 3, progress=False)
    assert result["perplexity"] == api.perplexity
    run(["eval", out, "--data", TEST, "--ctx", 128, "--max-windows", 3, "--json", "--dequantized"], monkeypatch)
    fake = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["perplexity"]
    assert abs(fake - result["perplexity"]) <= 1e-5 * fake  # float32 both ways: summation order only
    after = float(printed.split("after: perplexity ")[1].split()[0])
    assert abs(after - quantkit.evaluate(out, TEST, "llamacpp", 128, 2, progress=False).perplexity) < 0.01 * after
    assert torch.isfinite(torch.tensor(result["perplexity"]))


def test_a_quantization_refused_on_the_model_costs_no_before_perplexity(tiny_dir, tmp_path, monkeypatch, capsys):
    """Checks that need the model (the AWQ layout's widths, an --imatrix file, rules), and --out's lock,
    ran after the "before" perplexity: on a 7B model a whole evaluation spent on a command then refused."""
    (tmp_path / "rules.json").write_text('[{"match": "nothing", "bits": 8}]')
    for args, said in ((["--method", "awq", "--bits", 3, "--format", "awq", "--calib-data", VALID],
                        "4-bit weights only"), (["--rules", tmp_path / "rules.json"], "matches no linear")):
        code, out, err = cli(["quantize", tiny_dir, "--out", tmp_path / "q", *args, "--eval-data", TEST,
                              "--eval-windows", 1, "--ctx", 64], capsys, monkeypatch)
        assert code == 2 and said in err[-1] and "before:" not in out, (out, err)
        assert not (tmp_path / "q").exists()
    from quantkit import atomic

    with atomic.locked(tmp_path / "q", "out"):  # another job writing --out
        code, out, err = cli(["quantize", tiny_dir, "--out", tmp_path / "q", "--eval-data", TEST, "--eval-windows", 1,
                              "--ctx", 64], capsys, monkeypatch)
    assert code == 2 and "being written by another quantkit process" in err[-1] and "before:" not in out, (out, err)


def test_quantize_shows_progress(tiny_dir, tmp_path, monkeypatch, capsys):
    run(["quantize", tiny_dir, "--out", tmp_path / "q"], monkeypatch)
    err = capsys.readouterr().err
    assert "quantizing layers" in err and "2/2" in err and "MiB written" in err and "peak RSS" in err


def test_no_command_is_one_line(capsys, monkeypatch):
    """`quantkit` alone printed the whole help as an error: message, then "(see quantkit --help)"."""
    code, out, err = cli([], capsys, monkeypatch)
    assert code == 2 and err == ["error: no command given: pass one of eval, export, lm-eval, merge, quantize, report, "
                                 "train (see quantkit --help)"], err


def test_device_cpu_with_an_index_is_the_cpu(tiny_dir, tmp_path, monkeypatch, capsys):
    """--device cpu:0 was called a damaged model file ("re-download it"): safetensors' reader takes no index.
    quantize took it first; eval, eval --base and lm-eval after."""
    run(["quantize", tiny_dir, "--method", "rtn", "--group-size", 32, "--device", "cpu:0", "--out", tmp_path / "q"],
        monkeypatch)
    assert (tmp_path / "q" / "config.json").is_file()
    text = tmp_path / "t.txt"
    text.write_text(TEST.read_text()[:20_000])
    # the perplexity before and after ran where a GPU would be (in float16), whatever --device said
    import quantkit.api

    devices, evaluate = [], quantkit.api.evaluate
    monkeypatch.setattr(quantkit.api, "evaluate", lambda *a, **kw: devices.append(kw.get("device")) or evaluate(*a, **kw))
    run(["quantize", tiny_dir, "--method", "rtn", "--group-size", 32, "--device", "cpu", "--out", tmp_path / "e",
         "--eval-data", text, "--ctx", 64, "--eval-windows", 1], monkeypatch)
    assert devices == ["cpu", "cpu"]
    monkeypatch.setattr(quantkit.api, "evaluate", evaluate)
    for args in (["eval", tmp_path / "q", "--data", text, "--ctx", 64, "--max-windows", 1],
                 ["eval", tmp_path / "q", "--base", tiny_dir, "--data", text, "--ctx", 64, "--max-windows", 1],
                 ["lm-eval", tiny_dir, "--tasks", "dolly_mc", "--limit", 1, "--max-length", 256]):
        code, out, err = cli([*args, "--device", "cpu:0"], capsys, monkeypatch)
        assert code == 0 and "float32 on cpu" in "".join(out) + "".join(err) or args[0] == "lm-eval" and code == 0, err
        if args[0] == "eval":  # one window is "1 window", not "1 windows"
            assert re.search(r"\b1 window\b", "".join(out)), out


def answered(args: list[list], modules: set[str]) -> tuple[list, list[str], str]:
    """Each command line run in turn in one fresh interpreter: their exit codes (0 when main returns),
    which of modules were imported by the end, and the error output."""
    import subprocess

    code = ("import sys\nfrom quantkit.command import main\ncodes = []\n"
            f"for args in {[[str(a) for a in c] for c in args]!r}:\n"
            "    sys.argv = ['quantkit', *args]\n"
            "    try:\n        main()\n        codes.append(0)\n    except SystemExit as e:\n        codes.append(e.code)\n"
            f"import json\nprint(json.dumps([codes, sorted(set({sorted(modules)!r}) & set(sys.modules))]))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    codes, imported = json.loads(run.stdout.splitlines()[-1])
    return codes, imported, run.stderr


def test_help_and_mistakes_in_options_are_answered_without_the_libraries(tmp_path):
    """`quantkit --help`, every command's --help and an unknown or malformed option are answered before
    torch is imported; options that contradict each other, or settings out of range, before transformers.
    Both took about 10 s on a 2-core machine, where these answers take well under one and about 4 s."""
    helps = [["--help"], ["--version"], *[[c, "--help"] for c in ("quantize", "eval", "lm-eval", "report", "train",
                                                                   "merge", "export")]]
    early = [["quantize", "--bogus"], ["quantize", "--bits", "4.5", "--out", tmp_path / "q"], ["eval", "--max-kld", "0.1"]]
    codes, imported, err = answered(helps + early, {"torch", "transformers", "numpy"})
    assert (codes, imported) == ([0] * len(helps) + [2] * len(early), []), err
    late = [["quantize", "--method", "rtn", "--calib-samples", "8", "--out", tmp_path / "q"],
            ["quantize", "--method", "nf4", "--block-size", "100", "--out", tmp_path / "q"],
            ["train", "--data", VALID, "--out", tmp_path / "a", "--rank", "0"],
            ["train", "--data", VALID, "--out", tmp_path / "a", "--bits", "3"]]
    codes, imported, err = answered(late, {"transformers", "peft"})
    assert (codes, imported) == ([2] * len(late), []), err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == len(late) and "Traceback" not in err, err
