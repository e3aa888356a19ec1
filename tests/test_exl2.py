"""EXL2: an independent decoder of ExLlamaV2's layout, written from the format's description
(../shared/docs/FORMATS.md section 6, not from our packer), gives our dequantized weights; the
widths mix within a linear and meet the target; quantkit loads and scores the files. The
measurement (quantkit.measurement: each attention and MLP block's output error at each candidate
setting) is saved, reused and refused when it is another run's; the allocation from it is the
knapsack's optimum."""
import itertools
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import quantkit
from quantkit import measurement
from quantkit.quantizers.exl2 import CANDIDATES, Setting, quantize_head

from .conftest import TEST, VALID, make_tiny, measurement_stopped_in_layer_1, refused


def decode(parts: dict[str, torch.Tensor], n: int) -> np.ndarray:
    """W [n, K] from one linear's EXL2 tensors, as ExLlamaV2's loader and kernels read them."""
    qw = parts["q_weight"].numpy().view(np.uint32)
    pairs = parts["q_groups"].numpy().astype(np.int64).reshape(-1, 2)
    q_scale = parts["q_scale"].numpy().view(np.uint32)
    scale_max = parts["q_scale_max"].numpy().astype(np.float16)
    perm = np.argsort(parts["q_invperm"].numpy())  # the loader's q_perm
    n_pad = qw.shape[1]
    rows = []
    for g, (bits, first) in enumerate(pairs):
        last = pairs[g + 1][1] if g + 1 < len(pairs) else qw.shape[0]
        words = np.ascontiguousarray(qw[first:last].T)  # [N_pad, words]: one little-endian stream per column
        stream = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little").reshape(n_pad, -1, bits)
        q = (stream.astype(np.int64) << np.arange(bits)).sum(axis=2)  # [N_pad, rows of the group]
        codes = (q_scale[g][:, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15  # [N_pad/8, 8]
        # the loader divides the maximum by 256 and the kernels multiply in float16
        scale = np.float16(((codes.reshape(-1) + 1) ** 2).astype(np.float16) * np.float16(scale_max[g] / np.float16(256)))
        rows.append(((q - (1 << (bits - 1))) * scale.astype(np.float32)[:, None]).T)
    w_perm = np.concatenate(rows)  # [K, N_pad] rows in the file's order
    w = np.zeros((n_pad, w_perm.shape[0]), dtype=np.float32)
    w[:, perm] = w_perm.T
    return w[:n]


CALIB = dict(calib_data=VALID, calib_samples=16, calib_seqlen=64)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A measurement of the tiny model, for the tests that do not test the measurement itself."""
    return tmp_path_factory.mktemp("measurement") / "measurement.json"


@pytest.fixture(scope="module")
def exported(tiny_dir, measured, tmp_path_factory):
    out = tmp_path_factory.mktemp("exl2") / "q"
    m = quantkit.quantize(str(tiny_dir), method="gptq", format="exl2", exl2=4.0, measurement=str(measured), **CALIB,
                          out=out, keep=True, progress=False)
    return m, out


@pytest.fixture(scope="module")
def uniform(tiny_dir, tmp_path_factory):
    """The default allocation, which mixes two widths in every linear."""
    out = tmp_path_factory.mktemp("exl2-uniform") / "q"
    m = quantkit.quantize(str(tiny_dir), method="gptq", format="exl2", exl2=4.0, **CALIB, out=out, keep=True,
                          progress=False)
    return m, out


@pytest.mark.parametrize("which", ["uniform", "exported"])
def test_independent_decoder_reads_our_weights(which, request):
    m, out = request.getfixturevalue(which)
    state = load_file(out / "model.safetensors")
    mixed = 0
    for name, qt in m.tensors.items():
        parts = {p: state[f"{name}.{p}"] for p in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")}
        assert f"{name}.weight" not in state
        np.testing.assert_array_equal(decode(parts, qt.shape[0]), qt.dequantize().numpy(), err_msg=name)
        pairs = parts["q_groups"].view(-1, 2)
        assert pairs[:, 0].tolist() == sorted(pairs[:, 0].tolist(), reverse=True), name  # widest first
        mixed += len(set(pairs[:, 0].tolist())) > 1
    assert mixed or which == "exported"  # widths mix within linears (the measured ones may not)


def test_bits_per_weight_meet_the_target(exported):
    m, out = exported
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "exl2" and qc["calibration"]["target"] == 4.0
    stored = sum(t.numel() * t.element_size() * 8 for key, t in load_file(out / "model.safetensors").items()
                 if key.rsplit(".", 1)[-1].startswith("q_"))
    weights = sum(qt.codes.numel() for qt in m.tensors.values())
    assert qc["bits"] == pytest.approx(stored / weights, abs=1e-4)
    assert 3.5 < qc["bits"] <= 4.0 and qc["calibration"]["allocation"] == "measured"


def test_without_a_measurement_every_linear_gets_the_targets_widths(uniform):
    m, _ = uniform
    for qt in m.tensors.values():
        n, k = qt.shape
        assert qt.group_bits.tolist() == Setting.for_target(4.0, n, k).group_bits(k)


def test_quantkit_loads_and_scores_the_file(exported):
    m, out = exported
    back = quantkit.load(out)
    for name, qt in m.tensors.items():
        assert torch.equal(back.tensors[name].dequantize(), qt.dequantize()), name
        assert torch.equal(back.module.get_submodule(name).weight, qt.dequantize())
    ours = quantkit.evaluate(m, TEST, max_windows=2, ctx=128, progress=False).perplexity
    # the export keeps the other tensors in float16
    assert quantkit.evaluate(out, TEST, max_windows=2, ctx=128, progress=False).perplexity == pytest.approx(ours, rel=1e-3)


def test_wider_targets_fit_better(tiny_dir, measured, exported, monkeypatch):
    """The same GPTQ onto wider EXL2 grids: the layer loss falls as the target rises. Each run reads
    the measurement the first one saved: none measures again."""
    monkeypatch.setattr(measurement, "measure_layer", None)  # a call would fail
    monkeypatch.setattr(measurement, "fisher", None)
    losses = []
    for target in (3.5, 4.5, 6.0):
        m = quantkit.quantize(str(tiny_dir), method="gptq", format="exl2", exl2=target, measurement=str(measured),
                              **CALIB, keep=True, progress=False)
        losses.append(sum(m.losses.values()))
    assert losses[0] > losses[1] > losses[2]


def test_the_measurement_falls_with_width(measured, exported):
    """Every attention and MLP block of the tiny model is measured; its predicted loss falls as the
    setting widens, from a visible one at 2 bits to almost none at 8."""
    body = json.loads(measured.read_text())
    assert body["candidates"] == measurement.described(CANDIDATES)
    assert list(body["units"]) == [f"model.layers.{i}.{b}" for i in range(2) for b in ("self_attn", "mlp")]
    order = sorted(range(len(CANDIDATES)), key=lambda c: CANDIDATES[c].total_bits(64, 64))
    for name, entry in body["units"].items():
        assert sorted(entry["linears"]) == sorted(f"{name}.{lin.split('.')[1]}"
                                                  for lin in measurement.BLOCKS[name.split(".")[-1]])
        errors = [entry["errors"][c] for c in order]
        assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-3 * errors[0] < errors[0] < 1, name


def width(setting: Setting) -> float:
    """The mean code width of a setting."""
    return sum(b * p for b, p in zip(setting.bits, setting.props))


def brute_force(blocks, errors, target):
    """The least summed error within the budget, over every choice."""
    weights = sum(n * k for shapes in blocks.values() for n, k in shapes)
    return min(sum(errors[b][c] for b, c in zip(blocks, combo))
               for combo in itertools.product(range(len(CANDIDATES)), repeat=len(blocks))
               if sum(CANDIDATES[c].total_bits(*shape) for b, c in zip(blocks, combo) for shape in blocks[b])
               <= target * weights)


def test_the_allocation_is_the_optimum():
    """Random errors falling with width, random blocks of one or two linears of random shapes, and
    random targets: the allocation stays within the budget and its summed error is the least of
    every choice (4 blocks: 11^4 choices)."""
    rng = np.random.default_rng(0)
    for _ in range(12):
        blocks = {f"b{i}": [(int(rng.choice([64, 256])), int(rng.choice([64, 128, 256])))
                            for _ in range(int(rng.integers(1, 3)))] for i in range(4)}
        errors = {}
        for name in blocks:
            slope, scale = rng.uniform(2, 6), rng.uniform(0.01, 2)
            errors[name] = [scale * slope ** -width(c) for c in CANDIDATES]
        target = rng.uniform(2.5, 8)
        chosen = measurement.allocate(blocks, errors, target, CANDIDATES)
        bits = sum(chosen[b].total_bits(*shape) for b in blocks for shape in blocks[b])
        assert bits <= target * sum(n * k for shapes in blocks.values() for n, k in shapes)
        assert sum(errors[b][CANDIDATES.index(chosen[b])] for b in blocks) == pytest.approx(
            brute_force(blocks, errors, target), rel=1e-12)


def test_bits_go_where_they_save_most_error():
    """Two blocks of one shape, one whose error falls steeply with width: at a 4-bit average it
    gets the wider setting."""
    blocks = {"steep": [(256, 256)], "flat": [(256, 256)]}
    errors = {"steep": [4.0 ** -width(c) for c in CANDIDATES], "flat": [0.05 * 1.1 ** -width(c) for c in CANDIDATES]}
    chosen = measurement.allocate(blocks, errors, 4.2, CANDIDATES)
    assert chosen["steep"].total_bits(256, 256) > chosen["flat"].total_bits(256, 256)


def test_outputs_padded_to_32_count_in_the_target(tmp_path):
    """The file pads each linear's outputs to whole 32s, and the widths were chosen on the outputs unpadded: k/v
    of 16 outputs (grouped-query attention with 8-wide heads) were stored at 7.34 bits per weight under a target
    of 5.0, and a measured export came out at 5.30 bits where 5.0 was asked for. Now each linear's least is
    counted with its padding (6.34 bits for a 16 x 32 linear: 5.0 is refused for a uniform export)."""
    from quantkit.exporters.exl2 import PARTS

    model = make_tiny(tmp_path / "m", hidden=32, intermediate=64)  # k/v: 2 heads of 8, 16 outputs
    with pytest.raises(quantkit.QuantkitError, match=r"outside what EXL2 reaches for every linear of this model \(6.344"):
        quantkit.quantize(str(model), method="gptq", format="exl2", exl2=5.0, **CALIB, out=tmp_path / "x",
                          progress=False)
    for measured, target in ((None, 7.0), (tmp_path / "m.json", 5.0)):
        out = tmp_path / ("measured" if measured else "uniform")
        m = quantkit.quantize(str(model), method="gptq", format="exl2", exl2=target, measurement=measured, **CALIB,
                              out=out, keep=True, progress=False)
        tensors = load_file(out / "model.safetensors")
        stored = {name: sum(tensors[f"{name}.{p}"].numel() * tensors[f"{name}.{p}"].element_size() * 8 for p in PARTS)
                  for name in m.tensors}
        weights = {name: qt.shape[0] * qt.shape[1] for name, qt in m.tensors.items()}
        assert any(qt.shape[0] == 16 for qt in m.tensors.values())
        if measured is None:  # each linear within the target
            assert all(stored[name] <= target * weights[name] for name in m.tensors), \
                {name: stored[name] / weights[name] for name in m.tensors}
        assert sum(stored.values()) <= target * sum(weights.values())
        bits = json.loads((out / "config.json").read_text())["quantization_config"]["bits"]
        assert bits == pytest.approx(sum(stored.values()) / sum(weights.values()), abs=1e-4) and bits <= target


def test_a_killed_measurement_resumes(tiny_dir, tmp_path, monkeypatch, capsys):
    """Interrupted in layer 1 of 2: the same command goes on measuring from layer 1, and the
    measurement and export equal an uninterrupted run's; the progress a killed torchrun job left is
    cleared once the measurement is saved."""
    kw = dict(method="gptq", format="exl2", exl2=4.0, **CALIB, progress=False)
    quantkit.quantize(str(tiny_dir), out=tmp_path / "whole", measurement=str(tmp_path / "whole.json"), **kw)
    real, calls, killed = measurement.measure_layer, [], []

    def dies_in_layer_1(*args, **kwargs):
        calls.append(kwargs["prefix"])
        if kwargs["prefix"] == "model.layers.1." and not killed:
            killed.append(kwargs["prefix"])
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(measurement, "measure_layer", dies_in_layer_1)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tiny_dir), out=tmp_path / "q", measurement=str(tmp_path / "q.json"), **kw)
    assert (tmp_path / ".q.json.progress-measurement.pt").is_file() and not (tmp_path / "q.json").exists()
    for stale in (".q.json.progress-measurement-1.pt", ".q.json.progress-measurement-0.pt.tmp-123"):  # a torchrun job's
        (tmp_path / stale).write_bytes(b"killed")
    calls.clear()
    capsys.readouterr()
    quantkit.quantize(str(tiny_dir), out=tmp_path / "q", measurement=str(tmp_path / "q.json"), **kw)
    assert "resuming after layer 1/2" in capsys.readouterr().err
    assert calls and all("layers.1." in c for c in calls)
    whole, resumed = json.loads((tmp_path / "whole.json").read_text()), json.loads((tmp_path / "q.json").read_text())
    assert resumed["units"] == whole["units"]
    assert load_file(tmp_path / "q" / "model.safetensors").keys() == load_file(tmp_path / "whole" / "model.safetensors").keys()
    for key, t in load_file(tmp_path / "q" / "model.safetensors").items():
        assert torch.equal(t, load_file(tmp_path / "whole" / "model.safetensors")[key]), key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "q.json", "whole", "whole.json"]


def test_another_runs_measurement_is_kept_until_overwrite(tiny_dir, tmp_path, capsys):
    """A measurement stopped in layer 1, then run again into the same file on other calibration
    windows: refused, its finished layer kept (it was dropped, an hour of a large model's); with
    overwrite it measures afresh."""
    kw = dict(method="gptq", format="exl2", exl2=4.0, measurement=str(tmp_path / "q.json"))
    measurement_stopped_in_layer_1(tiny_dir, tmp_path / "q", **CALIB, **kw)
    kw["progress"] = False
    progress = tmp_path / ".q.json.progress-measurement.pt"
    kept = progress.read_bytes()
    other = {**CALIB, "seed": CALIB.get("seed", 0) + 1}
    with pytest.raises(quantkit.QuantkitError, match=r"progress-measurement\.pt holds 1 of 2 layers of another run measuring "
                                            r"into .*q\.json \(another model, calibration.*\): run that command again"):
        quantkit.quantize(str(tiny_dir), out=tmp_path / "q", **other, **kw)
    assert progress.read_bytes() == kept and not (tmp_path / "q.json").exists()
    capsys.readouterr()
    quantkit.quantize(str(tiny_dir), out=tmp_path / "q", overwrite=True, **other, **kw)
    assert "resuming" not in capsys.readouterr().err and (tmp_path / "q.json").is_file() and not progress.exists()


def test_a_measurement_another_process_is_making_is_left_to_it(tiny_dir, tmp_path):
    """Two runs measuring into one file: the second is refused, and the first's progress stays (the
    second removed it as 'from another run', and could take it over mid-save)."""
    from quantkit.atomic import lock

    progress = tmp_path / ".m.json.progress-measurement.pt"
    progress.write_bytes(b"the first run's")
    lock_path, held = lock(tmp_path / "m.json", "measurement")
    with pytest.raises(quantkit.QuantkitError, match="m.json is being written by another quantkit process: wait for it "
                                                     "to finish or choose another measurement"):
        quantkit.quantize(str(tiny_dir), method="gptq", format="exl2", exl2=4.0, **CALIB, progress=False,
                          measurement=str(tmp_path / "m.json"), out=tmp_path / "q")
    held.close()
    assert progress.read_bytes() == b"the first run's" and not (tmp_path / "q").exists()


def test_a_measurement_of_another_calibration_is_refused(tiny_dir, measured, exported, tmp_path, capsys, monkeypatch):
    args = ["quantize", str(tiny_dir), "--method", "gptq", "--format", "exl2", "--bits", "4.0", "--calib-data",
            str(VALID), "--calib-samples", "16", "--calib-seqlen", "64", "--measurement", str(measured)]
    refused([*args, "--seed", "1", "--out", str(tmp_path / "q")], capsys, monkeypatch,
            "the measurement of another model, calibration or quantizer settings")
    damaged = tmp_path / "damaged.json"
    damaged.write_text(measured.read_text()[:-40])
    refused([*args[:-1], str(damaged), "--out", str(tmp_path / "q")], capsys, monkeypatch, "not a measurement file")
    assert not (tmp_path / "q").exists()


def test_head_bits_quantize_an_untied_head(tmp_path, capsys):
    """--head-bits 6: lm_head is stored in the layout at about 6 bits per weight (the independent
    decoder reads our dequantized head), the config's head_bits says what it holds while bits counts
    the decoder linears alone, and the file reads back as the model that was scored. The config
    names the architecture even when the source's did not. The head's quantizing (minutes on a CPU for a
    large vocabulary, after the layers' bar ended) is announced."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .conftest import tiny_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "m")
    tiny_tokenizer(tmp_path / "m")
    source = json.loads((tmp_path / "m" / "config.json").read_text())
    del source["architectures"]  # as a config saved without a model has it
    (tmp_path / "m" / "config.json").write_text(json.dumps(source))
    m = quantkit.quantize(str(tmp_path / "m"), method="gptq", format="exl2", exl2=4.0, head_bits=6.0, **CALIB,
                          out=tmp_path / "q", keep=True, progress=True)
    assert "quantizing lm_head (512 x 64) to 6.0 bits per weight on cpu" in capsys.readouterr().err
    state = load_file(tmp_path / "q" / "model.safetensors")
    head = {p: state[f"lm_head.{p}"] for p in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")}
    assert "lm_head.weight" not in state
    np.testing.assert_array_equal(decode(head, 512), m.tensors["lm_head"].dequantize().numpy())
    with pytest.raises(quantkit.QuantkitError, match="head_bits: 99.0 bits per weight is outside what EXL2 reaches"):
        quantkit.quantize(str(tmp_path / "m"), method="gptq", format="exl2", exl2=4.0, head_bits=99.0, **CALIB,
                          out=tmp_path / "q99", progress=False)
    assert torch.equal(m.module.lm_head.weight, m.tensors["lm_head"].dequantize())
    written = json.loads((tmp_path / "q" / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"]  # ExLlamaV2's loader fails without it
    qc = written["quantization_config"]
    head_bits = sum(t.numel() * t.element_size() * 8 for t in head.values()) / (512 * 64)
    assert qc["head_bits"] == pytest.approx(head_bits, abs=1e-4) and 5.5 < head_bits <= 6.0
    assert 3.5 < qc["bits"] <= 4.0
    back = quantkit.load(tmp_path / "q")
    assert torch.equal(back.tensors["lm_head"].dequantize(), m.tensors["lm_head"].dequantize())
    ours = quantkit.evaluate(m, TEST, max_windows=2, ctx=64, progress=False).perplexity
    assert quantkit.evaluate(tmp_path / "q", TEST, max_windows=2, ctx=64, progress=False).perplexity == \
        pytest.approx(ours, rel=1e-3)


def test_a_read_checkpoint_exports_again_as_exl2_only(uniform, tiny_dir, tmp_path):
    """A loaded EXL2 checkpoint exported as GPTQ wrote its mixed widths under a 4-bit config (a file that
    fails to load), and as EXL2 was refused for want of a target."""
    from quantkit.errors import QuantkitError

    _, out = uniform
    m = quantkit.load(out)
    for fmt in ("safetensors", "awq", "compressed-tensors"):
        with pytest.raises(QuantkitError, match="linears mix widths, which only its own layout holds"):
            quantkit.export(m, tmp_path / fmt, fmt, progress=False)
        assert not (tmp_path / fmt).exists()
    quantkit.export(m, tmp_path / "again", "exl2", progress=False)
    before, after = load_file(out / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    config = lambda p: json.loads((p / "config.json").read_text())["quantization_config"]  # noqa: E731
    assert config(tmp_path / "again") == config(out)
    rtn = quantkit.quantize(str(tiny_dir), method="rtn", group_size=32, keep=True, progress=False)
    with pytest.raises(QuantkitError, match="the EXL2 layout holds what an EXL2 quantization made"):
        quantkit.export(rtn, tmp_path / "rtn", "exl2", progress=False)


def test_a_tied_models_quantized_head_is_read_as_its_own(uniform, tmp_path):
    """ExLlamaV2's converter quantizes lm_head also where the config ties it (conversion/compile.py), and
    ExLlamaV2 runs that head; quantkit read the file with lm_head tied to the float16 embedding."""
    import shutil

    from safetensors.torch import save_file

    from quantkit.exporters import exl2

    _, out = uniform
    shutil.copytree(out, tmp_path / "q")
    state = load_file(tmp_path / "q" / "model.safetensors")
    assert "lm_head.weight" not in state and json.loads((out / "config.json").read_text())["tie_word_embeddings"]
    head = quantize_head(state["model.embed_tokens.weight"].float(), 6.0)
    state |= {f"lm_head.{k}": v for k, v in exl2.pack_tensor("lm_head", head).items()}
    save_file(state, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    module = quantkit.load(tmp_path / "q").module
    assert torch.equal(module.lm_head.weight, head.dequantize().float())
    assert torch.equal(module.model.embed_tokens.weight, state["model.embed_tokens.weight"].float())


@pytest.mark.parametrize("args,match", [
    (["--format", "exl2", "--method", "gptq", "--bits", "4.0", "--head-bits", "6"], "ties its output head"),
    (["--head-bits", "6"], "--head-bits quantizes the output head of an EXL2 export"),
    (["--format", "exl2", "--method", "gptq", "--bits", "9"], "--bits 9 is outside what EXL2 reaches"),
    (["--format", "exl2", "--bits", "4.5"], "EXL2 is filled by GPTQ"),
    (["--bits", "4.5"], "only --format exl2 takes a bits-per-weight target"),
    (["--measurement", "m.json"], "use it with --target-bpw, or"),
    (["--format", "exl2", "--method", "gptq", "--bits", "4.5", "--measurement", "nowhere/m.json"], "no such directory"),
])
def test_bad_exl2_input(tiny_dir, tmp_path, capsys, monkeypatch, args, match):
    refused(["quantize", str(tiny_dir), "--out", str(tmp_path / "q"), *args], capsys, monkeypatch, match)
    assert not (tmp_path / "q").exists()


def test_a_target_outside_the_model_s_range_is_refused_with_that_range(tiny_dir):
    """The refusal gave the range of the first linear that failed: the embedded model's 2.0 was told
    "2.183 to 8.183", then 2.25 and 8.17 from inside it were refused with other ranges. It now gives
    the range every linear reaches: each target inside it is taken, each outside refused."""
    import re

    from quantkit.config import QuantConfig
    from quantkit.exporters import exl2 as layout

    module = quantkit.load(tiny_dir).module
    ranges = set()
    for target in (1.0, 9.0):
        with pytest.raises(quantkit.QuantkitError, match="for every linear of this model") as e:
            layout.check(module, QuantConfig("gptq", 4, 32, exl2=target))
        ranges.add(re.search(r"\((\S+) to (\S+)\)", str(e.value)).groups())
    (low, high), = ranges
    shapes = {(n, k) for n, k in layout.shapes_by_name(module).values()}
    assert len(shapes) > 1  # linears of several shapes, each with a range of its own
    for target in (float(low), float(high)):
        layout.check(module, QuantConfig("gptq", 4, 32, exl2=target))
        assert all(Setting.for_target(target, n, k) for n, k in shapes)
    for target in (float(low) - 0.002, float(high) + 0.002):
        with pytest.raises(quantkit.QuantkitError, match=f"\\({low} to {high}\\)"):
            layout.check(module, QuantConfig("gptq", 4, 32, exl2=target))
