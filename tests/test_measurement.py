"""Measured mixed precision (quantkit.measurement) and --target-bpw: the Fisher weights are the loss's
gradients as autograd gives them for the whole model; a unit's measured error is the weighted error
of its block's output; a --target-bpw export gives each group of linears sharing an input one grid of
the candidates, stays within the target as its bytes count it, and its measurement serves other
targets; in GGUF, each linear gets a block type as llama-quantize's --tensor-type would write it;
bad input is refused."""
import json
import os
import re

import gguf
import pytest
import torch
from safetensors.torch import load_file

import quantkit
from quantkit import calibration, measurement
from quantkit.api import quantizer
from quantkit.config import QuantConfig
from quantkit.errors import QuantkitError, ResumableError
from quantkit.exporters.gptq import override
from quantkit.measurement import GGUF_TYPES, GRIDS, Grid
from quantkit.quantizers import rtn

from .conftest import TEST, VALID, gguf_tensors, loaded, refused

CALIB = dict(calib_data=VALID, calib_samples=16, calib_seqlen=64)


@pytest.fixture(scope="module")
def windows(tiny_dir):
    m = quantkit.load(str(tiny_dir))
    return calibration.sample_windows(m.tokenizer, calibration.load_text(VALID), 16, 64, 0)


def test_the_weights_are_the_gradients_of_the_loss(tiny_dir, windows):
    """fisher streams the layers forward and then backward in batches of 2; autograd through the whole
    model on the first 8 windows at once gives the same mean squared gradient at every block's output."""
    m = loaded(str(tiny_dir))
    outputs = {}

    def keep(name):
        def hook(module, args, out):
            out = out[0] if isinstance(out, tuple) else out
            out.retain_grad()
            outputs[name] = out
        return hook

    for i, layer in enumerate(m.layers):
        layer.self_attn.register_forward_hook(keep(f"model.layers.{i}.self_attn"))
        layer.mlp.register_forward_hook(keep(f"model.layers.{i}.mlp"))
    x = windows[:measurement.FISHER_WINDOWS]
    logits = m.module(x, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="sum").backward()
    expected = {name: out.grad.double().square().sum((0, 1)) / x.numel() for name, out in outputs.items()}
    got = measurement.fisher(quantkit.load(str(tiny_dir)), windows, torch.device("cpu"), progress=False)
    assert got.keys() == expected.keys()
    for name, f in got.items():
        assert f.dtype == torch.float64 and f.shape == (64,) and bool((f > 0).all()), name
        torch.testing.assert_close(f, expected[name], rtol=1e-4, atol=0, msg=name)


