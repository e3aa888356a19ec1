"""Per-layer mixed precision (--rules): each linear gets the settings of the first rule whose pattern
its name holds, or stays in float; the GPTQ layout says so in GPTQModel's and vLLM's `dynamic`, the
compressed-tensors layout in config groups that the compressed-tensors package and transformers
resolve to the same linears; both read back as written."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file

import quantkit
from quantkit import consumers
from quantkit.config import QuantConfig
from quantkit.errors import QuantkitError
from quantkit.layers import linear_shapes
from quantkit.rules import Rule, check, parse, read

from .conftest import VALID, loaded, refused

# the first pattern sorts after the third: a file that sorted `dynamic` would give layer 0's down_proj the third's
RULES = [{"match": r"model\.layers\.0\.mlp\.down_proj", "bits": 8, "group_size": 32},
         {"match": r"layers\.1\.self_attn\.o_proj", "skip": True},
         {"match": r"mlp\.down_proj", "group_size": 32},  # layer 0's took the first rule
         {"match": r"layers\.1\.mlp\.(gate|up)_proj", "bits": 8}]


def settings(config: QuantConfig, names) -> dict:
    return {n: (c.bits, c.group_size) if (c := config.for_linear(n)) else None for n in names}


def test_the_first_matching_rule_decides():
    c = QuantConfig(method="rtn", bits=4, group_size=64, rules=parse(RULES, "test"))
    got = settings(c, ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.down_proj",
                       "model.layers.1.mlp.up_proj", "model.layers.0.self_attn.q_proj"])
    assert got == {"model.layers.0.mlp.down_proj": (8, 32), "model.layers.1.self_attn.o_proj": None,
                   "model.layers.1.mlp.down_proj": (4, 32), "model.layers.1.mlp.up_proj": (8, 64),
                   "model.layers.0.self_attn.q_proj": (4, 64)}


def test_yaml_and_json_read_the_same(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps(RULES))
    (tmp_path / "r.yaml").write_text("\n".join(
        f"- match: '{r['match']}'\n" + "".join(f"  {k}: {str(v).lower()}\n" for k, v in r.items() if k != "match")
        for r in RULES))
    assert read(tmp_path / "r.json") == read(tmp_path / "r.yaml") == parse(RULES, "x")
    assert read(tmp_path / "r.json")[1] == Rule(r"layers\.1\.self_attn\.o_proj", skip=True)


@pytest.mark.parametrize("entries,match", [
    ({"match": "x", "bits": 8}, "non-empty list"),
    ([], "non-empty list"),
    (["down_proj"], "not a mapping with a match pattern"),
    ([{"match": "(", "bits": 8}], "not a regular expression"),
    ([{"match": "x", "bits": 5}], "r.json: rule 1: unsupported bit width 5"),
    ([{"match": "x", "bits": "8"}], "whole numbers"),
    ([{"match": "x", "group_size": 0}], "group size 0 is invalid"),
    ([{"match": "x"}], "either skip the linears it matches or give them bits"),
    ([{"match": "x", "skip": True, "bits": 8}], "either skip"),
    ([{"match": "x", "bit": 8}], "unknown key 'bit'"),
])
def test_bad_rules_are_refused(entries, match):
    with pytest.raises(QuantkitError, match=match):
        parse(entries, "r.json")


def test_a_rule_that_decides_no_linear_is_refused():
    """Rule 2 matches only what rule 1 took: it would change nothing, as a typo would."""
    names = [f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("up_proj", "down_proj")]
    check(parse(RULES, "r.json"), [*names, "model.layers.1.self_attn.o_proj"])  # each of these decides some
    shadowed = parse([{"match": r"layers\.0\.", "skip": True}, {"match": r"layers\.0\.mlp", "bits": 8},
                      {"match": "up_proj", "bits": 8}], "r.json")
    with pytest.raises(QuantkitError, match=r"r.json: rule 2 .* decides no linear: rule 1 comes first for "
                                            r"model.layers.0.mlp.up_proj"):
        check(shadowed, names, "r.json")


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rules") / "rules.json"
    path.write_text(json.dumps(RULES))
    return path


def vllm_dynamic(dynamic: dict, name: str):
    """How vLLM and GPTQModel read `dynamic` (their documented semantics): in the dict's order, the
    first pattern that re.match-es the module name; "-:" excludes the module, "+:" overrides."""
    for pattern, overrides in dynamic.items():
        if re.match(pattern.removeprefix("-:").removeprefix("+:"), name):
            return False if pattern.startswith("-:") else overrides
    return {}


def gptqmodel_dynamic(dynamic: dict, name: str):
    """GPTQModel's reading: its QuantizeConfig moves every "-:" pattern first, then as vLLM."""
    return vllm_dynamic({k: v for k, v in dynamic.items() if k.startswith("-:")} | dynamic, name)


