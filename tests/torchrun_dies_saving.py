"""`quantkit quantize` under torchrun, with rank $KILLED (1 by default) killed as its progress after layer 0
replaces its last, once the other's has (tests/test_distributed.py): the processes' saved progress differs."""
import os
import pathlib
import time

from quantkit.command import main

real = pathlib.Path.replace
killed = os.environ.get("KILLED", "1")


def replace(self, target):
    target = pathlib.Path(target)
    if os.environ["RANK"] == killed and target.name.endswith(f".progress-{killed}.pt"):
        theirs = target.with_name(target.name.replace(f"-{killed}.pt", f"-{1 - int(killed)}.pt"))
        for _ in range(600):
            if theirs.is_file():
                os._exit(3)
            time.sleep(0.1)
    return real(self, target)


pathlib.Path.replace = replace
main()
