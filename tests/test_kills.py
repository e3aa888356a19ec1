"""kill -9 at random moments of quantize (shards, streamed GGUF), export (from a model, and a GGUF
requantized), train, merge and the embedded model's cache fill (tests/kills.py): after every kill no output exists unless it is the complete
one, and the runs after it finish with the reference's output, resuming where the command can."""
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import kills

from .conftest import ROOT

POINTS = 5  # kills per scenario


@pytest.mark.slow
def test_no_kill_leaves_an_output_that_looks_complete(tmp_path):
    run = subprocess.run([sys.executable, "-m", "tests.kills", "--points", str(POINTS), "--root", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    counts = {c["scenario"]: c for c in map(json.loads, run.stdout.splitlines())}
    assert set(counts) == set(kills.NAMES)
    for c in counts.values():
        assert c["kills"] == POINTS and c["finished"] >= 1, c
    # some kills land past a saved progress, and the reruns go on from it (which ones is up to timing;
    # test_pipeline and test_trainer resume from a chosen layer and step)
    assert sum(c["resumed"] for c in counts.values()) >= 1, counts


def write(work: Path, halves: bool) -> int:
    """An output written in two halves: in place (halves), or under a hidden name and renamed; then
    more work after it, where a kill finds the output complete. Like quantkit, it refuses to replace
    an output."""
    if (work / "out").exists():
        print("error: out already exists")
        return 2
    out = work / (".out.tmp" if not halves else "out")
    out.write_text("a" * 100)  # truncates what a killed run left
    time.sleep(0.1)
    with out.open("a") as f:
        f.write("b" * 100)
    if not halves:
        os.replace(out, work / "out")
    time.sleep(0.1)
    return 0


def test_the_harness_passes_an_atomic_writer_killed_after_its_output_is_complete(tmp_path):
    s = kills.Scenario(lambda work, rerun: write(work, False), ["out"])
    counts = kills.run("atomic", s, 10, random.Random(0), tmp_path)
    assert counts["kills"] == 10 and counts["finished"] >= 1


def test_the_harness_catches_an_output_written_in_place(tmp_path):
    s = kills.Scenario(lambda work, rerun: write(work, True), ["out"])
    with pytest.raises(kills.Failed, match="not the complete output"):
        kills.run("in-place", s, 10, random.Random(0), tmp_path)
