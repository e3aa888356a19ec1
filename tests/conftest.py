import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run in Triton's interpreter (read when triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .refs import autogptq

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
VALID = DATA / "wikitext-2" / "wiki.valid.tokens"
TEST = DATA / "wikitext-2-raw" / "wiki.test.raw"


def tiny_tokenizer(path: Path, vocab_size: int = 512):
    """A byte-level BPE of up to vocab_size tokens trained on the calibration text: real tokenization, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([VALID.read_text()[:200_000]], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(path)
    return fast


def tokenizer_adding_bos(path):
    """A fresh copy of the tiny tokenizer that puts BOS (<|endoftext|>, id 0) in front of a text."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.bos_token = "<|endoftext|>"
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", tok.bos_token_id)])
    return tok


def make_tiny(path: Path, hidden: int = 64, intermediate: int = 128, layers: int = 2, seed: int = 0, **cfg) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         max_position_embeddings=512,
                         **{"tie_word_embeddings": True, "num_attention_heads": 4, "num_key_value_heads": 2, **cfg})
    LlamaForCausalLM(config).save_pretrained(path)
    tiny_tokenizer(path)
    return path


def make_hot(model: Path, path: Path) -> Path:
    """A copy of model with its final norm 3e6 times larger: logits so peaked that the mean loss per
    token passes e**709 in float32, and that overflow float16 (as a broken scale would make them)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, path)
    weights = load_file(path / "model.safetensors")
    weights["model.norm.weight"] *= 3e6
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def make_qwen3(path: Path) -> Path:
    """make_tiny's model as a Qwen3: per-head norms of q and k (random: transformers starts them at one),
    heads 32 wide where hidden / heads is 16."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    module = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                          max_position_embeddings=512, tie_word_embeddings=True))
    with torch.no_grad():
        for layer in module.model.layers:
            layer.self_attn.q_norm.weight.normal_(1, 0.2)
            layer.self_attn.k_norm.weight.normal_(1, 0.2)
    module.save_pretrained(path)
    tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    return make_qwen3(tmp_path_factory.mktemp("qwen3") / "model")


def cli(args, capsys, monkeypatch):
    """Run the quantkit command line in this process: (exit status, stdout, stderr's lines)."""
    import sys

    from quantkit.command import main

    monkeypatch.setattr(sys, "argv", ["quantkit", *map(str, args)])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def refused(args, capsys, monkeypatch, match) -> list[str]:
    """The command ends with one `error:` line holding match (after any progress bars), exit 2; its stderr's lines."""
    code, _, err = cli(args, capsys, monkeypatch)
    errors = [line for line in err if line.startswith("error: ")]
    assert code == 2 and errors == err[-1:] and match in errors[0], err
    assert not any("Traceback" in line for line in err)
    return err


def stopping_saves(monkeypatch):
    """From here quantize stops (KeyboardInterrupt, as Ctrl-C) right after each progress save, which it
    makes after a finished layer; the real save is returned, to put back."""
    from quantkit import pipeline

    real = pipeline.save_progress

    def save_then_stop(path, state):
        real(path, state)
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "save_progress", save_then_stop)
    return real


def measurement_stopped_in_layer_1(tiny_dir, out, **kw) -> None:
    """Quantize with kw until its measurement pass reaches layer 1, where it stops (KeyboardInterrupt, as
    Ctrl-C): layer 0's measurement is kept in its progress."""
    import quantkit
    from quantkit import measurement

    real = measurement.measure_layer

    def dies_in_layer_1(*args, **kwargs):
        if kwargs["prefix"] == "model.layers.1.":
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    measurement.measure_layer = dies_in_layer_1
    try:
        quantkit.quantize(str(tiny_dir), out=out, progress=False, **kw)
    except KeyboardInterrupt:
        return
    finally:
        measurement.measure_layer = real
    raise AssertionError("the measurement did not reach layer 1")


def loaded(path=None):
    """A model with every weight in memory (load() reads them layer by layer, when needed)."""
    import quantkit

    m = quantkit.load(path)
    m.materialize()
    return m


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny256(tmp_path_factory) -> Path:
    """Rows that fill llama.cpp's 256-value blocks, so that K-quant types need no fallback."""
    return make_tiny(tmp_path_factory.mktemp("tiny256") / "model", hidden=256, intermediate=512)


@pytest.fixture(scope="session")
def embedded_ppl4() -> float:
    """The embedded float model's perplexity on TEST's first 4 windows: the reference several tests move from,
    scored where their quantized Models are (a Model stays on the CPU; a path would go to a GPU)."""
    import quantkit

    return quantkit.evaluate(quantkit.load(), TEST, max_windows=4, progress=False).perplexity


def gguf_tensors(path) -> dict[str, tuple[str, bytes]]:
    """Each tensor of a GGUF file: its type's name and its bytes. The table comes from the header alone
    (quantkit.modelio.gguf_header; gguf-py's reader spends about 5 s parsing a 49k-token vocabulary
    first), checked to tile the data section up to the file's end with zeros between, so that no
    byte goes unchecked; test_gguf pins it to gguf-py's reader."""
    import gguf
    import numpy as np

    from quantkit.modelio import gguf_header

    metadata, header = gguf_header(Path(path))
    align = metadata.get("general.alignment", 32)
    data = np.memmap(path, np.uint8, mode="r")
    out, end = {}, header.data_start
    for t in sorted(header.tensors, key=lambda t: t.offset):
        start = header.data_start + t.offset
        assert 0 <= start - end < align and not data[end:start].any(), (path, t.name, start, end)  # zero padding
        end = start + t.nbytes
        out[t.name] = gguf.GGMLQuantizationType(t.ggml_type).name, data[start:end].tobytes()
    assert 0 <= len(data) - end < align and not data[end:].any(), (path, len(data), end)
    assert len(out) == len(header.tensors), path
    return out


def autogptq_quantlinear():
    return autogptq("nn_modules.qlinear.qlinear_cuda_old").QuantLinear


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def chat_dir(tmp_path_factory) -> Path:
    """The tiny model with a ChatML chat template, as instruct models have."""
    from transformers import AutoTokenizer

    path = make_tiny(tmp_path_factory.mktemp("chat") / "model")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    return path
