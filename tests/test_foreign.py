"""Quantized checkpoints as other tools write them, read back: transformers' GPTQConfig (meta null),
GPTQModel's `dynamic` without our meta, older AutoGPTQ's quantize_config.json alone, GPTQ-for-LLaMa's
missing g_idx, AutoAWQ's modules_to_not_convert, bitsandbytes' quant_storage, compressed-tensors'
actorder spellings. Each reads as the format defines, and what was mixed per linear exports again
as it was read."""
import json
import re
import shutil
import warnings
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

import quantkit
from quantkit.errors import QuantkitError
from quantkit.layers import linear_shapes
from quantkit.qlinear import GPTQLinear
from quantkit.quantizers import rtn

from .conftest import VALID, loaded, make_tiny
from .test_rules import RULES, settings, vllm_dynamic


def copy(src, dst, edit=None):
    """A copy of the checkpoint src at dst, edit(quantization_config) applied to its config.json."""
    shutil.copytree(src, dst)
    if edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def edit_tensors(path, edit):
    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def mixed(tiny_dir, tmp_path_factory):
    """A GPTQ checkpoint mixed per linear (8 bits, another group size, one linear in float)."""
    rules = tmp_path_factory.mktemp("rules") / "rules.json"
    rules.write_text(json.dumps(RULES))
    out = tmp_path_factory.mktemp("mixed") / "q"
    return quantkit.quantize(str(tiny_dir), method="rtn", bits=4, group_size=64, rules=str(rules), out=out, keep=True,
                             progress=False), out


def same_model(back, m):
    """back holds m's quantized tensors, and its other linears in float as m has them."""
    assert back.tensors.keys() == m.tensors.keys()
    for n, qt in m.tensors.items():
        assert torch.equal(back.tensors[n].dequantize(), qt.dequantize()), n
    names = [n for n, _, _ in linear_shapes(m.module)]
    assert settings(back.qconfig, names) == settings(m.qconfig, names)


def test_dynamic_without_our_meta_exports_again_as_read(mixed, tmp_path):
    """transformers' GPTQConfig writes meta null, which dropped our rules and broke the read; another
    tool's dynamic then holds the mix alone: read, it exports to GPTQ and compressed-tensors with
    each linear's settings (dynamic was dropped, and the exports read back as corrupt)."""
    m, out = mixed
    foreign = copy(out, tmp_path / "g", lambda qc: qc.update(meta=None))
    back = loaded(foreign)
    same_model(back, m)
    skipped = "model.layers.1.self_attn.o_proj"
    for fmt in ("safetensors", "compressed-tensors"):
        again = quantkit.export(back, tmp_path / fmt, fmt)
        same_model(loaded(again), m)
        assert torch.equal(loaded(again).module.get_submodule(skipped).weight,
                           m.module.get_submodule(skipped).weight.half().float())
    qc = json.loads((tmp_path / "safetensors" / "config.json").read_text())["quantization_config"]
    assert vllm_dynamic(qc["dynamic"], skipped) is False
    assert vllm_dynamic(qc["dynamic"], "model.layers.0.mlp.down_proj") == {"bits": 8, "group_size": 32}


