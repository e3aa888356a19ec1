"""The catalogue of bad inputs, one place for every command: each row is what a user might pass
and the words the one-line `error:` must hold. tests/test_catalogue.py runs every row through the
command line; later issues add their rows here. In args, {model} is a copy of the tiny model (which
a row's damage() may change first), {text} a short text file, {tmp} an empty directory."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass
class Bad:
    args: str  # the command line after `quantkit`, split on spaces
    match: str
    damage: Callable[[Path], None] | None = None  # applied to {model} first


def edit_config(**changes) -> Callable[[Path], None]:
    def damage(model: Path) -> None:
        cfg = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**cfg, **changes}))
    return damage


def write(name: str, content: str | bytes) -> Callable[[Path], None]:
    def damage(model: Path) -> None:
        (model / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return damage


def sharded(index: str) -> Callable[[Path], None]:
    """The model's weights as one shard under this index (beside model.safetensors, an index is not read)."""
    def damage(model: Path) -> None:
        (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
        (model / "model.safetensors.index.json").write_text(index)
    return damage


def truncate(name: str) -> Callable[[Path], None]:
    def damage(model: Path) -> None:
        data = (model / name).read_bytes()
        (model / name).write_bytes(data[: len(data) // 2])
    return damage


def chat_with_template(template: str) -> Callable[[Path], None]:
    """A chat template for the model's tokenizer, and chat records at {model}/chat.jsonl."""
    def damage(model: Path) -> None:
        (model / "chat_template.jinja").write_text(template)
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        (model / "chat.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    return damage


def pipe_beside(name: str) -> Callable[[Path], None]:
    """A named pipe beside {model} ({model}/../name): an output the commit's rename would replace."""
    def damage(model: Path) -> None:
        os.mkfifo(model.parent / name)
    return damage


DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = "1" * 5001  # JSON takes it; Python reads integers of up to 4300 digits

CATALOGUE = {
    # quantize: the model
    "missing model": Bad("quantize {tmp}/nope --out {tmp}/q", "no such file or directory"),
    "directory without a model": Bad("quantize {tmp} --out {tmp}/q", "no config.json"),
    "config.json not JSON": Bad("quantize {model} --out {tmp}/q", "not valid JSON", write("config.json", "{")),
    "config.json nested too deep": Bad("quantize {model} --out {tmp}/q", "not valid JSON", write("config.json", DEEP)),
    "config.json a list": Bad("quantize {model} --out {tmp}/q", "not valid JSON", write("config.json", "[]")),
    "unsupported architecture": Bad("quantize {model} --out {tmp}/q", "'bloom' is not supported",
                                    edit_config(model_type="bloom")),
    "a classifier": Bad("quantize {model} --out {tmp}/q", "not a causal language model",
                        edit_config(architectures=["LlamaForSequenceClassification"])),
    "no model_type": Bad("quantize {model} --out {tmp}/q", "no model_type", edit_config(model_type=None)),
    "the weights file for its directory": Bad("quantize {model}/model.safetensors --out {tmp}/q",
                                              "is a file of the model directory"),
    "out is the model": Bad("quantize {model} --out {model} --overwrite", "which this command reads"),
    "2**31 layers": Bad("quantize {model} --out {tmp}/q", "gives num_hidden_layers = 2147483648",
                        edit_config(num_hidden_layers=2**31)),
    "a context of -1": Bad("eval {model} --data {text}", "gives max_position_embeddings = -1, not a context length",
                           edit_config(max_position_embeddings=-1)),
    "zero attention heads": Bad("quantize {model} --out {tmp}/q", "not a model configuration transformers accepts",
                                edit_config(num_attention_heads=0)),
    "unknown activation": Bad("quantize {model} --out {tmp}/q", "describes no model transformers can build",
                              edit_config(hidden_act="")),
    "quantization_config not an object": Bad("quantize {model} --out {tmp}/q", "quantization_config is list",
                                             edit_config(quantization_config=[])),
    "unknown quantizer": Bad("quantize {model} --out {tmp}/q", "already quantized with 'fp8'",
                             edit_config(quantization_config={"quant_method": "fp8"})),
    "weights truncated": Bad("quantize {model} --out {tmp}/q", "corrupt or truncated safetensors",
                             truncate("model.safetensors")),
    "weights not safetensors": Bad("quantize {model} --out {tmp}/q", "corrupt or truncated safetensors",
                                   write("model.safetensors", b"\xff" * 4096)),
    "tokenizer damaged": Bad("quantize {model} --out {tmp}/q", "no usable tokenizer", truncate("tokenizer.json")),
    "generation config damaged": Bad("quantize {model} --out {tmp}/q", "not a usable generation config",
                                     write("generation_config.json", "{")),
    "shard index damaged": Bad("quantize {model} --out {tmp}/q", "not a valid shard index",
                               sharded('{"weight_map": 3}')),
    "shard index pointing outside": Bad("quantize {model} --out {tmp}/q", "names a shard outside the model directory",
                                        sharded('{"weight_map": {"x": "../model/model-00001-of-00001.safetensors"}}')),
    "GGUF damaged": Bad("quantize {tmp}/bad.gguf --out {tmp}/q", "not a readable GGUF file"),
    # quantize: the options
    "5 bits": Bad("quantize {model} --bits 5 --out {tmp}/q", "--bits 5 is an unsupported bit width"),
    "group size 0": Bad("quantize {model} --group-size 0 --out {tmp}/q", "--group-size 0 is invalid"),
    "unknown method": Bad("quantize {model} --method magic --out {tmp}/q", "unknown method 'magic'"),
    "unknown method with its options": Bad("quantize {model} --method GPTQ --damp 0.02 --out {tmp}/q",
                                           "unknown method 'GPTQ'"),  # not "--damp is not an option of"
    "AWQ loss for GPTQ": Bad("quantize {model} --method gptq --awq-loss output --out {tmp}/q",
                             "use it with --method awq"),
    "unknown format": Bad("quantize {model} --format onnx --out {tmp}/q", "unknown export format 'onnx'"),
    "unknown GGUF type": Bad("quantize {model} --format gguf --gguf-type Q9_K --out {tmp}/q.gguf",
                             "unknown GGUF type 'Q9_K'"),
    "imatrix file missing": Bad("quantize {model} --format gguf --gguf-type Q4_0 --imatrix {tmp}/nope.dat "
                                "--out {tmp}/q.gguf", "no such file"),
    "imatrix not an importance matrix": Bad("quantize {model} --format gguf --gguf-type Q4_0 --imatrix {text} "
                                            "--out {tmp}/q.gguf", "give a file llama-imatrix wrote"),
    "imatrix replaced by the output": Bad("quantize {model} --format gguf --gguf-type Q4_0 --imatrix {text} --out {text} "
                                          "--overwrite", "which this command reads"),
    "imatrix taking the model's place": Bad("quantize --imatrix {model} --format gguf --gguf-type Q4_0 "
                                            "--out {tmp}/q.gguf", "a directory, not an importance matrix"),
    "rules file missing": Bad("quantize {model} --rules {tmp}/nope.yaml --out {tmp}/q", "no such rules file"),
    "rules file not rules": Bad("quantize {model} --rules {text} --out {tmp}/q", "rules are a non-empty list"),
    "rules file not YAML": Bad("quantize {model} --rules {model}/rules.yaml --out {tmp}/q",
                               "not a JSON or YAML rules file", write("rules.yaml", "- [unclosed")),
    "GGUF of a rope llama.cpp lacks": Bad("quantize {model} --format gguf --gguf-type Q8_0 --out {tmp}/q.gguf",
                                          "rope scaling 'dynamic' of a llama model is not written to GGUF",
                                          edit_config(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                       "rope_theta": 10000.0})),
    "target bpw out of reach": Bad("quantize {model} --method gptq --target-bpw 12 --out {tmp}/q",
                                   "outside the range of the safetensors format's grids"),
    "target bpw for AWQ": Bad("quantize {model} --method awq --target-bpw 4 --out {tmp}/q",
                              "--target-bpw spends bits on RTN and GPTQ grids"),
    "target bpw with rules": Bad("quantize {model} --method gptq --target-bpw 4 --rules {text} --out {tmp}/q",
                                 "pass --rules or --target-bpw, not both"),
    "tensor type without a type": Bad("quantize {model} --format gguf --gguf-type Q4_0 --tensor-type attn_v "
                                      "--out {tmp}/q.gguf", "is not PATTERN=TYPE"),
    "tensor type for a float mix": Bad("quantize {model} --format gguf --gguf-type F16 --tensor-type attn_v=Q8_0 "
                                       "--out {tmp}/q.gguf", "overrides the types of a quantized GGUF mix"),
    "bits not a number": Bad("quantize {model} --bits four --out {tmp}/q", "'four' is not a valid float"),
    "unknown option": Bad("quantize {model} --bitz 4 --out {tmp}/q", "No such option '--bitz'"),
    "missing calibration file": Bad("quantize {model} --method gptq --calib-data {tmp}/nope.txt --out {tmp}/q",
                                    "no such file"),
    "calibration text too short": Bad("quantize {model} --method gptq --calib-data {text} --out {tmp}/q",
                                      "too few for 128 windows"),
    "no calibration windows": Bad("quantize {model} --method gptq --calib-samples 0 --calib-data {text} --out {tmp}/q",
                                  "ask for at least 1 window (--calib-samples)"),
    "out named .gguf, format safetensors": Bad("quantize {model} --out {tmp}/q.gguf",
                                               "names a GGUF file, and --format safetensors writes a directory"),
    "gguf type without format gguf": Bad("quantize {model} --out {tmp}/q --gguf-type Q4_K_M",
                                         "--gguf-type chooses a GGUF mix, and --format safetensors is not GGUF: add "
                                         "--format gguf"),
    "shard size for a GGUF file": Bad("quantize {model} --format gguf --out {tmp}/q.gguf --max-shard-size 1GB",
                                      "--max-shard-size does not apply to --format gguf, which writes one file"),
    "out is the model, no --overwrite": Bad("quantize {model} --out {model}", "which this command reads"),
    "export: out is the model": Bad("export {model} --out {model}", "which this command reads"),
    "merge: out is the adapter": Bad("merge {model} --out {model}", "which this command reads"),
    "shard size not a size": Bad("quantize {model} --max-shard-size lots --out {tmp}/q", "lots"),
    "unknown device": Bad("quantize {model} --device tpu --out {tmp}/q", "tpu"),
    "output in a missing directory": Bad("quantize {model} --out {tmp}/no/q", "no such directory"),
    "eval data missing": Bad("quantize {model} --eval-data {tmp}/nope.txt --out {tmp}/q", "no such file"),
    # export
    "export: missing model": Bad("export {tmp}/nope --out {tmp}/q.gguf", "no such file or directory"),
    "export: unknown GGUF type": Bad("export {model} --gguf-type Q9 --out {tmp}/q.gguf", "Q9"),
    "export: output exists": Bad("export {model} --gguf-type Q8_0 --out {text}", "already exists"),
    "export: GGUF damaged": Bad("export {tmp}/bad.gguf --gguf-type Q8_0 --out {tmp}/q.gguf",
                                "its header is cut short or damaged"),
    "export: GGUF into an unknown mix": Bad("export {tmp}/bad.gguf --gguf-type Q9 --out {tmp}/q.gguf", "Q9"),
    # eval
    "eval: data missing": Bad("eval {model} --data {tmp}/nope.txt", "no such file"),
    "eval: data empty": Bad("eval {model} --data {tmp}/empty.txt", "is empty"),
    "eval: data a device": Bad("eval {model} --data /dev/null", "/dev/null is not a regular file (a pipe or a device)"),
    "eval: text shorter than a window": Bad("eval {model} --data {text} --ctx 4096", "fewer than one window"),
    "eval: --dequantized on a float model": Bad("eval {model} --data {text} --dequantized", "is a float model"),
    "eval: context 0": Bad("eval {model} --data {text} --ctx 0", "ctx"),
    "eval: base missing": Bad("eval {model} --data {text} --ctx 64 --base {tmp}/nope", "no such file"),
    "eval: gate without a base": Bad("eval {model} --data {text} --max-kld 0.1", "--base"),
    "eval: save-base without a base": Bad("eval {model} --data {text} --save-base {tmp}/b.bin", "--base"),
    # lm-eval
    "lm-eval: --dequantized on a float model": Bad("lm-eval {model} --tasks wikitext --dequantized",
                                                   "is a float model"),
    "lm-eval: unknown task": Bad("lm-eval {model} --tasks no_such_task", "no_such_task"),
    "lm-eval: missing model": Bad("lm-eval {tmp}/nope --tasks wikitext", "no such file or directory"),
    # report
    "report: widths not numbers": Bad("report {model} --out {tmp}/r --data {text} --bits 4,x", "--bits '4,x'"),
    "report: unknown method": Bad("report {model} --out {tmp}/r --data {text} --methods magic", "magic"),
    "report: data missing": Bad("report {model} --out {tmp}/r --data {tmp}/nope.txt", "no such file"),
    "report: lm-eval data missing": Bad("report {model} --out {tmp}/r --data {text} --methods rtn --tasks "
                                        "wikitext --lm-eval-data-dir {tmp}/nope", "pass --lm-eval-data-dir or set QUANTKIT_DATA"),
    # train
    "train: data missing": Bad("train {model} --data {tmp}/nope.txt --out {tmp}/a", "nope.txt: no such file: pass an existing text file"),
    "train: rank 0": Bad("train {model} --data {text} --out {tmp}/a --rank 0", "rank"),
    "train: target matching nothing": Bad("train {model} --data {text} --out {tmp}/a --target nothing", "nothing"),
    "train: --fsdp in one process": Bad("train {model} --data {text} --out {tmp}/a --fsdp", "torchrun --nproc-per-node"),
    "train: --fsdp with QLoRA": Bad("train {model} --data {text} --out {tmp}/a --fsdp --method qlora", "NF4 base"),
    "train: --fsdp with 8-bit AdamW": Bad("train {model} --data {text} --out {tmp}/a --fsdp --optimizer adamw8bit",
                                          "--optimizer adamw with --fsdp"),
    "train: resume without a run": Bad("train {model} --data {text} --out {tmp}/a --resume", "nothing to resume"),
    "train: resume a finished run": Bad("train {model} --data {text} --out {tmp} --resume", "no checkpoint of a run"),
    "train: out is the model": Bad("train {model} --data {text} --out {model} --overwrite", "which this command reads"),
    "train: quantize-out holds the adapter": Bad("train {model} --data {text} --out {tmp}/a --quantize rtn --quantize-out "
                                                 "{tmp} --overwrite", "--quantize-out"),
    "train: quantize-out is the data, no --overwrite": Bad("train {model} --data {text} --out {tmp}/a --quantize rtn "
                                                          "--quantize-out {text}", "which this command reads"),
    "train: quantize-out a directory for a GGUF file": Bad("train {model} --data {text} --out {text}-a --quantize rtn "
                                                           "--format gguf --quantize-out {tmp}",
                                                           "choose another --quantize-out, such as"),
    "train: quantize-out a GGUF name for a directory": Bad(
        "train {model} --data {text} --out {tmp}/a --quantize rtn --quantize-out {tmp}/q.gguf",
        "q.gguf names a GGUF file, and --format safetensors writes a directory: add --format gguf, or choose an "
        "--quantize-out without .gguf"),  # before the training, and in train's words
    "train: quantize unknown format": Bad("train {model} --data {text} --out {tmp}/a --quantize rtn --format onnx",
                                          "onnx"),
    "train: --seqlen 1": Bad("train {model} --data {text} --out {tmp}/a --seqlen 1", "leaves no token to predict"),
    "train: --steps and --epochs": Bad("train {model} --data {text} --out {tmp}/a --steps 2 --epochs 3",
                                       "pass one of them"),
    "train: --eval-fraction beside --eval-data": Bad("train {model} --data {text} --out {tmp}/a --eval-data {text} "
                                                     "--eval-fraction 0.3", "drop one of them"),
    "train: the default --eval-fraction given beside --eval-data": Bad(
        "train {model} --data {text} --out {tmp}/a --eval-data {text} --eval-fraction 0.05", "drop one of them"),
    "train: --bits without --quantize": Bad("train {model} --data {text} --out {tmp}/a --bits 3",
                                            "--bits sets the quantization that --quantize METHOD turns on"),
    "train: --format without --quantize": Bad("train {model} --data {text} --out {tmp}/a --format gguf",
                                              "--format sets the quantization"),
    "train: --group-size with --quantize nf4": Bad("train {model} --data {text} --out {tmp}/a --quantize nf4 "
                                                   "--group-size 64", "--group-size is not an option of --quantize nf4"),
    "train: a record's reply not text": Bad("train {model} --data {model}/bad.jsonl --out {tmp}/a --steps 1",
                                            "the record's response is int, where text belongs",
                                            lambda m: (chat_with_template("{{ messages[0].content }}")(m),
                                                       write("bad.jsonl", '{"instruction": "hi", "response": 5}')(m))),
    "train: chat template escaping jinja's sandbox": Bad(
        "train {model} --data {model}/chat.jsonl --out {tmp}/a --steps 1 --seqlen 32 --batch-size 2",
        "chat template fails (SecurityError", chat_with_template("{{ cycler.__init__.__globals__.os.system('id') }}")),
    "train: chat template that does not parse": Bad(
        "train {model} --data {model}/chat.jsonl --out {tmp}/a --steps 1 --seqlen 32 --batch-size 2",
        "chat template fails (TemplateSyntaxError", chat_with_template("{% for m in messages %}")),
    "train: a record's integer past Python's digits": Bad("train {model} --data {model}/big.jsonl --out {tmp}/a",
                                                          "line 1: not valid JSON here (Exceeds the limit",
                                                          write("big.jsonl", f'{{"text": {HUGE_INT}}}\n')),
    "train: a .json list's integer past Python's digits": Bad("train {model} --data {model}/big.json --out {tmp}/a",
                                                              "not valid JSON (Exceeds the limit",
                                                              write("big.json", f'[{{"text": {HUGE_INT}}}]')),
    # outputs that are neither files nor directories
    "quantize: out a pipe": Bad("quantize {model} --out {model}/../pipe --overwrite", "is a pipe, device or socket",
                                pipe_beside("pipe")),
    "export: out a pipe": Bad("export {model} --out {model}/../pipe.gguf", "is a pipe, device or socket",
                              pipe_beside("pipe.gguf")),
    "merge: out a pipe": Bad("merge {model} --out {model}/../pipe", "is a pipe, device or socket", pipe_beside("pipe")),
    # a group past g_idx's int32
    "quantize: --group-size 2**32": Bad("quantize {model} --out {tmp}/q --group-size 4294967296", "is invalid"),
    # a text where the model goes
    "eval: a text file as the model": Bad("eval {text} --data {text}", "is not a model (a model directory or a GGUF file)"),
    "export: a text file as the model": Bad("export {text} --out {tmp}/x.gguf", "is not a model"),
    # merge
    "merge: not an adapter": Bad("merge {model} --out {tmp}/m", "pass a LoRA adapter directory"),
    "merge: missing adapter": Bad("merge {tmp}/nope --out {tmp}/m", "pass a LoRA adapter directory"),
}
