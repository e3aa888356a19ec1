"""compressed-tensors pack-quantized exports: the compressed-tensors package packs our codes to our
bytes and decompresses our files to our weights; transformers loads them with our perplexity."""
import json

import pytest
import torch
from safetensors.torch import load_file

import quantkit

from .conftest import TEST, refused

ct = pytest.importorskip("compressed_tensors")


def export(model_dir, out, **kw):
    return quantkit.quantize(model_dir and str(model_dir), out=out, format="compressed-tensors", keep=True, progress=False, **kw)


@pytest.mark.parametrize("bits,group_size,sym", [(4, 32, True), (4, 64, False), (8, 32, True), (4, -1, False),
                                                 (8, -1, True)])
def test_package_reads_our_bytes(tiny_dir, tmp_path, bits, group_size, sym):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationConfig

    m = export(tiny_dir, tmp_path / "q", bits=bits, group_size=group_size, sym=sym)
    qc = QuantizationConfig.model_validate(json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    assert (scheme.weights.num_bits, scheme.weights.symmetric, qc.format) == (bits, sym, "pack-quantized")
    state = load_file(tmp_path / "q" / "model.safetensors")
    offset = 1 << (bits - 1)
    for name, qt in m.tensors.items():
        parts = {key.removeprefix(f"{name}."): t for key, t in state.items() if key.startswith(f"{name}.")}
        assert sorted(parts) == sorted(["weight_packed", "weight_scale", "weight_shape"] +
                                       ([] if sym else ["weight_zero_point"])), name
        assert torch.equal(parts["weight_packed"], pack_to_int32((qt.codes.int() - offset).to(torch.int8), bits))
        if not sym:
            packed_zp = pack_to_int32((qt.zeros.int() - offset).to(torch.int8), bits, packed_dim=0)
            assert torch.equal(parts["weight_zero_point"], packed_zp), name
        weight = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
        assert torch.equal(weight, qt.dequantize().half()), name
    back = quantkit.load(tmp_path / "q")
    for name, qt in m.tensors.items():
        assert torch.equal(back.tensors[name].dequantize(), qt.dequantize()), name


def test_transformers_loads_ours_with_our_perplexity(tmp_path):
    """The embedded model, 4-bit in groups of 64 (its 576 inputs hold no group of 128)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from quantkit import evals

    export(None, tmp_path / "q", group_size=64)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q", quantization_config=CompressedTensorsConfig(dequantize=True))
    ours = quantkit.load(tmp_path / "q", packed=False)
    for name, qt in ours.tensors.items():
        assert torch.equal(theirs.get_submodule(name).weight, qt.dequantize().half()), name
    text = TEST.read_text()
    theirs_ppl = evals.perplexity(theirs.float(), ours.tokenizer, text, max_windows=4, progress=False).perplexity
    ours_ppl = quantkit.evaluate(tmp_path / "q", TEST, max_windows=4, progress=False).perplexity
    # theirs holds each weight rounded to float16: about 2^-11 of it
    assert theirs_ppl == pytest.approx(ours_ppl, rel=2e-3)


@pytest.mark.parametrize("sym", [True, False])
def test_transformers_compressed_path_takes_what_the_consumer_table_says(tiny_dir, tmp_path, sym):
    """transformers' default (compressed) load gives our logits where the table lists it for the export,
    and fails where the table says it does not (asymmetric: it expects unpacked zero points)."""
    from transformers import AutoModelForCausalLM

    from quantkit import consumers

    m = export(tiny_dir, tmp_path / "q", bits=4, group_size=32, sym=sym)
    why = dict((c.name, w) for c, w in consumers.verdicts(consumers.Export.of("compressed-tensors", m.qconfig, m.module)))
    listed = why["transformers + compressed-tensors (compressed)"] is None
    try:
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32)
    except RuntimeError:
        assert not listed
        return
    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, m.module(ids).logits, rtol=0, atol=2e-3)
    assert listed


@pytest.mark.parametrize("args,match", [
    (["--bits", "3"], "4 or 8 bits, not 3"),
    (["--bits", "8", "--method", "awq"], "asymmetric compressed-tensors weights as 4-bit only"),
    (["--method", "gptq", "--act-order", "--group-size", "32"], "--static-groups"),
    (["--method", "nf4"], "integer grids, not nf4"),
    (["--group-size", "48"], "use --group-size 64"),
])
def test_what_the_format_cannot_hold_is_refused(tiny_dir, tmp_path, capsys, monkeypatch, args, match):
    refused(["quantize", str(tiny_dir), "--format", "compressed-tensors", "--out", str(tmp_path / "q"), *args],
            capsys, monkeypatch, match)
    assert not (tmp_path / "q").exists()
