"""Several processes under torchrun (`torchrun --nproc-per-node N quantkit quantize ...`): each takes
its share of the calibration batches, the Hessians are summed across processes, each quantizes some
of a layer's linears and sends the results to the others (AWQ: the scale searches judged by block
losses run on every process together, its other searches and clippings are shared out like the
linears), and rank 0 writes the output. gloo on
CPUs, NCCL on GPUs. In a single process every function here does nothing (shared only moves its value
to the device asked for)."""
from __future__ import annotations

import os
import re
import sys
import threading
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import timedelta
from typing import Iterator, TypeVar

import torch
import torch.distributed as dist

from . import launcher
from .errors import QuantkitError, ResumableError, option

T = TypeVar("T")


# False while a process works by itself inside a process group (quantize(alone=True))
JOINS: ContextVar[bool] = ContextVar("JOINS", default=True)


def world() -> int:
    return dist.get_world_size() if JOINS.get() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if JOINS.get() and dist.is_initialized() else 0


@contextmanager
def joined(joins: bool) -> Iterator[None]:
    """Inside, this process takes part in its torchrun job or process group, or not (joins=False: it
    works alone, and every function here but finish acts as in a single process). The setting is the
    calling thread's: a thread started inside begins with the default (joins)."""
    token = JOINS.set(joins)
    try:
        yield
    finally:
        JOINS.reset(token)


JOIN_S = 300  # a job's processes start together: one not there by then is not coming


def init(device: torch.device) -> torch.device:
    """Join the torchrun job this process was launched in, if any (WORLD_SIZE > 1). A process that
    inherited WORLD_SIZE without the rest of torchrun's variables is refused; one whose peers do not
    join within JOIN_S says so and exits, where it waited 30 minutes, deaf to SIGTERM. The device this
    process works on: a GPU by its number (under torchrun, its LOCAL_RANK's), since safetensors' reader
    takes a bare "cuda" for GPU 0, where every process would then read its weights."""
    # quantize(alone=True): this process's environment is its pipeline's business
    if JOINS.get() and (size := launcher.launched()) >= 2 and not dist.is_initialized():
        join(size, device)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None \
        else device


def join(size: int, device: torch.device) -> None:
    launcher.check(size)
    if device.type == "cuda":
        if device.index is not None:  # every process on one GPU: NCCL refuses it, as a peer that "stopped"
            raise QuantkitError(f"{option('device', str(device))} under torchrun: each process takes the GPU of its "
                                f"LOCAL_RANK: pass {option('device', 'cuda')}, and choose the GPUs with "
                                "CUDA_VISIBLE_DEVICES")
        # one visible GPU per process (a scheduler's) is GPU 0 to each
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())

    def absent() -> None:  # the rendezvous blocks in C++: no exception reaches it
        print(f"error: the other processes of this job (WORLD_SIZE={size}) did not join at "
              f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within {JOIN_S} s: launch them together "
              "with torchrun, or unset WORLD_SIZE", file=sys.stderr, flush=True)
        os._exit(2)

    watchdog = threading.Timer(JOIN_S, absent)
    watchdog.daemon = True
    watchdog.start()
    try:
        with collective("starting"):
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=30))
            dist.barrier()  # NCCL (and torchrun's own store) let init return before the peers are there
    finally:
        watchdog.cancel()


def finish() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


TRANSPORT = re.compile(r"gloo|nccl|connection (closed|reset)|broken pipe", re.IGNORECASE)  # a lost peer's error


