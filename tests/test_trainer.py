"""The trainer against its judges: PEFT loads our adapters (and we load PEFT's) with the same logits,
merges equal PEFT's, QLoRA's base is bitsandbytes' NF4, a resumed run repeats an uninterrupted
one, and two processes repeat one."""
import functools
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantkit.errors import QuantkitError
from quantkit.trainer import TrainConfig, dataset, lora, merge, train
from quantkit.trainer.merging import attach

from .conftest import TEST, VALID
from .test_distributed import ROOT, one_process, refused_while_locked, torchrun

IDS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
SHORT = dict(seqlen=32, batch_size=2, eval_fraction=0, progress=False)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A slice of the training text: about 200 windows of 32 tokens, so evaluations stay quick."""
    path = tmp_path_factory.mktemp("data") / "train.txt"
    path.write_text(VALID.read_text()[:30_000])
    return path


def logits(module) -> torch.Tensor:
    with torch.no_grad():
        return module(IDS).logits


def base(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_model_trained_in_half_precision_scores_as_it_trained(tiny_dir, text, tmp_path, precision):
    """train(m) in bf16 or fp16 leaves m's frozen base in that dtype and its adapter in float32: evaluate(m)
    ran it without autocast and raised torch's dtype mismatch (a traceback). Now it scores under the
    training's autocast, near the adapter attached to the float32 base, and m keeps its dtypes."""
    import quantkit

    m = quantkit.load(tiny_dir)
    train(m, data=text, out=tmp_path / "a", steps=2, lr=0.05, dropout=0.0, rank=4, precision=precision, **SHORT)
    held = {n: p.dtype for n, p in m.module.named_parameters()}
    assert len(set(held.values())) == 2
    kw = dict(data=TEST, ctx=32, max_windows=4, progress=False)
    half, full = quantkit.evaluate(m, **kw), quantkit.evaluate(attach(tiny_dir, tmp_path / "a"), **kw)
    assert math.isclose(half.perplexity, full.perplexity, rel_tol=2e-2) and half.perplexity != full.perplexity
    assert {n: p.dtype for n, p in m.module.named_parameters()} == held


@pytest.mark.parametrize("options", [{}, {"rslora": True}, {"dora": True}], ids=["lora", "rslora", "dora"])
def test_peft_loads_our_adapter_and_merges_like_us(tiny_dir, text, tmp_path, options):
    from peft import PeftModel

    # a high rate, so that B is far from its zero start and every tensor matters
    train(tiny_dir, data=text, out=tmp_path / "a", steps=3, lr=0.05, dropout=0.0, rank=4, precision="fp32",
          **SHORT, **options)
    peft = PeftModel.from_pretrained(base(tiny_dir), tmp_path / "a")
    result = peft.load_adapter(tmp_path / "a", adapter_name="again")
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora_" in k]
    ours = attach(tiny_dir, tmp_path / "a")
    assert torch.allclose(logits(ours.module), logits(peft), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits(base(tiny_dir)), logits(peft), atol=1e-3)  # the adapter does something
    merge(tmp_path / "a", tmp_path / "m", progress=False)
    merged = logits(base(tmp_path / "m"))
    assert torch.allclose(merged, logits(peft.merge_and_unload()), atol=1e-4, rtol=1e-4)


def test_a_model_trained_in_memory_scores_as_its_merge_and_is_not_quantized(tiny_dir, text, tmp_path, recwarn):
    """train(m) left m in training mode: evaluate(m) raised on the dropout's seeds of the last batch,
    quantize(m) an AttributeError on the LoRA layers, and training m again blamed the checkpoint.
    Checkpointing turned on and off under transformers' names of the day: the old ones warned. The
    caller's random generator is as it was (train seeded it)."""
    import quantkit

    from quantkit.trainer.loop import checkpointing

    m = quantkit.load(tiny_dir)
    torch.manual_seed(1234)
    drawn = torch.get_rng_state()
    train(m, data=text, out=tmp_path / "a", steps=2, lr=0.05, dropout=0.1, rank=4, precision="fp32",
          gradient_checkpointing=True, **SHORT)
    assert torch.equal(torch.get_rng_state(), drawn)
    assert not m.module.training and not checkpointing(m.module, "is")
    assert not [str(w.message) for w in recwarn if "checkpointing" in str(w.message)]
    merge(tmp_path / "a", tmp_path / "m", progress=False)
    kw = dict(data=TEST, ctx=32, max_windows=4, progress=False)
    in_memory, merged = quantkit.evaluate(m, **kw), quantkit.evaluate(quantkit.load(tmp_path / "m"), **kw)
    assert math.isclose(in_memory.perplexity, merged.perplexity, rel_tol=1e-4)
    assert not math.isclose(merged.perplexity, quantkit.evaluate(quantkit.load(tiny_dir), **kw).perplexity,
                            rel_tol=1e-3)  # the adapter does something
    with pytest.raises(QuantkitError, match="holds the LoRA adapter .* unmerged .*: quantize the merged model"):
        quantkit.quantize(m, method="rtn", bits=4, group_size=32)
    with pytest.raises(QuantkitError, match="holds the LoRA adapter .* unmerged .*: train another on the base"):
        train(m, data=text, out=tmp_path / "b", steps=1, **SHORT)


def test_we_load_peft_adapters(tiny_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    # dropout on: the layers attached to a loaded model are in its eval mode, so it does nothing
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], use_dora=True, lora_dropout=0.1,
                        init_lora_weights=False, task_type="CAUSAL_LM")
    torch.manual_seed(0)
    peft = get_peft_model(base(tiny_dir), config).eval()  # get_peft_model leaves it training
    peft.save_pretrained(tmp_path / "peft")
    ours = attach(tiny_dir, tmp_path / "peft")
    assert sorted(n for n, m in ours.module.named_modules() if isinstance(m, lora.LoraLinear))[:2] == [
        "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj"]
    assert torch.allclose(logits(ours.module), logits(peft), atol=1e-5, rtol=1e-5)
    merge(tmp_path / "peft", tmp_path / "m", base=tiny_dir, progress=False)
    assert torch.allclose(logits(base(tmp_path / "m")), logits(peft.merge_and_unload()), atol=1e-4, rtol=1e-4)


