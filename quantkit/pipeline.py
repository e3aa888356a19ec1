"""The layer-wise pipeline, the one place where layers flow: each decoder layer is read from the
checkpoint (in its own dtype) onto the device, calibrated and quantized in float32 (a linear's
float32 weight made only while it runs or is quantized), handed to the writer and dropped, so one
layer is in memory at a time. Calibration inputs go through the decoder
with the layers: hooks gather what the quantizer needs from each linear's inputs, the linears are
quantized, and the layer is run again so the next layer sees the quantized layer's outputs.
"""
from __future__ import annotations

import copy
import hashlib
import os
import resource
import sys
import threading
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Protocol

import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import distributed
from .atomic import NEXT, siblings, waiting_path
from .layers import GROUPS, LINEARS, Captured, on_device, run_hooked
from .modelio import LIBC, Model, trim_heap
from .qtensor import QuantizedTensor, per_slice

QuantizeFn = Callable[[str, torch.Tensor, "Hessian | None"], QuantizedTensor]
# a whole layer at once (AWQ): (index, layer, its input batches) -> quantized tensors by name
LayerFn = Callable[[int, torch.nn.Module, list], dict[str, QuantizedTensor]]
# the weights outside the decoder layers (embedding, output): (name, weight) -> quantized, or None to keep it float
OtherFn = Callable[[str, torch.Tensor], "QuantizedTensor | None"]


BATCH = 8  # calibration windows run through a layer at once
CGROUP = Path("/sys/fs/cgroup")  # this process's cgroup (v2), as a container sees it
# what a layer progress holds, raised when its meaning changes: 2 keeps each kind of layer's attention mask
LAYERS_FORMAT = 2


class Writer(Protocol):
    """Where results go as they are made (an exporter): plain tensors by state-dict key, quantized
    linears by module name. start(None) begins afresh; start(state), with a state() taken after a
finished layer, goes on from there."""
    written: int  # bytes so far
    summary: str  # after close(): what was written, in a line

    def add(self, key: str, tensor: torch.Tensor) -> None: ...
    def add_quantized(self, name: str, qt: QuantizedTensor) -> None: ...
    def start(self, state: dict | None, own: str | None = None) -> None: ...  # own: Staged.fresh's
    def resumable(self, state: dict) -> bool: ...
    def state(self) -> dict: ...
    def close(self) -> Path: ...  # complete: renamed into place
    def abort(self, keep: bool = False) -> None: ...  # keep: leave the partial output for a resumed run


