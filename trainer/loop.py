"""The training loop: a frozen base (float, or NF4 for QLoRA) with LoRA adapters, trained on
seeded batches with gradient accumulation, autocast, clipping, warmup and cosine decay; evaluated on
held-out data; checkpointed atomically so that a killed run resumes where it was, on the same
batches, with the same losses. Under torchrun each process takes a share of every micro-batch and
the adapter's gradients are summed: the same global batch, the same losses."""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save as serialize
from tqdm import tqdm

from quantkit import distributed
from quantkit.api import device_of
from quantkit.errors import (NO_ROOM, REFUSED, QuantkitError, ResumableError, free_space, option, refused, size,
                             space_for, untrusted)
from quantkit.atomic import CHECKPOINT, Staged, check_apart, check_out, fsync, partial_path, remove
from quantkit.config import check_fields, check_arguments
from quantkit.modelio import Model, check_context, fingerprint, load
from quantkit.report import strict_json
from quantkit.pipeline import free_memory, map_large_blocks, peak_memory, read_progress, save_progress

from . import dataset, lora
from .config import TrainConfig, held_out_twice

LOG = "train_log.json"
# what a checkpoint's state means, raised when that changes: one saved under another is not resumed from
# (a checkpoint saved before it had a number is format 1)
CHECKPOINT_FORMAT = 1
PLOT = "loss.png"
# free to change on resume (checkpoints hold whole tensors, so also --fsdp and the number of processes)
SAME_RUN = ("save_every", "eval_every", "patience", "compile", "gradient_checkpointing", "fsdp")


@dataclass
class TrainResult:
    out: str
    steps: int  # optimizer steps taken, in all
    log: list[dict]  # a record per step: step, loss (per scored token), lr, grad_norm, tokens
    evals: list[dict] = field(default_factory=list)  # step, eval_loss (held-out loss per scored token)
    best_step: int | None = None
    tokens_per_s: float = 0.0  # this run's, over every process
    peak_memory: str = ""
    stopped_early: bool = False
    precision: str = ""  # what this run ran in, fp32, bf16 or fp16 (--precision auto chooses by the hardware)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # --precision's names: autocast's dtype


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    if precision == "auto":  # bf16 where the hardware has it; else fp16 on a GPU, float32 on a CPU
        if device.type == "cpu":
            return torch.bfloat16 if cpu_bf16() else None
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16  # T4, V100
    return AUTOCAST[precision]


def cpu_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX). Elsewhere bf16 is emulated: a
    step of the embedded model took 16x float32's time on an AVX2 CPU (benchmarks/RESULTS.md)."""
    return any(getattr(torch.cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported",
                                                                      "_is_amx_tile_supported"))


def digest(path: Path | None) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path is not None else None


def run_key(source: str, config: TrainConfig, data: Path, eval_data: Path | None) -> str:
    """What a run's checkpoints and its finished adapter are of: the base's files, the data, the settings
    that change the result."""
    return hashlib.sha256(json.dumps({
        "weights": fingerprint(source), "data": digest(data), "eval": digest(eval_data),
        "config": {k: v for k, v in config.to_dict().items() if k not in SAME_RUN}}, sort_keys=True).encode()).hexdigest()


def check_finished(out: str | os.PathLike, model: str | os.PathLike | None, config: TrainConfig,
                   data: str | os.PathLike, eval_data: str | os.PathLike | None) -> None:
    """Refuse to go on from out's finished adapter (train --resume --quantize after a kill in the merge or
    the quantization) unless this command trained it; an adapter without a log, or whose log holds no
    key (written before logs held one), is taken."""
    again = f"drop {option('resume', True)} and pass {option('overwrite', True)} to train again"
    log = Path(out) / LOG
    if not log.is_file():
        return
    with untrusted(log, "the adapter's training log is damaged", again):
        kept = json.loads(log.read_text()).get("key")
    if kept is not None and kept != run_key(load(model).source, config, Path(data), Path(eval_data) if eval_data else None):
        raise QuantkitError(f"{out} is the finished adapter of another run (a different model, data or settings): go "
                            f"on with that run's command, or {again}")


