"""`quantkit train` and `quantkit merge` on bad input: one line naming the problem and the fix, exit
status 2, no traceback; nothing left behind by a run that saved no checkpoint, and a checkpoint
that was saved survives for --resume."""
import errno
import json
import math
import os
import re
import shutil
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoTokenizer

from quantkit.command import main
from quantkit.errors import QuantkitError
from quantkit.trainer import dataset, loop, train

from .conftest import VALID, make_tiny

FAST = ["--seqlen", 32, "--batch-size", 2, "--rank", 4, "--warmup", 0, "--eval-fraction", 0]


def run(args, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["quantkit", *map(str, args)])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and [l for l in lines if "error:" in l] == lines[-1:], err  # one line, the last
    return e.value.code, lines[-1] if lines else ""


def fails(args, capsys, monkeypatch, match):
    code, line = run(args, capsys, monkeypatch)
    assert code == 2 and line.startswith("error: ") and match in line, line
    return line


def train_fails(model, data, capsys, monkeypatch, tmp_path, match, *args):
    """quantkit train (args after FAST's, so they win) fails before any checkpoint: nothing left behind."""
    line = fails(["train", model, "--data", data, "--out", tmp_path / "out", *FAST, "--steps", 2, *args],
                 capsys, monkeypatch, match)
    assert left(tmp_path) == []
    return line


def left(tmp_path, name="out"):
    """What a run writing tmp_path/name left: the output and its hidden siblings."""
    return sorted(p.name for p in tmp_path.iterdir() if p.name == name or p.name.startswith(f".{name}."))


def saved_step(tmp_path):
    from quantkit.pipeline import read_progress

    return read_progress(tmp_path / ".out.partial" / "checkpoint" / "state.pt")["step"]


@pytest.fixture
def text(tmp_path):
    """Text for plenty of 32-token windows, quick to tokenize."""
    path = tmp_path / "train.txt"
    path.write_text(VALID.read_text()[:5000])
    return path


def jsonl(path, *lines):
    """A JSON-lines file: dicts as JSON, strings as they are."""
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize("content,match", [
    ("", "the file is empty: pass a file with text to train on"),
    ("a few words", "not one window of --seqlen 32: pass more text or a smaller --seqlen")])
def test_data_without_a_window(tiny_dir, capsys, monkeypatch, tmp_path, content, match):
    (tmp_path / "data.txt").write_text(content)
    train_fails(tiny_dir, tmp_path / "data.txt", capsys, monkeypatch, tmp_path, match)


def test_binary_data(tiny_dir, capsys, monkeypatch, tmp_path):
    """Bytes that are not text were decoded with replacement characters and trained on."""
    (tmp_path / "data.bin").write_bytes(bytes(range(256)) * 64)
    train_fails(tiny_dir, tmp_path / "data.bin", capsys, monkeypatch, tmp_path, "data.bin: not UTF-8 text")


def test_compressed_data(tiny_dir, capsys, monkeypatch, tmp_path):
    """A gzip file was said to be "not UTF-8" only; calibration's reader names what it is."""
    import gzip

    (tmp_path / "data.txt.gz").write_bytes(gzip.compress(b"some words " * 500))
    train_fails(tiny_dir, tmp_path / "data.txt.gz", capsys, monkeypatch, tmp_path,
                "data.txt.gz: gzip-compressed: decompress it (gunzip) and pass the text")


@pytest.mark.parametrize("lines,match", [
    ([CHAT, {"foo": 1}], "line 2: a record needs messages, instruction and response"),
    ([CHAT, "", "{oops"], "line 3: not valid JSON")])  # blank lines count
def test_bad_record(chat_dir, capsys, monkeypatch, tmp_path, lines, match):
    train_fails(chat_dir, jsonl(tmp_path / "data.jsonl", *lines), capsys, monkeypatch, tmp_path, match)


