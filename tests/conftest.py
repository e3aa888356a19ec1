import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
VALID = DATA / "wikitext-2" / "wiki.valid.tokens"
TEST = DATA / "wikitext-2-raw" / "wiki.test.raw"


def tiny_tokenizer(path: Path):
    """A byte-level BPE of 512 tokens trained on the calibration text: real tokenization, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([VALID.read_text()[:200_000]], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(path)
    return fast


def make_tiny(path: Path, hidden: int = 64, intermediate: int = 128, layers: int = 2, seed: int = 0, **cfg) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, **cfg)
    LlamaForCausalLM(config).save_pretrained(path)
    tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model")


def autogptq(module: str):
    """A module of auto-gptq 0.7.1 (the reference implementation) without its package __init__,
    which fails under transformers 5: empty stand-in packages, then the one module."""
    if "auto_gptq" not in sys.modules:
        spec = importlib.util.find_spec("auto_gptq")
        if spec is None:
            pytest.fail("auto-gptq is a test dependency: BUILD_CUDA_EXT=0 pip install --no-deps auto-gptq==0.7.1")
        root = Path(spec.submodule_search_locations[0])
        for name in ("auto_gptq", "auto_gptq.nn_modules", "auto_gptq.nn_modules.qlinear", "auto_gptq.quantization"):
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            sys.modules[name] = pkg
        torch.cuda.synchronize = lambda *a, **k: None  # its GPTQ calls this between steps
    return importlib.import_module(f"auto_gptq.{module}")


def autogptq_quantlinear():
    return autogptq("nn_modules.qlinear.qlinear_cuda_old").QuantLinear
