"""EXL2: an independent decoder of ExLlamaV2's layout, written from the format's description
(../shared/docs/FORMATS.md section 6, not from our packer), gives our dequantized weights; the
widths mix within a linear and meet the target; quantkit loads and scores the files."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import quantkit
from quantkit.quantizers.exl2 import Setting

from .conftest import TEST, VALID, refused


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


@pytest.fixture(scope="module")
def exported(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("exl2") / "q"
    m = quantkit.quantize(str(tiny_dir), method="gptq", format="exl2", exl2=4.0, calib_data=VALID, calib_samples=16,
                          calib_seqlen=64, out=out, keep=True, progress=False)
    return m, out


def test_independent_decoder_reads_our_weights(exported):
    m, out = exported
    state = load_file(out / "model.safetensors")
    mixed = 0
    for name, qt in m.tensors.items():
        parts = {p: state[f"{name}.{p}"] for p in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")}
        assert f"{name}.weight" not in state
        np.testing.assert_array_equal(decode(parts, qt.shape[0]), qt.dequantize().numpy(), err_msg=name)
        pairs = parts["q_groups"].view(-1, 2)
        assert pairs[:, 0].tolist() == sorted(pairs[:, 0].tolist(), reverse=True), name  # widest first
        mixed += len(set(pairs[:, 0].tolist())) > 1
    assert mixed  # widths mix within linears


def test_bits_per_weight_meet_the_target(exported):
    m, out = exported
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "exl2" and qc["calibration"]["target"] == 4.0
    stored = sum(t.numel() * t.element_size() * 8 for key, t in load_file(out / "model.safetensors").items()
                 if key.rsplit(".", 1)[-1].startswith("q_"))
    weights = sum(qt.codes.numel() for qt in m.tensors.values())
    assert qc["bits"] == pytest.approx(stored / weights, abs=1e-4)
    assert 3.5 < qc["bits"] <= 4.0
    for qt in m.tensors.values():
        n, k = qt.shape
        assert qt.bits_per_weight <= Setting.for_target(4.0, n, k).total_bits(n, k) / (n * k)


def test_quantkit_loads_and_scores_the_file(exported):
    m, out = exported
    back = quantkit.load(out)
    for name, qt in m.tensors.items():
        assert torch.equal(back.tensors[name].dequantize(), qt.dequantize()), name
        assert torch.equal(back.module.get_submodule(name).weight, qt.dequantize())
    ours = quantkit.evaluate(m, TEST, max_windows=2, ctx=128, progress=False).perplexity
    # the export keeps the other tensors in float16
    assert quantkit.evaluate(out, TEST, max_windows=2, ctx=128, progress=False).perplexity == pytest.approx(ours, rel=1e-3)


def test_wider_targets_fit_better(tiny_dir):
    """The same GPTQ onto wider EXL2 grids: the layer loss falls as the target rises."""
    losses = []
    for target in (3.5, 4.5, 6.0):
        m = quantkit.quantize(str(tiny_dir), method="gptq", format="exl2", exl2=target, calib_data=VALID,
                              calib_samples=16, calib_seqlen=64, keep=True, progress=False)
        losses.append(sum(m.losses.values()))
    assert losses[0] > losses[1] > losses[2]


@pytest.mark.parametrize("args,match", [
    (["--format", "exl2", "--method", "gptq", "--bits", "9"], "outside what EXL2 reaches"),
    (["--format", "exl2", "--bits", "4.5"], "EXL2 is filled by GPTQ"),
    (["--bits", "4.5"], "only --format exl2 takes a bits-per-weight target"),
])
def test_bad_exl2_input(tiny_dir, tmp_path, capsys, monkeypatch, args, match):
    refused(["quantize", str(tiny_dir), "--out", str(tmp_path / "q"), *args], capsys, monkeypatch, match)
    assert not (tmp_path / "q").exists()