def test_a_byte_order_mark_is_not_read_as_data(chat_dir, tmp_path):
    """JSON lines saved with a UTF-8 byte-order mark (Windows editors) read as the same records."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_dir)
    plain = jsonl(tmp_path / "plain.jsonl", CHAT, CHAT)
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    got, want = dataset.read(marked, tok, 64), dataset.read(plain, tok, 64)
    assert len(got) == 2 and all(torch.equal(a.ids, b.ids) and torch.equal(a.labels, b.labels) for a, b in zip(got, want))


def test_records_without_a_chat_template(tiny_dir, capsys, monkeypatch, tmp_path):
    train_fails(tiny_dir, jsonl(tmp_path / "data.jsonl", CHAT, CHAT), capsys, monkeypatch, tmp_path,
                "need the tokenizer's chat template and this model's tokenizer has none: use a model with one")
    # other fields than a chat's: said so, not that the model lacks a template
    train_fails(tiny_dir, jsonl(tmp_path / "other.jsonl", {"text": "hi", "prompt": 1}), capsys, monkeypatch, tmp_path,
                "line 1: the record's prompt is int, where text belongs")


def test_records_of_plain_text_train_as_that_text(tiny_dir, tmp_path):
    """Pretraining's {"text": ...} lines (pile-val, C4) were refused as neither chats nor instructions:
    they are the text, each document ended by the end-of-sequence token as TRL packs them (joined by a
    blank line, a model trained on them never learnt to stop)."""
    from quantkit.modelio import load_tokenizer

    tok = load_tokenizer(tiny_dir)
    texts = [VALID.read_text()[i * 3000:(i + 1) * 3000] for i in range(3)]
    records = jsonl(tmp_path / "text.jsonl", *({"text": t, "meta": {"pile_set_name": "x"}} for t in texts))
    ids = torch.cat([torch.tensor(tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) for t in texts])
    got = dataset.read(records, tok, 64)
    assert tok.eos_token_id is not None and len(got) == ids.numel() // 64 > 10
    assert torch.equal(torch.cat([e.ids for e in got]), ids[:len(got) * 64])
    assert all(torch.equal(e.ids, e.labels) for e in got)  # every token scored, the ends of the texts too


def test_chat_without_an_assistant_turn(chat_dir, capsys, monkeypatch, tmp_path):
    data = jsonl(tmp_path / "data.jsonl", {"messages": [{"role": "user", "content": "hi"}]})
    train_fails(chat_dir, data, capsys, monkeypatch, tmp_path, "line 1: the chat has no assistant turn")


def test_target_that_matches_nothing(tiny_dir, text, capsys, monkeypatch, tmp_path):
    line = train_fails(tiny_dir, text, capsys, monkeypatch, tmp_path, "--target qkv matches no linear",
                       "--target", "qkv")
    assert "use all-linear or some of" in line and "q_proj" in line  # what there is to choose from
    from quantkit.trainer.config import TrainConfig

    assert TrainConfig(target="q_proj, v_proj").target == ["q_proj", "v_proj"]  # " v_proj" matched no linear


@pytest.mark.parametrize("rank,match", [
    (0, "rank 0 is invalid: use a positive rank"),
    (64, "--rank 64 is larger than model.layers.0.self_attn.k_proj (32x64): use a rank of at most 32")])  # k_proj: 64 -> 32
def test_bad_rank(tiny_dir, text, capsys, monkeypatch, tmp_path, rank, match):
    train_fails(tiny_dir, text, capsys, monkeypatch, tmp_path, match, "--rank", rank)


@pytest.mark.parametrize("args,match", [
    (["--max-grad-norm", 0], "--max-grad-norm 0 is invalid: use a positive norm"),  # zeroed every gradient
    (["--max-grad-norm", -1], "--max-grad-norm -1 is invalid"),  # flipped them: the held-out loss rose
    (["--max-grad-norm", "nan"], "--max-grad-norm nan is invalid"),  # an adapter of NaNs, exit 0
    (["--weight-decay", -0.1], "--weight-decay -0.1 is invalid: use 0 or"),  # torch's ValueError: a traceback
    (["--alpha", 0], "--alpha 0 is invalid: use a positive number"),  # scale 0: B never moved
    (["--lora-plus", "nan"], "--lora-plus nan is invalid"),  # an adapter of NaNs, exit 0
    (["--lora-plus", "inf"], "--lora-plus inf is invalid"),
    (["--patience", 0], "--patience 0 is invalid: use a number of evaluations"),  # stopped at the first one
    (["--patience", 2], "--patience stops on the held-out loss, and there is no held-out data"),  # FAST: none
    (["--seqlen", 1024], "--seqlen 1024 is longer than the model's context of 512 tokens"),  # trained past it
    (["--seed", 2**32], "Invalid value for '--seed'"),  # overflowed the data order's generator: a traceback
    # checked before the training, not after it
    (["--quantize", "gptq", "--calib-data", "missing.txt"], "missing.txt: no such file"),
    # too short for the windows, longer than the context: found after the training and the merge
    (["--quantize", "gptq", "--calib-data", VALID, "--calib-samples", 100000], "too few for 100000 windows"),
    (["--quantize", "awq", "--calib-data", VALID, "--calib-seqlen", 1024], "--calib-seqlen 1024 is longer than"),
    (["--calib-samples", 8], "--calib-samples sets the quantization that --quantize METHOD turns on"),
    (["--quantize", "nf4", "--calib-seqlen", 64], "--calib-seqlen calibrates --quantize, and --quantize nf4"),
    # taken and ignored, after the training: RTN reads no calibration
    (["--quantize", "rtn", "--calib-data", VALID], "--calib-data calibrates --quantize, and --quantize rtn quantizes "
     "without one"),
    # a format that cannot hold the quantization: refused after the training and the merge
    # quantize's advice in train's flags: its --method is --quantize here
    (["--quantize", "nf4", "--format", "gguf"], "GGUF types are filled by RTN or GPTQ, not nf4: use --quantize rtn or "
     "gptq"),
    (["--quantize", "awq", "--format", "awq", "--bits", 3, "--calib-data", VALID],
     "the AWQ GEMM layout holds 4-bit weights only, not 3-bit"),
    (["--quantize", "gptq", "--format", "exl2"], "--quantize writes safetensors, awq, gguf or compressed-tensors: for "
     "EXL2 (a target bits per weight), train, then run quantkit merge OUT --out OUT-merged and quantkit quantize "
     "OUT-merged --method gptq --format exl2 --bits 4.125 --out OUT-exl2"),
    (["--quantize", "gptq", "--format", "exl2", "--group-size", 64], "--quantize writes safetensors, awq, gguf or "
     "compressed-tensors"),  # not "--group-size does not apply to --format exl2", which dropping it does not help
    (["--quantize", "rtn", "--format", "gguf", "--bits", 3], "drop it, or choose the types with --gguf-type and "
     "--tensor-type (of quantkit quantize OUT-merged)")])  # train has no --tensor-type
def test_bad_training_settings(tiny_dir, text, capsys, monkeypatch, tmp_path, args, match):
    train_fails(tiny_dir, text, capsys, monkeypatch, tmp_path, match, *args)


@pytest.fixture(scope="module")
def adapter(tiny_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapter")
    (tmp / "train.txt").write_text(VALID.read_text()[:5000])
    train(str(tiny_dir), data=tmp / "train.txt", out=tmp / "adapter", steps=1, seqlen=32, batch_size=2, rank=4,
          eval_fraction=0, progress=False)
    return tmp / "adapter"


def test_merge_onto_another_base(adapter, capsys, monkeypatch, tmp_path, recwarn):
    """One line: a warning that it merged "as asked" came first."""
    narrow = make_tiny(tmp_path / "narrow", hidden=32, intermediate=64)
    capsys.readouterr()  # transformers' bar, writing it
    monkeypatch.setattr(sys, "argv", ["quantkit", *map(str, ["merge", adapter, "--base", narrow, "--out", tmp_path / "out"])])
    with pytest.raises(SystemExit) as e:
        main()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and line.startswith("error: ") and "but this base needs" in line, line
    assert line.endswith("pass the --base it was trained on") and left(tmp_path) == []
    assert not [w for w in recwarn if "as asked" in str(w.message)]


def test_a_gguf_base_is_refused_before_the_work(adapter, tiny_dir, text, capsys, monkeypatch, tmp_path):
    """A GGUF file passed the float-directory check (its checkpoint is one): train --quantize then failed
    with a traceback after training and merging every layer, and merge after merging them."""
    import quantkit

    gguf = tmp_path / "base.gguf"
    quantkit.api.export_gguf(quantkit.load(tiny_dir), gguf, "F32", progress=False)
    train_fails(gguf, text, capsys, monkeypatch, tmp_path, "train on a float model directory (safetensors), not a "
                "GGUF file", "--quantize", "rtn")
    fails(["merge", adapter, "--base", gguf, "--out", tmp_path / "out"], capsys, monkeypatch,
          "merge into a float model directory (safetensors), not a GGUF file")
    assert left(tmp_path) == []


def test_the_adapter_names_its_base_from_anywhere(tiny_dir, tmp_path, monkeypatch):
    """A base given relative to the working directory was recorded so: merge run from elsewhere found no
    base, or another model of that name there, and merged into it without a word."""
    import json

    from quantkit.trainer import merge

    (tmp_path / "train.txt").write_text(VALID.read_text()[:5000])
    monkeypatch.chdir(tiny_dir.parent)
    train(tiny_dir.name, data=tmp_path / "train.txt", out=tmp_path / "adapter", steps=1, seqlen=32, batch_size=2,
          rank=4, eval_fraction=0, progress=False)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(tiny_dir)
    make_tiny(tmp_path / tiny_dir.name, seed=1)  # another model of that name, where merge runs
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merged = merge(tmp_path / "adapter", tmp_path / "merged", progress=False)
    want = merge(tmp_path / "adapter", tmp_path / "want", base=tiny_dir, progress=False)
    assert (merged / "model.safetensors").read_bytes() == (want / "model.safetensors").read_bytes()


def test_merge_onto_a_base_of_the_same_shapes_warns(adapter, tiny_dir, tmp_path):
    from quantkit.trainer import merge

    other = make_tiny(tmp_path / "other", seed=1)  # the shapes checks cannot tell it from the adapter's base
    with pytest.warns(UserWarning, match=re.escape(f"trained on {tiny_dir}; merging it into {other}")):
        merge(adapter, tmp_path / "out", base=other, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merge(adapter, tmp_path / "same", base=tiny_dir / ".." / tiny_dir.name, progress=False)


def test_merge_lora_on_an_embedding(tiny_dir, capsys, monkeypatch, tmp_path):
    """PEFT's LoRA on embed_tokens (lora_embedding_A/B) was a traceback (an Embedding has no in_features)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"], task_type="CAUSAL_LM")
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_dir), config)
    peft.save_pretrained(tmp_path / "peft", save_embedding_layers=False)
    fails(["merge", tmp_path / "peft", "--base", tiny_dir, "--out", tmp_path / "out"], capsys, monkeypatch,
          "LoRA on model.embed_tokens, not a linear layer (Embedding): quantkit reads LoRA on linear layers only")
    assert left(tmp_path) == []