def build(m: Model, config: TrainConfig, names: list[str], device: torch.device, dtype: torch.dtype) -> dict:
    """Read the base layer by layer onto device in dtype (frozen), with LoRA layers on the targets:
    for QLoRA each target is quantized to NF4 as soon as its layer is read; with FSDP each layer is
    sharded over the processes as soon as it is read, so no process holds the whole model."""
    # the caller's random generators as they were after: train runs inside pipelines that draw after it
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        m.module.requires_grad_(False)
        torch.random.default_generator.manual_seed(config.seed)  # the adapters' initial A: the same in every process
        if device.type == "cuda":  # the device's own generator only: the others are not forked
            with torch.cuda.device(device):
                torch.cuda.manual_seed(config.seed)
        shard = fsdp_shard(device) if config.fsdp else lambda module: None
        map_large_blocks()
        layers = {}
        for i in range(len(m.layers)):
            prefix = f"model.layers.{i}"
            here = [n for n in names if n.startswith(prefix + ".")]
            layer = m.materialize(prefix, device, None if config.method == "qlora" else dtype)
            # QLoRA: NF4 of the checkpoint's weights, as merge --onto-nf4 rounds them, not of a copy in the compute dtype
            if config.method == "qlora":
                frozen = {layer.get_submodule(n.removeprefix(prefix + ".")) for n in here}
                for module in layer.modules():
                    for name, p in module.named_parameters(recurse=False):
                        if not (module in frozen and name == "weight"):
                            p.data = p.data.to(dtype)
            layers |= lora.inject(m.module, config, here)
            shard(m.layers[i])
            free_memory()  # the read buffers' (and FSDP: the whole layer's) freed blocks, else kept in glibc's heap
        for prefix in ("model.embed_tokens", "model.norm", "lm_head"):
            m.materialize(prefix, device, dtype)
        if m.module.config.tie_word_embeddings:
            m.module.tie_weights()
        shard(m.module)  # the rest: embeddings, final norm, head
        m.checkpoint = None  # everything is in memory now, and the adapters make it differ from the file
        return layers


def settle(module: torch.nn.Module) -> None:
    """A trained model as inference wants it: no dropout (the adapters' took the last batch's seeds and
    refused any other batch), no gradient checkpointing."""
    module.eval()
    lora.seed_examples({n: m for n, m in module.named_modules() if isinstance(m, lora.LoraLinear)}, [])
    if checkpointing(module, "is"):
        checkpointing(module, "disable")()


def checkpointing(module: torch.nn.Module, what: str):
    """module's activation checkpointing ("enable", "disable", or "is": on or not): transformers 5.23
    renamed gradient_checkpointing_* to activation_checkpointing_*, and the old names warn there;
    older 5.x has only those."""
    for kind in ("activation", "gradient"):
        name = f"is_{kind}_checkpointing" if what == "is" else f"{kind}_checkpointing_{what}"
        if hasattr(type(module), name):  # the class's: an instance's property would be read, and warn
            return getattr(module, name)
    raise AttributeError(f"{type(module).__name__} has no {what} of activation checkpointing")


def fsdp_shard(device: torch.device) -> Callable[[torch.nn.Module], None]:
    """FSDP2's fully_shard over every process, with the gradients summed rather than averaged, as the
    loss is already a mean over the whole global batch (sums only: gloo has no pre-scaled reduction)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (distributed.world(),))

    def shard(module: torch.nn.Module) -> None:
        fully_shard(module, mesh=mesh)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)

    return shard


def optimizer_state(opt: torch.optim.Optimizer) -> dict:
    """opt's state dict with every tensor whole and on the CPU (FSDP's shards gathered: every process
    must call it). bitsandbytes' states hold ints and dicts beside tensors: those stay as they are."""
    state = opt.state_dict()

    def cpu(v):
        return lora.whole(v).cpu() if isinstance(v, torch.Tensor) else v
    return {**state, "state": {k: {n: cpu(v) for n, v in s.items()} for k, s in state["state"].items()}}


def load_optimizer_state(opt: torch.optim.Optimizer, state: dict) -> None:
    """The inverse of optimizer_state: each tensor back as its parameter is held (sharded under FSDP;
    a scalar such as AdamW's step stays whole)."""
    params = [p for g in opt.param_groups for p in g["params"]]

    def held(v, p):
        return lora.like(v, p) if isinstance(v, torch.Tensor) and v.dim() else v
    opt.load_state_dict({**state, "state": {k: {n: held(v, params[k]) for n, v in s.items()}
                                            for k, s in state["state"].items()}})