def test_merge_writes_each_tensor_in_its_dtype_in_the_base(tiny_dir, text, tmp_path):
    """A base of bfloat16 linears beside float32 norms (as some releases keep them) was merged with every
    layer tensor in the majority dtype: the norms came out rounded to bfloat16."""
    import shutil

    from safetensors.torch import save_file

    mixed = tmp_path / "mixed"
    shutil.copytree(tiny_dir, mixed)
    state = load_file(mixed / "model.safetensors")
    state = {k: t.float() if "norm" in k else t.bfloat16() for k, t in state.items()}
    save_file(state, mixed / "model.safetensors", metadata={"format": "pt"})
    train(mixed, data=text, out=tmp_path / "a", steps=1, lr=0.05, rank=4, precision="fp32", **SHORT)
    merge(tmp_path / "a", tmp_path / "m", base=mixed, progress=False)
    merged = load_file(tmp_path / "m" / "model.safetensors")
    assert {k: t.dtype for k, t in merged.items()} == {k: t.dtype for k, t in state.items()}
    assert all(torch.equal(merged[k], t) for k, t in state.items() if "norm" in k)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], state["model.layers.0.self_attn.q_proj.weight"])


def test_merge_an_adapter_on_lm_head(tiny_dir, tmp_path):
    """PEFT can target lm_head: merge adds it (it was dropped: the merged head was the base's), and
    refuses a head tied to the embedding, which one merged weight cannot express."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    def peft_on(model, out):
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False,
                            task_type="CAUSAL_LM")
        torch.manual_seed(0)
        peft = get_peft_model(base(model), config).eval()
        peft.save_pretrained(out, save_embedding_layers=False)  # the LoRA tensors only
        return peft

    config = base(tiny_dir).config
    config.tie_word_embeddings = False
    LlamaForCausalLM(config).save_pretrained(tmp_path / "untied")  # a head of its own
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(tmp_path / "untied")
    peft = peft_on(tmp_path / "untied", tmp_path / "a")
    assert torch.allclose(logits(attach(tmp_path / "untied", tmp_path / "a").module), logits(peft), atol=1e-5, rtol=1e-5)
    merge(tmp_path / "a", tmp_path / "m", base=tmp_path / "untied", progress=False)
    assert torch.allclose(logits(base(tmp_path / "m")), logits(peft.merge_and_unload()), atol=1e-4, rtol=1e-4)

    peft_on(tiny_dir, tmp_path / "tied")
    with pytest.raises(QuantkitError, match="ties to its embedding, so it cannot be merged"):
        merge(tmp_path / "tied", tmp_path / "m2", base=tiny_dir, progress=False)
    assert not (tmp_path / "m2").exists()


def test_an_interrupted_merge_resumes_after_the_last_merged_layer(tiny_dir, text, tmp_path, monkeypatch, capsys):
    """Killed in layer 1 of 2, the same merge goes on from layer 1 and writes the bytes of one never
    stopped (it started afresh: a 70B merge is hours of reading and writing); another run's merged
    layers (another shard size, a quantization) are not thrown away without overwrite."""
    import quantkit
    from quantkit.trainer import merging

    train(tiny_dir, data=text, out=tmp_path / "a", steps=2, lr=0.05, dropout=0.0, rank=4, precision="fp32", warmup=0,
          **SHORT)
    kw = dict(max_shard_size="30kB", progress=False)
    merge(tmp_path / "a", tmp_path / "whole", **kw)
    real, parts = merging.merge_part, []

    def dies_in_layer_1(m, prefix, *args, **kwargs):
        parts.append(prefix)
        if prefix == "model.layers.1" and len(parts) == 2:
            raise KeyboardInterrupt
        return real(m, prefix, *args, **kwargs)

    monkeypatch.setattr(merging, "merge_part", dies_in_layer_1)
    with pytest.raises(KeyboardInterrupt):
        merge(tmp_path / "a", tmp_path / "m", **kw)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == [".m.partial", ".m.progress.pt", "a", "whole"]
    with pytest.raises(QuantkitError, match=r"holds 1 of 2 layers of another run writing .*m \(it ran with "
                                            r"max_shard_size='30kB', this command with '5GB'\).*pass overwrite=True"):
        merge(tmp_path / "a", tmp_path / "m", progress=False)
    with pytest.raises(QuantkitError, match=r"holds 1 of 2 layers of another run writing .*m \(it merged an adapter "
                                            r"into its base \(quantkit merge\)\)"):
        quantkit.quantize(str(tiny_dir), method="rtn", out=tmp_path / "m", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == kept
    parts.clear()
    merge(tmp_path / "a", tmp_path / "m", **kw)
    assert "resuming after layer 1/2" in capsys.readouterr().err
    assert parts[0] == "model.layers.1" and "model.layers.0" not in parts
    assert {f.name: f.read_bytes() for f in (tmp_path / "m").iterdir()} == \
        {f.name: f.read_bytes() for f in (tmp_path / "whole").iterdir()}
    assert len(list((tmp_path / "m").glob("model-*-of-*.safetensors"))) > 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "m", "whole"]  # no progress, partial or lock left


def test_a_merge_stopped_under_an_earlier_format_starts_afresh(tiny_dir, text, tmp_path, monkeypatch, capsys):
    """A merge's progress from before each tensor kept its own dtype (format 1) is not gone on from: its
    layers may hold norms rounded to the checkpoint's majority dtype."""
    from quantkit import pipeline
    from quantkit.atomic import progress_path
    from quantkit.trainer import merging

    train(tiny_dir, data=text, out=tmp_path / "a", steps=1, lr=0.05, dropout=0.0, rank=4, precision="fp32", warmup=0,
          **SHORT)
    merge(tmp_path / "a", tmp_path / "whole", progress=False)
    real = pipeline.save_progress

    def save_then_stop(path, state):
        del state["format"]  # as quantkit saved it before the format had a number
        real(path, state)
        raise KeyboardInterrupt

    monkeypatch.setattr(merging, "save_progress", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        merge(tmp_path / "a", tmp_path / "m", progress=False)
    monkeypatch.setattr(merging, "save_progress", real)
    capsys.readouterr()
    merge(tmp_path / "a", tmp_path / "m", progress=False)
    err = capsys.readouterr().err
    assert f"ignoring progress file {progress_path(tmp_path / 'm')}: another version of quantkit saved it " \
           f"(format 1, this one reads {merging.FORMAT}), so the run starts afresh" in err
    assert "resuming" not in err
    assert {f.name: f.read_bytes() for f in (tmp_path / "m").iterdir()} == \
        {f.name: f.read_bytes() for f in (tmp_path / "whole").iterdir()}


def test_dora_is_the_base_at_its_start_under_autocast_and_keeps_no_weight_for_the_backward():
    """DoRA's norm was taken in the autocast dtype and its magnitudes in float32: under bf16 an untrained
    layer was not the base (ratios off by up to 0.4%), and the merge rescaled rows by what training had
    absorbed. With dropout, F.linear(h, W) kept a weight-sized copy (QLoRA's dequantized base) until the
    backward."""
    torch.manual_seed(0)
    base = torch.nn.Linear(256, 512)
    layer = lora.LoraLinear(base, rank=4, scale=2.0, dora=True)
    x = torch.randn(3, 256, dtype=torch.bfloat16)  # as o_proj's and down_proj's inputs come under autocast
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(layer(x), base(x).float())
    nf4 = lora.LoraLinear(lora.quantize_nf4(torch.nn.Linear(64, 48, bias=False), 64), rank=4, scale=2.0, dropout=0.1,
                          dora=True)
    nf4.dropout.examples = [(1, 5), (2, 5)]  # (seed, length) of each example, as the loop sets them
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y = nf4(torch.randn(2, 5, 64, requires_grad=True))
    y.sum().backward()
    assert saved and (48, 64) not in saved and (64, 48) not in saved, saved
    assert nf4.magnitude.grad is not None and nf4.lora_A.weight.grad is not None


def test_all_linear_beside_other_names(tiny_dir):
    """--target all-linear,q_proj was refused: "--target all-linear matches no linear: use all-linear"."""
    from quantkit.modelio import load

    module = load(tiny_dir).module
    assert lora.targets(module, ["all-linear", "q_proj"]) == lora.decoder_linears(module)


def test_qlora_base_is_bitsandbytes_nf4_and_merges_onto_it(tiny_dir, text, tmp_path):
    import bitsandbytes.functional as bnbf

    w = base(tiny_dir).model.layers[0].mlp.up_proj.weight.detach()
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight.data = w
    ours = lora.quantize_nf4(linear, 64)
    assert torch.equal(ours.dequantize(), bnbf.dequantize_4bit(packed, state).float())

    train(tiny_dir, data=text, out=tmp_path / "q", method="qlora", steps=2, lr=0.05, dropout=0.0, rank=4,
          precision="fp32", **SHORT)
    merge(tmp_path / "q", tmp_path / "m", onto_nf4=True, progress=False)
    trained = attach(tiny_dir, tmp_path / "q", onto_nf4=True)  # what QLoRA computed with
    assert torch.allclose(logits(base(tmp_path / "m")), logits(trained.module), atol=1e-4, rtol=1e-4)


def test_qlora_rounds_the_checkpoints_weights_as_merge_does(tiny_dir):
    """Under bf16 autocast the trainer rounded a bf16 copy of each float32 weight to NF4, where merge
    --onto-nf4 and attach round the checkpoint's own weights: on the embedded model 0.3% of the codes
    differed, and the model as trained was not the one they rebuild."""
    import quantkit
    from quantkit.trainer.loop import build

    config = TrainConfig(method="qlora", rank=4)
    m = quantkit.load(tiny_dir)
    names = lora.check(m.module, config)
    layers = build(m, config, names, torch.device("cpu"), torch.bfloat16)
    reference = base(tiny_dir)
    for name in names:
        assert torch.equal(layers[name].weight(), lora.quantize_nf4(reference.get_submodule(name), 64).dequantize())
    assert m.module.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16  # the rest in the compute dtype


def test_the_warmup_steps_from_its_first_step(tiny_dir, text, tmp_path):
    """The warmup's first step had learning rate 0: --steps 1 wrote an untrained adapter (every B zero)
    and exited 0; a run no longer than its warmup (default 10 steps) never reached --lr."""
    one = train(tiny_dir, data=text, out=tmp_path / "one", steps=1, rank=4, lr=1e-2, **SHORT)
    assert one.log[0]["lr"] == 1e-2
    assert all(t.abs().max() > 0 for k, t in load_file(tmp_path / "one" / lora.WEIGHTS).items() if "lora_B" in k)
    with pytest.warns(UserWarning, match="warmup=10 is not shorter than the run's 4 steps"):
        short = train(tiny_dir, data=text, out=tmp_path / "short", steps=4, rank=4, lr=1e-2, **SHORT)
    assert [r["lr"] for r in short.log] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2])
    run = train(tiny_dir, data=text, out=tmp_path / "run", steps=6, warmup=2, rank=4, lr=1e-2, **SHORT)
    lrs = [r["lr"] for r in run.log]
    assert lrs[:3] == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2]) and lrs[2:] == sorted(lrs[2:], reverse=True) and lrs[-1] > 0


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_resumed_run_repeats_an_uninterrupted_one(tiny_dir, text, tmp_path, capsys, optimizer):
    """Dropout on, so its masks must follow the data's position; killed after step 3, resumed from
    step 2's checkpoint, with torch's AdamW and with bitsandbytes' 8-bit one (whose state holds ints)."""
    opts = dict(steps=6, save_every=2, dropout=0.1, rank=4, lr=1e-2, seqlen=32, batch_size=2, grad_accum=2,
                eval_fraction=0.1, eval_every=3, optimizer=optimizer, progress=False)
    whole = train(tiny_dir, data=text, out=tmp_path / "whole", **opts)

    def kill(record):
        if record["step"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(tiny_dir, data=text, out=tmp_path / "cut", callback=kill, **opts)
    assert not (tmp_path / "cut").exists() and (tmp_path / ".cut.partial" / "checkpoint").is_dir()
    assert "stopped: the checkpoint of step 2 is in" in capsys.readouterr().err
    resumed = train(tiny_dir, data=text, out=tmp_path / "cut", resume=True, **opts)
    assert [r["loss"] for r in resumed.log] == pytest.approx([r["loss"] for r in whole.log], rel=1e-6)
    assert [r["eval_loss"] for r in resumed.evals] == pytest.approx([r["eval_loss"] for r in whole.evals], rel=1e-6)
    a, b = load_file(tmp_path / "whole" / lora.WEIGHTS), load_file(tmp_path / "cut" / lora.WEIGHTS)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert whole.evals[-1]["eval_loss"] < whole.evals[0]["eval_loss"]  # it learns
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "loss.png", "train_log.json"]