def test_a_units_error_is_its_blocks_weighted_output_error(tiny_dir):
    """measure_layer against a direct computation: the MLP of layer 0 with its three linears by GPTQ
    at 3 bits (EXL2's unit, the block), or down_proj alone (--target-bpw's unit), run on the float
    hidden state after attention, against the float MLP, each channel's squared error times its
    weight."""
    torch.manual_seed(0)
    m = loaded(str(tiny_dir))
    layer = m.module.model.layers[0].float()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(2, 16, layer.mlp.gate_proj.in_features)
    pos = torch.arange(16)[None].expand(2, -1)
    kw = {"position_embeddings": m.module.model.rotary_emb(x, pos), "attention_mask": None}
    names = measurement.BLOCKS["self_attn"] + measurement.BLOCKS["mlp"]

    class H:  # a Hessian as the pipeline hands it over
        def __init__(self, v):
            self.m, self.count = 2 * v.T @ v / len(v), len(v)

        def matrix(self):
            return self.m

    hessians = {name: H(torch.randn(64, layer.get_submodule(name).in_features)) for name in names}
    core = quantizer(QuantConfig(method="gptq", bits=3, group_size=32), {})
    weights = torch.rand(2, 64, dtype=torch.float64)
    blocks = measurement.measure_layer(layer, [(x, kw)], hessians, [core], weights, measurement.BLOCK_UNITS)
    groups = measurement.measure_layer(layer, [(x, kw)], hessians, [core], weights, measurement.GROUP_UNITS)
    assert blocks.shape == (1, 2, 1) and groups.shape == (1, 4, 1)
    linear = torch.nn.functional.linear
    with torch.no_grad():
        h = x + layer.self_attn(hidden_states=layer.input_layernorm(x), **kw)[0]
        hn = layer.post_attention_layernorm(h)
        ref = layer.mlp(hn)
        mlp = {name: layer.get_submodule(name).weight.data for name in measurement.BLOCKS["mlp"]}
        q = {name: core(name, w, hessians[name]).dequantize() for name, w in mlp.items()}
        for got, ws in ((blocks[0, 1, 0], q), (groups[0, 3, 0], {**mlp, "mlp.down_proj": q["mlp.down_proj"]})):
            act = layer.mlp.act_fn(linear(hn, ws["mlp.gate_proj"]))
            out = linear(act * linear(hn, ws["mlp.up_proj"]), ws["mlp.down_proj"])
            assert float(got) == pytest.approx(float(((out - ref).double().square() * weights[1]).sum()), rel=1e-4)
    assert float(groups[0, 3, 0]) < float(blocks[0, 1, 0])
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())  # left float
    # a candidate labelled as an earlier one for a unit's linears (two GGUF types falling back to one) is
    # neither quantized nor run again there; it is where a label differs
    calls, quantized = [], []
    handle = layer.mlp.register_forward_hook(lambda *_: calls.append(1))
    wider = quantizer(QuantConfig(method="gptq", bits=4, group_size=32), {})

    def counted(fn):
        return lambda name, w, h: quantized.append(name) or fn(name, w, h)

    names = [n for unit in measurement.BLOCK_UNITS.values() for n in unit]
    labels = [dict.fromkeys(names, "a"), dict.fromkeys(names, "b"), dict.fromkeys(names, "a")]
    try:
        again = measurement.measure_layer(layer, [(x, kw)], hessians, [counted(core), counted(wider), counted(core)],
                                          weights, measurement.BLOCK_UNITS, labels=labels)
        assert len(calls) == 3  # the float MLP, then one forward per distinct candidate
        assert sorted(quantized) == sorted(names * 2)
        labels[2]["self_attn.o_proj"] = "c"  # the attention's third candidate differs: quantized and run
        calls.clear(), quantized.clear()
        measurement.measure_layer(layer, [(x, kw)], hessians, [counted(core), counted(wider), counted(core)],
                                  weights, measurement.BLOCK_UNITS, labels=labels)
        assert len(calls) == 3 and len(quantized) == 2 * len(names) + len(measurement.BLOCK_UNITS["self_attn"])
    finally:
        handle.remove()
    assert torch.equal(again[..., 0], blocks[..., 0]) and torch.equal(again[..., 2], again[..., 0])
    assert float(again[0, 1, 1]) < float(again[0, 1, 0])  # 4 bits lose less than 3


@pytest.fixture(scope="module")
def targeted(tiny_dir, tmp_path_factory):
    """GPTQ at 3.6 bits per weight of the tiny model, its measurement saved."""
    root = tmp_path_factory.mktemp("target")
    m = quantkit.quantize(str(tiny_dir), method="gptq", target_bpw=3.6, measurement=str(root / "m.json"), **CALIB,
                          out=root / "q", keep=True, progress=False)
    return m, root


def settings_of(m) -> dict[str, Grid]:
    return {name: Grid(qt.bits, qt.group_size) for name, qt in m.tensors.items()}


def test_each_group_gets_one_grid_within_the_target(targeted):
    """q/k/v and gate/up share a grid, one of GRIDS; the grids differ between groups; each linear's
    tensors in the file hold Grid.total_bits, and all of them at most the target."""
    m, root = targeted
    grids = settings_of(m)
    assert set(grids.values()) <= set(GRIDS) and len(set(grids.values())) > 1
    qc = json.loads((root / "q" / "config.json").read_text())["quantization_config"]
    for i in range(2):
        for group, fused in ((("q_proj", "k_proj", "v_proj"), "self_attn.qkv_proj"), (("gate_proj", "up_proj"), "mlp.gate_up_proj")):
            names = [f"model.layers.{i}.{fused.split('.')[0]}.{name}" for name in group]
            assert len({grids[name] for name in names}) == 1
            # vLLM matches `dynamic` against the one linear it fuses them into
            g = grids[names[0]]
            settings = override(qc, f"model.layers.{i}.{fused}")
            assert (settings["bits"], settings["group_size"]) == (g.bits, g.group_size)
    state = load_file(root / "q" / "model.safetensors")
    total = weights = 0
    for name, qt in m.tensors.items():
        n, k = qt.shape
        stored = sum(state[f"{name}.{p}"].numel() * state[f"{name}.{p}"].element_size() * 8
                     for p in ("qweight", "qzeros", "scales", "g_idx"))
        assert stored == grids[name].total_bits(n, k), name
        total, weights = total + stored, weights + n * k
    assert 3.3 < total / weights <= 3.6
    back = quantkit.load(root / "q")
    for name, qt in m.tensors.items():
        assert torch.equal(back.tensors[name].dequantize(), qt.dequantize()), name
    ours = quantkit.evaluate(m, TEST, max_windows=2, ctx=64, progress=False).perplexity
    assert quantkit.evaluate(root / "q", TEST, max_windows=2, ctx=64, progress=False).perplexity == \
        pytest.approx(ours, rel=1e-3)


