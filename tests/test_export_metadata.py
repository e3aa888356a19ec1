"""What consumers read beyond the tensors: the generation config a re-export keeps, the rope where
loaders before transformers 5 look for it, and the settings vLLM finds for the linears it fuses
(q/k/v as qkv_proj, gate/up as gate_up_proj) under --rules."""
import json
import re
import shutil

import pytest

import quantkit
from quantkit.layers import linear_shapes

from .conftest import make_tiny
from .test_rules import settings, vllm_dynamic

# gate and up of layer 1 at 8 bits by a pattern that names each part, not the fused gate_up_proj;
# q/k/v of layer 0 left in float the same way
RULES = [{"match": r"layers\.1\.mlp\.(gate|up)_proj", "bits": 8},
         {"match": r"layers\.0\.self_attn\.[qkv]_proj", "skip": True}]
FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}


def fused_names(layers: int) -> dict[str, list[str]]:
    return {f"model.layers.{i}.{f}": [f"model.layers.{i}.{f.split('.')[0]}.{p}" for p in parts]
            for i in range(layers) for f, parts in FUSED.items()}


def test_reexport_keeps_the_generation_config(tiny_dir, tmp_path):
    """A quantized checkpoint read back and exported again (to another format) keeps its sampling settings."""
    from transformers import GenerationConfig

    src = tmp_path / "m"
    shutil.copytree(tiny_dir, src)
    g = GenerationConfig.from_pretrained(src)
    g.do_sample, g.temperature, g.top_p, g.max_new_tokens = True, 0.2, 0.9, 77
    g.save_pretrained(src)
    quantkit.quantize(str(src), bits=4, group_size=32, out=tmp_path / "q", progress=False)
    back = quantkit.load(tmp_path / "q")
    assert (back.module.generation_config.temperature, back.module.generation_config.max_new_tokens) == (0.2, 77)
    quantkit.export(back, tmp_path / "ct", format="compressed-tensors")
    saved = json.loads((tmp_path / "ct" / "generation_config.json").read_text())
    assert (saved["do_sample"], saved["temperature"], saved["top_p"], saved["max_new_tokens"]) == (True, 0.2, 0.9, 77)


def test_the_licence_goes_with_every_copy_of_the_weights(tiny_dir, tmp_path):
    """A model's LICENSE (Llama's USE_POLICY.md, a NOTICE) was left behind by every export and by merge:
    the weights went out without the terms they are shared under."""
    from quantkit.trainer import merge, train

    from .conftest import VALID

    model = shutil.copytree(tiny_dir, tmp_path / "model")
    terms = {name: f"the terms of {name}\n" for name in ("LICENSE", "USE_POLICY.md", "NOTICE.txt")}
    for name, text in terms.items():
        (model / name).write_text(text)
    (tmp_path / "train.txt").write_text(VALID.read_text()[:5000])
    train(str(model), data=tmp_path / "train.txt", out=tmp_path / "adapter", steps=1, seqlen=32, batch_size=2, rank=4,
          eval_fraction=0, progress=False)
    merge(tmp_path / "adapter", tmp_path / "merged", progress=False)
    for fmt in ("safetensors", "compressed-tensors"):
        quantkit.quantize(str(model), method="rtn", group_size=32, out=tmp_path / fmt, format=fmt, progress=False)
    for out in ("merged", "safetensors", "compressed-tensors"):
        assert {name: (tmp_path / out / name).read_text() for name in terms} == terms, out


def test_the_model_card_names_the_base_and_keeps_its_licence(tiny_dir, tmp_path):
    """Exports had no model card: uploaded to the Hub, one was not linked to the model it quantizes, nor
    under the base's licence. The card's metadata, as huggingface_hub reads it, names the base where
    its path does (the Hub's cache) and, read back and exported again, where the source's card does.
    A GGUF file holds the licence too, and the model's name, not its revision's (the snapshot's directory)."""
    import gguf
    from huggingface_hub import ModelCard

    model = shutil.copytree(tiny_dir, tmp_path / "hub" / "models--org--tiny-1.5B" / "snapshots" / "0a1b")
    (model / "README.md").write_text("---\nlicense: other\nlicense_name: tiny-terms\nlicense_link: LICENSE\n"
                                     "pipeline_tag: text-generation\n---\n\n# tiny\n\nThe base's own claims.\n")
    quantkit.quantize(str(model), method="rtn", group_size=32, out=tmp_path / "q", progress=False)
    quantkit.quantize(str(model), method="nf4", out=tmp_path / "nf4", progress=False)
    quantkit.export(quantkit.load(tmp_path / "q"), tmp_path / "ct", format="compressed-tensors")
    quantkit.quantize(str(model), method="rtn", format="gguf", gguf_type="Q8_0", out=tmp_path / "m.gguf", progress=False)
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    assert (fields["general.name"].contents(), fields["general.license"].contents()) == ("tiny-1.5B", "other")
    for out, layout in (("q", "gptq"), ("nf4", "bitsandbytes"), ("ct", "compressed-tensors")):
        card = ModelCard.load(tmp_path / out / "README.md")
        assert (card.data.base_model, card.data.base_model_relation) == ("org/tiny-1.5B", "quantized"), out
        assert (card.data.license, card.data.license_name, card.data.license_link) == ("other", "tiny-terms", "LICENSE")
        assert layout in card.data.tags and "claims" not in card.text
    quantkit.quantize(str(tiny_dir), method="rtn", group_size=32, out=tmp_path / "local", progress=False)
    card = ModelCard.load(tmp_path / "local" / "README.md")  # a directory of no known name: no base claimed
    assert card.data.base_model is None and card.data.license is None and "quantkit" in card.data.tags


