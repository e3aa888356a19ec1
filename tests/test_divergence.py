"""Divergence from the base (quantkit eval --base): the figures against a direct float64 computation,
the saved base file, the gate, and the refusals. llama-perplexity's agreement is in test_gguf."""
import dataclasses
import json
import math
import shutil
import struct

import numpy as np
import pytest
import torch

import quantkit
from quantkit import evals
from .conftest import TEST, VALID, cli, loaded, make_hot, make_tiny, refused, tiny_tokenizer

CTX, WINDOWS = 128, 6


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny model whose weights are large enough for peaked distributions: top tokens to disagree on."""
    return make_tiny(tmp_path_factory.mktemp("sharp") / "model", initializer_range=0.1)


@pytest.fixture(scope="module")
def pair(tiny_dir):
    """The tiny model and a 4-bit RTN copy of it, in memory."""
    base = loaded(tiny_dir)
    quant = quantkit.quantize(loaded(tiny_dir), method="rtn", bits=4, group_size=32, keep=True, progress=False)
    return base, quant


@pytest.fixture(scope="module")
def quant_dir(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("divergence") / "q"
    quantkit.quantize(tiny_dir, method="rtn", bits=4, group_size=32, out=out, progress=False)
    return out


def direct(base, quant):
    """Every figure recomputed from the two models' full float64 distributions."""
    ids = torch.tensor(base.tokenizer(TEST.read_bytes().decode(), add_special_tokens=False)["input_ids"][:WINDOWS * CTX])
    ids = ids.view(WINDOWS, CTX)
    with torch.no_grad():
        lb, lq = (torch.log_softmax(m.module(ids).logits[:, CTX // 2:-1].double(), -1) for m in (base, quant))
    targets = ids[:, CTX // 2 + 1:, None]
    nll_b, nll_q = -lb.gather(-1, targets)[..., 0], -lq.gather(-1, targets)[..., 0]
    kld = (lb.exp() * (lb - lq)).sum(-1)
    dp = nll_q.neg().exp() - nll_b.neg().exp()
    return {"perplexity": nll_q.mean().exp().item(), "base_perplexity": nll_b.mean().exp().item(),
            "kld_mean": kld.mean().item(), "kld_p99": np.percentile(kld.flatten().numpy(), 99),
            "kld_max": kld.max().item(), "delta_p_rms": dp.pow(2).mean().sqrt().item(),
            "same_top": (lb.argmax(-1) == lq.argmax(-1)).double().mean().item()}


def test_figures_match_a_direct_computation(pair, tmp_path):
    base, quant = pair
    d = quantkit.compare(quant, base, TEST, ctx=CTX, max_windows=WINDOWS, progress=False)
    want = direct(base, quant)
    assert (d.windows, d.tokens) == (WINDOWS, WINDOWS * (CTX - 1 - CTX // 2))
    assert d.kld_mean > 1e-2 and 0.2 < d.same_top < 0.9  # 4-bit weights: divergence to measure
    for key, value in want.items():  # the saved base rounds each log-probability to 1/65535 of its range
        assert d.to_dict()[key] == pytest.approx(value, rel=2e-3, abs=1e-6), key
    assert d.ppl_ratio == pytest.approx(want["perplexity"] / want["base_perplexity"], rel=1e-4)
    assert d.kld_percentiles[99.0] == d.to_dict()["kld_p99"] and d.kld_min <= d.kld_median <= d.kld_max


def test_layerwise_gives_the_same_figures(quant_dir, tiny_dir):
    """The float base run a layer at a time (the model of a 70B comparison that does not fit the GPU), and
    the export, held whole, as it is."""
    whole = quantkit.compare(quant_dir, tiny_dir, TEST, ctx=CTX, max_windows=WINDOWS, progress=False, layerwise=False)
    assert quantkit.compare(quant_dir, tiny_dir, TEST, ctx=CTX, max_windows=WINDOWS, progress=False,
                            layerwise=True) == whole


def test_a_model_against_itself(pair):
    base, _ = pair
    d = quantkit.compare(base, base, TEST, ctx=CTX, max_windows=2, progress=False)
    assert d.same_top == 1 and d.kld_mean < 1e-6 and abs(d.ln_ratio) < 1e-4 and d.delta_p_rms < 1e-4


def test_no_room_for_the_base_names_what_the_user_can_do(pair, monkeypatch):
    """Without --save-base the base goes to a temporary file: no room there said "write it elsewhere",
    of a path the user never named."""
    from quantkit import errors

    base, quant = pair
    monkeypatch.setattr(errors, "free_space", lambda path: 1000)
    with pytest.raises(quantkit.QuantkitError, match=r"base.logits: the saved base needs about .* and 1.0 kB is free there \(a "
                                            r"temporary file\): free some space there, pass save_base='FILE' on a disk with room, set TMPDIR to one, or score "
                                            r"fewer windows \(max_windows\)"):
        quantkit.compare(quant, base, TEST, ctx=CTX, max_windows=2, progress=False)


def test_a_trained_model_against_itself_is_no_worse():
    """A trained model gives some targets more than 16 nats under its top, which the saved base holds
    at that floor: the model's exact loss against the base's floored one made the embedded model scored
    against itself 1.5% worse (PPL ratio 1.015, two windows of 256), failing --max-ppl-increase 0.01.
    The ratio now takes both as the saved rows resolve them; the perplexities shown stay each one's."""
    m = quantkit.load()
    d = quantkit.compare(m, m, TEST, ctx=256, max_windows=2, progress=False)
    assert d.perplexity > 1.01 * d.base_perplexity  # such targets are there
    assert abs(d.ppl_ratio - 1) < 1e-5 and d.kld_mean < 1e-6


def test_saved_base_is_reused_with_the_same_figures(pair, tmp_path):
    base, quant = pair
    saved = tmp_path / "base.logits"
    first = quantkit.compare(quant, base, TEST, ctx=CTX, max_windows=WINDOWS, save_base=saved, progress=False)
    f = evals.BaseFile(saved)
    assert (f.n, f.ctx, f.n_vocab) == (WINDOWS, CTX, 512) and not list(tmp_path.glob(".*"))
    again = quantkit.compare(quant, saved, TEST, ctx=CTX, progress=False)  # every window the file holds
    assert again.to_dict() == first.to_dict()
    fewer = quantkit.compare(quant, saved, TEST, ctx=CTX, max_windows=2, progress=False)
    assert fewer.windows == 2


def test_a_damaged_row_is_refused_and_nan_figures_fail_every_limit(pair, tmp_path):
    """A saved row whose probabilities no longer sum to 1 (its scale doubled) is refused by window and
    prediction; figures that are NaN (broken logits) break every gate limit instead of passing them."""
    base, quant = pair
    saved = tmp_path / "base.logits"
    d = quantkit.compare(quant, base, TEST, ctx=CTX, max_windows=2, save_base=saved, progress=False)
    f = evals.BaseFile(saved)
    at = evals.kld.HEADER.size + f.n * f.ctx * 4 + (f.scored + 3) * f.width * 2  # window 1, prediction 3
    del f
    raw = bytearray(saved.read_bytes())
    raw[at:at + 4] = struct.pack("<f", 2 * struct.unpack("<f", raw[at:at + 4])[0])
    saved.write_bytes(raw)
    with pytest.raises(quantkit.QuantkitError, match="window 1, prediction 3 is not a distribution"):
        quantkit.compare(quant, saved, TEST, ctx=CTX, progress=False)
    limits = dict(max_ppl_increase=1e9, max_kld=1e9, min_same_top=0)
    assert d.failures(**limits) == []
    broken = dataclasses.replace(d, ppl_ratio=math.nan, kld_mean=math.nan, same_top=math.nan)
    assert [line.split()[0] for line in broken.failures(**limits)] == ["perplexity", "mean", "same"]


def test_rows_keep_sixteen_nats_as_llama_cpp_does():
    logits = torch.tensor([[0.0, -3.0, -20.0, 5.0], [1.0, 1.0, 1.0, 1.0]])
    back = evals.kld.expand(evals.kld.compress(logits), 4)
    exact = torch.log_softmax(logits, -1)
    assert torch.allclose(back[0, [0, 1, 3]], exact[0, [0, 1, 3]], atol=16 / 65535)
    assert back[0, 2] < -16 and torch.allclose(back[1], exact[1])  # under the range; a flat row


def test_cli_json_and_gate(quant_dir, tiny_dir, tmp_path, capsys, monkeypatch):
    args = ["eval", quant_dir, "--base", tiny_dir, "--data", TEST, "--ctx", CTX, "--max-windows", WINDOWS,
            "--device", "cpu"]
    saved = tmp_path / "base.logits"
    code, out, _ = cli([*args, "--save-base", saved, "--json"], capsys, monkeypatch)
    result = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and "Mean    KLD" in out and "Same top p" in out
    assert {"perplexity", "base_perplexity", "kld_mean", "kld_p99", "same_top", "delta_p_rms"} <= result.keys()
    assert (result["dtype"], result["device"], result["data"]) == ("float32", "cpu", str(TEST))  # what it depends on
    increase = result["perplexity"] / result["base_perplexity"] - 1
    assert increase > 0 and saved.is_file()
    reused = ["eval", quant_dir, "--base", saved, "--data", TEST, "--ctx", CTX]
    code, out, _ = cli([*reused, "--json", "--max-kld", result["kld_mean"] * 2,
                        "--min-same-top", result["same_top"] / 2], capsys, monkeypatch)
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["kld_mean"] == result["kld_mean"]
    # a kept limit is said too, with the figure's standard error (a go/no-go reads how near it came)
    passed = [line for line in out.splitlines() if line.startswith("pass: ")]
    assert len(passed) == 2 and passed[0].startswith(f"pass: mean KL divergence {result['kld_mean']:.6f} ± "
                                                      f"{result['kld_unc']:.6f} is within --max-kld")
    code, _, err = cli([*reused, "--max-ppl-increase", increase / 2, "--max-kld", 10], capsys, monkeypatch)
    failed = [line for line in err if line.startswith("fail: ")]  # after the progress bars, one line
    assert code == 1 and failed == err[-1:] and failed[0].startswith("fail: perplexity increase")
    assert f"{increase:.4f}" in failed[0] and "--max-ppl-increase" in failed[0] and "kld" not in failed[0]
    code, _, err = cli([*reused, "--min-same-top", 1.0], capsys, monkeypatch)
    assert code == 1 and f"same top token {result['same_top']:.4f} ± {result['same_top_unc']:.4f} is below " \
        "--min-same-top 1" in err[-1]
    with pytest.warns(UserWarning, match=r"^--max-ppl-increase 5 passes a perplexity up to 6 times the base's: the "
                                         r"limit is a fraction \(0.05 for 5%\)"):  # meant as 5%
        assert cli([*reused, "--max-ppl-increase", 5], capsys, monkeypatch)[0] == 0


def test_a_base_that_makes_the_gate_pass_for_nothing_warns(quant_dir, tiny_dir):
    """The model compared with itself, or with another quantized model, passes any gate: said, not silent."""
    kw = dict(data=TEST, ctx=CTX, max_windows=1, progress=False)
    with pytest.warns(UserWarning, match="the base is the model itself .*: every divergence is 0"):
        assert abs(quantkit.compare(quant_dir, quant_dir, **kw).kld_mean) < 1e-5  # the saved rows' rounding
    with pytest.warns(UserWarning, match="the base .* is quantized: the figures are the model's divergence from it"):
        quantkit.compare(tiny_dir, quant_dir, **kw)


def test_refusals(quant_dir, tiny_dir, tmp_path, capsys, monkeypatch):
    base = ["eval", quant_dir, "--data", TEST, "--ctx", CTX, "--max-windows", 2]
    refused([*base, "--max-kld", 0.1], capsys, monkeypatch, "--max-kld needs a base model to compare with: add --base")
    refused([*base, "--save-base", tmp_path / "b"], capsys, monkeypatch, "--save-base needs a base model")
    refused([*base, "--base", tiny_dir, "--protocol", "wikitext"], capsys, monkeypatch, "drop --protocol")
    refused(["eval", tiny_dir, "--base", tiny_dir, "--data", TEST, "--dequantized"], capsys, monkeypatch,
            "is a float model: --dequantized evaluates a dequantized copy")  # it was ignored
    quantkit.quantize(tiny_dir, method="rtn", format="gguf", gguf_type="Q8_0", out=tmp_path / "m.gguf", progress=False)
    refused(["eval", tmp_path / "m.gguf", "--data", TEST, "--dequantized"], capsys, monkeypatch,
            "is a GGUF file, scored with its blocks dequantized as llama.cpp does them either way")  # ignored too
    (tmp_path / "notes.txt").write_text("mine")
    refused([*base, "--base", tiny_dir, "--save-base", tmp_path / "notes.txt"], capsys, monkeypatch,
            "is not a saved base: choose another --save-base")
    assert (tmp_path / "notes.txt").read_text() == "mine"

    other = shutil.copytree(tiny_dir, tmp_path / "other")  # the same model with a smaller vocabulary
    for f in other.glob("tok*"):
        f.unlink()
    tiny_tokenizer(other, vocab_size=400)
    refused([*base, "--base", other], capsys, monkeypatch, "different tokenizers (vocabularies of")

    saved = tmp_path / "base.logits"
    cli([*base, "--base", tiny_dir, "--save-base", saved], capsys, monkeypatch)
    # a second --save-base there replaced the base a gate compared with, without a word
    kept = saved.read_bytes()
    refused([*base, "--base", tiny_dir, "--save-base", saved, "--max-windows", 1], capsys, monkeypatch,
            f"{saved} holds a saved base already: compare with it (--base {saved}), choose another --save-base, or pass "
            "--overwrite to replace it")
    assert saved.read_bytes() == kept
    refused([*base, "--base", tiny_dir, "--overwrite"], capsys, monkeypatch, "--overwrite replaces the base saved at "
            "--save-base, and none is saved: drop it")
    assert cli([*base, "--base", tiny_dir, "--save-base", saved, "--overwrite"], capsys, monkeypatch)[0] == 0
    with_saved = ["eval", quant_dir, "--base", saved, "--ctx", CTX]
    refused([*with_saved, "--data", VALID], capsys, monkeypatch, "was saved from other tokens (window 0")
    refused([*with_saved, "--data", TEST, "--ctx", 64], capsys, monkeypatch, "context of 128, not 64: pass --ctx 128")
    short = tmp_path / "short.txt"  # a text of fewer tokens than the context asked for: the context is the mistake
    short.write_text(TEST.read_text()[:200])
    refused([*with_saved, "--data", short, "--ctx", 512], capsys, monkeypatch, "context of 128, not 512: pass --ctx 128")
    refused([*with_saved, "--data", TEST, "--max-windows", 5], capsys, monkeypatch,
            "holds 2 windows, fewer than the 5 asked for")
    refused(["eval", quant_dir, "--base", saved, "--data", TEST, "--save-base", tmp_path / "again"], capsys,
            monkeypatch, "is a saved base already")
    data = saved.read_bytes()
    for bad in (data[:-2], data[:10], data[:8] + b"\xff" * 16 + data[24:]):
        saved.write_bytes(bad)
        refused([*with_saved, "--data", TEST], capsys, monkeypatch, str(saved))


def strict(line: str) -> dict:
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(line, parse_constant=refuse)


@pytest.fixture(scope="module")
def hot_dir(tiny_dir, tmp_path_factory):
    return make_hot(tiny_dir, tmp_path_factory.mktemp("hot") / "model")


def test_a_perplexity_past_floats_range_is_inf_and_fails_the_gate(hot_dir, tiny_dir, capsys, monkeypatch):
    """e**(mean loss) overflowed: a traceback and exit 1, a gate's failure code, with no figure printed.
    Then `Infinity` in --json, which is not JSON: now null there."""
    args = ["--data", TEST, "--ctx", CTX, "--max-windows", 2, "--json", "--device", "cpu"]  # float32
    code, out, _ = cli(["eval", hot_dir, *args], capsys, monkeypatch)
    assert code == 0 and "perplexity inf" in out and strict(out.strip().splitlines()[-1])["perplexity"] is None
    code, out, err = cli(["eval", hot_dir, "--base", tiny_dir, *args, "--max-ppl-increase", 0.05], capsys, monkeypatch)
    result = strict(out.strip().splitlines()[-1])  # `Infinity` was there: not JSON, jq refuses the line
    assert code == 1 and result["ppl_ratio"] is None and math.isfinite(result["base_perplexity"])
    assert err[-1].startswith("fail: perplexity increase inf") and "Mean    KLD" in out


def test_logits_that_are_not_finite_are_refused_and_no_base_is_saved(hot_dir, tiny_dir, tmp_path, capsys, monkeypatch):
    """NaN logits (float16 overflowing) gave "perplexity nan" and exit 0, and a saved base that every
    later use called corrupt; now one line names the window and the fix."""
    args = ["--data", TEST, "--ctx", CTX, "--max-windows", 2, "--dtype", "float16"]
    why = "logits are not finite (NaN or Inf) in window 1 of 2: it overflows float16: run it in float32 or " \
          "bfloat16 (--dtype float32)"
    refused(["eval", hot_dir, *args], capsys, monkeypatch, why)
    refused(["eval", tiny_dir, "--base", hot_dir, *args, "--save-base", tmp_path / "base.logits"], capsys, monkeypatch,
            why)
    assert list(tmp_path.iterdir()) == []


def test_summary_statistics_follow_llama_cpp():
    """Uncertainties as llama-perplexity computes them: standard errors of the means, none under 11 values."""
    rng = np.random.default_rng(0)
    v = rng.exponential(size=1000)
    mean, unc = evals.kld.mean_unc(v)
    assert mean == pytest.approx(v.mean()) and unc == pytest.approx(v.std() / math.sqrt(999), rel=1e-9)
    assert evals.kld.mean_unc(v[:10])[1] == 0