@pytest.mark.parametrize("bias", ["lora_only", "all"])
def test_merge_an_adapter_with_trained_biases(tiny_dir, capsys, monkeypatch, tmp_path, bias):
    """PEFT saves the base layers' biases it trained; merged without them the model is not the adapter's.
    The refusal blamed the base. On a base without biases there are none, and it merges as PEFT does."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from quantkit.trainer import merge

    biased = make_tiny(tmp_path / "biased", attention_bias=True)
    capsys.readouterr()
    for model, name in ((biased, "peft"), (tiny_dir, "plain")):
        torch.manual_seed(0)
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model),
                              LoraConfig(r=4, target_modules=["q_proj"], bias=bias, task_type="CAUSAL_LM"))
        torch.nn.init.normal_(peft.base_model.model.model.layers[0].self_attn.q_proj.lora_B.default.weight)
        peft.save_pretrained(tmp_path / name)
    fails(["merge", tmp_path / "peft", "--base", biased, "--out", tmp_path / "out"], capsys, monkeypatch,
          "the adapter has trained biases of the base's layers (bias), which quantkit does not merge: merge it with PEFT")
    assert not (tmp_path / "out").exists()
    merge(tmp_path / "plain", tmp_path / "merged", base=tiny_dir, progress=False)
    theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), tmp_path / "plain")
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.arange(12)[None]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs.merge_and_unload()(ids).logits, atol=1e-4, rtol=1e-4)


def test_merge_an_adapter_whose_config_says_another_rank(adapter, capsys, monkeypatch, tmp_path):
    """The refusal blamed the base, where the adapter's config is what is damaged."""
    broken = shutil.copytree(adapter, tmp_path / "adapter")
    cfg = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**cfg, "r": 8}))
    fails(["merge", broken, "--out", tmp_path / "out"], capsys, monkeypatch,
          "adapter_config.json says r=8, and its tensors have rank 4")
    assert left(tmp_path) == []


@pytest.mark.parametrize("change,match", [
    (lambda cfg, t: ({**cfg, "init_lora_weights": "pissa_niter_4"}, t), "initialized with pissa_niter_4, which changes "
     "the base weights"),
    (lambda cfg, t: ({**cfg, "init_lora_weights": "olora"}, t), "initialized with olora"),
    (lambda cfg, t: ({**cfg, "init_lora_weights": "lora_ga"}, t), "initialized with lora_ga"),
    (lambda cfg, t: ({**cfg, "alora_invocation_tokens": [5, 6]}, t), "is an activated LoRA (aLoRA) "
     "(alora_invocation_tokens), which quantkit does not compute: use it with PEFT"),
    (lambda cfg, t: ({**cfg, "use_bdlora": {"nblocks": 2}}, t), "is a block-diagonal LoRA (use_bdlora)"),
    (lambda cfg, t: (cfg, {k: v * float("nan") if "lora_B" in k else v for k, v in t.items()}),
     "holds NaN or Inf (the training diverged)"),
    (lambda cfg, t: ({**cfg, "base_model_name_or_path": 5}, t), "the adapter names no base model: pass --base"),
    (lambda cfg, t: ({**cfg, "trainable_token_indices": [1, 2]}, t), "the adapter has token embeddings trained beside "
     "it (trainable_token_indices)"),  # blamed the base
    (lambda cfg, t: ({k: v for k, v in cfg.items() if k != "peft_type"}, t), "names no peft_type")],  # "a None adapter"
    ids=["pissa", "olora", "lora-ga", "alora", "bdlora", "nan", "base-not-a-name", "token-embeddings", "no-type"])
