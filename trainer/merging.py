"""Adapters merged into their base: W + scale*BA in float32 (DoRA renormalized), layer by layer
from the base checkpoint into a new model directory, each tensor in its dtype in the base, so that the result feeds
`quantkit quantize` like any model. --onto-nf4 merges into the NF4-rounded base that QLoRA trained
against instead of the original weights."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from quantkit.config import check_arguments
from quantkit.errors import QuantkitError, ResumableError, option, space_for, untrusted
from quantkit.atomic import Staged, check_apart, check_out, progress_path, size_on_disk
from quantkit.exporters.checkpoint import licences
from quantkit.exporters.shards import DEFAULT_MAX_SIZE, INDEX, ShardWriter, parse_size, state_intact
from quantkit.modelio import FLOAT_DTYPES, Model, fingerprint, hub_snapshot, load
from quantkit.pipeline import load_progress, other_run, save_progress, write_other

from . import lora
from .config import TrainConfig
from .loop import LOG

SIDE_FILES = (".json", ".txt", ".model", ".jinja")  # config, generation config, tokenizer, chat template
VARIANTS = {"alora_invocation_tokens": "an activated LoRA (aLoRA)", "use_qalora": "a QA-LoRA adapter",
            "velora_config": "a VeLoRA adapter", "use_bdlora": "a block-diagonal LoRA",
            "monteclora_config": "a MonteCLoRA adapter", "arrow_config": "an Arrow routing of adapters",
            "kasa_config": "a KaSA adapter", "layer_replication": "LoRA on replicated layers",
            "target_parameters": "LoRA on parameters rather than linear layers",
            "fan_in_fan_out": "LoRA on transposed (Conv1D) weights"}  # PEFT's LoraConfig fields, by what they make
FORMAT = 2  # what a merge's progress holds, raised when its meaning changes: 2 writes each tensor in its own dtype
MERGED_FROM = "quantkit.merged_from"  # a merged model's shards' metadata: merge_key of what was merged into it


def read(adapter: str | os.PathLike, onto_nf4: bool = False) -> tuple[TrainConfig, dict, dict[str, torch.Tensor]]:
    """An adapter's settings (with the NF4 block QLoRA used, when quantkit trained it), its PEFT
    config and its tensors. onto_nf4: for merging into the NF4 base, which a LoRA adapter never saw."""
    cfg, tensors = lora.read(adapter)
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise QuantkitError(f"{adapter}: per-module ranks or alphas (rank_pattern, alpha_pattern) are not supported: "
                            "train the adapter with one rank and alpha")
    # PEFT's other parts beside the A and B matrices: merged without them, the model would not be the adapter's
    biases = any(k.endswith(".bias") for k in tensors)  # PEFT's bias "all" or "lora_only" saves those the base has
    for key, what in (("lora_bias", "a trained bias on lora_B"), ("bias", "trained biases of the base's layers"),
                      ("modules_to_save", "whole modules trained beside it"),
                      ("trainable_token_indices", "token embeddings trained beside it")):
        if cfg.get(key) and (key != "bias" or biases and cfg[key] != "none"):
            raise QuantkitError(f"{adapter}: the adapter has {what} ({key}), which quantkit does not merge: merge it "
                                "with PEFT (merge_and_unload), or train it without them")
    # PEFT's LoRA variants compute other than W + scale*BA (aLoRA only past its invocation tokens: PEFT merges none)
    if key := next((k for k in VARIANTS if cfg.get(k)), None):
        raise QuantkitError(f"{adapter}: the adapter is {VARIANTS[key]} ({key}), which quantkit does not compute: "
                            "use it with PEFT")
    log = Path(adapter) / LOG
    with untrusted(adapter, f"its {lora.CONFIG} or {LOG} is damaged", "train it again or restore it"):
        config = lora.config_of(cfg)
        trained = json.loads(log.read_text())["config"] if log.is_file() else {}
        if "nf4_block" in trained:
            config.nf4_block = int(trained["nf4_block"])
        lora_trained = trained.get("method") == "lora"  # a damaged log (not a mapping) is named by untrusted
    if onto_nf4 and lora_trained:
        raise QuantkitError(f"{adapter} was trained with LoRA on the float base (its {LOG} says so), and "
                            f"{option('onto_nf4', True)} merges into the NF4-rounded base QLoRA trains against: drop "
                            f"{option('onto_nf4', True)}")
    return config, cfg, tensors


def base_of(cfg: dict, base: str | os.PathLike | None, adapter) -> Model:
    named = named_base(cfg)
    if not (base or named):
        raise QuantkitError(f"{adapter}: the adapter names no base model: pass {option('base')} (its directory)")
    if not Path(base or named).exists() and hub_snapshot(base or named) is None:
        raise QuantkitError(f"{base or named}: the adapter's base model is not here (nor in the local hub cache): pass "
                            f"{option('base')} with its directory")
    m = load(base or named)
    if not m.float_directory:
        raise QuantkitError(f"{base or named}: merge into a float model directory (safetensors), not a GGUF file or a "
                            "quantized export")
    return m


def named_base(cfg: dict) -> str | None:
    """The base an adapter's config names, if it names one by a string (a hand-edited config may not)."""
    named = cfg.get("base_model_name_or_path")
    return named if isinstance(named, str) else None