def test_dynamic_reads_alike_where_a_skip_rule_follows_an_override():
    """A skip rule after an override that takes some of the same linears: GPTQModel, reading its skips first,
    built layer 0's down_proj in float where the file held it packed at 8 bits (vLLM, in order, was right)."""
    from quantkit.exporters.gptq import dynamic
    from quantkit.layers import fused

    config = QuantConfig(bits=4, group_size=64, rules=[{"match": r"layers\.0\.", "bits": 8},
                                                       {"match": "down_proj", "skip": True},
                                                       {"match": r"layers\.1\.mlp\.(gate|up)_proj", "skip": True}])
    names = [f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.q_proj", "self_attn.k_proj",
                                                                  "self_attn.v_proj", "self_attn.o_proj",
                                                                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    d = dynamic(config, names)
    want = settings(config, names)
    assert want["model.layers.0.mlp.down_proj"] == (8, 64) and want["model.layers.1.mlp.down_proj"] is None
    for reader in (vllm_dynamic, gptqmodel_dynamic):
        for n in names:
            got = reader(d, n)
            assert (None if got is False else (got.get("bits", 4), got.get("group_size", 64))) == want[n], (reader, n)
        assert "model.layers.1.mlp.gate_up_proj" in fused(names)  # vLLM's name for them: its parts are in float
        assert reader(d, "model.layers.1.mlp.gate_up_proj") is False, reader


@pytest.mark.parametrize("rules", [[{"match": r"layers\.0\.", "skip": True}],
                                   [{"match": r"layers\.0\.", "skip": True}, {"match": "self_attn|mlp", "bits": 8}]])
def test_dynamic_leaves_a_fused_linear_in_float_where_a_skip_rule_also_matches_its_name(rules):
    """A skip rule that matches the fused name too (a whole layer in float): both sides of quantkit's reading
    were None, so the fused name was not written, and vLLM, matching qkv_proj against the parts' exact
    names, built it packed at the base settings (or a later rule's) over float tensors."""
    from quantkit.exporters.gptq import dynamic
    from quantkit.layers import fused

    config = QuantConfig(bits=4, group_size=64, rules=rules)
    names = [f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.q_proj", "self_attn.k_proj",
                                                                  "self_attn.v_proj", "self_attn.o_proj",
                                                                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    d = dynamic(config, names)
    want = settings(config, names)
    groups = fused(names)
    assert set(groups) == {f"model.layers.{i}.{f}" for i in range(2) for f in ("self_attn.qkv_proj", "mlp.gate_up_proj")}
    for reader in (vllm_dynamic, gptqmodel_dynamic):
        for name, parts in groups.items():
            got = reader(d, name)
            part = want[parts[0]]
            assert (None if got is False else (got.get("bits", 4), got.get("group_size", 64))) == part, (reader, name)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_gptq_layout_holds_each_linears_settings(tiny_dir, rules_file, tmp_path, method):
    original = loaded(tiny_dir)
    kw = {"calib_data": VALID, "calib_samples": 4, "calib_seqlen": 64} if method == "gptq" else {}
    m = quantkit.quantize(str(tiny_dir), method=method, bits=4, group_size=64, rules=str(rules_file), out=tmp_path / "q",
                          keep=True, progress=False, **kw)
    names = [n for n, _, _ in linear_shapes(m.module)]
    want = settings(m.qconfig, names)
    assert {n: (qt.bits, qt.group_size) for n, qt in m.tensors.items()} == {n: s for n, s in want.items() if s}
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    for n, s in want.items():  # the file's dynamic, read as vLLM reads it, gives each linear its settings
        d = vllm_dynamic(qc["dynamic"], n)
        assert (None if d is False else (d.get("bits", qc["bits"]), d.get("group_size", qc["group_size"]))) == s, n
    state = load_file(tmp_path / "q" / "model.safetensors")
    skipped = "model.layers.1.self_attn.o_proj"
    assert f"{skipped}.qweight" not in state and torch.equal(
        state[f"{skipped}.weight"], original.module.get_submodule(skipped).weight.half())
    back = quantkit.load(tmp_path / "q")
    for n, qt in m.tensors.items():
        assert torch.equal(back.tensors[n].dequantize(), qt.dequantize()), n
    assert back.qconfig.rules == m.qconfig.rules


def test_compressed_tensors_groups_resolve_as_the_rules(tiny_dir, rules_file, tmp_path):
    """transformers loads the directory compressed, through the compressed-tensors package: each
    linear gets the config group the rules gave it (found by exact name before the Linear class) and
    decompresses to our weights; the skipped one is the float weight. (Its dequantize-at-load path
    takes the first group for every linear, so the consumer table says it refuses mixed settings.)"""
    from compressed_tensors.compressors import decompress_module
    from transformers import AutoModelForCausalLM

    original = loaded(tiny_dir)
    m = quantkit.quantize(str(tiny_dir), method="rtn", bits=4, group_size=64, rules=str(rules_file),
                          out=tmp_path / "q", format="compressed-tensors", keep=True, progress=False)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    for n, s in settings(m.qconfig, [n for n, _, _ in linear_shapes(m.module)]).items():
        module = theirs.get_submodule(n)
        if s is None:
            assert getattr(module, "quantization_scheme", None) is None, n
            assert torch.equal(module.weight, original.module.get_submodule(n).weight.half()), n
            continue
        w = module.quantization_scheme.weights
        assert (w.num_bits, w.group_size) == s == (m.tensors[n].bits, m.tensors[n].group_size), n
        decompress_module(module)
        assert torch.equal(module.weight, m.tensors[n].dequantize().half()), n
    back = quantkit.load(tmp_path / "q")
    assert {n: (qt.bits, qt.group_size) for n, qt in back.tensors.items()} == \
        {n: (qt.bits, qt.group_size) for n, qt in m.tensors.items()}
    assert settings(back.qconfig, list(m.tensors)) == settings(m.qconfig, list(m.tensors))


def test_consumers_see_every_setting(tiny_dir):
    """--for judges each setting the rules give: a 3-bit rule keeps vLLM's gptq kernel; through
    transformers, GPTQModel's kernels lose any rule (transformers drops `dynamic`); q/k/v at different settings lose vLLM (it loads them as one linear);
    mixed compressed-tensors settings lose transformers' dequantize-at-load path, not its compressed one."""
    module = quantkit.load(tiny_dir).module

    def verdicts(fmt, config):
        return dict((c.name, why) for c, why in consumers.verdicts(consumers.Export.of(fmt, config, module)))

    four = QuantConfig(method="rtn", bits=4, group_size=32)
    three = QuantConfig(method="rtn", bits=4, group_size=32, rules=parse([{"match": "down_proj", "bits": 3}], "r"))
    assert verdicts("safetensors", four)["GPTQModel default CPU kernel"] is None
    assert verdicts("safetensors", three)["GPTQModel default CPU kernel"].startswith("per-linear settings")
    consumers.check_targets(consumers.Export.of("safetensors", three, module), ("vllm",))  # its gptq kernel: 3 bits
    eight = QuantConfig(method="rtn", bits=4, group_size=32, rules=parse([{"match": "down_proj", "bits": 8}], "r"))
    ct = verdicts("compressed-tensors", eight)
    assert ct["transformers + compressed-tensors (dequantized at load)"].startswith("2 settings in one file")
    assert ct["transformers + compressed-tensors (compressed)"] is None
    assert verdicts("compressed-tensors", four)["transformers + compressed-tensors (dequantized at load)"] is None
    split = QuantConfig(method="rtn", bits=4, group_size=32, rules=parse([{"match": "k_proj", "bits": 8}], "r"))
    with pytest.raises(QuantkitError, match=r"vllm cannot load.*self_attn.q_proj / .*k_proj / .*v_proj at different"):
        consumers.check_targets(consumers.Export.of("safetensors", split, module), ("vllm",))


@pytest.mark.parametrize("args,rules,match", [
    (["--format", "gguf"], RULES, "for GGUF use --tensor-type"),
    (["--format", "awq", "--method", "rtn"], RULES, "quantkit writes one in the awq layout"),
    (["--method", "nf4"], RULES, "RTN and GPTQ grids"),
    ([], [{"match": "layers\\.7\\.", "bits": 8}], "rule 1 ('layers\\\\.7\\\\.') matches no linear"),
    # what a rule set is changed in the rule: the advice named the option, already given
    (["--format", "compressed-tensors", "--group-size", "32"], [{"match": "down_proj", "bits": 3}],
     "4 or 8 bits, not 3 (model.layers.0.mlp.down_proj): change rule 1 of --rules (match 'down_proj'), or --format "
     "safetensors"),
    (["--format", "compressed-tensors", "--group-size", "32"], [{"match": "down_proj", "group_size": 48}],
     "model.layers.0.mlp.down_proj has 128 inputs, not a multiple of the group size 48, which compressed-tensors "
     "requires: change rule 1 of --rules (match 'down_proj')"),
    (["--format", "compressed-tensors", "--group-size", "32", "--asym"], [{"match": "down_proj", "bits": 8}],
     "asymmetric compressed-tensors weights as 4-bit only (model.layers.0.mlp.down_proj): change rule 1 of --rules "
     "(match 'down_proj'), or symmetric weights"),
    (["--format", "compressed-tensors", "--group-size", "48"], [{"match": "down_proj", "bits": 8}],
     "has 64 inputs, not a multiple of the group size 48, which compressed-tensors requires: use --group-size 64"),
])
def test_what_rules_cannot_do_is_refused(tiny_dir, tmp_path, capsys, monkeypatch, args, rules, match):
    (tmp_path / "r.json").write_text(json.dumps(rules))
    refused(["quantize", tiny_dir, "--out", tmp_path / "q", "--rules", tmp_path / "r.json", *args], capsys, monkeypatch,
            match)
    assert not (tmp_path / "q").exists()


def test_out_replaced_with_overwrite_does_not_take_the_rules_file(tiny_dir, tmp_path, capsys, monkeypatch):
    """--rules q/rules.json --out q --overwrite deleted the rules with the old export they sat beside."""
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text("{}")  # an export, which --overwrite replaces
    rules = tmp_path / "q" / "rules.json"
    rules.write_text(json.dumps([{"match": "down_proj", "bits": 8}]))
    refused(["quantize", tiny_dir, "--rules", rules, "--out", tmp_path / "q", "--overwrite"], capsys, monkeypatch,
            "holds " + str(rules) + ", which this command reads")
    with pytest.raises(QuantkitError, match="which this command reads"):
        quantkit.quantize(str(tiny_dir), rules=str(rules), out=tmp_path / "q", overwrite=True, progress=False)
    assert rules.is_file()