def test_merge_an_adapter_it_would_merge_wrong(adapter, capsys, monkeypatch, tmp_path, change, match):
    """PiSSA's, OLoRA's and LoRA-GA's adapters go onto a base PEFT changes when it loads them: merged onto
    the base as saved they were silently wrong (0.24-0.46 in the logits); aLoRA applies only after its
    invocation tokens, and other variants compute other than W + scale*BA. An adapter of NaNs was merged into a model
    that eval then called a damaged file; a base named by a number was a traceback."""
    broken = shutil.copytree(adapter, tmp_path / "adapter")
    cfg, tensors = change(json.loads((broken / "adapter_config.json").read_text()),
                          load_file(broken / "adapter_model.safetensors"))
    (broken / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, broken / "adapter_model.safetensors")
    fails(["merge", broken, "--out", tmp_path / "out"], capsys, monkeypatch, match)
    assert left(tmp_path) == []


def test_held_out_data_that_is_the_training_data_warns(tiny_dir, text, tmp_path):
    with pytest.warns(UserWarning, match="eval_data is the training data itself: its loss is the training loss"):
        result = train(str(tiny_dir), data=text, eval_data=text, out=tmp_path / "a", steps=1, seqlen=32, batch_size=2,
                       rank=4, progress=False)
    assert result.evals


@pytest.mark.parametrize("missing", ["adapter_config.json", "adapter_model.safetensors"])
def test_merge_adapter_missing_a_file(adapter, capsys, monkeypatch, tmp_path, missing):
    broken = shutil.copytree(adapter, tmp_path / "adapter")
    (broken / missing).unlink()
    fails(["merge", broken, "--out", tmp_path / "out"], capsys, monkeypatch, "pass a LoRA adapter directory")
    assert left(tmp_path) == []