class Hessian:
    """Running H = 2 X^T X / n of one linear's inputs: float32 products, float64 sums. H is symmetric,
    so only its blocks of rows from the diagonal on are summed (about half the memory and the products);
    the blocks also keep any product, and the float32 result, from needing a K x K matrix beside
    them (down_proj of a 7B model: 11008^2 values, 0.9 GiB in float64, 0.45 GiB as kept here). The
    first matrix() drops the sums (linears sharing an input share the float32 matrix). diagonal: only
    diag(H) is summed, for a quantizer that reads nothing else (an importance matrix): a K-vector where
    the blocks are K^2 / 2 products a batch."""

    def __init__(self, cols: int, device: str | torch.device = "cpu", diagonal: bool = False):
        step = min(per_slice(cols), -(-cols // 8))  # rows per block: a 16 MiB float32 product at most, 8 blocks at least
        self.blocks = [] if diagonal else [torch.zeros(min(step, cols - r), cols - r, dtype=torch.float64,
                                                       device=device) for r in range(0, cols, step)]
        self.squares = torch.zeros(cols, dtype=torch.float64, device=device) if diagonal else None
        self.cols, self.count, self.result = cols, 0, None

    def add_batch(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        if self.squares is not None:  # in float64 a slice at a time: no copies of the whole batch
            for part in x.split(per_slice(x.shape[1])):
                self.squares.add_(part.double().square_().sum(0))
        r = 0
        for block in self.blocks:
            block.add_(x[:, r:r + len(block)].T @ x[:, r:])
            r += len(block)
        self.count += x.shape[0]

    def reduce(self) -> "Hessian":
        """The sums over the processes of a torchrun job (in one process, nothing changes)."""
        sums = self.blocks if self.squares is None else [self.squares]
        for block in sums:
            distributed.sum_(block)
        count = torch.tensor(self.count, dtype=torch.float64, device=sums[0].device)
        self.count = int(distributed.sum_(count).item())
        return self

    def diagonal(self) -> torch.Tensor:
        """diag(H), in float32."""
        if self.squares is None:
            return self.matrix().diagonal()
        return self.squares.mul(2).div_(max(self.count, 1)).float()

    def matrix(self) -> torch.Tensor:
        if self.squares is not None:
            raise ValueError("a Hessian summed as its diagonal has no matrix")
        if self.result is None:
            # float32 first, each float64 block freed as it goes: the sums and the result never live side by side
            # (down_proj of a 70B model: 3 GiB of sums beside a 3 GiB result, now 1.5 GiB beside it)
            halves = [self.blocks.pop(0).mul_(2).div_(max(self.count, 1)).float() for _ in range(len(self.blocks))]
            h = self.result = torch.empty(self.cols, self.cols, device=halves[0].device)
            r = 0
            while halves:  # each freed once placed
                block = halves.pop(0)  # 2 * sum / n
                s = len(block)
                h[r:r + s, r:] = block
                h[r + s:, r:r + s] = block[:, s:].T
                d = h[r:r + s, r:r + s]
                d.copy_(d.triu() + d.triu(1).T)  # the diagonal block symmetric too: all of H is
                r += s
        return self.result


def capture_inputs(model: Model, windows: torch.Tensor | list[torch.Tensor], batch_size: int,
                   device: str | torch.device = "cpu", store: str | torch.device | None = None,
                   dtype: torch.dtype = torch.float32, share: bool = True) -> list[tuple[torch.Tensor, dict]]:
    """The first decoder layer's inputs (hidden states and keyword arguments), one entry per batch of
    windows (a LongTensor [n, seqlen] cut into batch_size, or the batches themselves, of any lengths;
    share: under torchrun, of this process's share of the batches), computed in dtype; the embedding is
    read for this and dropped after. The hidden states are kept on store (default: device; a CUDA run
    whose activations do not fit keeps them in pinned CPU memory). A model whose layers mask attention
    differently (full and sliding-window layers) gets the mask of each kind, by kind (masked_by_kind)."""
    captured, store, masks = [], torch.device(store or device), {}
    kinds = getattr(model.module.config, "layer_types", None) or []
    firsts = {kind: kinds.index(kind) for kind in dict.fromkeys(kinds)} if len(set(kinds)) > 1 else {}
    last = max(firsts.values(), default=0)

    def grab(module, args, kwargs):
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kwargs.pop("past_key_values", None)
        kwargs["use_cache"] = False
        hidden = hidden.detach().to(store, dtype)
        captured.append((hidden.pin_memory() if store.type == "cpu" and torch.device(device).type == "cuda" else hidden,
                         kwargs))
        if not firsts:
            raise Captured

    def mask(i: int, kind: str):
        def take(module, args, kwargs):
            masks[kind] = kwargs.get("attention_mask")
            if i == last:
                captured[-1][1]["attention_mask"] = dict(masks)
                raise Captured
        return take

    loaded = model.module.model.embed_tokens.weight.is_meta
    model.materialize("model.embed_tokens", device, dtype)
    model.module.model.rotary_emb.to(device)
    handles = [model.layers[0].register_forward_pre_hook(grab, with_kwargs=True)]
    handles += [model.layers[i].register_forward_pre_hook(mask(i, kind), with_kwargs=True) for kind, i in firsts.items()]
    own = [layer.__dict__.get("forward") for layer in model.layers[:last]]  # a hook's wrapper (accelerate's)
    if firsts:
        masked_by_kind(model.module)
        for layer in model.layers[:last]:  # reached for their masks only: passed through, not run
            layer.forward = lambda hidden_states, *args, **kwargs: hidden_states
    try:
        batches = windows if isinstance(windows, list) else list(windows.split(batch_size))
        for batch in distributed.share(batches) if share else batches:
            try:
                model.module(batch.to(device), use_cache=False)
            except Captured:
                pass
    finally:
        for handle in handles:
            handle.remove()
        for layer, forward in zip(model.layers[:last], own):  # as it was: the class's, or its own wrapper
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward
        if loaded:
            model.release("model.embed_tokens")
    return captured


def masked_by_kind(module: torch.nn.Module) -> None:
    """Each decoder layer's attention takes, from captured inputs holding the mask of each kind of layer
    (capture_inputs), its own kind's: whichever way it is called (a whole layer, or its attention alone,
    as AWQ and the measurement do), also after a resumed run read them from its progress. Once per model."""
    kinds = getattr(module.config, "layer_types", None) or []
    if len(set(kinds)) < 2 or getattr(module, "_masked_by_kind", False):
        return
    for layer, kind in zip(module.model.layers, kinds):
        def own(mod, args, kwargs, kind=kind):
            if isinstance(kwargs.get("attention_mask"), dict):
                kwargs = {**kwargs, "attention_mask": kwargs["attention_mask"][kind]}
            return args, kwargs
        layer.self_attn.register_forward_pre_hook(own, with_kwargs=True)
    module._masked_by_kind = True


def run_layer(layer: torch.nn.Module, batches: list[tuple[torch.Tensor, dict]]) -> list[tuple[torch.Tensor, dict]]:
    """Replace each batch's hidden states by the layer's output, in place: one copy alive at a time."""
    for j, (hidden, kwargs) in enumerate(batches):
        y = layer(on_device(layer, hidden), **kwargs)
        batches[j] = ((y[0] if isinstance(y, tuple) else y).to(hidden.device), kwargs)
    return batches


class Layerwise:
    """A model read lazily from its checkpoint, run a decoder layer at a time over every batch of
    windows at once, as the GPTQ reference evaluates: one layer's weights are in memory beside all the
    windows' hidden states, so a model larger than the device's memory is scored, each layer read once.
    Called as evals' Forward: batches of token windows and the positions to keep -> each batch's logits."""

    def __init__(self, model: Model, device: torch.device, dtype: torch.dtype, progress: bool = True):
        self.model, self.device, self.dtype, self.progress = model, device, dtype, progress
        self.ran = (str(dtype).removeprefix("torch."), device.type)

    def __call__(self, batches: list[torch.Tensor], keep: int) -> Iterator[torch.Tensor]:
        """Each batch's logits of its last keep positions (0: of every one). The batches may differ in
        length. Those whose hidden states take more than half the host's free memory run in parts, as
        many batches at a time as fit, each part reading the model again."""
        parts = self.parts(batches)
        for k, part in enumerate(parts):
            yield from self.part(part, keep, f" (part {k + 1}/{len(parts)})" if len(parts) > 1 else "")

    def parts(self, batches: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """batches in order, cut where their hidden states fill half the host's free memory (one batch at least)."""
        free = free_bytes(torch.device("cpu"))
        budget = free // 2 if free is not None else float("inf")
        per_token = self.model.module.config.hidden_size * self.dtype.itemsize
        parts, used = [[]], 0
        for batch in batches:
            need = batch.numel() * per_token
            if parts[-1] and used + need > budget:
                parts.append([])
                used = 0
            parts[-1].append(batch)
            used += need
        return parts

    @torch.no_grad()
    def part(self, batches: list[torch.Tensor], keep: int, said: str) -> Iterator[torch.Tensor]:
        m, dev = self.model, self.device
        tokens, n, began = sum(b.numel() for b in batches), len(m.layers), time.monotonic()
        # every batch: under torchrun one process scores (quantize --eval-data's "before")
        hidden = capture_inputs(m, batches, 0, dev, store_of(m, tokens, dev), self.dtype, share=False)
        bar = tqdm(range(n), desc=f"scoring a layer at a time{said}", unit="layer", disable=not self.progress,
                   file=sys.stderr)
        # whatever stops it, each part read is dropped: the model is left as lazy as it came, to stream again,
        # and the hidden states go (a traceback kept after an error holds this frame)
        try:
            for i in bar:
                try:
                    run_layer(m.materialize(f"model.layers.{i}", dev, self.dtype), hidden)
                finally:
                    m.release(f"model.layers.{i}")
                free_memory()
                rate = tokens * (i + 1) / n / (time.monotonic() - began)  # through the whole model, at this pace
                bar.set_postfix_str(f"{rate:.0f} tok/s, {peak_memory()}", refresh=False)
            try:
                norm, head = m.materialize("model.norm", dev, self.dtype), m.materialize("lm_head", dev, self.dtype)
                while hidden:  # each batch's hidden states freed once its logits are made
                    h, _ = hidden.pop(0)
                    yield head(norm(on_device(head, h))[:, -keep:])  # as the model's forward: norm, then the kept rows
            finally:
                m.release("model.norm")
                m.release("lm_head")
        finally:
            hidden.clear()


def free_bytes(device: torch.device) -> int | None:
    """Memory free for weights on device: the GPU's free memory with what torch holds cached for reuse,
    or the host's available memory within this process's cgroup limit (None where neither is said)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - \
            torch.cuda.memory_allocated(device)
    free, left = proc_field("/proc/meminfo", "MemAvailable"), cgroup_left()
    return left if free is None else free if left is None else min(free, left)


def cgroup_left(root: Path = CGROUP, own: str | None = None) -> int | None:
    """What the memory limits (cgroup v2) of this process's group and the groups above it, which
    MemAvailable does not know, leave it: the least of each limit less what its group uses, the page
    cache the kernel drops first (inactive files) counted as free. None where no group has a limit.
    own: the group's path under root (default: this process's, from /proc/self/cgroup)."""
    if own is None:
        try:
            own = next((line[3:].strip() for line in Path("/proc/self/cgroup").read_text().splitlines()
                        if line.startswith("0::")), "/")
        except OSError:
            own = "/"
    group, lefts = root / own.strip("/"), []
    for level in [group, *group.parents]:
        if not level.is_relative_to(root):
            break
        try:
            limit = (level / "memory.max").read_text().strip()
            if limit.isdecimal():
                stat = level / "memory.stat"
                cache = dict(line.split() for line in stat.read_text().splitlines()).get("inactive_file", 0) \
                    if stat.is_file() else 0
                lefts.append(max(0, int(limit) - int((level / "memory.current").read_text()) + int(cache)))
        except (OSError, ValueError):
            pass
    return min(lefts, default=None)


def proc_field(path: str, key: str) -> int | None:
    """A /proc file's field given in kB (MemAvailable, VmHWM), in bytes; None where it is not there."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def gather_hessians(layer: torch.nn.Module, batches: list[tuple[torch.Tensor, dict]],
                    groups: tuple[tuple[str, ...], ...], capture: str | None = None,
                    diagonal: bool = False) -> tuple[dict[str, Hessian], list[torch.Tensor]]:
    """One Hessian per input shared by a group of linears (diagonal: only its diagonal), filled by
    running the layer once; the run stops at the last group's input, since nothing after it is needed.
    The inputs of the linear named capture are returned too."""
    hessians, takes, kept = {}, {}, []
    for group in groups:
        first = layer.get_submodule(group[0])
        h = Hessian(first.in_features, first.weight.device, diagonal)

        def take(i, x, h=h, captured=group[0] == capture):
            h.add_batch(x)
            if captured:  # kept where the batches are (the CPU, for a GPU run whose activations do not fit it)
                kept.append(x.to(batches[0][0].device))

        takes[group[0]] = take
        hessians.update({name: h for name in group})
    run_hooked(layer, batches, takes, stop=True)
    for h in {id(h): h for h in hessians.values()}.values():  # summed over the processes of a torchrun job
        h.reduce()
    return hessians, kept


@contextmanager
def replaying_attention(layer: torch.nn.Module, outputs: list[torch.Tensor] | None) -> Iterator[None]:
    """Once q/k/v/o are quantized the attention block's output is fixed: hand out the cached
    outputs, batch by batch, instead of recomputing q/k/v and attention on every later pass."""
    if outputs is None:
        yield
        return
    queue = iter(outputs)
    layer.self_attn.forward = lambda *args, **kwargs: (on_device(layer, next(queue)), None)
    try:
        yield
    finally:
        del layer.self_attn.forward  # the class's forward again


def store_of(model: Model, tokens: int, device: str | torch.device) -> torch.device:
    """Where the activations of so many tokens live: on the GPU when a quarter of its free memory holds
    them, else in pinned CPU memory (each batch then goes to the GPU when it is used)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    need = tokens * model.module.config.hidden_size * 4
    return device if need < torch.cuda.mem_get_info(device)[0] // 4 else torch.device("cpu")


def map_large_blocks() -> None:
    """glibc: each allocation of 16 MiB or more gets a mapping of its own, given back to the system when
    freed. glibc's own threshold rises to 32 MiB as large blocks are freed, and blocks under it then
    stay in a fragmented heap: on the 7B shape that was up to 0.9 GiB of peak (a Hessian's blocks)."""
    if LIBC is not None:
        LIBC.mallopt(-3, 2**24)  # M_MMAP_THRESHOLD; setting it also ends its dynamic adjustment


def free_memory() -> None:
    """Give a finished layer's memory back to the system: glibc keeps freed blocks of the many
    differently sized temporaries in its heap, which grows layer after layer without this."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    trim_heap()


def peak_rss() -> int:
    """This process's peak resident memory in bytes. The kernel's VmHWM belongs to the address space
    (new at exec); getrusage's maxrss is carried over exec from the parent, whose peak it may be."""
    return proc_field("/proc/self/status", "VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_memory() -> str:
    """The process's peak resident memory (and the GPU's peak allocation when there is one)."""
    rss = f"peak RSS {peak_rss() / 2**30:.2f} GiB"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rss += f", GPU {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
    return rss


def digest(state) -> str:
    """A hash of a progress state, tensors' bytes included: a file damaged (or edited) after it was
    written no longer matches, and is ignored rather than resumed from."""
    h = hashlib.sha256()

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            h.update(f"T{x.dtype}{tuple(x.shape)}".encode())
            h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        elif isinstance(x, dict):
            h.update(f"D{len(x)}".encode())
            for k, v in x.items():
                h.update(repr(k).encode())
                walk(v)
        elif isinstance(x, (list, tuple)):
            h.update(f"L{len(x)}".encode())
            for v in x:
                walk(v)
        else:
            h.update(f"{type(x).__name__}:{x!r}".encode())

    walk(state)
    return h.hexdigest()


class KeptErrors:
    """A file whose write errors are kept: torch.save reports them as a RuntimeError, and a full
    disk must reach the caller as the OSError it is."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, b) -> int:
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def save_progress(path: Path, state: dict) -> None:
    """state at path, replacing the last one. Not forced to the disk: one torn by a power cut fails
    its digest and is ignored, and what it points at carries its own CRCs."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            kept = KeptErrors(f)
            try:
                torch.save({"digest": digest(state), "state": state}, kept)
            except RuntimeError:
                if kept.error is None:
                    raise
                raise kept.error from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)


class Saver:
    """A run's progress saved behind its next layer: a thread writes each state while the next layer is
    quantized (a 7B layer's 128 calibration windows are 1 GiB, seconds to hash and write), one save in
    flight at a time; a save's error reaches the run at its next save or at its end. The activations
    are replaced, never changed in place, so the thread holds the ones it writes: up to a second copy
    of them in host memory (a GPU's copied out at once), so a save is made behind only where they take
    at most half the free host memory. Under torchrun each save is made at once: a process's state
    waits under its own name until every process has written its own, then replaces the last one, and
    that agreement is a collective (the main thread's, between the layer's own)."""

    def __init__(self, path: Path) -> None:
        self.path, self.thread, self.error, self.waiting, self.pending = path, None, None, None, 0

    def save(self, state: dict, next_layer: int) -> None:
        self.wait()  # one in flight
        self.pending = next_layer
        self.waiting = waiting_path(self.path, next_layer) if distributed.world() > 1 else None
        batches = state["batches"] or []
        free = free_bytes(torch.device("cpu"))
        if self.waiting is None and (free is None or 2 * sum(h.nbytes for h, _ in batches) <= free):
            # what the run changes next must not change what is written: new lists, the writer's state copied
            state = {k: to(v, "cpu") if k == "batches" else copy.deepcopy(v) for k, v in state.items()}
            self.thread = threading.Thread(target=self.write, args=(self.path, state), name="saving progress",
                                           daemon=True)
            self.thread.start()
        else:
            self.write(self.waiting or self.path, state)
            self.wait()

    def write(self, path: Path, state: dict) -> None:
        try:
            save_progress(path, state)
        except BaseException as e:  # the save's own (a test's KeyboardInterrupt too): the run raises it
            self.error = e

    def wait(self) -> None:
        """The save in flight finished, its error raised; under torchrun in place once every process's is."""
        if not self.pending:
            return
        if self.thread is not None:
            self.thread.join()
        self.pending, self.thread, error, self.error = 0, None, self.error, None
        if error is not None:
            raise error
        if self.waiting is not None:  # every process's state whole on disk before any replaces its last one
            distributed.agree(0, "min", "saving the progress")
            self.waiting.replace(self.path)

    def stop(self) -> None:
        """The save in flight finished as the run stops for another reason, the one raised."""
        if self.thread is not None:
            if self.thread.is_alive():
                print(f"finishing the save of the progress after layer {self.pending}", file=sys.stderr)
            self.thread.join()
            if self.error is not None and not isinstance(self.error, KeyboardInterrupt):
                print(f"the progress after layer {self.pending} was not saved "
                      f"({type(self.error).__name__}: {self.error})", file=sys.stderr)
        self.pending, self.thread, self.error = 0, None, None


def read_progress(path: Path, checked: bool = True) -> dict:
    """A state save_progress wrote, checked against its digest (ValueError when it was changed); unchecked,
    its tensors mapped from the file, not read (a look at its key costs nothing)."""
    with zipfile.ZipFile(path) as z:  # torch.save stores every entry: a compressed one could inflate a thousandfold
        if any(info.compress_type != zipfile.ZIP_STORED for info in z.infolist()):
            raise ValueError("it holds compressed entries, which torch.save does not write")
    # on the CPU: a GPU's number saved in it may name none here (CUDA_VISIBLE_DEVICES); the state is moved when used
    saved = torch.load(path, weights_only=True, map_location="cpu", mmap=not checked)
    if not isinstance(saved, dict) or checked and saved.get("digest") != digest(saved.get("state")):
        raise ValueError("its contents changed after it was written")
    return saved["state"]


def other_run(paths: list[Path], key) -> tuple[Path, object, int] | None:
    """(path, its key, layers done) of the first progress at paths saved by a run other than key's, read
    without its tensors; a dict key is compared on the entries key has. One that cannot be read is none
    (load_progress says so)."""
    for path in paths:
        try:
            state = read_progress(path, checked=False)
            theirs, done = state["key"], int(state["next_layer"])
        except Exception:
            continue
        if isinstance(theirs, dict) and isinstance(key, dict) and theirs.keys() >= key.keys():
            theirs = {name: theirs[name] for name in key}
        if theirs != key:
            return path, theirs, done
    return None


def resumed(resume: tuple[Path, str], writer) -> dict | None:
    """The state to go on from: the last saved of the same run, where the partial output it describes is
    still as it was."""
    state = load_progress(*resume, LAYERS_FORMAT)
    if state is not None and writer is not None and not writer.resumable(state["writer"]):
        if distributed.rank() == 0:  # under torchrun, one process speaks for the job
            print(f"ignoring progress file {resume[0]}: the partial output it describes is gone or changed",
                  file=sys.stderr)
        return None
    return state


def load_progress(path: Path, key: str, format: int) -> dict | None:
    """The state saved after the last finished layer of the same run (same model, config, data), by a
    quantkit that saves the same format (a state saved before the format had a number is format 1)."""
    for stale in siblings(path, r"{name}\.tmp-\d+"):  # a killed save's (one process per output: atomic.Staged)
        stale.unlink(missing_ok=True)
    if not path.is_file():
        return None
    try:
        state = read_progress(path)
    except MemoryError:
        raise
    except Exception as e:  # a file damaged on disk: start afresh
        print(f"ignoring unreadable progress file {path} ({type(e).__name__}: {e})", file=sys.stderr)
        path.unlink()
        return None
    if not isinstance(state, dict) or state.get("key") != key:
        print(f"ignoring progress file {path}: it is from another model, configuration or calibration set",
              file=sys.stderr)
        path.unlink()
        return None
    if state.get("format", 1) != format:  # the same run, stopped under another version: its layers may differ
        print(f"ignoring progress file {path}: another version of quantkit saved it (format {state.get('format', 1)}, "
              f"this one reads {format}), so the run starts afresh", file=sys.stderr)
        path.unlink()
        return None
    return state


class Lean:
    """A layer's linears kept small while it is quantized (a 7B layer is 0.8 GB in float32): each holds
    the checkpoint's weight, in the checkpoint's dtype, until it is quantized, then only its quantized
    tensor. A linear's float32 weight is made when it is called and let go after (GGUF blocks, which
    dequantize only in numpy, once on the CPU, and moved at each call); finish() leaves the layer as
    the other paths do (float32, the quantized linears dequantized)."""

    def __init__(self, layer: torch.nn.Module):
        self.layer, self.quantized, self.dense = layer, {}, {}
        linears = {name: layer.get_submodule(name) for name in LINEARS}
        kept = {name: linear.weight.data for name, linear in linears.items()}
        for linear in linears.values():
            linear.weight.data = linear.weight.new_empty(0)
        layer.float()  # the rest: norms, biases, buffers
        for name, linear in linears.items():
            linear.weight.data = kept[name]
            linear.forward = lambda x, name=name, linear=linear: F.linear(x, self.weight(name), linear.bias)

    def weight(self, name: str) -> torch.Tensor:
        qt, weight = self.quantized.get(name), self.layer.get_submodule(name).weight
        if name in self.dense:
            return self.dense[name].to(weight.device)
        return qt.dequantize().to(weight.device) if qt is not None else weight.float()

    def set(self, name: str, qt: QuantizedTensor) -> None:
        """name quantized to qt: the checkpoint's weight is let go."""
        weight = self.layer.get_submodule(name).weight
        if qt.ggml is None:  # integer grids dequantize where the layer is, at each call
            self.quantized[name] = qt.to(weight.device)
        else:  # GGUF blocks only on the CPU (numpy, a 70B layer's in minutes): once, kept there
            self.dense[name] = qt.dequantize()
        weight.data = weight.new_empty(0)

    def finish(self) -> None:
        for name in LINEARS:
            linear = self.layer.get_submodule(name)
            linear.weight.data = self.weight(name)
            del linear.forward  # the class's again


def quantize_layer(i: int, layer: torch.nn.Module, quantize: QuantizeFn, batches: list | None,
                   stages: list[tuple[tuple[str, ...], ...]],
                   update: bool = True, diagonal: bool = False) -> dict[str, QuantizedTensor]:
    """One decoder layer's linears through quantize, group by group; with calibration batches the
    next group and layer see the quantized outputs. update: the weights become their dequantized
    values in place, in float32; otherwise, with batches, the layer is Lean while it is quantized
    and left as update leaves it."""
    tensors = {}
    lean = Lean(layer) if batches is not None and not update else None
    try:
        attention = None  # the attention block's outputs, once they are final
        for stage in stages:
            hessians, o_inputs = {}, []
            if batches is not None:
                # o_proj's inputs are final when q/k/v were quantized in an earlier stage
                capture = "self_attn.o_proj" if stage == (("self_attn.o_proj",),) else None
                with replaying_attention(layer, attention):
                    hessians, o_inputs = gather_hessians(layer, batches, stage, capture, diagonal)
            names = [name for group in stage for name in group]
            mine = {}
            for j, name in enumerate(names):
                h = hessians.pop(name, None)  # the last linear sharing an input lets its Hessian go
                if distributed.owner(j) == distributed.rank():
                    mine[name] = quantize(f"model.layers.{i}.{name}", layer.get_submodule(name).weight.data, h)
            for j, name in enumerate(names):  # under torchrun, each linear from the process that quantized it
                qt = distributed.shared(mine.pop(name, None), distributed.owner(j), "cpu")
                if qt is None:  # left in float (a rule skips it)
                    continue
                if lean is not None:
                    lean.set(name, qt)
                elif update:
                    linear = layer.get_submodule(name)
                    linear.weight.data.copy_(qt.dequantize().to(linear.weight.device))  # in place: no second copy
                tensors[f"model.layers.{i}.{name}"] = qt
            if o_inputs:
                attention = [layer.self_attn.o_proj(on_device(layer, x)).to(x.device) for x in o_inputs]
            del hessians, h, o_inputs
            free_memory()
        if batches is not None:
            with replaying_attention(layer, attention):
                run_layer(layer, batches)
    finally:
        if lean is not None:  # also when interrupted: the layer whole again
            lean.finish()
    return tensors


def write_other(model: Model, prefix: str, writer: Writer | None, other: OtherFn | None, keep: bool) -> dict:
    """The weights of a part outside the decoder layers (embedding, final norm, lm_head): read, quantized
    by other when it says so, written, dropped unless kept. Its quantized tensors by name."""
    if writer is None and other is None:
        return {}
    tied = prefix == "lm_head" and model.module.config.tie_word_embeddings
    if tied:
        return {}
    module = model.materialize(prefix, dtype=torch.float32 if keep else None)  # kept: float32, as the rest
    tensors = {}
    for key, t in module.state_dict().items():
        qt = other(prefix, t) if other is not None and key == "weight" else None
        if qt is not None:
            tensors[prefix] = qt
            if keep:
                t.copy_(qt.dequantize())
        if writer is not None:
            writer.add_quantized(prefix, qt) if qt is not None else writer.add(f"{prefix}.{key}", t)
    if not keep:
        model.release(prefix)
    return tensors


@torch.no_grad()
def quantize_layers(
    model: Model,
    quantize: QuantizeFn | None,
    windows: torch.Tensor | None = None,
    *,
    batch_size: int = BATCH,
    sequential: bool = False,
    device: str | torch.device = "cpu",
    writer: Writer | None = None,
    other: OtherFn | None = None,
    keep: bool = True,
    progress: bool = True,
    resume: tuple[Path, str] | None = None,
    layer_fn: LayerFn | None = None,
    desc: str = "quantizing layers",
    diagonal: bool = False,
) -> dict[str, QuantizedTensor]:
    """Quantize every decoder linear, layer by layer; the quantized tensors by name.

    Each layer is read from the model's checkpoint when not in memory, quantized on device in
    float32, handed to writer (its quantized linears and its other tensors, such as norms), then
    dropped, or with keep left in memory (on the CPU, weights dequantized) and returned. The
    embedding, final norm and lm_head go to the writer as well, through other (e.g. GGUF blocks).

    With windows (LongTensor [n, seqlen]) each linear's quantizer also gets the Hessian of its
    inputs; without, it gets None and no forward pass is made. sequential: q/k/v, then o, then
    gate/up, then down, each group seeing the inputs the already quantized ones produce.
    layer_fn, when given, quantizes each layer whole instead. resume (path, key), without keep:
    after each layer the state (the writer's, the calibration activations) is saved there; a run
    with the same key starts after the last finished layer. diagonal: quantize reads only each
    Hessian's diagonal (Hessian.diagonal), so only that is summed.
    """
    tensors, start, n = {}, 0, len(model.layers)
    map_large_blocks()
    state = resumed(resume, writer) if resume and not keep else None
    at = state["next_layer"] if state else 0
    if resume and not keep and distributed.world() > 1:
        last = distributed.agree(at, "max")
        waiting = waiting_path(resume[0], last)
        if at < last and waiting.is_file():  # a job killed after some processes renamed their state (save_progress)
            waiting.replace(resume[0])
            state = resumed(resume, writer)
            at = state["next_layer"] if state else 0
        for stale in siblings(resume[0], r"{name}" + NEXT + r"(\.tmp-\d+)?"):
            stale.unlink(missing_ok=True)
    if distributed.agree(at, "min") != distributed.agree(at, "max"):
        if distributed.rank() == 0:
            print(f"ignoring this job's progress files ({resume[0].name} and its processes' others): they do not "
                  "agree on the last finished layer, so the job starts afresh", file=sys.stderr)
        state = None
    if state is not None:
        masked_by_kind(model.module)
        start, batches = state["next_layer"], state["batches"]
        store = store_of(model, windows.numel(), device) if windows is not None else device
        batches = [(h.to(store), {k: to(v, device) for k, v in kw.items()}) for h, kw in batches] \
            if batches is not None else None
        if writer is not None:
            writer.start(state["writer"])
        if distributed.rank() == 0:
            print(f"resuming after layer {start}/{n} from {resume[0]}", file=sys.stderr)
    else:
        if writer is not None:  # a resuming run's progress was checked to be its own (api.check_progress)
            writer.start(None, own="layers" if resume and not keep else None)
        batches = capture_inputs(model, windows, batch_size, device, store_of(model, windows.numel(), device)) \
            if windows is not None else None
        tensors |= write_other(model, "model.embed_tokens", writer, other, keep)
    stages = [(group,) for group in GROUPS] if sequential else [GROUPS]
    tokens = 0 if windows is None else windows.numel()
    bar = tqdm(range(start, n), desc=desc, unit="layer", initial=start, total=n,
               disable=not progress, file=sys.stderr)
    began = time.monotonic()
    saver = Saver(resume[0]) if resume and not keep else None
    try:
        for i in bar:
            prefix = f"model.layers.{i}"
            layer = model.materialize(prefix, device, dtype=None)
            if keep or layer_fn is not None:  # computed in float32 (quantize_layer keeps the rest Lean)
                layer.float()
            if layer_fn is not None:
                layer_tensors = {name: qt.to("cpu") for name, qt in layer_fn(i, layer, batches).items()}
                if batches is not None:  # the next layer's inputs: this quantized layer's outputs
                    run_layer(layer, batches)
            else:
                layer_tensors = quantize_layer(i, layer, quantize, batches, stages, update=keep, diagonal=diagonal)
            if writer is not None:
                for name, qt in layer_tensors.items():
                    writer.add_quantized(name, qt)
                for key, t in layer.state_dict().items():
                    if f"{prefix}.{key}".removesuffix(".weight") not in layer_tensors:
                        writer.add(f"{prefix}.{key}", t)
            if keep or model.checkpoint is None:
                layer.to("cpu")
                tensors |= layer_tensors
            else:
                model.release(prefix)
            del layer, layer_tensors
            free_memory()
            if saver is not None:
                saver.wait()  # on disk before the writer's state is taken: that lets go of what only the last needed
                saver.save({"format": LAYERS_FORMAT, "key": resume[1], "next_layer": i + 1, "batches": batches,
                            "writer": writer.state() if writer is not None else None}, i + 1)
            rate = tokens * (i + 1 - start) / (time.monotonic() - began)
            bar.set_postfix_str(", ".join(filter(None, [
                f"{rate:.0f} tok/s" if tokens else "", f"{writer.written / 2**20:.0f} MiB written" if writer else "",
                peak_memory()])), refresh=False)  # drawn with the count, by the next update
        if saver is not None:
            saver.wait()
    finally:
        if saver is not None:
            saver.stop()
    for prefix in ("model.norm", "lm_head"):
        tensors |= write_other(model, prefix, writer, other, keep)
    if keep:
        model.materialize()
    return tensors


def to(value, device):
    """A calibration keyword argument on device (tensors, and the tuples of them such as rotary embeddings,
    and the masks by kind of layer), or the batches themselves (a list: a new one)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(to(v, device) for v in value)
    if isinstance(value, list):
        return [to(v, device) for v in value]
    if isinstance(value, dict):
        return {k: to(v, device) for k, v in value.items()}
    return value
