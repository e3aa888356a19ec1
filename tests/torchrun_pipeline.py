"""A deployment pipeline under torchrun that made its own process group and calls quantkit.quantize: on rank 0
alone (alone=True), the others waiting for it at the pipeline's next barrier, as they do while rank 0 trains
an adapter alone; then on every rank, where quantize shares the work over the caller's group
(tests/test_distributed.py)."""
import sys

import torch.distributed as dist

import quantkit
from quantkit.trainer import train

model, data, out = sys.argv[1:]
settings = dict(method="gptq", group_size=32, calib_data=data, calib_samples=24, calib_seqlen=64, progress=False)
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    quantkit.quantize(model, out=f"{out}/alone", alone=True, **settings)
    train(model, data=data, out=f"{out}/adapter", steps=1, seqlen=32, batch_size=3, rank=4, eval_fraction=0,
          progress=False, alone=True)  # a batch of 3 would not split over the job's 2 processes
dist.barrier()
quantkit.quantize(model, out=f"{out}/every", **settings)
dist.barrier()
dist.destroy_process_group()
