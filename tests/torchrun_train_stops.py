"""`quantkit train` under torchrun, with every process stopping after step 3 (tests/test_trainer.py)."""
import os

from quantkit import trainer
from quantkit.command import main

real = trainer.train


def stops(*args, **kwargs):
    def callback(record):
        if record["step"] == 3:
            os._exit(3)
    return real(*args, callback=callback, **kwargs)


trainer.train = stops
main()