@pytest.fixture(scope="module")
def plain(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "q"
    return quantkit.quantize(str(tiny_dir), method="rtn", bits=4, group_size=32, out=out, keep=True, progress=False), out


def test_quantize_config_json_alone_reads(plain, tmp_path):
    """Older AutoGPTQ checkpoints keep their settings in quantize_config.json only (it was called
    already quantized, "pass the original model")."""
    m, out = plain
    foreign = copy(out, tmp_path / "g")
    cfg = json.loads((foreign / "config.json").read_text())
    del cfg["quantization_config"]
    (foreign / "config.json").write_text(json.dumps(cfg))
    assert (foreign / "quantize_config.json").is_file()
    same_model(loaded(foreign), m)


def test_gptq_without_g_idx_takes_plain_groups(plain, tmp_path):
    """GPTQ-for-LLaMa's checkpoints hold no g_idx: groups in order, AutoGPTQ's default (was refused)."""
    m, out = plain
    foreign = copy(out, tmp_path / "g")
    edit_tensors(foreign, lambda state: [state.pop(k) for k in list(state) if k.endswith(".g_idx")])
    same_model(loaded(foreign), m)


def test_settings_the_tensors_contradict_are_refused(plain, tiny_dir, tmp_path):
    """An asymmetric checkpoint labelled sym scored right packed (the zeros are read) but exported to
    GGUF as Q4_0, which drops them: perplexity 1.9e7, exit 0; a v2 checkpoint labelled v1 alike. A
    g_idx that is not k // G in a checkpoint without desc_act scored as read, where kernels that
    trust the label would not. Each is refused, naming the setting."""
    m, out = plain
    asym = tmp_path / "asym"
    quantkit.quantize(str(tiny_dir), method="rtn", bits=4, group_size=32, sym=False, out=asym, progress=False)
    cases = {
        "says sym, but its zero points are not all 8": copy(asym, tmp_path / "a", lambda q: q.update(sym=True)),
        "zero points are not all 8": copy(out, tmp_path / "v2", lambda q: q.update(checkpoint_format="gptq_v2")),
        "g_idx is not k // group_size": copy(out, tmp_path / "g"),
    }
    edit_tensors(tmp_path / "g", lambda state: state.update({k: state[k].flip(0) for k in state if k.endswith("up_proj.g_idx")}))
    for match, path in cases.items():
        with pytest.raises(QuantkitError, match=match):
            quantkit.load(path)
    copy(tmp_path / "g", tmp_path / "act", lambda q: q.update(desc_act=True))  # act-order's g_idx: any order
    assert not quantkit.load(tmp_path / "act").qconfig.static_groups


def test_what_a_reader_would_guess_or_ignore_is_refused(plain, tiny_dir, tmp_path):
    """A double-quantized NF4 weight without nested_offset was read with 0 (a worse perplexity, exit 0;
    bitsandbytes' QuantState.from_dict requires it); a compressed-tensors checkpoint's quantized KV
    cache or output activations were ignored; a weights file that is a broken link gave a traceback."""
    nf4 = tmp_path / "nf4"
    quantkit.quantize(str(tiny_dir), method="nf4", double_quant=True, out=nf4, progress=False)

    def drop_offset(state):
        key = next(k for k in state if ".layers.1." in k and ".quant_state." in k)
        meta = json.loads(bytes(state[key].tolist()))
        del meta["nested_offset"]
        state[key] = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)

    edit_tensors(nf4, drop_offset)
    ct = tmp_path / "ct"
    quantkit.quantize(str(tiny_dir), method="rtn", group_size=32, format="compressed-tensors", out=ct, progress=False)
    fp8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
    cases = {
        "incomplete or inconsistent (KeyError('nested_offset'))": nf4,
        "a quantized KV cache (kv_cache_scheme)": copy(ct, tmp_path / "kv", lambda q: q.update(kv_cache_scheme=fp8)),
        "pack-quantized integer weights": copy(ct, tmp_path / "o", lambda q: [
            g.update(output_activations=fp8) for g in q["config_groups"].values()]),
        "a broken symbolic link (to": copy(plain[1], tmp_path / "link"),
    }
    (tmp_path / "link" / "model.safetensors").unlink()
    (tmp_path / "link" / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")
    for match, path in cases.items():
        with pytest.raises(QuantkitError, match=re.escape(match)):
            quantkit.load(path)


def test_packed_layers_that_the_config_does_not_make_are_refused(plain, tiny_dir, tmp_path):
    """Packed layers were installed without a look at the config's shapes (only q_proj's rows were
    checked): a config with other key/value heads gave a traceback at the first forward; EXL2 cut its
    columns to the config's and scored the rest (perplexity 834684, exit 0)."""
    exl2 = tmp_path / "exl2"
    quantkit.quantize(str(tiny_dir), method="gptq", format="exl2", exl2=4.125, calib_data=str(VALID),
                      calib_samples=4, calib_seqlen=64, out=exl2, progress=False)
    for path, packed in ((plain[1], True), (exl2, False)):
        heads = copy(path, tmp_path / f"{path.name}-heads")
        cfg = json.loads((heads / "config.json").read_text())
        cfg["num_key_value_heads"] = 1
        (heads / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(QuantkitError, match=r"k_proj.* (32 x 64 weights where config.json makes it 16 x 64|q_weight "
                                                r"holds weights past the config's 16 outputs)"):
            quantkit.load(heads, packed=packed)


def test_awq_modules_not_converted_export_as_float(tiny_dir, tmp_path):
    """AutoAWQ leaves modules_to_not_convert in float: read, they stay float in a GPTQ export, whose
    dynamic says so (it was written as a 4-bit linear's missing qweight)."""
    m = quantkit.quantize(str(tiny_dir), method="rtn", bits=4, group_size=32, sym=False, format="awq",
                          out=tmp_path / "a", keep=True, progress=False)
    name = "model.layers.0.mlp.down_proj"
    float_weight = m.tensors[name].dequantize().half()

    def to_float(state):
        for part in ("qweight", "qzeros", "scales"):
            state.pop(f"{name}.{part}")
        state[f"{name}.weight"] = float_weight
    foreign = copy(tmp_path / "a", tmp_path / "aa", lambda qc: qc.update(modules_to_not_convert=[name]))
    edit_tensors(foreign, to_float)
    back = loaded(foreign)
    assert name not in back.tensors and back.qconfig.for_linear(name) is None
    out = quantkit.export(back, tmp_path / "g", "safetensors")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert vllm_dynamic(qc["dynamic"], name) is False
    assert all(vllm_dynamic(qc["dynamic"], n) == {} for n in m.tensors if n != name)
    again = loaded(out)
    assert torch.equal(again.module.get_submodule(name).weight, float_weight.float())
    for n, qt in m.tensors.items():
        if n != name:
            assert torch.equal(again.tensors[n].dequantize(), qt.dequantize()), n


def test_bitsandbytes_quant_storage_reads_as_bytes(tiny_dir, tmp_path):
    """bnb_4bit_quant_storage (bfloat16 for FSDP-QLoRA) stores the packed codes viewed as that dtype
    (it was called corrupt)."""
    m = quantkit.quantize(str(tiny_dir), method="nf4", out=tmp_path / "n", keep=True, progress=False)
    foreign = copy(tmp_path / "n", tmp_path / "b", lambda qc: qc.update(bnb_4bit_quant_storage="bfloat16"))

    def as_bf16(state):
        for k in [k for k in state if k.endswith(".weight") and state[k].dtype == torch.uint8]:
            state[k] = state[k].reshape(-1).view(torch.bfloat16)[:, None].clone()
    edit_tensors(foreign, as_bf16)
    back = loaded(foreign)
    for n, qt in m.tensors.items():
        assert torch.equal(back.tensors[n].dequantize(), qt.dequantize()), n


@pytest.mark.parametrize("order", [True, "dynamic", "group"])
def test_compressed_tensors_group_actorder_spellings_are_refused_alike(plain, tmp_path, order):
    """true (older configs) and "dynamic" are compressed-tensors' aliases of "group" (a weight_g_idx):
    the same refusal (they read as plain groups and failed on unexpected tensors)."""
    m, _ = plain
    out = quantkit.export(m, tmp_path / "c", "compressed-tensors")
    foreign = copy(out, tmp_path / "cc", lambda qc: [g["weights"].update(actorder=order)
                                                     for g in qc["config_groups"].values()])
    with pytest.raises(QuantkitError, match=f"actorder {order!r}"):
        quantkit.load(foreign)


def test_rotary_frequencies_in_a_quantized_checkpoint_are_made_again(plain, tmp_path):
    """Older GPTQ and AWQ checkpoints hold rotary_emb.inv_freq, which transformers ignores (they were
    refused as unexpected tensors, "re-export the checkpoint")."""
    m, out = plain
    foreign = copy(out, tmp_path / "g")
    inv = loaded(out).module.model.rotary_emb.inv_freq
    edit_tensors(foreign, lambda state: state.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv.clone()
                                                      for i in range(2)}))
    back = loaded(foreign)
    same_model(back, m)
    assert torch.equal(back.module.model.rotary_emb.inv_freq, inv)


