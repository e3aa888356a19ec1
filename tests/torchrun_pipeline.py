"""A deployment pipeline under torchrun that made its own process group and calls quantkit.quantize: on rank 0
alone (alone=True), the others waiting for it at the pipeline's next barrier; then on every rank, where
quantize shares the work over the caller's group (tests/test_distributed.py)."""
import sys

import torch.distributed as dist

import quantkit

model, data, out = sys.argv[1:]
settings = dict(method="gptq", group_size=32, calib_data=data, calib_samples=24, calib_seqlen=64, progress=False)
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    quantkit.quantize(model, out=f"{out}/alone", alone=True, **settings)
dist.barrier()
quantkit.quantize(model, out=f"{out}/every", **settings)
dist.barrier()
dist.destroy_process_group()