def test_the_measurement_serves_other_targets(tiny_dir, targeted, monkeypatch):
    """Read back, the measurement spends a wider target on more bits and a smaller summed error, and
    none measures again; the units' errors fall as the grid widens."""
    _, root = targeted
    monkeypatch.setattr(measurement, "measure_layer", None)  # a call would fail
    monkeypatch.setattr(measurement, "fisher", None)
    body = json.loads((root / "m.json").read_text())
    assert body["candidates"] == [{"bits": g.bits, "group_size": g.group_size} for g in GRIDS]
    assert list(body["units"]) == [f"model.layers.{i}.{u}" for i in range(2) for u in measurement.GROUP_UNITS]
    for name, entry in body["units"].items():
        e = entry["errors"]
        assert e[0] > e[1] > e[4] > e[7] > 0 and e[7] < 1e-3 * e[0], name  # 2, 3, 4 and 8 bits
    spent = []
    for target in (3.2, 4.4, 8.0):
        m = quantkit.quantize(str(tiny_dir), method="gptq", target_bpw=target, measurement=str(root / "m.json"),
                              **CALIB, keep=True, progress=False)
        grids = settings_of(m)
        bits = sum(grids[name].total_bits(*qt.shape) for name, qt in m.tensors.items())
        error = sum(body["units"][measurement.unit_of(name, measurement.GROUP_UNITS)]["errors"][GRIDS.index(grid)]
                    for name, grid in grids.items() if name.endswith(("q_proj", "o_proj", "gate_proj", "down_proj")))
        spent.append((bits, error))
    assert spent[0][0] < spent[1][0] < spent[2][0] and spent[0][1] > spent[1][1] > spent[2][1]


def test_a_measurement_of_other_settings_is_refused(tiny_dir, targeted, tmp_path, capsys, monkeypatch):
    """The GPTQ measurement read by an RTN run: the same candidates, another quantizer."""
    _, root = targeted
    refused(["quantize", str(tiny_dir), "--method", "rtn", "--target-bpw", "4", "--calib-data", str(VALID),
             "--calib-samples", "16", "--calib-seqlen", "64", "--measurement", str(root / "m.json"),
             "--out", str(tmp_path / "q")], capsys, monkeypatch, "another model, calibration or quantizer settings")
    assert not (tmp_path / "q").exists()


def test_a_measurement_inside_out_is_refused_before_measuring(tiny_dir, tmp_path, capsys, monkeypatch):
    """--measurement OUT/m.json: the run measured (minutes to hours), then found OUT there (written by its own
    measurement) and refused; with --overwrite of an export holding the measurement the run read, the
    replaced directory took the measurement with it. Refused at once, as --calib-data inside --out is."""
    out = tmp_path / "q"
    args = ["quantize", str(tiny_dir), "--method", "rtn", "--target-bpw", "4", "--calib-data", str(VALID),
            "--calib-samples", "16", "--calib-seqlen", "64", "--out", str(out)]
    for made in (False, True):
        if made:
            out.mkdir()
        refused([*args, "--measurement", str(out / "m.json")], capsys, monkeypatch,
                f"--out {out} holds {out / 'm.json'}, which this command reads")
    monkeypatch.setattr(measurement, "fisher", lambda *a, **k: pytest.fail("measured"))
    refused([*args, "--measurement", str(out / "m.json"), "--overwrite"], capsys, monkeypatch, "which this command reads")
    with pytest.raises(QuantkitError, match="which this command reads"):
        quantkit.quantize(str(tiny_dir), method="rtn", target_bpw=4, measurement=out / "m.json", **CALIB, out=out,
                          progress=False)
    assert list(out.iterdir()) == []


