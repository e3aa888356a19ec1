import json

import pytest
import torch
from safetensors import safe_open

import quantkit
from quantkit import QuantkitError
from quantkit.exporters import shards
from quantkit.qtensor import QuantizedTensor

from .conftest import autogptq_quantlinear


def quantized(tiny_dir, **kw):
    return quantkit.quantize(str(tiny_dir), keep=True, progress=False, **kw)


@pytest.mark.parametrize("bits,group_size,sym", [(4, 32, True), (4, 32, False), (3, 64, True), (2, -1, False),
                                                 (8, 48, True), (8, 128, False)])
def test_export_reloads_bit_identical(tiny_dir, tmp_path, bits, group_size, sym):
    m = quantized(tiny_dir, bits=bits, group_size=group_size, sym=sym)
    out = quantkit.export(m, tmp_path / "q")
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["checkpoint_format"] == ("gptq" if sym else "gptq_v2")
    assert (cfg["bits"], cfg["group_size"], cfg["sym"], cfg["desc_act"]) == (bits, group_size, sym, False)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert (out / "tokenizer.json").is_file()
    back = quantkit.load(out)
    assert back.tensors.keys() == m.tensors.keys()
    for name, qt in m.tensors.items():
        assert torch.equal(back.tensors[name].dequantize(), qt.dequantize()), name
        assert torch.equal(back.module.get_submodule(name).weight, m.module.get_submodule(name).weight)
    # the rest is stored as float16
    for key, t in m.module.state_dict().items():
        if key.removesuffix(".weight") in m.tensors:
            continue
        assert torch.equal(back.module.state_dict()[key], t.half().float()), key
    assert back.tokenizer("hello world")["input_ids"] == m.tokenizer("hello world")["input_ids"]


def test_act_order_g_idx_round_trips(tiny_dir, tmp_path):
    m = quantized(tiny_dir, bits=4, group_size=32)
    name = "model.layers.0.mlp.down_proj"
    qt = m.tensors[name]
    perm = torch.randperm(qt.shape[1], generator=torch.Generator().manual_seed(0))
    g_idx = torch.empty_like(qt.g_idx)
    g_idx[perm] = (torch.arange(qt.shape[1]) // 32).int()  # group = position in the act-order // G
    m.tensors[name] = QuantizedTensor(qt.codes, qt.scales, qt.zeros, g_idx, 4, 32, True)
    out = quantkit.export(m, tmp_path / "q")
    assert json.loads((out / "quantize_config.json").read_text())["desc_act"] is True
    back = quantkit.load(out)
    assert torch.equal(back.tensors[name].g_idx, g_idx)
    assert torch.equal(back.tensors[name].dequantize(), m.tensors[name].dequantize())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_autogptq_forward_reads_our_export(tiny_dir, tmp_path, bits):
    """auto-gptq's own CPU forward over our qweight/qzeros/scales gives our dequantized matmul."""
    m = quantized(tiny_dir, bits=bits, group_size=32, sym=True)
    out = quantkit.export(m, tmp_path / "q")
    name = "model.layers.1.mlp.down_proj"
    n, k = m.tensors[name].shape
    ql = autogptq_quantlinear()(bits, 32, k, n, bias=False, weight_dtype=torch.float32)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for part in ("qweight", "qzeros", "scales", "g_idx"):
            getattr(ql, part).copy_(f.get_tensor(f"{name}.{part}"))
    x = torch.randn(5, k)
    expected = x @ m.tensors[name].dequantize().T
    torch.testing.assert_close(ql(x), expected, rtol=1e-5, atol=1e-5)


def test_failed_export_leaves_nothing(tiny_dir, tmp_path, monkeypatch):
    m = quantized(tiny_dir)

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(shards.ShardWriter, "flush", broken)
    with pytest.raises(OSError):
        quantkit.export(m, tmp_path / "q")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key", ["model.layers.1.post_attention_layernorm.weight", "model.norm.weight",
                                 "model.layers.1.mlp.down_proj.weight"])
