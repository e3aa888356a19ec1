"""Evaluation refusals: each before any model loads, naming the option to change."""
import os

import pytest

from .conftest import TEST, refused


def test_unwritable_save_base_directory_is_refused_by_its_option(tiny_dir, tmp_path, capsys, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: os.fspath(p) != str(ro) and access(p, mode, **kw))
    monkeypatch.setattr("quantkit.api.load", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("loaded")))
    refused(["eval", tiny_dir, "--base", tiny_dir, "--data", TEST, "--ctx", 64, "--max-windows", 1,
             "--save-base", ro / "base.logits"], capsys, monkeypatch,
            f"{ro}: not writable by this user: choose another --save-base")


@pytest.mark.parametrize("option,value", [("--max-kld", "nan"), ("--max-kld", "-0.1"), ("--min-same-top", "1.5"),
                                          ("--max-ppl-increase", "nan")])
def test_gate_limits_that_are_not_limits_are_refused(tiny_dir, capsys, monkeypatch, option, value):
    """A NaN limit failed every run (exit 1, as a broken gate), a negative KLD limit too."""
    monkeypatch.setattr("quantkit.api.compare", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("compared")))
    refused(["eval", tiny_dir, "--base", tiny_dir, "--data", TEST, option, value], capsys, monkeypatch,
            f"{option} {float(value)} is not a limit: pass a number from")


def test_a_base_being_saved_by_another_process_names_its_option(tiny_dir, tmp_path, capsys, monkeypatch):
    from quantkit.atomic import Staged

    path = tmp_path / "base.logits"
    held = Staged(path, overwrite=True, directory=False)  # another process's save, under way
    refused(["eval", tiny_dir, "--base", tiny_dir, "--data", TEST, "--ctx", 64, "--max-windows", 1, "--save-base", path],
            capsys, monkeypatch, "being written by another quantkit process: wait for it to finish or choose another "
            "--save-base")
    held.lock.close()


NOT_LOADED = ("quantkit.api.load", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("loaded")))


@pytest.mark.parametrize("command,value,match", [
    ("eval", "foo", "unknown device 'foo': use cpu or cuda"),
    ("eval", "mps", "device 'mps' is not supported"),
    ("compare", "foo", "unknown device 'foo': use cpu or cuda"),
    ("lm-eval", "foo", "unknown device 'foo': use cpu or cuda"),
])
def test_a_device_torch_cannot_use_is_named_before_the_model_loads(tiny_dir, capsys, monkeypatch, command, value, match):
    """eval, eval --base and lm-eval moved the model there and failed with a traceback (exit 1)."""
    monkeypatch.setattr(*NOT_LOADED)
    monkeypatch.setattr("quantkit.modelio.load", NOT_LOADED[1])
    args = {"eval": ["eval", tiny_dir, "--data", TEST], "compare": ["eval", tiny_dir, "--base", tiny_dir, "--data", TEST],
            "lm-eval": ["lm-eval", tiny_dir, "--tasks", "dolly_mc"]}[command]
    refused([*args, "--device", value], capsys, monkeypatch, match)


def test_missing_data_is_named_before_the_model_loads(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("quantkit.api.load", NOT_LOADED[1])
    refused(["eval", tiny_dir, "--data", tmp_path / "none.txt"], capsys, monkeypatch, "none.txt")


def test_a_saved_base_passed_as_the_model_is_named(tiny_dir, tmp_path, capsys, monkeypatch):
    """It was called a damaged GGUF file, to download again."""
    import quantkit

    saved = tmp_path / "base.logits"
    quantkit.api.write_base(quantkit.load(tiny_dir), saved, TEST.read_text()[:20000], 64, 1, progress=False)
    refused(["eval", saved, "--base", tiny_dir, "--data", TEST], capsys, monkeypatch,
            "is a saved base (log-probabilities, not a model): pass it as --base")


@pytest.mark.parametrize("settings, match", [(dict(max_windows=0), "max_windows=0 scores nothing"),
                                             (dict(ctx=-5), "context -5 is too short"),
                                             (dict(protocol="bad"), "unknown perplexity protocol 'bad'")])
def test_windows_that_cannot_be_cut_are_refused_before_the_model_loads(tiny_dir, monkeypatch, settings, match):
    import quantkit
    from quantkit import api
    from quantkit.errors import QuantkitError

    monkeypatch.setattr(api, "load", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(QuantkitError, match=match):
        quantkit.evaluate(tiny_dir, TEST, progress=False, **settings)
    if "protocol" not in settings:  # compare takes llama.cpp's protocol only
        with pytest.raises(QuantkitError, match=match):
            quantkit.compare(tiny_dir, tiny_dir, TEST, progress=False, **settings)