def test_ctrl_c_before_the_first_checkpoint_says_nothing_is_kept(tiny_dir, text, tmp_path, capsys):
    def kill(record):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(tiny_dir, data=text, out=tmp_path / "a", steps=4, save_every=2, warmup=0, rank=4, callback=kill, **SHORT)
    assert "stopped before the first checkpoint (one each save_every=2 steps): nothing is kept" in \
        capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_cut_short_stays_out_of_the_adapter(tiny_dir, text, tmp_path, monkeypatch):
    """Ctrl-C while a checkpoint is written leaves it half-written beside the last good one; the run
    resumed by another process (another name for its own) wrote that inside the adapter directory."""
    import os

    from quantkit.trainer import loop

    real, calls = loop.save_progress, []

    def save(*args):
        calls.append(1)
        if len(calls) == 2:  # the checkpoint of step 4
            raise KeyboardInterrupt
        real(*args)

    monkeypatch.setattr(loop, "save_progress", save)
    opts = dict(steps=6, save_every=2, rank=4, seqlen=32, batch_size=2, eval_fraction=0, progress=False)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_dir, data=text, out=tmp_path / "a", **opts)
    monkeypatch.undo()
    partial = tmp_path / ".a.partial"
    (partial / f".checkpoint-{os.getpid()}").rename(partial / ".checkpoint-1")  # as a process now gone left it
    train(tiny_dir, data=text, out=tmp_path / "a", resume=True, **opts)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "loss.png", "train_log.json"]


