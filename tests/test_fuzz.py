"""The readers of untrusted files under fuzzing (tests/fuzz.py, run as CI's derandomized subset):
every mutated input of every kind loads, with finite weights, or is refused with QuantkitError (the
CLI's one `error:` line, exit 2); no other exception, hang or unbounded allocation."""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import fuzz

from .conftest import ROOT

EXAMPLES = 150  # per kind: about 10 s each
SLOW = {"progress": 8, "base": 60, "imatrix": 60, "measurement": 30}  # a quantization resumed (or started
# afresh), a comparison, two weighted GGUF quantizations, an EXL2 quantization, per input


@pytest.mark.slow
def test_every_mutated_input_loads_or_is_refused(tmp_path):
    def fuzzed(i: int, kinds: list[str], n: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tests.fuzz", *kinds, "--examples", str(n), "--root", str(tmp_path / str(i))],
                              cwd=ROOT, capture_output=True, text=True, timeout=1200)

    jobs = [([k for k in fuzz.KINDS if k not in SLOW], EXAMPLES), *(([k], n) for k, n in SLOW.items())]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # a run per core, each in its own root
        runs = list(pool.map(fuzzed, range(len(jobs)), *zip(*jobs)))
    counts = {}
    for run in runs:
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
        counts |= {c["kind"]: c for c in map(json.loads, run.stdout.splitlines())}
    assert set(counts) == set(fuzz.KINDS)
    for kind, c in counts.items():
        assert c["examples"] == SLOW.get(kind, EXAMPLES) == c["loaded"] + c["refused"], c
        # the mutations reach past the first check: some inputs still load, some are refused
        assert kind == "progress" or (c["loaded"] > 0 and c["refused"] > 0), c