def test_another_methods_mixed_checkpoint_reads_as_its_grids(mixed, tmp_path):
    """quantkit's own earlier re-export of an AutoAWQ checkpoint with a float linear: meta.method "awq"
    and no meta.rules. Its mix read as rules made a QuantConfig AWQ cannot have (refused on load)."""
    m, out = mixed
    foreign = copy(out, tmp_path / "g", lambda qc: qc["meta"].update(method="awq", rules=[]))
    back = loaded(foreign)
    assert back.qconfig.method == "gptq"
    same_model(back, m)


def test_autoawq_quant_config_json_alone_reads(tiny_dir, tmp_path):
    """Older AutoAWQ checkpoints keep w_bit, q_group_size, zero_point and version in quant_config.json."""
    m = quantkit.quantize(str(tiny_dir), method="rtn", bits=4, group_size=32, sym=False, format="awq",
                          out=tmp_path / "a", keep=True, progress=False)
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "a" / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": 32, "w_bit": 4,
                                                                  "version": "GEMM"}))
    back = loaded(tmp_path / "a")
    for n, qt in m.tensors.items():
        assert torch.equal(back.tensors[n].dequantize(), qt.dequantize()), n


def test_a_side_config_beside_a_float_model_is_not_read(tiny_dir, tmp_path):
    """A leftover quantize_config.json beside float weights: the weights decide (it read as a GPTQ
    checkpoint with every linear skipped); a malformed one beside packed weights is named."""
    model = shutil.copytree(tiny_dir, tmp_path / "m")
    (model / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 32}))
    assert not quantkit.load(model).tensors and quantkit.load(model).checkpoint is not None


