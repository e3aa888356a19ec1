"""`python -m quantkit ...`, and `torchrun --nproc-per-node N -m quantkit quantize ...`."""
from .command import main

main()