def test_consumers_are_asked_of_the_candidates_before_measuring(tiny_dir, tmp_path, monkeypatch):
    """--target-bpw --for vllm was refused for the base grid (groups of 128 across the tiny model's 64 inputs),
    which the target never uses and --group-size cannot change there; a loader that takes no mix of grids
    (transformers' GPTQConfig) was named only after the measurement."""
    class Measuring(Exception):
        pass

    def fisher(*args, **kwargs):
        raise Measuring

    monkeypatch.setattr(measurement, "fisher", fisher)
    with pytest.raises(Measuring):
        quantkit.quantize(str(tiny_dir), method="rtn", target_bpw=4.5, targets=("vllm",), **CALIB, out=tmp_path / "q",
                          progress=False)
    with pytest.raises(QuantkitError, match="vllm does not read the gguf format"):  # GGUF: asked after it
        quantkit.quantize(str(tiny_dir), method="rtn", format="gguf", target_bpw=4.5, targets=("vllm",), **CALIB,
                          out=tmp_path / "q.gguf", progress=False)
    with pytest.raises(QuantkitError, match="target_bpw gives each group of linears its own grid, and transformers "
                                            "cannot load this export: .* refuses per-linear settings .*: drop "
                                            "target_bpw for one bits and group_size, or drop targets"):
        quantkit.quantize(str(tiny_dir), method="rtn", target_bpw=4.5, targets=("transformers",), **CALIB,
                          out=tmp_path / "q", progress=False)


def test_rtn_spends_the_target_on_plain_rounding(tiny_dir, tmp_path):
    """RTN's measurement needs calibration; its export does not: each linear is RTN of its grid."""
    m = quantkit.quantize(str(tiny_dir), method="rtn", target_bpw=3.6, **CALIB, keep=True, progress=False)
    grids = settings_of(m)
    assert len(set(grids.values())) > 1
    float_model = loaded(str(tiny_dir))
    for name, qt in m.tensors.items():
        w = float_model.module.get_submodule(name).weight.data
        expected = rtn.quantize(w, grids[name].bits, grids[name].group_size, True, False)
        assert torch.equal(qt.dequantize(), expected.dequantize()), name


def test_only_the_grids_a_format_takes_are_measured(tiny_dir):
    """compressed-tensors packs 4 and 8 bits in groups that divide the inputs (64 for q/k/v, o and
    gate/up of the tiny model); the GPTQ layout takes every grid."""
    from quantkit.api import grids

    m = quantkit.load(str(tiny_dir))
    config = QuantConfig(method="gptq", target_bpw=5.0)
    assert grids(m, config, "safetensors", ()) == GRIDS
    assert grids(m, config, "compressed-tensors", ()) == tuple(g for g in GRIDS if g.bits in (4, 8) and 64 % g.group_size == 0)


def test_an_older_measurement_is_refused(tiny_dir, tmp_path, capsys, monkeypatch):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "quantkit-exl2-measurement/2", "blocks": {}}))
    refused(["quantize", str(tiny_dir), "--method", "gptq", "--target-bpw", "4", "--calib-data", str(VALID),
             "--calib-samples", "16", "--calib-seqlen", "64", "--measurement", str(old), "--out", str(tmp_path / "q")],
            capsys, monkeypatch, "measured by an older quantkit")


def gguf_linears(path) -> dict[str, tuple[str, int, int]]:
    """Each decoder linear's (type, bytes, weights) in a GGUF file."""
    return {t.name: (t.tensor_type.name, int(t.n_bytes), int(t.n_elements)) for t in gguf.GGUFReader(path).tensors
            if t.name.startswith("blk.") and len(t.shape) == 2}


@pytest.mark.slow
def test_gguf_target_types_each_linear_as_llama_quantize_would(tiny256, tmp_path, monkeypatch):
    """In GGUF, --target-bpw gives each linear one of GGUF_TYPES within the target, as --tensor-type
    overrides of the mix: llama-quantize given the same overrides writes the same bytes from our F32
    file. The saved measurement serves a wider target, on more bits, without measuring again."""
    from . import llamacpp

    spent = []
    for target in (3.5, 5.0):
        m = quantkit.quantize(str(tiny256), method="rtn", format="gguf", target_bpw=target,
                              measurement=str(tmp_path / "m.json"), **CALIB, out=tmp_path / f"{target}.gguf",
                              progress=False)
        ours = gguf_linears(tmp_path / f"{target}.gguf")
        assert {t for t, _, _ in ours.values()} <= {t.type for t in GGUF_TYPES}
        assert len(m.qconfig.tensor_type) == len(ours) == 14
        spent.append(sum(8 * b for _, b, _ in ours.values()) / sum(n for _, _, n in ours.values()))
        monkeypatch.setattr(measurement, "measure_layer", None)  # the second target reads the file
        monkeypatch.setattr(measurement, "fisher", None)
    assert 3.3 < spent[0] <= 3.5 and 4.8 < spent[1] <= 5.0
    quantkit.api.export_gguf(quantkit.load(tiny256), tmp_path / "f32.gguf", "F32", progress=False)
    llamacpp.quantize(tmp_path / "f32.gguf", tmp_path / "theirs.gguf", "Q4_K_M",
                      *[a for o in m.qconfig.tensor_type for a in ("--tensor-type", o)])
    assert gguf_tensors(tmp_path / "5.0.gguf") == gguf_tensors(tmp_path / "theirs.gguf")


