"""Each benchmark measurement runs in its own child process, so its time and peak RSS are its own."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def child(script: str, python: str = sys.executable, env: dict[str, str] | None = None, **kw) -> dict:
    """Run `script run --key=value ...` (by python: another environment's; env: with these variables
    set too) and return the JSON object its last line prints."""
    args = [python, script, "run"] + [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    done = subprocess.run(args, capture_output=True, text=True, env=os.environ | (env or {}))
    if done.returncode:  # the child's own error, not only its exit status
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"{' '.join(args[1:])} failed (exit {done.returncode}):\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def flag(s: str) -> bool:
    """A child's True/False argument."""
    return s == "True"


def ints(s: str) -> list[int]:
    """A comma-separated list of whole numbers (an argparse type: a bad one is argparse's one-line error)."""
    try:
        return [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of whole numbers, like 0,1") from None