def test_config_holds_what_save_pretrained_writes(tiny_dir, tmp_path):
    """config.json is the source's, as save_pretrained writes it, plus the quantization: not the
    user's local path to the source (_name_or_path) nor transformers' defaults for every model."""
    from transformers import AutoConfig

    quantkit.quantize(str(tiny_dir), method="rtn", group_size=32, out=tmp_path / "q", progress=False)
    AutoConfig.from_pretrained(tiny_dir).save_pretrained(tmp_path / "plain")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    plain = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert str(tiny_dir) not in json.dumps(cfg)
    assert set(cfg) - set(plain) <= {"quantization_config", "rope_theta", "rope_scaling"}


LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("rope,scaling", [({"rope_type": "default", "rope_theta": 100000.0}, None),
                                          (LLAMA3, {k: v for k, v in LLAMA3.items() if k != "rope_theta"})])
def test_the_rope_is_where_older_loaders_read_it(tmp_path, rope, scaling):
    """transformers 5 writes the rope as rope_parameters only; ExLlamaV2 (config.py) and loaders on
    transformers 4 read rope_theta and rope_scaling, and without them ran a base of 10000: every
    SmolLM2, Llama 3 and Qwen export was read with the wrong rope."""
    from transformers import AutoConfig

    src = make_tiny(tmp_path / "src", rope_parameters=rope)
    quantkit.quantize(str(src), method="rtn", group_size=32, out=tmp_path / "q", progress=False)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["rope_theta"] == rope["rope_theta"] and cfg.get("rope_scaling") == scaling
    assert "type" not in (cfg.get("rope_scaling") or {})  # ExLlamaV2 refuses both type and rope_type
    assert AutoConfig.from_pretrained(tmp_path / "q").rope_parameters == AutoConfig.from_pretrained(src).rope_parameters


def test_vllm_finds_the_fused_linears_settings_in_dynamic(tiny_dir, tmp_path):
    """vLLM matches `dynamic` against qkv_proj and gate_up_proj: they get the settings their parts have."""
    (tmp_path / "r.json").write_text(json.dumps(RULES))
    m = quantkit.quantize(str(tiny_dir), bits=4, group_size=32, rules=str(tmp_path / "r.json"), out=tmp_path / "q",
                          keep=True, progress=False)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    names = [n for n, _, _ in linear_shapes(m.module)]
    want = settings(m.qconfig, names)
    for fused, parts in fused_names(len(m.module.model.layers)).items():
        d = vllm_dynamic(qc["dynamic"], fused)
        got = None if d is False else (d.get("bits", qc["bits"]), d.get("group_size", qc["group_size"]))
        assert {want[p] for p in parts} == {got}, fused
    for n in names:  # the parts as before
        d = vllm_dynamic(qc["dynamic"], n)
        assert (None if d is False else (d.get("bits", qc["bits"]), d.get("group_size", qc["group_size"]))) == want[n]


def vllm_target(name: str, cls: str, targets: list[str]) -> str | None:
    """vLLM's compressed_tensors.utils.find_matched_target: the layer's name exactly or by "re:", then
    its class name containing a target, then (a fused layer) the target of all its parts."""
    def hit(value, contains=False):
        return next((t for t in targets if (re.match(t[3:], value) if t.startswith("re:") else
                                            t.lower() in value.lower() if contains else t == value)), None)

    return hit(name) or hit(cls, True)


@pytest.mark.parametrize("rules", [[{"match": r"layers\.1\.mlp\.(gate|up)_proj", "bits": 8}],
                                   [{"match": r"self_attn\.[qkv]_proj", "group_size": 64}]])
def test_vllm_finds_the_fused_linears_config_group(tiny_dir, tmp_path, rules):
    """vLLM's QKVParallelLinear and MergedColumnParallelLinear contain "Linear": the config group
    targeting the parts by name must also name the fused linear, or the run's group takes it."""
    (tmp_path / "r.json").write_text(json.dumps(rules))
    m = quantkit.quantize(str(tiny_dir), bits=4, group_size=32, rules=str(tmp_path / "r.json"), out=tmp_path / "q",
                          format="compressed-tensors", keep=True, progress=False)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    by_target = {t: g["weights"] for g in qc["config_groups"].values() for t in g["targets"]}
    want = settings(m.qconfig, [n for n, _, _ in linear_shapes(m.module)])
    classes = {"self_attn.qkv_proj": "QKVParallelLinear", "mlp.gate_up_proj": "MergedColumnParallelLinear"}
    for fused, parts in fused_names(len(m.module.model.layers)).items():
        w = by_target[vllm_target(fused, classes[fused.split(".", 3)[3]], list(by_target))]
        assert {want[p] for p in parts} == {(w["num_bits"], w["group_size"] or -1)}, fused
    back = quantkit.load(tmp_path / "q")  # our reader resolves the pattern as before
    assert {n: (qt.bits, qt.group_size) for n, qt in back.tensors.items()} == \
        {n: (qt.bits, qt.group_size) for n, qt in m.tensors.items()}