@pytest.mark.slow
def test_gguf_types_are_counted_as_the_rows_take_them(tiny_dir, tmp_path):
    """Rows of 64 and 128 values fill no 256-value block: Q2_K and Q3_K fall back to Q4_0, so the
    lowest reachable target is 4.5 bits; the file holds the fallback types at the bits counted, and
    llama-quantize given the same overrides writes the same bytes."""
    from quantkit.api import grids

    from . import llamacpp

    m = quantkit.load(str(tiny_dir))
    with pytest.raises(QuantkitError, match=r"outside the range of the GGUF types Q2_K to Q8_0.*\(4.500 to 8.500\)"):
        grids(m, QuantConfig(method="rtn", gguf_type="Q4_K_M", target_bpw=4.4), "gguf", ())
    q = quantkit.quantize(str(tiny_dir), method="rtn", format="gguf", target_bpw=5.0, **CALIB, out=tmp_path / "q.gguf",
                          progress=False)
    ours = gguf_linears(tmp_path / "q.gguf")
    assert {t for t, _, _ in ours.values()} <= {"Q4_0", "Q5_0", "Q5_1", "Q8_0"}
    assert 4.5 < sum(8 * b for _, b, _ in ours.values()) / sum(n for _, _, n in ours.values()) <= 5.0
    assert len(q.qconfig.tensor_type) == len(ours)
    assert all(o.endswith(("=Q4_0", "=Q5_0", "=Q5_1", "=Q8_0")) for o in q.qconfig.tensor_type)
    quantkit.api.export_gguf(m, tmp_path / "f32.gguf", "F32", progress=False)
    llamacpp.quantize(tmp_path / "f32.gguf", tmp_path / "theirs.gguf", "Q4_K_M",
                      *[a for o in q.qconfig.tensor_type for a in ("--tensor-type", o)])
    assert gguf_tensors(tmp_path / "q.gguf") == gguf_tensors(tmp_path / "theirs.gguf")


@pytest.mark.parametrize("args,match", [
    (["--method", "gptq", "--target-bpw", "2"], "outside the range of the safetensors format's grids"),
    (["--method", "nf4", "--target-bpw", "4"], "--target-bpw spends bits on RTN and GPTQ grids"),
    (["--method", "gptq", "--target-bpw", "4", "--format", "gguf", "--tensor-type", "attn_v=Q8_0"],
     "writes its own --tensor-type overrides"),
    (["--method", "rtn", "--target-bpw", "4", "--format", "gguf", "--gguf-type", "F16"], "the mix F16 is float"),
    (["--method", "gptq", "--target-bpw", "9", "--format", "gguf"], "outside the range of the GGUF types"),
    (["--method", "gptq", "--target-bpw", "4", "--format", "awq"], "--target-bpw mixes settings per linear"),
    (["--method", "gptq", "--target-bpw", "4", "--format", "exl2", "--bits", "4.0"], "for EXL2 pass the target"),
    (["--method", "gptq", "--target-bpw", "4", "--measurement", "nowhere/m.json"], "no such directory"),
    (["--method", "gptq", "--target-bpw", "3.5", "--format", "compressed-tensors"],
     "outside the range of the compressed-tensors format's grids"),
    (["--method", "gptq", "--target-bpw", "3.6", "--for", "exllama"],
     "outside the range of the safetensors format's grids that exllama loads"),
    # accepted and ignored before (each linear gets the measured grid), yet written as the config's
    (["--method", "rtn", "--target-bpw", "4.5", "--bits", "8"], "--bits does not apply with --target-bpw"),
    (["--method", "rtn", "--target-bpw", "4.5", "--group-size", "32"], "--group-size does not apply with --target-bpw"),
    (["--method", "gptq", "--format", "exl2", "--bits", "4.125", "--group-size", "64"],
     "--group-size does not apply to --format exl2"),
    (["--method", "gptq", "--format", "exl2", "--bits", "4.125", "--act-order"], "does not apply to --format exl2"),
    (["--seed", "-1"], "-1 is not in the range x>=0"),  # Python's random seeds -1 as 1
])
def test_bad_target_input(tiny_dir, tmp_path, capsys, monkeypatch, args, match):
    refused(["quantize", str(tiny_dir), "--out", str(tmp_path / "q"), *args], capsys, monkeypatch, match)
    assert not (tmp_path / "q").exists()