def test_a_tensor_past_float16s_range_is_refused_not_written_as_inf(tiny_dir, tmp_path, monkeypatch, key):
    """A norm weight past 65504 (kept in float by the quantizer) was stored in float16 as inf: the export
    said it was written, and loading it then called it damaged. Now refused before any layer is
    quantized (the final norm is written after the last), and so is a linear the rules leave in float
    (refused when written, after the layers before it). NF4's layout keeps the dtype."""
    import shutil

    from safetensors.torch import load_file, save_file

    from quantkit import pipeline

    model = tmp_path / "m"
    shutil.copytree(tiny_dir, model)
    state = load_file(model / "model.safetensors")
    state[key][3] = 1e5
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    quantized = []
    monkeypatch.setattr(pipeline, "quantize_layer", lambda *a, **k: quantized.append(a[0]))
    rules = [{"match": r"layers\.1\.mlp\.down_proj", "skip": True}] if "proj" in key else None
    with pytest.raises(QuantkitError, match=rf"{key} holds values up to 1e\+05, past what torch.float16 holds.*use NF4"):
        quantkit.quantize(str(model), bits=4, group_size=32, rules=rules, out=tmp_path / "q", progress=False)
    assert not (tmp_path / "q").exists() and quantized == []
    monkeypatch.undo()
    if rules:  # the rest is the norms'
        return
    quantkit.quantize(str(model), method="nf4", out=tmp_path / "nf4", progress=False)
    assert quantkit.load(tmp_path / "nf4").module.state_dict()[key][3] == 1e5


def test_existing_output_is_not_overwritten_by_default(tiny_dir, tmp_path):
    m = quantized(tiny_dir)
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "keep").write_text("mine")
    with pytest.raises(QuantkitError, match="already exists"):
        quantkit.export(m, tmp_path / "q")
    # overwrite replaces a model directory, not one of other things (--out models, meant models/m)
    with pytest.raises(QuantkitError, match="q holds keep and is not a model or adapter directory, which "
                                            "overwrite=True replaces: choose another out, such as .*q/model"):
        quantkit.export(m, tmp_path / "q", overwrite=True)
    (tmp_path / "q" / "config.json").write_text("{}")  # a previous export, say
    quantkit.export(m, tmp_path / "q", overwrite=True)
    assert not (tmp_path / "q" / "keep").exists() and (tmp_path / "q" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_unquantized_model_cannot_be_exported(tiny_dir, tmp_path):
    with pytest.raises(QuantkitError, match="not quantized"):
        quantkit.export(quantkit.load(tiny_dir), tmp_path / "q")


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3"])
def test_other_supported_architectures(tiny_dir, tmp_path, arch):
    """Mistral, Qwen2 (q/k/v with bias) and Qwen3 (per-head norms of q and k, heads not hidden / heads
    wide) quantize, export and reload like Llama."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.for_model(arch, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               tie_word_embeddings=False, **({"head_dim": 32} if arch == "qwen3" else {}))
    torch.manual_seed(0)
    module = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "_norm." in name:  # transformers starts norms at one, which would test nothing
                p.normal_(1, 0.2)
    module.save_pretrained(tmp_path / "m")
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(tmp_path / "m")
    m = quantkit.quantize(str(tmp_path / "m"), bits=4, group_size=32, out=tmp_path / "q", keep=True, progress=False)
    back = quantkit.load(tmp_path / "q")
    assert back.module.config.model_type == arch and len(back.tensors) == 14
    for name, qt in m.tensors.items():
        assert torch.equal(back.module.get_submodule(name).weight, qt.dequantize())
    bias = "model.layers.0.self_attn.q_proj.bias"
    if arch == "qwen2":
        assert torch.equal(back.module.state_dict()[bias], m.module.state_dict()[bias].half().float())
    if arch == "qwen3":
        norm = "model.layers.1.self_attn.k_norm.weight"
        assert back.module.config.head_dim == 32
        assert torch.equal(back.module.state_dict()[norm], m.module.state_dict()[norm].half().float())
    assert torch.equal(back.module.lm_head.weight, m.module.lm_head.weight.half().float())


def test_progress_false_writes_nothing_on_stderr(tiny_dir, tmp_path, capfd):
    """progress=False still printed the writer's "wrote N tensors in 1 file(s)" line (a deployment
    pipeline's log asked to stay quiet); with progress it is the last line, for both kinds of writer."""
    for fmt, kw in (("safetensors", {}), ("gguf", {"gguf_type": "Q8_0"})):
        for progress in (False, True):
            out = tmp_path / f"{fmt}-{progress}"
            quantkit.quantize(str(tiny_dir), out=out, format=fmt, progress=progress, **kw)
            err = capfd.readouterr().err
            assert (err.strip().splitlines()[-1].startswith("wrote ") if progress else err == ""), err
    m = quantized(tiny_dir)
    capfd.readouterr()
    quantkit.export(m, tmp_path / "kept", progress=False)
    assert capfd.readouterr().err == ""