@pytest.mark.parametrize("fraction", [0.0, 0])  # 0 from Python and 0.0 from the command line are one setting
def test_resume_another_runs_checkpoint(tiny_dir, text, capsys, monkeypatch, tmp_path, fraction):
    """A run (Python API) stopped after its checkpoint of step 2 is not resumed with another --lr;
    the checkpoint stays, and the same settings (CLI) resume from it."""
    def stop(record):
        if record["step"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(str(tiny_dir), data=text, out=tmp_path / "out", steps=6, save_every=2, seqlen=32, batch_size=2, rank=4,
              warmup=0, eval_fraction=fraction, progress=False, callback=stop)
    args = ["train", tiny_dir, "--data", text, "--out", tmp_path / "out", *FAST, "--steps", 6, "--save-every", 2,
            "--resume"]
    fails([*args, "--lr", 1e-3], capsys, monkeypatch, "is of another run (a different model, data or settings): resume "
          "with the command that started it")
    assert left(tmp_path) == [".out.partial"] and saved_step(tmp_path) == 2
    monkeypatch.setattr(sys, "argv", ["quantkit", *map(str, args)])
    main()
    assert left(tmp_path) == ["out"] and json.loads((tmp_path / "out" / "train_log.json").read_text())["steps"] == 6


def test_resume_a_checkpoint_of_another_format(tiny_dir, text, capsys, monkeypatch, tmp_path):
    """A checkpoint whose state means something else to this quantkit (another format number) is not
    resumed from, even of the same run, nor cleared by a run without --resume: it is refused naming both
    formats, and stays for its version."""
    from quantkit.pipeline import read_progress, save_progress
    from quantkit.trainer import loop

    stopped_at_step_3(tiny_dir, text, tmp_path)
    state_file = tmp_path / ".out.partial" / "checkpoint" / "state.pt"
    state = read_progress(state_file)
    assert state["format"] == loop.CHECKPOINT_FORMAT
    state["format"] = loop.CHECKPOINT_FORMAT + 1  # as a later quantkit would save it, without a key this one needs:
    del state["bad"]  # refused for its format, not called damaged
    save_progress(state_file, state)
    args = ["train", tiny_dir, "--data", text, "--out", tmp_path / "out", *FAST, "--steps", 6, "--save-every", 2]
    for more in (["--resume"], []):  # nor is it cleared by a run that does not resume
        fails([*args, *more], capsys, monkeypatch, f"was saved by another version of quantkit (format "
              f"{loop.CHECKPOINT_FORMAT + 1}, this one reads {loop.CHECKPOINT_FORMAT}): resume it with that version, "
              "or pass --overwrite to start over")
        assert left(tmp_path) == [".out.partial"] and saved_step(tmp_path) == 2


def test_resumed_where_auto_precision_is_float16(tiny_dir, text, monkeypatch, tmp_path):
    """A checkpoint of a bfloat16 run (the CPU's "auto") holds no loss scaler; resumed where "auto" is
    float16 (a GPU without bfloat16), the scaler was loaded from that None: a TypeError."""
    from quantkit.trainer import loop

    def stop(record):
        if record["step"] == 3:
            raise KeyboardInterrupt

    common = dict(data=text, out=tmp_path / "out", steps=4, save_every=2, seqlen=32, batch_size=2, rank=4, warmup=0,
                  eval_fraction=0, progress=False)
    with pytest.raises(KeyboardInterrupt):
        train(str(tiny_dir), **common, callback=stop)
    monkeypatch.setattr(loop, "autocast_dtype", lambda precision, device: torch.float16)
    train(str(tiny_dir), **common, resume=True)
    log = json.loads((tmp_path / "out" / "train_log.json").read_text())
    assert log["steps"] == 4 and log["precision"] == "fp16" and log["config"]["precision"] == "auto"  # what auto chose


def stopped_at_step_3(tiny_dir, text, tmp_path) -> None:
    """train_6's run (checkpoints every 2 steps, to tmp_path/out) stopped by Ctrl-C at step 3."""
    def stop(record):
        if record["step"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(str(tiny_dir), data=text, out=tmp_path / "out", steps=6, save_every=2, seqlen=32, batch_size=2, rank=4,
              warmup=0, eval_fraction=0, progress=False, callback=stop)


def test_a_checkpoint_is_not_lost_to_a_run_without_resume(tiny_dir, text, capsys, monkeypatch, tmp_path):
    """Run again without --resume, a stopped run's command deleted its checkpoint and started over;
    now it is refused (for another run's checkpoint too), Ctrl-C says where to go on from, and
    --overwrite starts over."""
    stopped_at_step_3(tiny_dir, text, tmp_path)
    assert "stopped: the checkpoint of step 2 is in" in capsys.readouterr().err
    args = train_6(tmp_path, tiny_dir, text)
    fails(args, capsys, monkeypatch, "holds the checkpoint of step 2 of this run: add --resume to go on from it, or "
          "pass --overwrite to start over")
    fails([*args, "--lr", 1e-3], capsys, monkeypatch, "of another run writing it (a different model, data or settings)")
    assert left(tmp_path) == [".out.partial"] and saved_step(tmp_path) == 2
    monkeypatch.setattr(sys, "argv", ["quantkit", *map(str, args), "--overwrite"])
    main()
    assert left(tmp_path) == ["out"] and json.loads((tmp_path / "out" / "train_log.json").read_text())["steps"] == 6


@pytest.mark.parametrize("where", ["model", "data"])
def test_the_api_does_not_train_into_what_it_reads(tiny_dir, text, tmp_path, where):
    """train(model, out=model, overwrite=True) replaced the base directory it was training on (and with
    the data inside out, deleted that): refused before the model loads, as the command line does."""
    model = shutil.copytree(tiny_dir, tmp_path / "model")
    data = shutil.copy(text, model / "train.txt") if where == "data" else text
    before = sorted(p.name for p in model.iterdir())
    loaded = []
    real = loop.load
    loop.load = lambda *a, **k: loaded.append(a) or real(*a, **k)
    try:
        with pytest.raises(QuantkitError, match=f"out {model} (is|holds) .*, which this command reads"):
            train(str(model), data=data, out=model, overwrite=True, steps=1, seqlen=32, batch_size=2, rank=4,
                  eval_fraction=0, progress=False)
    finally:
        loop.load = real
    assert not loaded and sorted(p.name for p in model.iterdir()) == before


@pytest.mark.parametrize("kw, match", [(dict(), "already exists"), (dict(overwrite=True, max_shard_size="big"),
                                                                     "max_shard_size='big' is not a size")])
def test_the_api_merge_checks_its_output_before_the_base_loads(adapter, tmp_path, monkeypatch, kw, match):
    from quantkit.trainer import merge, merging

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    monkeypatch.setattr(merging, "load", lambda *a, **k: pytest.fail("the base loaded"))
    with pytest.raises(QuantkitError, match=match):
        merge(adapter, tmp_path / "out", **kw)


def test_a_stopped_runs_work_is_not_cleared_by_another_command(tiny_dir, text, capsys, monkeypatch, tmp_path):
    """Every writer started afresh by clearing what a stopped run left for its output: quantize into a
    killed training run's output deleted its checkpoint, and train or a kept quantization into a killed
    quantization's output its finished layers. Now each is refused until --overwrite."""
    import quantkit

    from .conftest import stopping_saves

    stopped_at_step_3(tiny_dir, text, tmp_path)
    fails(["quantize", tiny_dir, "--out", tmp_path / "out"], capsys, monkeypatch,
          "checkpoint holds the finished work of another run writing " + str(tmp_path / "out") + " (a training checkpoint)")
    assert saved_step(tmp_path) == 2
    monkeypatch.setattr(sys, "argv", ["quantkit", "quantize", str(tiny_dir), "--out", str(tmp_path / "out"),
                                      "--overwrite"])
    main()
    assert left(tmp_path) == ["out"] and (tmp_path / "out" / "model.safetensors").is_file()

    real = stopping_saves(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tiny_dir), out=tmp_path / "q", progress=False)
    monkeypatch.setattr("quantkit.pipeline.save_progress", real)
    fails(["train", tiny_dir, "--data", text, "--out", tmp_path / "q", *FAST, "--steps", 1], capsys, monkeypatch,
          ".q.progress.pt holds the finished work of another run writing " + str(tmp_path / "q") + " (the finished "
          "layers of a quantize, export or merge)")
    with pytest.raises(QuantkitError, match="holds the finished work of another run writing"):
        quantkit.quantize(str(tiny_dir), out=tmp_path / "q", keep=True, progress=False)
    assert left(tmp_path, "q") == [".q.partial", ".q.progress.pt"]
    quantkit.quantize(str(tiny_dir), out=tmp_path / "q", progress=False)  # the stopped run's command goes on
    assert left(tmp_path, "q") == ["q"]


def test_merge_refuses_what_it_would_leave_out(adapter, tiny_dir, capsys, monkeypatch, tmp_path):
    """A PEFT adapter with a bias on lora_B or whole modules saved beside it was refused as one for another
    base ("pass the --base it was trained on"), and a LoRA adapter merged onto NF4 codes it never saw."""
    for key, value, what in (("lora_bias", True, "a trained bias on lora_B"),
                             ("modules_to_save", ["norm"], "whole modules trained beside it")):
        edited = shutil.copytree(adapter, tmp_path / key)
        cfg = json.loads((edited / "adapter_config.json").read_text())
        (edited / "adapter_config.json").write_text(json.dumps({**cfg, key: value}))
        fails(["merge", edited, "--out", tmp_path / "out"], capsys, monkeypatch, f"has {what} ({key}), which quantkit "
              "does not merge: merge it with PEFT")
    fails(["merge", adapter, "--out", tmp_path / "out", "--onto-nf4"], capsys, monkeypatch,
          "was trained with LoRA on the float base (its train_log.json says so)")
    assert left(tmp_path) == []
    with warnings.catch_warnings():  # a base that is not there: the error alone, not a warning about it first
        warnings.simplefilter("error")
        fails(["merge", adapter, "--out", tmp_path / "out", "--base", tmp_path / "nope"], capsys, monkeypatch,
              "the adapter's base model is not here")


def test_a_base_named_by_its_hub_id_is_read_from_the_hub_cache(adapter, tiny_dir, capsys, monkeypatch, tmp_path):
    """PEFT writes the hub id of the base into an adapter's config: merge refused it unless --base named
    the snapshot's directory, though huggingface-cli download had put it in the cache."""
    from huggingface_hub import constants

    import quantkit

    named = shutil.copytree(adapter, tmp_path / "named")
    cfg = json.loads((named / "adapter_config.json").read_text())
    (named / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "org/tiny"}))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    fails(["merge", named, "--out", tmp_path / "out"], capsys, monkeypatch,
          "org/tiny: the adapter's base model is not here (nor in the local hub cache): pass --base")
    folder = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(tiny_dir, folder / "snapshots" / "abc123")
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("abc123")
    assert quantkit.load("org/tiny").source == str(folder / "snapshots" / "abc123")
    quantkit.merge(named, tmp_path / "out", progress=False)
    quantkit.merge(adapter, tmp_path / "by-path", base=tiny_dir, progress=False)
    assert load_file(tmp_path / "out" / "model.safetensors").keys() == load_file(tmp_path / "by-path" / "model.safetensors").keys()
    for k, t in load_file(tmp_path / "out" / "model.safetensors").items():
        assert torch.equal(t, load_file(tmp_path / "by-path" / "model.safetensors")[k]), k