def test_options_that_must_not_change_the_losses(tiny_dir, text, tmp_path, monkeypatch):
    """Gradient checkpointing recomputes the same, dropout's masks included; a torch.compile that fails
    falls back to the same."""
    opts = dict(steps=3, rank=4, lr=1e-2, dropout=0.1, precision="fp32", **SHORT)
    plain = train(tiny_dir, data=text, out=tmp_path / "plain", **opts)
    checkpointed = train(tiny_dir, data=text, out=tmp_path / "gc", gradient_checkpointing=True, **opts)
    assert [r["loss"] for r in checkpointed.log] == pytest.approx([r["loss"] for r in plain.log], rel=1e-5)

    def broken(module):
        def fail(*args, **kwargs):
            raise RuntimeError("no compiler")
        return fail

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(UserWarning, match="torch.compile failed"):
        compiled = train(tiny_dir, data=text, out=tmp_path / "c", compile=True, **opts)
    assert [r["loss"] for r in compiled.log] == pytest.approx([r["loss"] for r in plain.log], rel=1e-6)


def test_lora_plus_and_8bit_adamw(tiny_dir, text, tmp_path):
    from quantkit.trainer.loop import optimizer

    layer = lora.LoraLinear(torch.nn.Linear(16, 8), rank=2, scale=1.0)
    groups = optimizer(TrainConfig(lr=1e-3, lora_plus=16), {"x": layer}, torch.device("cpu")).param_groups
    assert [g["lr"] for g in groups] == [1e-3, 16e-3] and groups[1]["params"] == [layer.lora_B.weight]
    dora = lora.LoraLinear(torch.nn.Linear(16, 8), rank=2, scale=1.0, dora=True)  # its magnitude with B, as PEFT's
    groups = optimizer(TrainConfig(lr=1e-3, lora_plus=16), {"x": dora}, torch.device("cpu")).param_groups
    assert groups[0]["params"] == [dora.lora_A.weight] and groups[1]["params"] == [dora.lora_B.weight, dora.magnitude]
    result = train(tiny_dir, data=text, out=tmp_path / "a", steps=3, rank=4, lr=1e-2, optimizer="adamw8bit", **SHORT)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in result.log)
    assert load_file(tmp_path / "a" / lora.WEIGHTS)[
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"].abs().sum() > 0  # it stepped


def test_epochs_and_a_held_out_file(tiny_dir, text, tmp_path):
    """--epochs counts optimizer steps over every window of --data (nothing is split off when
    --eval-data is given, the default --eval-fraction aside; another is refused), and the first
    held-out loss is the base's mean token loss on that file."""
    from quantkit import load

    held = tmp_path / "held.txt"
    held.write_text(TEST.read_text()[:4000])
    tok = load(tiny_dir).tokenizer
    result = train(tiny_dir, data=text, out=tmp_path / "a", eval_data=held, epochs=0.25, grad_accum=2, rank=4,
                   precision="fp32", eval_every=1000, **{**SHORT, "eval_fraction": TrainConfig.eval_fraction})
    assert result.steps == math.ceil(0.25 * len(dataset.read(text, tok, 32)) / 4)
    ids = torch.stack([e.ids for e in dataset.read(held, tok, 32)])
    with torch.no_grad():
        expected = float(base(tiny_dir)(ids, labels=ids).loss)
    assert result.evals[0]["step"] == 0 and result.evals[0]["eval_loss"] == pytest.approx(expected, rel=1e-4)


def test_early_stopping_keeps_the_best_adapter(tiny_dir, text, tmp_path, monkeypatch):
    """--patience 2: held-out losses 3.0, 2.0, 2.5, 2.6 at steps 0-3 stop the run after step 3 with
    step 1's adapter, which equals a run of one step."""
    from quantkit.trainer import loop

    losses = iter([3.0, 2.0, 2.5, 2.6])
    monkeypatch.setattr(loop, "held_out_loss", lambda *args: next(losses))
    opts = dict(rank=4, lr=1e-2, dropout=0.0, warmup=0, precision="fp32", eval_every=1, seqlen=32, batch_size=2,
                eval_fraction=0.1, progress=False)
    stopped = train(tiny_dir, data=text, out=tmp_path / "stopped", steps=10, patience=2, **opts)
    assert stopped.stopped_early and stopped.steps == 3 and stopped.best_step == 1
    monkeypatch.undo()
    train(tiny_dir, data=text, out=tmp_path / "one", steps=1, **opts)
    a, b = load_file(tmp_path / "stopped" / lora.WEIGHTS), load_file(tmp_path / "one" / lora.WEIGHTS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_early_stopping_at_the_untrained_adapter_warns(tiny_dir, text, tmp_path, monkeypatch):
    """Held-out losses that only rose: --patience wrote step 0's adapter (B all zero, the model as it was)
    and exited 0 without a word."""
    from quantkit.trainer import loop

    losses = iter([2.0, 2.5, 2.6])
    monkeypatch.setattr(loop, "held_out_loss", lambda *args: next(losses))
    with pytest.warns(UserWarning, match=r"never went below the untrained adapter's \(step 0\), which is the one "
                                         r"written: it leaves the model as it was: lower lr"):
        r = train(tiny_dir, data=text, out=tmp_path / "a", steps=4, patience=2, rank=4, warmup=0, eval_every=1,
                  seqlen=32, batch_size=2, eval_fraction=0.1, progress=False)
    assert r.best_step == 0 and r.stopped_early
    assert all(not t.any() for k, t in load_file(tmp_path / "a" / lora.WEIGHTS).items() if "lora_B" in k)


def test_patience_keeps_the_best_adapter_when_the_run_ends_first(tiny_dir, text, tmp_path, monkeypatch):
    """--patience 5: held-out losses 3.0, 2.0, 2.5 at steps 0-2 end the run (2 steps) before it stops
    early; step 1's adapter is kept, as the option says, not the last step's."""
    from quantkit.trainer import loop

    losses = iter([3.0, 2.0, 2.5])
    monkeypatch.setattr(loop, "held_out_loss", lambda *args: next(losses))
    opts = dict(rank=4, lr=1e-2, dropout=0.0, warmup=0, precision="fp32", eval_every=1, seqlen=32, batch_size=2,
                eval_fraction=0.1, progress=False)
    kept = train(tiny_dir, data=text, out=tmp_path / "kept", steps=2, patience=5, **opts)
    assert not kept.stopped_early and kept.steps == 2 and kept.best_step == 1
    monkeypatch.undo()
    train(tiny_dir, data=text, out=tmp_path / "one", steps=1, **opts)
    a, b = load_file(tmp_path / "kept" / lora.WEIGHTS), load_file(tmp_path / "one" / lora.WEIGHTS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_killed_after_its_early_stop_resumes_to_the_stop(tiny_dir, text, tmp_path, monkeypatch):
    """Killed after the checkpoint of the step that stopped it early (before the adapter was
    written): --resume ends there as the uninterrupted run did, rather than training on."""
    from quantkit.trainer import loop

    losses = [3.0, 2.0, 2.5, 2.6, 2.7, 2.8]
    opts = dict(steps=6, patience=2, rank=4, lr=1e-2, dropout=0.0, warmup=0, precision="fp32", eval_every=1, seqlen=32,
                batch_size=2, eval_fraction=0.1, progress=False)
    monkeypatch.setattr(loop, "held_out_loss", lambda *args, it=iter(losses): next(it))
    whole = train(tiny_dir, data=text, out=tmp_path / "whole", **opts)

    def kill(record):
        if record["step"] == 3:  # the stop's checkpoint is saved
            raise KeyboardInterrupt

    monkeypatch.setattr(loop, "held_out_loss", lambda *args, it=iter(losses): next(it))
    with pytest.raises(KeyboardInterrupt):
        train(tiny_dir, data=text, out=tmp_path / "cut", callback=kill, **opts)
    resumed = train(tiny_dir, data=text, out=tmp_path / "cut", resume=True, **opts)
    assert whole.steps == 3 and resumed.stopped_early and resumed.steps == 3 and resumed.best_step == 1
    a, b = load_file(tmp_path / "whole" / lora.WEIGHTS), load_file(tmp_path / "cut" / lora.WEIGHTS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fp16_with_a_gradient_scaler(tiny_dir, text, tmp_path):
    """--precision fp16 (for GPUs without bf16) scales the loss and unscales before clipping: the same
    losses as float32 to fp16's precision, and the adapter steps."""
    opts = dict(steps=3, rank=4, lr=1e-2, dropout=0.0, **SHORT)
    full = train(tiny_dir, data=text, out=tmp_path / "fp32", precision="fp32", **opts)
    half = train(tiny_dir, data=text, out=tmp_path / "fp16", precision="fp16", **opts)
    assert [r["loss"] for r in half.log] == pytest.approx([r["loss"] for r in full.log], rel=1e-2)
    assert [r["grad_norm"] for r in half.log] == pytest.approx([r["grad_norm"] for r in full.log], rel=5e-2)
    assert load_file(tmp_path / "fp16" / lora.WEIGHTS)[
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"].abs().sum() > 0


def test_fp16_steps_the_scaler_skips_take_none_of_the_schedule(tiny_dir, text, tmp_path, monkeypatch):
    """A step whose fp16 gradients overflowed is skipped by the scaler (which then lowers its scale); it took
    its step of the learning-rate schedule all the same, so a run that began with such steps lost that much
    of its warmup. Here the scale starts at 2^20, where the first steps overflow."""
    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0 ** 20))
    result = train(tiny_dir, data=text, out=tmp_path / "a", precision="fp16", steps=8, rank=4, lr=1e-2, warmup=3,
                   dropout=0.0, **SHORT)
    skipped = [not math.isfinite(r["grad_norm"]) for r in result.log]
    assert skipped[0] and not all(skipped), skipped
    factors = [1 / 4, 2 / 4, 3 / 4] + [0.5 * (1 + math.cos(math.pi * k / 5)) for k in range(5)]  # 3 warm of 8
    taken = [r["lr"] for r, s in zip(result.log, skipped) if not s]
    assert taken == pytest.approx([1e-2 * f for f in factors[:len(taken)]])


def test_auto_precision_is_bf16_only_where_the_cpu_multiplies_it(monkeypatch):
    """--precision auto on a CPU: bf16 autocast where the CPU has AVX512-BF16 or AMX (its flags in
    /proc/cpuinfo), float32 elsewhere, where bf16 is emulated (16x float32's time per step on AVX2);
    asked for, bf16 is used either way."""
    from quantkit.trainer import loop

    cpu = torch.device("cpu")
    info = Path("/proc/cpuinfo")
    if info.is_file():
        flags = {f for line in info.read_text().splitlines() if line.startswith("flags") for f in line.split()}
        assert loop.cpu_bf16() == bool(flags & {"avx512_bf16", "amx_tile"})
    for native, chosen in ((True, torch.bfloat16), (False, None)):
        monkeypatch.setattr(loop, "cpu_bf16", lambda: native)
        assert loop.autocast_dtype("auto", cpu) == chosen
        assert loop.autocast_dtype("bf16", cpu) == torch.bfloat16 and loop.autocast_dtype("fp32", cpu) is None


@pytest.mark.parametrize("limit", [0.01, 1e6], ids=["clipped", "unclipped"])
def test_the_optimizer_steps_with_clipped_gradients(tiny_dir, text, tmp_path, limit):
    """--max-grad-norm: every step's gradients reach the optimizer with a norm of at most the limit
    (the log keeps the norm before clipping); a limit above it leaves them as they are."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    stepped = []

    def norm(opt, args, kwargs):
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        stepped.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

    handle = register_optimizer_step_pre_hook(norm)
    try:
        result = train(tiny_dir, data=text, out=tmp_path / "a", steps=3, rank=4, lr=1e-2, max_grad_norm=limit,
                       precision="fp32", **SHORT)
    finally:
        handle.remove()
    before = [r["grad_norm"] for r in result.log]
    assert all(0.01 < b < 1e6 for b in before)
    assert stepped == pytest.approx([min(b, limit) for b in before], rel=1e-4)


# --lr 2.5e-3 moves the adapter as far over these 4 warmup steps as 1e-2 did when the warmup's first step
# had rate 0. Adam divides each gradient by its own size, so where one is near 0 the float noise of
# summing it in another order (one process or two) becomes a step of up to the rate
TWO = ["--steps", 4, "--seqlen", 32, "--batch-size", 4, "--grad-accum", 2, "--rank", 4, "--dropout", 0.1,
       "--eval-fraction", 0.1, "--eval-every", 2, "--save-every", 2, "--precision", "fp32", "--lr", 2.5e-3]


@pytest.fixture(scope="module")
def one(tiny_dir, text, tmp_path_factory):
    """The single-process run the two-process ones repeat: its log and adapter."""
    out = tmp_path_factory.mktemp("one") / "a"
    job = one_process(tiny_dir, "--data", text, *TWO, "--out", out, command="train")
    assert job.returncode == 0, job.stderr[-3000:]
    return json.loads((out / "train_log.json").read_text()), load_file(out / lora.WEIGHTS)


def same_run(out, one) -> None:
    log, adapter = one
    two = json.loads((out / "train_log.json").read_text())
    assert [r["loss"] for r in two["log"]] == pytest.approx([r["loss"] for r in log["log"]], rel=1e-5)
    assert [r["eval_loss"] for r in two["evals"]] == pytest.approx([r["eval_loss"] for r in log["evals"]], rel=1e-5)
    theirs = load_file(out / lora.WEIGHTS)
    assert theirs.keys() == adapter.keys()
    assert all(torch.allclose(theirs[k], adapter[k], rtol=1e-4, atol=1e-6) for k in adapter)


@pytest.mark.parametrize("fsdp", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_two_processes_repeat_one(tiny_dir, text, tmp_path, one, fsdp):
    """The same global batch of 4 split 2 + 2, two micro-batches a step, dropout on (each example's
    masks follow its place in the data, not in a process's batch): the summed gradients, hence the
    losses and the adapter, are one process's. With --fsdp the base, adapter and optimizer state are
    sharded and the checkpoints gathered."""
    job = torchrun(tiny_dir, "--data", text, *TWO, *fsdp, "--out", tmp_path / "two", command="train")
    assert job.returncode == 0, job.stderr[-3000:]
    same_run(tmp_path / "two", one)
    assert job.stdout.count("adapter written to") == 1


def test_two_processes_repeat_one_on_padded_batches(chat_dir, tmp_path):
    """Instruction records of different lengths: each process pads its share of a batch to its own
    longest, and dropout's masks, drawn for the real tokens only, are still one process's."""
    words = VALID.read_text().split()
    records = [{"instruction": " ".join(words[i * 40: i * 40 + 5 + 3 * i]), "response": " ".join(words[i * 40 + 20: i * 40 + 24 + i])}
               for i in range(12)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # at 128 tokens, 11 records of 68 to 128 (at 64, 3 were left, all cut to 64: nothing was padded)
    common = [chat_dir, "--data", tmp_path / "data.jsonl", "--steps", 2, "--seqlen", 128, "--batch-size", 4, "--rank", 4,
              "--dropout", 0.1, "--eval-fraction", 0, "--precision", "fp32", "--lr", 1e-2]
    single = one_process(*common, "--out", tmp_path / "one", command="train")
    assert single.returncode == 0, single.stderr[-3000:]
    job = torchrun(*common, "--out", tmp_path / "two", command="train")
    assert job.returncode == 0, job.stderr[-3000:]
    one, two = (json.loads((tmp_path / d / "train_log.json").read_text())["log"] for d in ("one", "two"))
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one]  # not the first process's share times two


def test_fsdp_shards_the_base_and_the_adapter(tiny_dir, tmp_path):
    """What --fsdp builds: every parameter, frozen or trained, a shard of the process group's mesh (one
    process here; the two-process tests check the numbers)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from quantkit.modelio import load
    from quantkit.trainer import loop

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        m, config = load(tiny_dir), TrainConfig(fsdp=True, rank=4)
        layers = loop.build(m, config, lora.check(m.module, config), torch.device("cpu"), torch.float32)
        assert layers and all(isinstance(p, DTensor) for p in m.module.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("resume", ["fsdp", "one-process"])
def test_fsdp_run_stopped_and_resumed_repeats_one_process(tiny_dir, text, tmp_path, one, resume, monkeypatch):
    """Both processes stop after step 3 (or rank 1 alone, and rank 0 tells how to go on: its advice was
    quantize's, the same command, which refused for want of --resume); the checkpoint of step 2 (gathered
    from the shards) is sharded again on --resume, optimizer state included, or, since it holds whole
    tensors, resumed by a single process without --fsdp."""
    args = [tiny_dir, "--data", text, *TWO, "--out", tmp_path / "a"]
    if resume == "one-process":
        monkeypatch.setenv("STOPPING", "1")
    job = torchrun(*args, "--fsdp", script=(str(ROOT / "tests" / "torchrun_train_stops.py"),), command="train")
    assert job.returncode != 0 and not (tmp_path / "a").exists()
    if resume == "one-process":
        errors = [line for line in job.stderr.splitlines() if line.startswith("error: ")]
        assert errors and errors[0].endswith("the last checkpoint is kept: run the same command with --resume to go on "
                                             "from it"), job.stderr[-3000:]
    if resume == "fsdp":
        job = torchrun(*args, "--fsdp", "--resume", command="train")
    else:
        job = one_process(*args, "--resume", command="train")
    assert job.returncode == 0, job.stderr[-3000:]
    assert "resuming after step 2/4" in job.stderr
    same_run(tmp_path / "a", one)


def test_a_job_whose_adapter_another_run_writes_stops_every_process(tiny_dir, text, tmp_path):
    """Rank 0 alone takes the output's lock: refused it, it said so, while rank 1 built the model and
    then reported a stopped process and a run to resume."""
    errors = refused_while_locked(tmp_path / "a", tiny_dir, "--data", text, *TWO, "--out", tmp_path / "a",
                                  command="train")
    assert any(f"{tmp_path / 'a'} is being written by another quantkit process" in e for e in errors), errors
    assert any(f"the first process of this torchrun job could not open {tmp_path / 'a'}" in e for e in errors), errors


def test_fsdp_processes_with_unequal_held_out_shares(tiny_dir, text, tmp_path):
    """5 held-out windows in batches of 2: rank 0 scores 3 (two forwards), rank 1 scores 2 (one). Under
    FSDP every forward gathers the layers from both, so rank 1 joins the second with a stand-in it
    does not count: the held-out losses are one process's."""
    tok, source = AutoTokenizer.from_pretrained(tiny_dir), VALID.read_text()
    size = next(n for n in range(100, 10_000, 10) if len(tok(source[:n], add_special_tokens=False).input_ids) // 32 == 5)
    (tmp_path / "held.txt").write_text(source[:size])
    common = [tiny_dir, "--data", text, "--eval-data", tmp_path / "held.txt", "--steps", 1, "--seqlen", 32,
              "--batch-size", 2, "--rank", 4, "--precision", "fp32", "--eval-every", 1]
    single = one_process(*common, "--out", tmp_path / "one", command="train")
    assert single.returncode == 0, single.stderr[-3000:]
    job = torchrun(*common, "--fsdp", "--out", tmp_path / "two", command="train")
    assert job.returncode == 0, job.stderr[-3000:]
    one, two = (json.loads((tmp_path / d / "train_log.json").read_text())["evals"] for d in ("one", "two"))
    assert len(one) == 2 and [r["eval_loss"] for r in two] == pytest.approx([r["eval_loss"] for r in one], rel=1e-5)


def test_train_then_quantize_in_one_command(tiny_dir, text, tmp_path):
    import quantkit

    job = one_process(tiny_dir, "--data", text, "--steps", 2, "--seqlen", 32, "--batch-size", 2, "--rank", 4,
                      "--out", tmp_path / "a", "--quantize", "rtn", "--group-size", 32, command="train")
    assert job.returncode == 0, job.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "a-merged", "a-rtn"]
    assert quantkit.load(tmp_path / "a-rtn").qconfig.method == "rtn"
    said = job.stdout.splitlines()  # who loads it, as quantize says
    assert said[said.index(f"exported to {tmp_path / 'a-rtn'}") + 1] == "who loads it, from their documented limits:"
    assert any(line.split()[0] == "yes" and "GPTQModel" in line for line in said if line.startswith("  "))


@pytest.mark.parametrize("stage", ["merge", "quantize"])
def test_train_then_quantize_killed_after_the_training_resumes(tiny_dir, text, tmp_path, capsys, monkeypatch, stage):
    """Killed in the merge or the quantization, the same command with --resume went nowhere ("a-merged already
    exists", or "nothing to resume": the adapter was finished): now it takes the finished adapter (and merge)
    and goes on, the quantization from its last finished layer. Once merged, the base may be gone (the
    calibration text was checked against it, and the resume refused)."""
    import shutil

    from quantkit import api, trainer

    from .conftest import VALID, cli

    base = tmp_path / "base"
    shutil.copytree(tiny_dir, base)
    args = ["train", base, "--data", text, "--steps", 2, "--seqlen", 32, "--batch-size", 2, "--rank", 4,
            "--out", tmp_path / "a", "--quantize", "gptq", "--group-size", 32, "--calib-data", VALID,
            "--calib-samples", 8, "--calib-seqlen", 64]
    with monkeypatch.context() as killed:
        killed.setattr(trainer if stage == "merge" else api, stage,
                       lambda *a, **kw: (_ for _ in ()).throw(KeyboardInterrupt))
        assert cli(args, capsys, monkeypatch)[0] == 130
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == \
        ["a"] + ["a-merged"] * (stage == "quantize") + ["base"]
    if stage == "quantize":
        shutil.rmtree(base)
    trained = (tmp_path / "a" / "adapter_model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(trainer, "train", lambda *a, **kw: pytest.fail("trained again"))
    if stage == "merge":  # another run's command (it went on from this adapter, as if it were its own)
        code, _, err = cli([*args, "--resume", "--lr", "1e-3"], capsys, monkeypatch)
        assert code == 2 and err[-1].startswith("error: ") and "is the finished adapter of another run" in err[-1]
    code, printed, err = cli([*args, "--resume"], capsys, monkeypatch)
    assert code == 0, err
    assert "a is a finished adapter: going on to " + ("merge and quantize" if stage == "merge" else "quantize") in printed
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "base") == ["a", "a-gptq", "a-merged"]
    assert (tmp_path / "a" / "adapter_model.safetensors").stat().st_mtime_ns == trained


def test_train_then_quantize_resumed_after_an_overwrite(tiny_dir, text, tmp_path, capsys, monkeypatch):
    """An --overwrite run of train --quantize killed in its merge, then resumed, quantized the earlier run's
    merge (a-merged was taken as this adapter's); one killed in its training was refused on resume, as "the
    finished adapter of another run" (the earlier run's adapter, this run's checkpoint beside it)."""
    from quantkit import trainer

    from .conftest import VALID, cli

    other = tmp_path / "other.txt"
    other.write_text(VALID.read_text()[30_000:60_000])

    def run(data, out, *more):
        return cli(["train", tiny_dir, "--data", data, "--out", tmp_path / out, "--steps", 4, "--save-every", 1, "--warmup", 1,
                    "--seqlen", 32, "--batch-size", 2, "--rank", 4, "--lr", 0.05, "--quantize", "rtn", "--group-size",
                    32, *more], capsys, monkeypatch)

    def weights(path):
        return load_file(path / ("model.safetensors" if path.name.endswith("merged") else lora.WEIGHTS))

    assert run(text, "a")[0] == 0
    first, first_merged = weights(tmp_path / "a"), weights(tmp_path / "a-merged")
    assert run(other, "b")[0] == 0  # the other data's run, uninterrupted
    with monkeypatch.context() as killed:
        killed.setattr(trainer, "merge", lambda *a, **kw: (_ for _ in ()).throw(KeyboardInterrupt))
        assert run(other, "a", "--overwrite")[0] == 130
    code, printed, err = run(other, "a", "--overwrite", "--resume")
    assert code == 0 and "a is a finished adapter: going on to merge and quantize it" in printed, err
    merged, wanted = weights(tmp_path / "a-merged"), weights(tmp_path / "b-merged")
    assert all(torch.equal(merged[k], wanted[k]) for k in wanted)
    assert not all(torch.equal(merged[k], first_merged[k]) for k in wanted)

    real = trainer.train

    def stop(record):
        if record["step"] == 3:
            raise KeyboardInterrupt

    with monkeypatch.context() as killed:
        killed.setattr(trainer, "train", lambda *a, **kw: real(*a, callback=stop, **kw))
        assert run(text, "a", "--overwrite")[0] == 130
    code, _, err = run(text, "a", "--overwrite", "--resume")
    assert code == 0, err
    again = weights(tmp_path / "a")
    assert all(torch.allclose(again[k], first[k], atol=1e-6) for k in first)


def test_a_step_larger_than_the_training_set_is_told(tiny_dir, tmp_path):
    """A step of more examples than the training set has takes some twice or more (the stream runs on
    into the next epoch): a run asked for one epoch of 9 windows trained on 64, silently."""
    short = tmp_path / "short.txt"
    short.write_text(VALID.read_text()[:600])
    n = len(dataset.read(short, AutoTokenizer.from_pretrained(tiny_dir), 32))
    with pytest.warns(UserWarning, match=rf"a step takes 64 examples \(batch_size x grad_accum\) and .* gives {n} to"):
        run = train(tiny_dir, data=short, out=tmp_path / "run", epochs=1, rank=4, warmup=0, **{**SHORT, "batch_size": 64})
    assert n < 64 and run.steps == 1