def test_a_killed_measurement_run_again_with_other_candidates_starts_afresh(tiny_dir, tmp_path, monkeypatch, capsys):
    """--for exllama takes fewer grids: a measurement killed with them and run again without resumed into a
    mix of both lists (a traceback, and a saved file of mismatched lists that every later run refused).
    Now it is another run's, refused without overwrite, and measured afresh with it."""
    real, killed = measurement.measure_layer, []

    def dies_in_layer_1(*args, **kwargs):
        if kwargs["prefix"] == "model.layers.1." and not killed:
            killed.append(kwargs["prefix"])
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(measurement, "measure_layer", dies_in_layer_1)
    kw = dict(method="rtn", target_bpw=4.9, measurement=str(tmp_path / "m.json"), out=tmp_path / "q", **CALIB,
              progress=False)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tiny_dir), targets=("exllama",), **kw)
    with pytest.raises(quantkit.QuantkitError, match="holds 1 of 2 layers of another run measuring into"):
        quantkit.quantize(str(tiny_dir), **kw)
    capsys.readouterr()
    quantkit.quantize(str(tiny_dir), overwrite=True, **kw)
    assert "resuming" not in capsys.readouterr().err
    saved = json.loads((tmp_path / "m.json").read_text())
    assert len(saved["candidates"]) > 3 and all(len(u["errors"]) == len(saved["candidates"])
                                                for u in saved["units"].values())


def test_the_output_is_locked_through_the_measurement(tiny_dir, tmp_path, monkeypatch):
    """--out's lock was taken and let go before the measurement: a second run to the same --out measured for as long
    as the first (hours on a real model) and was refused only when it came to write."""
    from quantkit import atomic

    real, seen = measurement.measure_layer, []

    def tries_the_lock(*args, **kwargs):
        try:
            atomic.lock(tmp_path / "q", "out")[1].close()
            seen.append("free")
        except QuantkitError:
            seen.append("held")
        return real(*args, **kwargs)

    monkeypatch.setattr(measurement, "measure_layer", tries_the_lock)
    quantkit.quantize(str(tiny_dir), method="rtn", target_bpw=4.3, out=tmp_path / "q", **CALIB, progress=False)
    assert seen and set(seen) == {"held"}


def test_a_full_disk_in_the_measurement_is_one_line_and_resumes(tiny_dir, tmp_path, monkeypatch, capsys):
    """--target-bpw's measurement ran outside any disk-space handling: a full disk while its progress was
    saved was a bare OSError (a traceback on the command line). Now it names the file and resumes."""
    import errno

    from quantkit import pipeline

    real, saves = pipeline.save_progress, []

    def full(path, state):  # the disk fills while the second layer's progress is saved
        if "progress-measurement" in path.name:
            saves.append(path)
            if len(saves) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, state)

    monkeypatch.setattr(pipeline, "save_progress", full)
    kw = dict(method="rtn", target_bpw=4.3, measurement=str(tmp_path / "m.json"), out=tmp_path / "q", **CALIB,
              progress=False)
    with pytest.raises(ResumableError, match=rf"out of disk space writing {re.escape(str(tmp_path / 'm.json'))}: the "
                                             r"measurement's progress did not fit.*the measurement resumes after its last"):
        quantkit.quantize(str(tiny_dir), **kw)
    capsys.readouterr()
    quantkit.quantize(str(tiny_dir), **kw)
    assert "resuming" in capsys.readouterr().err and (tmp_path / "m.json").is_file()


def test_quantize_without_out_raises_what_stopped_it(tiny_dir, monkeypatch):
    """In memory (no out), every failure of the run became a TypeError from the resume bookkeeping."""
    from quantkit import api

    def stops(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "quantize_layers", stops)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tiny_dir), method="rtn", group_size=32, keep=True, progress=False)