def test_merge_onto_nf4_with_a_damaged_log(adapter, capsys, monkeypatch, tmp_path):
    """train_log.json's settings not a mapping: one error naming the file, not an AttributeError."""
    damaged = shutil.copytree(adapter, tmp_path / "damaged")
    log = json.loads((damaged / "train_log.json").read_text())
    (damaged / "train_log.json").write_text(json.dumps({**log, "config": [1, 2]}))
    fails(["merge", damaged, "--out", tmp_path / "out", "--onto-nf4"], capsys, monkeypatch,
          "its adapter_config.json or train_log.json is damaged")


def test_resume_with_nothing_to_resume(tiny_dir, text, capsys, monkeypatch, tmp_path):
    from quantkit.trainer import dataset

    def read(*args, **kwargs):
        raise AssertionError("the data was tokenized before the run found nothing to resume")

    with monkeypatch.context() as patch:  # said before the data is read: a large file takes minutes
        patch.setattr(dataset, "read", read)
        train_fails(tiny_dir, text, capsys, monkeypatch, tmp_path, "nothing to resume", "--resume")
    # a directory that holds no adapter was "a finished adapter", then refused with merge's advice
    (tmp_path / "out").mkdir()
    fails(["train", tiny_dir, "--data", text, "--out", tmp_path / "out", *FAST, "--steps", 1, "--resume", "--quantize",
           "rtn", "--group-size", 32], capsys, monkeypatch, "nothing to resume")
    assert not capsys.readouterr().out


def test_the_api_names_its_keywords(adapter, tiny_dir, text, tmp_path):
    """Through quantkit.train and merge, the trainer's errors named the command line's flags (--max-grad-norm
    0.0, --patience, --eval-data, --resume, --onto-nf4), which a Python caller does not have; now its keywords,
    as quantize's errors do. The command line's spelling of the same mistakes is checked above."""
    from quantkit.trainer import merge

    common = dict(data=text, out=tmp_path / "out", steps=1, seqlen=32, batch_size=2, rank=4, progress=False)
    for extra, match in [
        (dict(max_grad_norm=0), "max_grad_norm=0 is invalid: use a positive norm"),
        (dict(steps=2, epochs=1.0), "steps and epochs both set the run's length"),
        (dict(target="qkv"), "target='qkv' matches no linear of this model"),
        (dict(target=["q_proj", 5]), "target=['q_proj', 5] is invalid: name the modules"),  # a TypeError
        (dict(steps=None, epochs=math.inf), "epochs=inf is invalid: use a finite number of epochs"),  # an OverflowError
        (dict(eval_fraction=0, patience=2), "patience stops on the held-out loss, and there is no held-out data: "
                                            "pass eval_data or a positive eval_fraction, or drop patience"),
        (dict(resume=True), "run without resume=True"),
        (dict(rank=64), "rank=64 is larger than model.layers.0.self_attn.k_proj"),
        (dict(method="qlora", fsdp=True), "fsdp=True shards a float base; QLoRA's NF4 base is not sharded: use "
                                          "method='lora' with fsdp=True"),
    ]:
        with pytest.raises(QuantkitError, match=re.escape(match)):
            train(str(tiny_dir), **{**common, **extra})
    with pytest.raises(QuantkitError, match=re.escape("and onto_nf4=True merges into the NF4-rounded base QLoRA "
                                                      "trains against: drop onto_nf4=True")):
        merge(adapter, tmp_path / "merged", onto_nf4=True, progress=False)
    assert left(tmp_path) == [] and left(tmp_path, "merged") == []


@pytest.fixture
def quiet(monkeypatch):
    """No progress bar: the error joins its line (test_error_after_the_progress_bar); the rest is checked."""
    monkeypatch.setattr(loop, "tqdm", lambda *a, **kw: tqdm(*a, **{**kw, "disable": True}))


def nan_from(monkeypatch, at):
    """The training loss turns NaN at step `at` (a huge --lr gives no NaN reliably)."""
    real, calls = loop.token_loss, []

    def token_loss(*a):
        calls.append(1)  # one call per step: one micro-batch, no held-out data
        return real(*a) * (float("nan") if len(calls) >= at else 1)

    monkeypatch.setattr(loop, "token_loss", token_loss)


def train_6(tmp_path, model, text):
    return ["train", model, "--data", text, "--out", tmp_path / "out", *FAST, "--steps", 6, "--save-every", 2]


@pytest.mark.parametrize("at,match", [(1, "at step 1: no checkpoint was saved yet: lower --lr"),
                                      (3, "at step 3: lower --lr and train again with --overwrite (resumed, the run "
                                          "would repeat the same steps; the last good checkpoint, of step 2, is in")])
def test_nan_loss(tiny_dir, text, quiet, capsys, monkeypatch, tmp_path, at, match):
    nan_from(monkeypatch, at)
    fails(train_6(tmp_path, tiny_dir, text), capsys, monkeypatch, match)
    if at == 1:
        assert left(tmp_path) == []
    else:
        assert left(tmp_path) == [".out.partial"] and saved_step(tmp_path) == 2