def test_a_malformed_side_config_is_named(plain, tmp_path):
    m, out = plain
    foreign = copy(out, tmp_path / "g")
    cfg = json.loads((foreign / "config.json").read_text())
    del cfg["quantization_config"]
    (foreign / "config.json").write_text(json.dumps(cfg))
    (foreign / "quantize_config.json").write_text("[4, 32]")
    with pytest.raises(QuantkitError, match="an unreadable quantization config .*restore the checkpoint's quantize_config"):
        quantkit.load(foreign)


def test_compressed_tensors_static_actorder_reads_as_weight(plain, tmp_path):
    """"static" is compressed-tensors' alias of "weight" (columns ordered at quantization, groups in order)."""
    m, _ = plain
    out = quantkit.export(m, tmp_path / "c", "compressed-tensors")
    foreign = copy(out, tmp_path / "cc", lambda qc: [g["weights"].update(actorder="static")
                                                     for g in qc["config_groups"].values()])
    back = loaded(foreign)
    assert back.qconfig.act_order and back.qconfig.static_groups
    same_model(back, m)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """A GPTQ checkpoint of an untied model (4 bits, groups of 32) whose lm_head is not quantized yet."""
    root = tmp_path_factory.mktemp("untied")
    src = make_tiny(root / "model", tie_word_embeddings=False)
    quantkit.quantize(str(src), method="rtn", bits=4, group_size=32, out=root / "q", progress=False)
    return root / "q"


def with_head(src, dst, bits, group_size, flag=True):
    """GPTQModel's checkpoint with a quantized lm_head ("lm_head": true; another setting by dynamic);
    the head's dequantized weight."""
    head = {}

    def pack_head(state):
        head["qt"] = rtn.quantize(state.pop("lm_head.weight").float(), bits=bits, group_size=group_size)
        state.update({f"lm_head.{k}": t for k, t in GPTQLinear.from_tensor(head["qt"]).packed().items()})

    def flag_head(qc):
        qc["lm_head"] = flag
        if (bits, group_size) != (4, 32):
            qc["dynamic"] = {"+:lm_head$": {"bits": bits, "group_size": group_size}}
    edit_tensors(copy(src, dst, flag_head), pack_head)
    return head["qt"].dequantize()


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 64)])
def test_a_quantized_lm_head_exports_again_as_read(untied, tmp_path, bits, group_size):
    """A quantized lm_head read from GPTQModel's checkpoint was packed again under "lm_head": false
    (GPTQ) or an ignored lm_head (compressed-tensors), which transformers loaded as a random head.
    Now the GPTQ and compressed-tensors exports say it is quantized, with its own setting, and
    transformers loads the compressed one's head; AutoAWQ's layout, whose consumers take lm_head in
    float, gets it dequantized."""
    from transformers import AutoModelForCausalLM

    ref = with_head(untied, tmp_path / "g", bits, group_size)
    back = loaded(tmp_path / "g")
    assert torch.equal(back.module.lm_head.weight, ref)
    for fmt in ("safetensors", "compressed-tensors"):
        out = quantkit.export(back, tmp_path / fmt, fmt)
        again = loaded(out)
        assert again.tensors.keys() == back.tensors.keys()
        assert torch.equal(again.module.lm_head.weight, ref), fmt
    qc = json.loads((tmp_path / "safetensors" / "config.json").read_text())["quantization_config"]
    assert qc["lm_head"] is True
    assert {**qc, **vllm_dynamic(qc.get("dynamic", {}), "lm_head")}["bits"] == bits
    # the package's forward: its dequantize-at-load path takes one setting per file (consumers.one_setting)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "compressed-tensors", dtype=torch.float32)
    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, back.module(ids).logits, rtol=0, atol=2e-3)
    if bits == 4:
        out = quantkit.export(back, tmp_path / "awq", "awq")
        assert torch.equal(load_file(out / "model.safetensors")["lm_head.weight"], ref.half())
        assert torch.equal(loaded(out).module.lm_head.weight, ref.half().float())