@contextmanager
def collective(what: str, among: bool = False) -> Iterator[None]:
    """A process that dies leaves the others' collectives failing: one clear error instead. among: the
    block does more than collectives (FSDP's forwards and backwards): only the transport's errors are a
    lost peer's (not running out of memory)."""
    try:
        yield
    except (RuntimeError, dist.DistError) as e:
        if among and not isinstance(e, dist.DistNetworkError) and (
                isinstance(e, torch.OutOfMemoryError) or not TRANSPORT.search(str(e)) or "out of memory" in str(e)):
            raise  # this process's own fault (NCCL reports running out of memory as its own error)
        # gloo's "[.../pair.cc:553] Connection closed by peer ...": its first sentence, without the source path
        reason = re.sub(r"^\[[^\]]*\]\s*", "", (str(e).strip().splitlines() or [type(e).__name__])[0]).split(". ")[0]
        raise Stopped(f" while {what} ({reason})") from None


@contextmanager
def first_refuses(what: str) -> Iterator[None]:
    """Around what rank 0 alone does before the work (open the output, lock a file): an error of input
    it raises there stops every process at the end of the block, before any layer, the others saying
    that rank 0 could not do what (they would go on to wait for it, and then report it stopped)."""
    error = None
    try:
        yield
    except QuantkitError as e:
        if world() == 1:
            raise
        error = e
    if agree(int(error is None), "min", f"waiting for the first process to {what}") == 0:
        raise error or QuantkitError(f"the first process of this torchrun job could not {what} (its error says "
                                     "why): nothing was done")


class Stopped(ResumableError):
    """The job lost a process (how: when, and why as far as this process can tell): what every process
    finished stays, and the same command resumes, unless the command says otherwise."""

    def __init__(self, how: str):
        self.how = how
        super().__init__(f"another process of this torchrun job stopped{how}: what was finished is kept; fix what "
                         "stopped it (see its error) and run the same command again to resume")


def share(items: list[T]) -> list[T]:
    """This process's share of items: every world()-th, from its rank."""
    return items[rank()::world()]


def owner(j: int) -> int:
    """The rank that quantizes the j-th linear of a stage."""
    return j % world()


def sum_(t: torch.Tensor, what: str = "summing calibration statistics") -> torch.Tensor:
    """t summed over the processes, in place."""
    if world() > 1:
        with collective(what):
            dist.all_reduce(t)
    return t


def gather_rows(t: torch.Tensor, what: str = "gathering the measurement") -> torch.Tensor:
    """Every process's rows of t (one per item share() dealt it), in the items' order, on the CPU.
    Each row comes from one process and zeros from the others, so the sum is exact."""
    if world() == 1:
        return t
    count = sum_(torch.tensor([len(t)], dtype=torch.int64, device=collective_device()), what)
    full = torch.zeros(int(count.item()), *t.shape[1:], dtype=t.dtype, device=collective_device())
    full[rank()::world()] = t.to(full.device)
    return sum_(full, what).cpu()


def collective_device() -> str:
    """Where tensors for a collective live: NCCL reduces only GPU tensors."""
    return "cuda" if world() > 1 and dist.get_backend() == "nccl" else "cpu"


def agree(value: int, op: str, what: str = "agreeing where to start") -> int:
    """The min or max of an integer over the processes (what: the step, for the error if one stops)."""
    if world() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device())
    with collective(what):
        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
    return int(t.item())


def broadcast(obj: T, src: int) -> T:
    """obj as rank src has it (CPU tensors inside it travel pickled)."""
    if world() == 1:
        return obj
    box = [obj]
    with collective("sharing quantized linears and scales"):
        dist.broadcast_object_list(box, src=src)
    return box[0]


def shared(value, src: int, device: str | torch.device):
    """value (a quantized tensor, a tuple of tensors, or None) as process src has it, on device: under
    torchrun sent from src to the others through the CPU, and their own value dropped."""
    if world() > 1:
        if rank() != src:
            return _moved(broadcast(None, src), device)
        sent = _moved(value, "cpu")
        broadcast(sent, src)
        if torch.device(device).type == "cpu":
            return sent
    return _moved(value, device)


def _moved(value, device: str | torch.device):
    if value is None:
        return None
    return tuple(t.to(device) for t in value) if isinstance(value, tuple) else value.to(device)