def test_nan_gradients_under_a_finite_loss(tiny_dir, text, quiet, capsys, monkeypatch, tmp_path):
    """Gradients that are not finite while the loss is (float32, no scaler to skip the step) stop the
    run as a NaN loss does: the optimizer would have written NaN into the adapter."""
    real, calls = torch.nn.utils.clip_grad_norm_, []

    def clip(params, *a, **kw):
        params = list(params)
        calls.append(1)
        if len(calls) == 3:
            params[0].grad.fill_(float("nan"))
        return real(params, *a, **kw)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    fails(train_6(tmp_path, tiny_dir, text), capsys, monkeypatch,
          "the gradients' norm became nan at step 3: lower --lr and train again with --overwrite")
    assert left(tmp_path) == [".out.partial"] and saved_step(tmp_path) == 2


def test_a_step_the_loss_scaler_skipped_is_logged_as_strict_json(tiny_dir, text, quiet, monkeypatch, tmp_path):
    """fp16's scaler skips a step whose gradients overflow (its norm inf), as it should; train_log.json
    then held `Infinity`, which jq and JavaScript refuse."""
    real, calls = torch.amp.GradScaler.unscale_, []

    def unscale(self, opt):  # an overflow in the second step's backward, as the scaler finds it
        calls.append(1)
        if len(calls) == 2:
            opt.param_groups[0]["params"][0].grad.fill_(float("inf"))
        return real(self, opt)

    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", unscale)
    train(str(tiny_dir), data=text, out=tmp_path / "out", steps=3, seqlen=32, batch_size=2, rank=4, warmup=0,
          eval_fraction=0, precision="fp16", progress=False)

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    log = json.loads((tmp_path / "out" / "train_log.json").read_text(), parse_constant=refuse)["log"]
    assert [r["grad_norm"] is None for r in log] == [False, True, False]


def test_error_after_the_progress_bar(tiny_dir, text, capsys, monkeypatch, tmp_path):
    nan_from(monkeypatch, 1)
    fails(train_6(tmp_path, tiny_dir, text), capsys, monkeypatch, "the training loss became nan")


@pytest.mark.parametrize("writer,nth,step,kept,code", [
    ("state.pt", 1, 2, "no earlier checkpoint", errno.ENOSPC),
    ("state.pt", 2, 4, "the checkpoint of step 2 is kept", errno.ENOSPC),
    ("adapter", 5, 4, "the checkpoint of step 2 is kept", errno.ENOSPC),
    ("state.pt", 2, 4, "the checkpoint of step 2 is kept", errno.EFBIG),  # a traceback before
])
def test_out_of_disk_space_while_checkpointing(tiny_dir, text, quiet, capsys, monkeypatch, tmp_path, writer, nth,
                                               step, kept, code):
    """The disk fills up writing state.pt (torch.save: the nth call) or the adapter (its fsync, the
    first of four per checkpoint, with state.pt's and the directories': the 5th is the second
    checkpoint's adapter); or the file system refuses
    the file. --resume is named where a checkpoint is kept (without one, it would find nothing)."""
    owner, name = {"state.pt": (loop.torch, "save"), "adapter": (loop.os, "fsync")}[writer]
    error = OSError(code, os.strerror(code))
    real, calls = getattr(owner, name), []

    def write(*a, **kw):
        calls.append(1)
        if len(calls) == nth:
            raise error
        return real(*a, **kw)

    monkeypatch.setattr(owner, name, write)
    again = "run the same command again" if nth == 1 else "run again with --resume"
    partial = tmp_path / ".out.partial"
    if code == errno.ENOSPC:
        line = fails(train_6(tmp_path, tiny_dir, text), capsys, monkeypatch,
                     f"out of disk space saving the checkpoint of step {step} in {partial} (about ")
        assert re.search(rf"\(about [\d.]+ kB, [\d.]+ GB free; {kept}\): free some space and {again}$", line), line
    else:
        fails(train_6(tmp_path, tiny_dir, text), capsys, monkeypatch,
              f"saving the checkpoint of step {step} ({kept}): could not write {partial} (File too large): fix that "
              f"and {again}")
    if nth == 1:  # no checkpoint saved: nothing left
        assert left(tmp_path) == []
    else:
        assert left(tmp_path) == [".out.partial"] and saved_step(tmp_path) == 2
        assert [p.name for p in (tmp_path / ".out.partial").iterdir()] == ["checkpoint"]  # no half-written one


@pytest.mark.parametrize("fault", [KeyboardInterrupt, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))])
def test_a_stop_while_the_finished_adapter_goes_to_disk_keeps_the_run(tiny_dir, text, monkeypatch, tmp_path, fault):
    """The checkpoints were removed before the finished adapter was flushed to the disk: Ctrl-C there (or
    the disk refusing the flush, a bare OSError) deleted the whole run, adapter and all, and said
    "stopped before the first checkpoint". The last checkpoint now stays until the adapter is in place."""
    import quantkit.atomic as atomic

    real = atomic.sync

    def sync(path, skip=frozenset()):
        if (path / "adapter_model.safetensors").is_file():  # the commit's flush of the finished adapter
            raise fault
        return real(path, skip)

    kw = dict(data=text, out=tmp_path / "out", steps=4, save_every=2, seqlen=32, batch_size=2, rank=4, warmup=0,
              eval_fraction=0, progress=False)
    monkeypatch.setattr(atomic, "sync", sync)
    with pytest.raises(KeyboardInterrupt if fault is KeyboardInterrupt else QuantkitError,
                       match=None if fault is KeyboardInterrupt else "run again with resume=True"):
        train(str(tiny_dir), **kw)
    assert left(tmp_path) == [".out.partial"] and saved_step(tmp_path) == 4
    monkeypatch.setattr(atomic, "sync", real)
    train(str(tiny_dir), **kw, resume=True)
    assert left(tmp_path) == ["out"] and json.loads((tmp_path / "out" / "train_log.json").read_text())["steps"] == 4
    assert not (tmp_path / "out" / "checkpoint").exists()


