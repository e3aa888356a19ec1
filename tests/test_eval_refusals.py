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
