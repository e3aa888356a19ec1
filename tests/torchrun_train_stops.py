"""`quantkit train` under torchrun, with every process stopping after step 3, or those STOPPING names
(tests/test_trainer.py)."""
import os

from quantkit import trainer
from quantkit.command import main

real = trainer.train


def stops(*args, **kwargs):
    def callback(record):
        if record["step"] == 3 and os.environ["RANK"] in os.environ.get("STOPPING", os.environ["RANK"]).split(","):
            os._exit(3)
    return real(*args, callback=callback, **kwargs)


trainer.train = stops
main()
