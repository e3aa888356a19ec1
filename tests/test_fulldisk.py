"""A full disk, for real: tests/fulldisk.py runs each writer on a small tmpfs in a mount namespace
of its own. Each ends in one `error:` line naming the output and the bytes it needs, leaves no
output that is not complete (a previous one replaced with --overwrite stays as it was), and the
same command writes the complete output once there is space, resuming where it can."""
import json
import shutil
import subprocess
import sys

import pytest

from .conftest import ROOT

UNSHARE = ["unshare", "--user", "--map-root-user", "--mount"]


def namespaces() -> bool:
    return shutil.which("unshare") is not None and subprocess.run([*UNSHARE, "true"]).returncode == 0


@pytest.mark.skipif(not namespaces(), reason="no user and mount namespaces here, so no tmpfs can be mounted")
def test_full_disk(tmp_path):
    run = subprocess.run([*UNSHARE, sys.executable, "-m", "tests.fulldisk", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    cases = {c["case"]: c for c in map(json.loads, [s for s in run.stdout.splitlines() if s.startswith("{")])}
    assert set(cases) == {"quantize-refused", "quantize-midway", "gguf-midway", "overwrite", "train-checkpoint",
                          "merge", "merge-midway", "save-base", "cache"}
    for c in cases.values():
        where, name = c["path"].rsplit("/", 1)  # the output, or the partial one a checkpoint goes into
        assert c["code"] == 2 and c["line"].startswith("error: "), c
        assert c["path"] in c["line"] or f"{where}/.{name}.partial" in c["line"], c
        assert "needs about" in c["line"] or "(about" in c["line"], c
        assert " free" in c["line"] and "free some space" in c["line"], c
        assert not [n for n in c["left"] if not n.startswith(".")] or c["case"] in ("overwrite", "cache"), c
        if c["case"] != "cache":
            assert c["intact"] and c["rerun_code"] == 0 and c["rerun_same"], c
            assert c["left_after_rerun"] == [c["path"].rsplit("/", 1)[1]], c
    assert cases["overwrite"]["left"] == ["q"]  # the previous export, as it was ("intact")
    assert "is kept" in cases["train-checkpoint"]["line"]  # the first checkpoint stays for --resume
    assert "resumes" in cases["gguf-midway"]["line"] and cases["gguf-midway"]["left"]  # its progress stays
    assert cases["merge"]["line"].startswith(f"error: {cases['merge']['path']}: the merged model needs about")
    assert cases["merge-midway"]["line"].startswith("error: out of disk space writing")  # past the check before
    assert "resumes" in cases["merge-midway"]["line"] and ".m.progress.pt" in cases["merge-midway"]["left"]
    # the cache: the GGUF it fits is complete, the float entry it does not fit was never begun
    assert [n for n in cases["cache"]["left"] if not n.endswith(".lock")] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


@pytest.mark.parametrize("source", ["model", "gguf"])
def test_a_write_the_file_system_refuses_is_one_line(tiny_dir, tmp_path, source):
    """Only a full disk was one line: a quota (a cluster's usual way to run out), a file over the largest
    the file system or ulimit takes, a failing disk gave a traceback. Here ulimit's (EFBIG: Python ignores
    SIGXFSZ), writing a GGUF from a model directory (streamed: it resumes after its last finished layer)
    and from a GGUF (requantized whole: it starts over); the same command then writes the whole file."""
    import resource

    import quantkit

    src = tiny_dir
    if source == "gguf":
        src = tmp_path / "f32.gguf"
        quantkit.api.export_gguf(quantkit.load(tiny_dir), src, "F32", progress=False)
    command = [sys.executable, "-m", "quantkit", "export", src, "--gguf-type", "F16"]
    whole = subprocess.run([*command, "--out", tmp_path / "whole.gguf"], capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr[-2000:]
    limit = (tmp_path / "whole.gguf").stat().st_size * 3 // 4  # past the first layer, short of the second

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cut = subprocess.run([*command, "--out", tmp_path / "out.gguf"], capture_output=True, text=True,
                         preexec_fn=small_files)
    lines = cut.stderr.replace("\r", "\n").strip().splitlines()
    assert cut.returncode == 2 and "Traceback" not in cut.stderr, cut.stderr[-3000:]
    assert lines[-1].startswith(f"error: could not write {tmp_path / 'out.gguf'}") and "(File too large)" in lines[-1]
    assert not (tmp_path / "out.gguf").exists()
    streamed = source == "model"
    assert ("resumes after the last finished layer" in lines[-1]) == streamed
    assert (tmp_path / ".out.gguf.progress.pt").is_file() == streamed  # what a resumed run goes on from
    again = subprocess.run([*command, "--out", tmp_path / "out.gguf"], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (tmp_path / "out.gguf").read_bytes() == (tmp_path / "whole.gguf").read_bytes()


@pytest.mark.parametrize("command", ["requantize", "save-base"])
def test_a_disk_full_at_the_commit_is_one_line(tiny_dir, tmp_path, capsys, monkeypatch, command):
    """A file system that reports the full disk only when the data is forced out (NFS, quotas, thin
    volumes: at the commit's fsync) gave a traceback: the commit ran after the space check's scope."""
    import errno

    import quantkit
    from quantkit import atomic

    from .conftest import TEST, refused

    src = tmp_path / "f32.gguf"
    quantkit.api.export_gguf(quantkit.load(tiny_dir), src, "F32", progress=False)

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "fsync", full)
    args = ["export", src, "--gguf-type", "F16", "--out", tmp_path / "out"] if command == "requantize" else \
        ["eval", tiny_dir, "--base", tiny_dir, "--data", TEST, "--ctx", 64, "--max-windows", 2, "--save-base",
         tmp_path / "out"]
    refused(args, capsys, monkeypatch, f"out of disk space writing {tmp_path / 'out'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f32.gguf"]


def test_a_killed_requantizations_partial_counts_as_free(tiny_dir, tmp_path, capsys, monkeypatch):
    """After a kill, the next run's space check counted the partial file it replaces as taken: on a
    disk with room for one copy it was refused ("free some space"), naming nothing it could free."""
    import quantkit
    from quantkit import errors

    from .conftest import cli

    src = tmp_path / "f32.gguf"
    quantkit.api.export_gguf(quantkit.load(tiny_dir), src, "F32", progress=False)
    args = ["export", src, "--gguf-type", "Q8_0", "--out"]
    assert cli([*args, tmp_path / "whole.gguf"], capsys, monkeypatch)[0] == 0
    size = (tmp_path / "whole.gguf").stat().st_size
    (tmp_path / ".out.gguf.partial").write_bytes(bytes(size // 2))  # as a kill halfway leaves it
    monkeypatch.setattr(errors, "free_space", lambda path: size - size // 4)  # room once the partial goes
    assert cli([*args, tmp_path / "out.gguf"], capsys, monkeypatch)[0] == 0
    assert (tmp_path / "out.gguf").read_bytes() == (tmp_path / "whole.gguf").read_bytes()