def same_model(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two model names or directories are the same model (a hub id matches its last part)."""
    pa, pb = Path(a), Path(b)
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return pa.name == pb.name


def fitted(m: Model, config: TrainConfig, tensors: dict[str, torch.Tensor], adapter) -> dict[str, dict[str, torch.Tensor]]:
    """The adapter's tensors by linear name, each checked against the base's shapes."""
    by_linear: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, _, part = key.removeprefix(lora.PREFIX).partition(".lora_")
        by_linear.setdefault(name, {})[part] = t
    for name, parts in by_linear.items():
        try:
            linear = m.module.get_submodule(name)
        except AttributeError:
            raise QuantkitError(f"{adapter}: the adapter has {name}, which the base model lacks: pass the "
                                f"{option('base')} it was trained on") from None
        if not isinstance(linear, torch.nn.Linear):  # PEFT's LoRA on an embedding (lora_embedding_A)
            raise QuantkitError(f"{adapter}: the adapter has LoRA on {name}, not a linear layer ({type(linear).__name__}): "
                                "quantkit reads LoRA on linear layers only: use PEFT for this adapter")
        a, b = parts.get("A.weight"), parts.get("B.weight")
        want = {"A.weight": (config.rank, linear.in_features), "B.weight": (linear.out_features, config.rank)}
        if config.dora:
            want["magnitude_vector"] = (linear.out_features,)
        got = {k: tuple(v.shape) for k, v in parts.items()}
        if a is not None and b is not None and a.dim() == b.dim() == 2 and a.shape[0] == b.shape[1] != config.rank:
            raise QuantkitError(f"{adapter}: its {lora.CONFIG} says r={config.rank}, and its tensors have rank "
                                f"{a.shape[0]} ({name}): the adapter is damaged: train it again or restore it")
        if a is None or b is None or got != want:
            raise QuantkitError(f"{adapter}: {name}'s adapter tensors are {got}, but this base needs {want}: pass the "
                                f"{option('base')} it was trained on")
    return by_linear


def merge(adapter: str | os.PathLike, out: str | os.PathLike, base: str | os.PathLike | None = None,
          onto_nf4: bool = False, overwrite: bool = False, max_shard_size: int | str = DEFAULT_MAX_SIZE,
          progress: bool = True) -> Path:
    """Write base + adapter to out as a model directory (safetensors shards, each tensor in its dtype in
    the base, its config and tokenizer files). base: the adapter config's base_model_name_or_path by default."""
    check_arguments(merge, locals())
    check_out(out, overwrite, directory=True, inputs=[adapter, base])  # before the base loads
    parse_size(max_shard_size)
    config, cfg, tensors = read(adapter, onto_nf4)
    m = base_of(cfg, base, adapter)
    check_apart(out, [adapter, m.source])
    by_linear = fitted(m, config, tensors, adapter)
    if "lm_head" in by_linear and m.module.config.tie_word_embeddings:  # merged, it would change the embedding too
        raise QuantkitError(f"{adapter}: the adapter changes lm_head, which this model ties to its embedding, so it "
                            "cannot be merged into one weight: use the adapter unmerged (PEFT), or train without lm_head")
    needed = sum(f.stat().st_size for f in set(m.checkpoint.where.values()))  # the base's shards, in its dtype
    # what a killed merge's progress must match to be gone on from
    key = {"merge": merge_key(adapter, onto_nf4), "base": fingerprint(m.source), "max_shard_size": str(max_shard_size)}
    saved, n = progress_path(out), len(m.layers)
    staged, writer = Staged(out, overwrite), None
    try:
        if not overwrite:  # another run's merged layers are not thrown away
            check_progress(staged, key, n)
        named = named_base(cfg)
        if base and named and not same_model(base, named):  # after the checks: a base they refuse gets one line
            # same shapes pass every check, so a wrong base of the same architecture would merge silently
            warnings.warn(f"{adapter} was trained on {named}; merging it into {base} as asked")
        with space_for(out, needed - size_on_disk(staged.path), "the merged model",
                       "run the same command again: it resumes after the last merged layer"):
            writer = ShardWriter(staged.path, max_shard_size, {MERGED_FROM: key["merge"]})
            state = load_progress(saved, key, FORMAT)
            if state is not None and not (staged.path.is_dir() and not staged.path.is_symlink()
                                          and state_intact(staged.path, state["writer"])):
                print(f"ignoring progress file {saved}: the partial output it describes is gone or changed",
                      file=sys.stderr)
                state = None
            if state is None:
                staged.fresh(own="layers")  # a progress file left now is this merge's, of no use
            else:
                writer.resume(state["writer"])
                print(f"resuming after layer {state['next_layer']}/{n} from {saved}", file=sys.stderr)
            start = state["next_layer"] if state else 0
            for i in tqdm(range(start, n), initial=start, total=n, unit="layer", desc="merging", disable=not progress):
                merge_part(m, f"model.layers.{i}", by_linear, config=config, onto_nf4=onto_nf4, writer=writer)
                save_progress(saved, {"format": FORMAT, "key": key, "next_layer": i + 1, "writer": writer.state()})
            for prefix in ("model.embed_tokens", "model.norm", "lm_head"):
                if prefix in by_linear:  # PEFT can target lm_head (fitted: only linears have adapters)
                    merge_part(m, prefix, by_linear, config=config, onto_nf4=onto_nf4, writer=writer)
                else:
                    write_other(m, prefix, writer, None, keep=False)
            writer.close()
            sides = {f for f in Path(m.source).iterdir() if f.is_file() and f.suffix in SIDE_FILES and f.name != INDEX}
            for f in sides | set(licences(m.source)):
                shutil.copy2(f, staged.path / f.name)
            return staged.commit(writer.scratch())
    except BaseException as e:
        # the merged layers stay for the same command, unless the input is at fault: it would fail the same way
        keep = saved.is_file() and not (isinstance(e, QuantkitError) and not isinstance(e, ResumableError))
        if writer is not None:
            writer.release()
        staged.abort(keep=keep)
        if isinstance(e, KeyboardInterrupt) and keep:  # Ctrl-C, SIGTERM
            print(f"stopped: the merged layers are kept beside {out} ({saved.name}): run the same command to go "
                  "on from them", file=sys.stderr)
        raise


def check_progress(staged: Staged, key: dict, layers: int) -> None:
    """Refuse to start afresh over the merged layers of another run writing the same output (a merge of
    another adapter or base, a quantization): what differs, and how to go on or discard them."""
    found = other_run([progress_path(staged.out)], key)
    if found is None or not staged.path.exists():
        return
    _, theirs, done = found
    if not isinstance(theirs, dict) or theirs.keys() != key.keys():
        why = "it was not a merge"
    elif theirs["merge"] != key["merge"]:
        why = "it merged another adapter, or the adapter's files changed since it started"
    elif theirs["base"] != key["base"]:
        why = "it merged into another base, or the base's files changed since it started"
    else:
        why = f"it ran with max_shard_size={theirs['max_shard_size']!r}, this command with {key['max_shard_size']!r}"
    staged.refused = True  # abort() leaves that work where it is
    raise QuantkitError(f"{staged.path} holds {done} of {layers} layers of another run writing {staged.out} ({why}): "
                        f"run that command again to go on from them, or pass {option('overwrite', True)} to discard "
                        "them and start afresh")


def merge_key(adapter: str | os.PathLike, onto_nf4: bool = False) -> str | None:
    """A digest of the adapter's files (and whether it goes onto the NF4-rounded base), as a merge records it
    in the shards it writes (None: the adapter's files cannot be read). The base is train --quantize's own."""
    h = hashlib.sha256()
    try:
        for name in (lora.CONFIG, lora.WEIGHTS):
            h.update((Path(adapter) / name).read_bytes())
    except OSError:
        return None
    return h.hexdigest() + ("+nf4" if onto_nf4 else "")


def merged_from(model: str | os.PathLike) -> str | None:
    """The merge_key a model directory's shards record (None: no merge of quantkit's wrote them)."""
    from safetensors import safe_open

    shard = min(Path(model).glob("*.safetensors"), default=None)
    if shard is None:
        return None
    try:
        with safe_open(shard, "pt") as f:
            return (f.metadata() or {}).get(MERGED_FROM)
    except Exception:  # a damaged shard: not known to be any merge (safetensors raises its own error types)
        return None


def merge_part(m: Model, prefix: str, by_linear: dict[str, dict[str, torch.Tensor]], *, config: TrainConfig,
               onto_nf4: bool, writer: ShardWriter) -> None:
    """The part of the model at prefix, read in float32, with the adapters on its linears merged, each
    tensor written in its dtype in the base (float32 norms beside bfloat16 linears stay float32)."""
    part = m.materialize(prefix, "cpu", torch.float32)
    for name, parts in by_linear.items():
        if name == prefix or name.startswith(prefix + "."):
            linear = m.module.get_submodule(name)
            w = lora.quantize_nf4(linear, config.nf4_block).dequantize() if onto_nf4 else linear.weight
            linear.weight.data = lora.merged(w, parts["A.weight"], parts["B.weight"], config.scale,
                                             parts.get("magnitude_vector"))
    for key, t in part.state_dict().items():
        writer.add(f"{prefix}.{key}", t.to(FLOAT_DTYPES[m.checkpoint.dtypes[f"{prefix}.{key}"]]))
    m.release(prefix)


def attach(model: str | os.PathLike | Model | None, adapter: str | os.PathLike, onto_nf4: bool = False) -> Model:
    """model (whole, in float32) with adapter's LoRA layers in place, unmerged: for evaluating an
    adapter, ours or PEFT's, as it trained (onto_nf4: on the NF4 base QLoRA trained against)."""
    check_arguments(attach, locals())
    config, cfg, tensors = read(adapter, onto_nf4)
    m = model if isinstance(model, Model) else load(model)
    if m.adapter is not None:
        raise QuantkitError(f"this Model holds the LoRA adapter {m.adapter} already: attach {adapter} to the base "
                            "loaded again (quantkit.load)")
    by_linear = fitted(m, config, tensors, adapter)
    m.materialize()
    m.checkpoint = None
    m.module.requires_grad_(False)
    config.method = "qlora" if onto_nf4 else "lora"
    layers = lora.inject(m.module, config, list(by_linear))
    lora.load_state(layers, tensors, str(adapter))
    m.adapter = str(adapter)
    return m