DOLLY = [{"instruction": f"Name colour number {i}.", "context": "Colours of the rainbow." if i % 2 else "",
          "response": f"The colour is {c} indeed.", "category": "open_qa"}
         for i, c in enumerate(["red", "orange", "yellow", "green", "blue", "indigo", "violet", "purple"])]


def test_dolly_records_score_only_the_response(chat_dir, monkeypatch, tmp_path):
    data = jsonl(tmp_path / "dolly.jsonl", *DOLLY)
    # --seqlen 128: the records with a context are over 64 tokens in the tiny tokenizer
    args = ["train", chat_dir, "--data", data, "--out", tmp_path / "out", "--steps", 2, "--seqlen", 128,
            "--batch-size", 2, "--rank", 4]
    monkeypatch.setattr(sys, "argv", ["quantkit", *map(str, args)])
    main()
    assert json.loads((tmp_path / "out" / "train_log.json").read_text())["steps"] == 2
    tok = AutoTokenizer.from_pretrained(chat_dir)
    for record, example in zip(DOLLY, dataset.read(data, tok, 128), strict=True):
        scored = example.labels[example.labels != dataset.IGNORE]
        assert tok.decode(scored) == record["response"] + "<|im_end|>\n"  # the reply and its end of turn, whole


def test_every_assistant_turn_is_scored(chat_dir, tmp_path):
    chat = [{"role": "user", "content": "Say red."}, {"role": "assistant", "content": "Red it is."},
            {"role": "user", "content": "Now blue."}, {"role": "assistant", "content": "Blue as asked."}]
    tok = AutoTokenizer.from_pretrained(chat_dir)
    (example,) = dataset.read(jsonl(tmp_path / "chat.jsonl", {"messages": chat}), tok, 256)
    kept = (example.labels != dataset.IGNORE).int()
    edges = torch.diff(kept, prepend=torch.tensor([0]), append=torch.tensor([0])).nonzero().flatten().tolist()
    runs = [tok.decode(example.ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]
    assert runs == ["Red it is.<|im_end|>\n", "Blue as asked.<|im_end|>\n"]  # the replies, not the user's turns


def test_a_template_that_writes_the_last_reply_otherwise_scores_every_reply(chat_dir, tmp_path):
    """Qwen3's template writes an empty think block before the reply after the last user turn only: a chat
    cut after an earlier reply was no prefix of the whole, and every chat of two turns or more ended the
    read ("the chat template does not write earlier turns as a prefix")."""
    think = ("{% set roles = messages | map(attribute='role') | list %}"
             "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
             "{% if m['role'] == 'assistant' and 'user' not in roles[loop.index0:] %}<think>\n\n</think>\n\n{% endif %}"
             "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = AutoTokenizer.from_pretrained(chat_dir)
    tok.chat_template = think
    chat = [{"role": "user", "content": "Say red."}, {"role": "assistant", "content": "Red it is."},
            {"role": "user", "content": "Now blue."}, {"role": "assistant", "content": "Blue as asked."}]
    assert "Red it is." in tok.apply_chat_template(chat, tokenize=False).split("<think>")[0]  # the template as meant
    (example,) = dataset.read(jsonl(tmp_path / "chat.jsonl", {"messages": chat}), tok, 256)
    kept = (example.labels != dataset.IGNORE).int()
    edges = torch.diff(kept, prepend=torch.tensor([0]), append=torch.tensor([0])).nonzero().flatten().tolist()
    runs = [tok.decode(example.ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]
    assert runs == ["Red it is.<|im_end|>\n", "<think>\n\n</think>\n\nBlue as asked.<|im_end|>\n"]


def test_a_chat_that_opens_with_a_reply_scores_the_reply_alone(chat_dir, tmp_path):
    """The turn's header (and a template's default system prompt) before a first reply was scored as
    part of the reply."""
    chat = [{"role": "assistant", "content": "I start."}, {"role": "user", "content": "Go on."},
            {"role": "assistant", "content": "Done."}]
    tok = AutoTokenizer.from_pretrained(chat_dir)
    (example,) = dataset.read(jsonl(tmp_path / "chat.jsonl", {"messages": chat}), tok, 256)
    kept = (example.labels != dataset.IGNORE).int()
    edges = torch.diff(kept, prepend=torch.tensor([0]), append=torch.tensor([0])).nonzero().flatten().tolist()
    runs = [tok.decode(example.ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]
    assert runs == ["I start.<|im_end|>\n", "Done.<|im_end|>\n"]


def test_resume_after_the_base_was_rewritten_at_its_path(text, capsys, monkeypatch, tmp_path):
    """A run stopped at its checkpoint is not resumed once the model at the same path is another one:
    the adapter would be half trained on each."""
    make_tiny(tmp_path / "m", seed=0)

    def stop(record):
        if record["step"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(str(tmp_path / "m"), data=text, out=tmp_path / "out", steps=4, save_every=2, seqlen=32, batch_size=2,
              rank=4, warmup=0, eval_fraction=0, progress=False, callback=stop)
    shutil.rmtree(tmp_path / "m")
    make_tiny(tmp_path / "m", seed=1)
    fails(["train", tmp_path / "m", "--data", text, "--out", tmp_path / "out", *FAST, "--steps", 4, "--save-every", 2,
           "--resume"], capsys, monkeypatch, "is of another run (a different model, data or settings)")


def test_replies_cut_at_seqlen_are_told(chat_dir, tmp_path):
    """A reply cut at --seqlen trains without its end of turn: the records it happens to are counted."""
    tok = AutoTokenizer.from_pretrained(chat_dir)
    long = {"messages": [{"role": "user", "content": "Count."},
                         {"role": "assistant", "content": " ".join(["one two three"] * 40)}]}
    data = jsonl(tmp_path / "d.JSONL", CHAT, long, long)  # any spelling of the suffix is JSON lines
    with pytest.warns(UserWarning, match=r"^2 records of .* have their last reply cut at seqlen=64 tokens: raise seqlen "):
        examples = dataset.read(data, tok, 64)
    assert len(examples) == 3 and examples[1].scored > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dataset.read(data, tok, 512)  # whole at 512: no warning