def test_a_packed_lm_head_the_config_does_not_quantize_is_refused(untied, tmp_path):
    """Consumers go by the config and would load a random lm_head; quantkit's older exports wrote such."""
    with_head(untied, tmp_path / "g", 4, 32, flag=False)
    with pytest.raises(QuantkitError, match="lm_head is quantized where the config's lm_head is false"):
        quantkit.load(tmp_path / "g")
    with_head(untied, tmp_path / "h", 4, 32)
    quantkit.export(loaded(tmp_path / "h"), tmp_path / "c", "compressed-tensors")
    foreign = copy(tmp_path / "c", tmp_path / "cc", lambda qc: qc.update(ignore=["re:.*head$"]))
    with pytest.raises(QuantkitError, match="lm_head is packed where the config ignores it"):
        quantkit.load(foreign)


def test_linears_of_mixed_symmetry_are_not_exported_under_one(tiny_dir, tmp_path):
    """GPTQModel's `dynamic` may give a linear its own sym. Such a checkpoint read well, but the GPTQ
    layout wrote that linear's zero points minus one under the file's gptq_v2 (read back, its weights
    were off by up to a step: 0.0096), and compressed-tensors left them out where its config said
    asymmetric (the export read back as incomplete). Those exports are refused; AWQ, which stores every
    zero point as it is, writes it as read."""
    asym = quantkit.quantize(str(tiny_dir), method="rtn", bits=4, group_size=32, sym=False, out=tmp_path / "q",
                             keep=True, progress=False)
    name = "model.layers.0.mlp.up_proj"
    sym = rtn.quantize(loaded(tiny_dir).module.get_submodule(name).weight.data, bits=4, group_size=32, sym=True)
    raw = GPTQLinear.from_tensor(replace(sym, sym=False)).packed()  # gptq_v2 stores the zero points as they are
    edit_tensors(tmp_path / "q", lambda state: state.update({f"{name}.{k}": t for k, t in raw.items()}))
    foreign = copy(tmp_path / "q", tmp_path / "g", lambda qc: qc.update(dynamic={rf"+:{re.escape(name)}$": {"sym": True}}))
    back = loaded(foreign)
    assert back.tensors[name].sym and not back.qconfig.sym
    assert torch.equal(back.tensors[name].dequantize(), sym.dequantize())
    for fmt in ("safetensors", "compressed-tensors"):
        with pytest.raises(QuantkitError, match=f"{re.escape(name)} is symmetric where the model's other linears are "
                                                "asymmetric.*format='awq'"):
            quantkit.export(back, tmp_path / fmt, fmt)
        assert not (tmp_path / fmt).exists()
    again = loaded(quantkit.export(back, tmp_path / "awq", "awq"))
    assert torch.equal(again.tensors[name].dequantize(), sym.dequantize())
    assert torch.equal(again.tensors["model.layers.0.mlp.gate_proj"].dequantize(),
                       asym.tensors["model.layers.0.mlp.gate_proj"].dequantize())


def test_scales_float16_cannot_hold_are_named(plain, tmp_path):
    """llm-compressor writes a bfloat16 model's scales in bfloat16; quantkit holds scales in float16.
    Inside float16's normal range that is exact for bfloat16 values; below it they went subnormal and
    their weights moved by up to 0.4% without a word. Now they are named; in range, nothing is said."""
    m, _ = plain
    out = quantkit.export(m, tmp_path / "ct", "compressed-tensors")
    name = "model.layers.0.mlp.down_proj"
    state = load_file(out / "model.safetensors")
    for key in [k for k in state if k.endswith(".weight_scale")]:
        state[key] = state[key].bfloat16()  # as a bfloat16 model's export holds them
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = loaded(out)
    for n, qt in back.tensors.items():  # float16 holds each bfloat16 value of its normal range exactly
        assert torch.equal(qt.scales.float(), state[f"{n}.weight_scale"].float()), n
    state[f"{name}.weight_scale"] = (state[f"{name}.weight_scale"].float() * 2e-3).bfloat16()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=rf"of {re.escape(name)}'s bfloat16 scales lie outside float16's normal range"):
        loaded(out)