def optimizer(config: TrainConfig, layers: dict, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (torch's, or bitsandbytes' 8-bit or paged one); LoRA+: B at lora_plus times the rate."""
    a = [l.lora_A.weight for l in layers.values()]  # DoRA's magnitude with B, as PEFT's LoRA+ puts every vector
    b = [p for l in layers.values() for p in (l.lora_B.weight, l.magnitude) if p is not None]
    groups = [{"params": a}, {"params": b, "lr": config.lr * (config.lora_plus or 1)}]
    kw = {"lr": config.lr, "weight_decay": config.weight_decay}
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, **kw)
    import bitsandbytes as bnb

    if config.optimizer == "paged_adamw":
        if device.type != "cuda":
            raise QuantkitError("paged AdamW pages its state between GPU and CPU memory, so it needs a GPU: use "
                                f"{option('optimizer', 'adamw', 'adamw8bit')} on the CPU")
        return bnb.optim.PagedAdamW(groups, **kw)
    return bnb.optim.AdamW8bit(groups, **kw)


def schedule(opt: torch.optim.Optimizer, config: TrainConfig, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to --lr, then cosine decay towards 0. The warmup's first step takes lr/(warmup+1), not
    0 (a step at 0 is wasted, and --steps 1 wrote an untrained adapter); a warmup as long as the run ends at --lr."""
    warm = min(config.warmup, total - 1)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(total - warm, 1)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def token_loss(forward, examples: list[dataset.Example], pad: int, device: torch.device) -> torch.Tensor:
    """The summed cross-entropy of the examples' scored tokens (float32)."""
    ids, labels, mask = (t.to(device) for t in dataset.collate(examples, pad))
    logits = forward(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=dataset.IGNORE, reduction="sum")


def held_out_loss(module, examples, config: TrainConfig, pad: int, device, amp, progress: bool = False) -> float:
    """Mean loss per scored token over examples, every process scoring its share (progress: a bar on rank 0)."""
    module.eval()
    mine = distributed.share(examples)
    # under FSDP every forward gathers each layer from all processes: each runs as many as the busiest
    busiest = math.ceil(len(examples) / distributed.world()) if config.fsdp else len(mine)
    chunks = math.ceil(busiest / config.batch_size)
    total = torch.zeros(2, dtype=torch.float64, device=distributed.collective_device())  # NCCL: a GPU's
    with torch.no_grad(), (torch.autocast(device.type, amp) if amp else nullcontext()):
        # below the step bar, which a log (no terminal) cannot redraw: there it would write cursor moves
        for k in tqdm(range(0, chunks * config.batch_size, config.batch_size), desc="held-out loss", unit="batch",
                      leave=False, disable=not progress or distributed.rank() != 0 or not sys.stderr.isatty(),
                      dynamic_ncols=True):
            chunk = mine[k: k + config.batch_size]
            loss = token_loss(module, chunk or examples[:1], pad, device)  # an idle process scores a stand-in
            if chunk:
                total[0] += float(loss)
                total[1] += sum(e.scored for e in chunk)
    module.train()
    distributed.sum_(total, "evaluating")
    return float(total[0] / total[1])


def tensors(x) -> list[torch.Tensor]:
    """The tensors in a nested state (dicts, lists)."""
    if isinstance(x, torch.Tensor):
        return [x]
    values = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else ()
    return [t for v in values for t in tensors(v)]


STATE_KEYS = {"key", "step", "optimizer", "scheduler", "scaler", "rng", "cuda_rng", "log", "evals", "best_step",
              "best", "best_loss", "bad"}  # what a checkpoint's state.pt holds (run() saves and reads them)


class OtherFormat(QuantkitError):
    """A checkpoint saved by a quantkit whose checkpoints mean something else."""


class Checkpoints:
    """The latest checkpoint in directory/checkpoint: adapter tensors, optimizer, scheduler, scaler,
    RNG, step and log, written beside it and swapped in whole."""

    def __init__(self, directory: Path):
        self.path, self.old = directory / CHECKPOINT, directory / f".{CHECKPOINT}.old"

    def latest(self) -> Path | None:
        # a kill between the two renames of a save leaves the previous checkpoint at .old. A symbolic link
        # planted at the partial output is not followed: the run writes there
        if self.path.parent.is_symlink():
            return None
        return next((p for p in (self.path, self.old) if (p / "state.pt").is_file() and not p.is_symlink()), None)

    def save(self, adapter: dict[str, torch.Tensor], state: dict) -> None:
        tmp = self.path.with_name(f".{CHECKPOINT}-{os.getpid()}")
        blob = serialize(adapter, metadata={"format": "pt"})
        try:
            remove(tmp)
            tmp.mkdir()
            with open(tmp / lora.WEIGHTS, "wb") as f:  # written by us, so that a full disk is an OSError
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            save_progress(tmp / "state.pt", state)
            fsync(tmp / "state.pt")  # unlike quantize's progress, the only copy once the old checkpoint goes
            fsync(tmp)  # the names of both files too
        except OSError as e:
            remove(tmp)
            previous = self.load()["step"] if self.latest() else None
            kept = f"the checkpoint of step {previous} is kept" if previous is not None else "no earlier checkpoint"
            again = f"run again with {option('resume', True)}" if previous is not None else "run the same command again"
            if e.errno in NO_ROOM:
                needed = len(blob) + sum(t.nbytes for t in tensors(state))
                raise ResumableError(f"out of disk space saving the checkpoint of step {state['step']} in {tmp.parent} "
                                     f"(about {size(needed)}, {size(free_space(tmp.parent))} free; {kept}): free some "
                                     f"space and {again}") from None
            if e.errno in REFUSED:
                raise ResumableError(f"saving the checkpoint of step {state['step']} ({kept}): "
                                     + refused(e, tmp.parent, again)) from None
            raise
        if self.path.exists():
            remove(self.old)
            self.path.rename(self.old)
        tmp.rename(self.path)
        fsync(self.path.parent)  # the renames on the disk before the old checkpoint goes
        remove(self.old)

    def all(self) -> list[Path]:
        """Every checkpoint, the previous one and any a killed save left (named for another process):
        none of them belongs in the output."""
        return [self.path, self.old, *self.path.parent.glob(f".{CHECKPOINT}-*")]

    def intact(self) -> dict | None:
        """The latest checkpoint, or None when there is none or it is damaged (a fresh start clears it)."""
        try:
            return self.load() if self.latest() is not None else None
        except OtherFormat:  # not damaged: kept for the version that saved it
            raise
        except QuantkitError:
            return None

    def load(self) -> dict:
        path = self.latest()
        with untrusted(path, "the checkpoint is damaged", f"run again without {option('resume', True)}"):
            state = read_progress(path / "state.pt")
            saved = state.get("format", 1) if isinstance(state, dict) else CHECKPOINT_FORMAT
            if saved != CHECKPOINT_FORMAT:  # before its keys: another format may have others
                raise OtherFormat(f"the checkpoint in {self.path.parent} was saved by another version of quantkit "
                                  f"(format {saved}, this one reads {CHECKPOINT_FORMAT}): resume it with that version, "
                                  f"or pass {option('overwrite', True)} to start over")
            missing = sorted(STATE_KEYS - state.keys()) if isinstance(state, dict) else ["every key"]
            if missing:
                raise ValueError(f"its state lacks {', '.join(missing)}")
            state["adapter"] = load_file(path / lora.WEIGHTS)
        return state


def plot(path: Path, log: list[dict], evals: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot([r["step"] for r in log], [r["loss"] for r in log], "o-" if len(log) < 30 else "-", ms=3, lw=0.8,
            alpha=0.6, label="training loss")  # a short run's few points marked
    if len(log) >= 10:  # a moving average shows the trend through the batch-to-batch noise
        k = max(len(log) // 20, 5)
        losses = torch.tensor([r["loss"] for r in log])
        smooth = losses.unfold(0, k, 1).mean(1)
        ax.plot([r["step"] for r in log[k - 1:]], smooth.tolist(), lw=1.5, label=f"training loss, mean of {k}")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", lw=1.5, label="held-out loss")
    ax.set(xlabel="step", ylabel="loss per scored token (nats)", title=title)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # steps: no 0.25
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def diverged(checkpoints: Checkpoints, what: str) -> None:
    """Stop a run whose loss or gradients are no longer finite, saying where to go on from."""
    saved = checkpoints.latest()
    # a resumed run repeats the same steps, and another --lr is another run: its checkpoint is of no use to it
    where = (f"lower {option('lr')} and train again with {option('overwrite', True)} (resumed, the run would repeat "
             f"the same steps; the last good checkpoint, of step {checkpoints.load()['step']}, is in {saved})"
             if saved else f"no checkpoint was saved yet: lower {option('lr')}")
    raise QuantkitError(f"{what}: {where}")


def train(model: str | os.PathLike | Model | None = None, config: TrainConfig | None = None, *,
          data: str | os.PathLike, out: str | os.PathLike, eval_data: str | os.PathLike | None = None,
          resume: bool = False, overwrite: bool = False, device: str | torch.device | None = None,
          progress: bool = True, callback: Callable[[dict], None] | None = None, alone: bool = False,
          **fields) -> TrainResult:
    """Fine-tune model (a directory, or by default the embedded model) with LoRA or QLoRA on data
    and write the adapter to out in PEFT's format, with its log and loss plot. config, or its fields
    by keyword. callback(record) is called after every step. resume: go on from the checkpoint a
    killed run of the same command left. Under torchrun, or in a process group the caller made, every
    process makes the same call and trains on its share of each batch; alone=True trains in this
    process by itself (a pipeline calling train on one rank of its own job)."""
    check_arguments(train, locals())
    check_fields(TrainConfig, config, fields, "train")
    config = replace(config, **fields) if config is not None else TrainConfig(**fields)
    with distributed.joined(not alone):
        dev = distributed.init(device_of(device))  # under torchrun: on this process's GPU
        rank, world = distributed.rank(), distributed.world()
        if config.fsdp and world < 2:
            raise QuantkitError(f"{option('fsdp', True)} shards the model over the processes of a torchrun job: launch "
                                f"with torchrun --nproc-per-node N, or train without {option('fsdp', True)}")
        if config.batch_size % world:
            raise QuantkitError(f"a batch of {config.batch_size} does not split over {world} processes: use a "
                                f"{option('batch_size')} that is a multiple of {world}")
        # before the model and data are read: out replaced with overwrite must not be what is read
        inputs = [model.source if isinstance(model, Model) else model, data, eval_data]
        if resume:
            check_apart(out, inputs)
        else:
            check_out(out, overwrite, directory=True, inputs=inputs)
        # every process reads the checkpoint, only rank 0 holds the lock
        partial = partial_path(out)
        checkpoints = Checkpoints(partial)
        if resume and checkpoints.latest() is None:
            raise QuantkitError(f"nothing to resume: {out} exists and no checkpoint of a run writing it is left (the run "
                                f"finished): use it, or train again without {option('resume', True)}, with "
                                f"{option('overwrite', True)} or another {option('out')}" if Path(out).exists() else
                                f"nothing to resume: no checkpoint of a run writing {out} (in {partial}): run without "
                                f"{option('resume', True)}")
        amp = autocast_dtype(config.precision, dev)
        m = model if isinstance(model, Model) else load(model)
        check_apart(out, [m.source])  # the embedded model, or a hub name's snapshot
        if m.adapter is not None:
            raise QuantkitError(f"this Model holds the LoRA adapter {m.adapter} unmerged (trained or attached in this "
                                "process): train another on the base loaded again (quantkit.load)")
        if not m.float_directory:
            raise QuantkitError(f"{m.source}: train on a float model directory (safetensors), not a GGUF file or a "
                                "quantized export: adapters are merged into the original weights")
        names = lora.check(m.module, config)
        check_context(m.module.config, config.seqlen, "seqlen")
        data_file, eval_file = Path(data), Path(eval_data) if eval_data else None
        if eval_file is not None and config.eval_fraction not in (0, TrainConfig.eval_fraction):
            raise held_out_twice(config.eval_fraction)
        examples = dataset.read(data_file, m.tokenizer, config.seqlen, progress)
        if eval_file is not None:
            train_set, held_out = examples, dataset.read(eval_file, m.tokenizer, config.seqlen, progress)
            same = os.path.samefile(eval_file, data_file) or (
                eval_file.stat().st_size == data_file.stat().st_size and digest(eval_file) == digest(data_file))
            if same and rank == 0:
                warnings.warn(f"{option('eval_data')} is the training data itself: its loss is the training loss "
                              f"(and {option('patience')} would stop on it): pass text the run does not train on")
        else:
            train_set, held_out = dataset.split(examples, config.eval_fraction, config.seed)
        if config.patience is not None and not held_out:
            raise QuantkitError(f"{option('patience')} stops on the held-out loss, and there is no held-out data: pass "
                                f"{option('eval_data')} or a positive {option('eval_fraction')}, or drop {option('patience')}")
        per_step = config.batch_size * config.grad_accum
        if per_step > len(train_set) and rank == 0:  # the stream runs on into the next epoch within the step
            warnings.warn(f"a step takes {per_step} examples ({option('batch_size')} x {option('grad_accum')}) and "
                          f"{data_file} gives {len(train_set)} to train on: each step takes some of them more than "
                          f"once: pass a smaller {option('batch_size')} or {option('grad_accum')}, or more data")
        total = config.steps or max(1, math.ceil((config.epochs or 1) * len(train_set) / per_step))
        if config.warmup >= total > 1 and rank == 0:
            warnings.warn(f"{option('warmup', config.warmup)} is not shorter than the run's {total} steps: the learning "
                          f"rate rises through the whole run, reaches {option('lr')} at its last step and never decays: pass "
                          f"a smaller {option('warmup')}")
        key = run_key(m.source, config, data_file, eval_file)

        with distributed.first_refuses(f"open {out}"):  # its lock: the others stop too, before building the model
            staged = Staged(out, overwrite) if rank == 0 else None
        state = None
        try:
            if resume:
                state = checkpoints.load()
                if state["key"] != key:
                    raise QuantkitError(f"the checkpoint in {partial} is of another run (a different model, data or "
                                        f"settings): resume with the command that started it, or choose another {option('out')}")
                if rank == 0:
                    print(f"resuming after step {len(state['log'])}/{total} from {checkpoints.latest()}", file=sys.stderr)
            else:
                kept = None if overwrite else checkpoints.intact()
                if kept is not None:  # hours of training, not to be lost to a missed flag
                    ours = kept["key"] == key
                    raise QuantkitError(f"{partial} holds the checkpoint of step {kept['step']} of " + (
                        f"this run: add {option('resume', True)} to go on from it" if ours else "another run writing it (a "
                        f"different model, data or settings): go on with that run's command and {option('resume', True)}")
                        + f", or pass {option('overwrite', True)} to start over")
                if staged is not None:  # a checkpoint kept is refused above: one left here is damaged
                    staged.fresh(own="checkpoint")
            m.adapter = str(out)  # the Model in memory gets the adapter's layers (evaluate scores it with them)
            try:  # FSDP's gathers run inside the forwards, backwards and checkpoints: a lost peer fails them there
                with distributed.collective("training", among=True) if world > 1 else nullcontext():
                    result, adapter = run(m, config, names, train_set=train_set, held_out=held_out, total=total,
                                          dev=dev, amp=amp, checkpoints=checkpoints, state=state, key=key,
                                          progress=progress, callback=callback)
            finally:
                settle(m.module)
            if rank == 0:
                # the checkpoints go once the adapter is on the disk: a stop until then resumes from the last
                with space_for(out, None, "the adapter", f"run again with {option('resume', True)} (the last checkpoint holds "
                               "every step)"):
                    write(partial, m, config, result, adapter, key)
                    staged.commit(checkpoints.all())
            result.out = str(out)
            return result
        except BaseException as e:
            if staged is not None:  # a checkpoint stays for --resume; a run that saved none leaves nothing
                staged.abort(keep=checkpoints.latest() is not None)
            kept = checkpoints.intact() if isinstance(e, KeyboardInterrupt) and rank == 0 else None
            if kept is not None:  # Ctrl-C or SIGTERM: where to go on from
                print(f"stopped: the checkpoint of step {kept['step']} is in {checkpoints.latest()}: run the same command "
                      f"with {option('resume', True)} to go on from it", file=sys.stderr)
            elif isinstance(e, KeyboardInterrupt) and rank == 0:
                print(f"stopped before the first checkpoint (one each {option('save_every', config.save_every)} steps): "
                      "nothing is kept", file=sys.stderr)
            if isinstance(e, distributed.Stopped):  # its advice (the same command) is quantize's: train's needs --resume
                raise ResumableError(f"another process of this torchrun job stopped{e.how}: " + (
                    f"the last checkpoint is kept: run the same command with {option('resume', True)} to go on from it"
                    if checkpoints.latest() is not None else "no checkpoint was saved yet: run the same command again")
                ) from None
            raise


def run(m: Model, config: TrainConfig, names: list[str], *, train_set: list[dataset.Example],
        held_out: list[dataset.Example], total: int, dev: torch.device, amp: torch.dtype | None,
        checkpoints: Checkpoints, state: dict | None, key: str, progress: bool,
        callback: Callable[[dict], None] | None) -> tuple[TrainResult, dict[str, torch.Tensor]]:
    """Train; the result and the adapter to write (with --patience, the best step's)."""
    rank, world = distributed.rank(), distributed.world()
    layers = build(m, config, names, dev, amp or torch.float32)
    module = m.module.train()
    if config.gradient_checkpointing:
        checkpointing(module, "enable")({"use_reentrant": False})
    params = [p for p in module.parameters() if p.requires_grad]
    opt = optimizer(config, layers, dev)
    sched = schedule(opt, config, total)
    scaler = torch.amp.GradScaler(dev.type) if amp == torch.float16 else None
    pad = m.tokenizer.pad_token_id if m.tokenizer.pad_token_id is not None else (m.tokenizer.eos_token_id or 0)
    precision = next(name for name, dtype in AUTOCAST.items() if dtype == amp)
    result = TrainResult(out="", steps=0, log=[], precision=precision)
    best, best_loss, bad = None, math.inf, 0
    if state is not None:
        lora.load_state(layers, state["adapter"], "the checkpoint")
        load_optimizer_state(opt, state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        if scaler is not None and state["scaler"] is not None:  # none: resumed where "auto" is float16, not bfloat16
            scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"])
        if dev.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"])
        result.log, result.evals, result.best_step = state["log"], state["evals"], state["best_step"]
        best, best_loss, bad = state["best"], state["best_loss"], state["bad"]
    start = len(result.log)

    evaluating = 0.0  # seconds spent on held-out data, left out of the training speed

    def evaluate(step: int) -> bool:
        """Score the held-out data; True when early stopping says stop."""
        nonlocal best, best_loss, bad, evaluating
        if not held_out:
            return False
        t = time.perf_counter()
        loss = held_out_loss(module, held_out, config, pad, dev, amp, progress)
        evaluating += time.perf_counter() - t
        result.evals.append({"step": step, "eval_loss": loss})
        if loss < best_loss:
            best, best_loss, bad, result.best_step = lora.adapter_state(layers), loss, 0, step
        else:
            bad += 1
        return config.patience is not None and bad >= config.patience

    forward = torch.compile(module) if config.compile else module
    if state is None:
        evaluate(0)
    context = (lambda: torch.autocast(dev.type, amp)) if amp else nullcontext
    bar = tqdm(total=total, initial=start, desc=f"training ({precision})", unit="step", disable=not progress or rank != 0,
               dynamic_ncols=True)
    began, tokens, evaluating = time.perf_counter(), 0, 0.0  # this run's tokens and time, for its speed
    # a run killed after the checkpoint of its early stop (before writing the adapter) stops there again
    stop = state is not None and config.patience is not None and bad >= config.patience
    seen = result.log[-1]["tokens"] if result.log else 0  # every run's, for the log
    try:
        for step in range(start, start if stop else total):
            first = step * config.batch_size * config.grad_accum  # this step's first place in the data stream
            stream = dataset.sequence(len(train_set), config.seed, first, config.batch_size * config.grad_accum)
            scored = sum(train_set[i].scored for i in stream)  # over the whole global batch: every process knows it
            tokens += sum(train_set[i].ids.numel() for i in stream)  # each process's share differs in length
            loss_sum = 0.0
            for k in range(config.grad_accum):
                shares = list(range(k * config.batch_size, (k + 1) * config.batch_size))[rank::world]
                mine = [train_set[stream[j]] for j in shares]
                # dropout's masks follow each example's place in the stream, not its place in this process's batch
                lora.seed_examples(layers, [(config.seed << 40 | first + j, e.ids.numel()) for j, e in zip(shares, mine)])
                if config.fsdp:  # the gradients are reduced after the last micro-batch only
                    module.set_requires_gradient_sync(k == config.grad_accum - 1)
                with context():
                    try:
                        loss = token_loss(forward, mine, pad, dev) / scored
                    except Exception as e:  # torch.compile's failures surface at the first call
                        if forward is module:
                            raise
                        warnings.warn(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}): "
                                      "training without it")
                        forward = module
                        loss = token_loss(forward, mine, pad, dev) / scored
                (scaler.scale(loss) if scaler else loss).backward()
                loss_sum += float(loss.detach())
            if config.fsdp:  # FSDP summed the gradients
                loss_sum = float(distributed.sum_(torch.tensor([loss_sum], device=dev), "summing the loss"))
            elif world > 1:  # the adapter's gradients and the loss, summed over the processes in one message
                flat = torch.cat([p.grad.reshape(-1) for p in params] + [torch.tensor([loss_sum], device=dev)])
                distributed.sum_(flat, "summing gradients")
                for p, g in zip(params, flat[:-1].split([p.numel() for p in params])):
                    p.grad.copy_(g.view_as(p))
                loss_sum = float(flat[-1])
            if not math.isfinite(loss_sum):
                diverged(checkpoints, f"the training loss became {loss_sum} at step {step + 1}")
            if scaler:
                scaler.unscale_(opt)
            norm = float(lora.whole(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)))
            if not scaler and not math.isfinite(norm):  # the scaler skips such a step; the optimizer would take it
                diverged(checkpoints, f"the gradients' norm became {norm} at step {step + 1}")
            lr = sched.get_last_lr()[0]
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            if math.isfinite(norm):  # as transformers' Trainer: a step the scaler skipped takes none of the schedule
                sched.step()
            opt.zero_grad(set_to_none=True)
            record = {"step": step + 1, "loss": loss_sum, "lr": lr, "grad_norm": norm, "tokens": seen + tokens}
            result.log.append(record)
            elapsed = time.perf_counter() - began - evaluating
            bar.set_postfix(loss=f"{loss_sum:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens / elapsed:.0f}", refresh=False)
            bar.update()
            last = step + 1 == total
            if (step + 1) % config.eval_every == 0 or last:
                stop = evaluate(step + 1)
                if result.evals and result.evals[-1]["step"] == step + 1 and rank == 0:  # once, not per process
                    bar.write(f"step {step + 1}: held-out loss {result.evals[-1]['eval_loss']:.4f}")
            if (step + 1) % config.save_every == 0 or last or stop:
                adapter, opt_state = lora.adapter_state(layers), optimizer_state(opt)  # every process: FSDP gathers
                if rank == 0:
                    checkpoints.save(adapter, {
                        "format": CHECKPOINT_FORMAT, "key": key, "step": step + 1, "optimizer": opt_state, "scheduler": sched.state_dict(),
                        # LoRA's dropout has its own seeds; the RNG is for the model's own dropout, if any
                        "scaler": scaler.state_dict() if scaler else None, "rng": torch.get_rng_state(),
                        "cuda_rng": torch.cuda.get_rng_state() if dev.type == "cuda" else None, "log": result.log,
                        "evals": result.evals, "best_step": result.best_step, "best": best, "best_loss": best_loss,
                        "bad": bad})
            if callback is not None:
                callback(record)
            if stop:
                if rank == 0:
                    bar.write(f"early stop at step {step + 1}: no better held-out loss in {config.patience} evaluations; "
                              f"the adapter of step {result.best_step} is kept")
                break
    finally:  # an error is printed after the bar, not on its line
        bar.close()
    result.steps = len(result.log)
    result.stopped_early = stop
    result.tokens_per_s = tokens / max(time.perf_counter() - began - evaluating, 1e-9)
    result.peak_memory = peak_memory()
    if config.patience is not None and best is not None:  # --patience keeps the best step's adapter, stopped or not
        if result.best_step == 0 and rank == 0:
            warnings.warn(f"the held-out loss never went below the untrained adapter's (step 0), which is the one "
                          f"written: it leaves the model as it was: lower {option('lr')}, or train on more data")
        lora.load_state(layers, best, "the best step's adapter")  # and the model in memory is the adapter written
        return result, best
    return result, lora.adapter_state(layers)


def write(directory: Path, m: Model, config: TrainConfig, result: TrainResult, adapter: dict[str, torch.Tensor],
          key: str) -> None:
    """The adapter, the log (with the run's key) and the loss plot."""
    # a relative path would name another model from another directory
    base = os.path.abspath(m.source) if os.path.exists(m.source) else m.source
    lora.save(directory, m.module, adapter, config, base)
    log = {"config": config.to_dict(), "key": key, **{k: v for k, v in result.to_dict().items() if k != "out"}}
    (directory / LOG).write_text(strict_json(log, indent=1) + "\n")  # a step fp16's scaler skipped: grad_norm null
    plot(directory / PLOT, result.log, result.evals, f"{config.method}{' + DoRA' if config.dora else ''} "
         f"r{config.rank} on {Path(m.source).name}")
