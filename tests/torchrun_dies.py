"""`quantkit quantize` under torchrun, with rank 1 dying in the middle of layer 1 (tests/test_distributed.py)."""
import os

from quantkit.command import main
from quantkit.quantizers import gptq

real = gptq.quantize


def dies(*args, **kwargs):
    if os.environ["RANK"] == "1" and ".layers.1." in kwargs["name"]:
        os._exit(3)
    return real(*args, **kwargs)


gptq.quantize = dies
main()
