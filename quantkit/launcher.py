"""What torchrun (or a launcher setting the same variables) told this process, read without torch: the
command line consults it before torch-free commands such as a GGUF requantization."""
import os
import socket

from .errors import QuantkitError


def launched() -> int:
    """The number of processes the environment says this job has (torchrun's WORLD_SIZE; 1 without)."""
    size = os.environ.get("WORLD_SIZE", "1").strip()
    if not size.isdecimal() or int(size) < 1:
        raise QuantkitError(f"WORLD_SIZE={size!r} is not a number of processes: launch with torchrun, or unset it")
    return int(size)


def check(size: int) -> None:
    """Refuse the variables of a job of size processes that torch would fail on deep in its rendezvous
    (a traceback), or wait on for a peer that is not coming: a process that inherited WORLD_SIZE from
    a torchrun or SLURM job without the rest, a rank outside the job, a port that is not one."""
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise QuantkitError(f"WORLD_SIZE={size} is set, but not {', '.join(missing)}, so this process was not started "
                            "by torchrun: launch it with torchrun --nproc-per-node N, or unset WORLD_SIZE")
    rank, port = os.environ["RANK"].strip(), os.environ["MASTER_PORT"].strip()
    if not rank.isdecimal() or int(rank) >= size:
        raise QuantkitError(f"RANK={rank!r} is not a process of a job of WORLD_SIZE={size}: launch with torchrun")
    if not port.isdecimal() or not 0 < int(port) < 2**16:
        raise QuantkitError(f"MASTER_PORT={port!r} is not a port: launch with torchrun, or give a port such as 29500")
    addr = os.environ["MASTER_ADDR"].strip()
    try:  # a name that does not resolve: the rendezvous would retry it until its timeout
        socket.getaddrinfo(addr, int(port))
    except (OSError, UnicodeError) as e:
        raise QuantkitError(f"MASTER_ADDR={addr!r} does not resolve ({getattr(e, 'strerror', None) or e}): give the "
                            "first node's address or host name, as torchrun's --master-addr") from None
