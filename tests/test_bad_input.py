"""Every bad input is one line naming the problem and the fix, exit status 2, nothing written."""
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import quantkit
from quantkit.command import main

from .conftest import TEST, VALID, cli, make_tiny, stopping_saves


def run(args, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["quantkit", *map(str, args)])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    return e.value.code, err[-1] if err else ""


@pytest.fixture
def model(tiny_dir, tmp_path):
    return shutil.copytree(tiny_dir, tmp_path / "model")


def quantize_fails(args, capsys, monkeypatch, tmp_path, match):
    out = tmp_path / "out"
    code, line = run(["quantize", *args, "--out", out], capsys, monkeypatch)
    assert code == 2 and line.startswith("error: ") and match in line, line
    assert "Traceback" not in line
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_missing_path(capsys, monkeypatch, tmp_path):
    quantize_fails([tmp_path / "nope"], capsys, monkeypatch, tmp_path, "no such file or directory")


def test_directory_without_a_model(capsys, monkeypatch, tmp_path):
    (tmp_path / "empty").mkdir()
    quantize_fails([tmp_path / "empty"], capsys, monkeypatch, tmp_path, "no config.json")


def test_a_hub_cache_folder_names_its_snapshot(model, capsys, monkeypatch, tmp_path):
    """The hub's cache keeps a model's files under snapshots/<revision>/, where users look last."""
    repo = tmp_path / "models--org--tiny"
    (repo / "snapshots").mkdir(parents=True)
    shutil.move(model, repo / "snapshots" / "abc123")
    quantize_fails([repo], capsys, monkeypatch, tmp_path, f"this hub cache folder holds its files in {repo / 'snapshots' / 'abc123'}")


def test_directory_without_weights(model, capsys, monkeypatch, tmp_path):
    (model / "model.safetensors").unlink()
    quantize_fails([model], capsys, monkeypatch, tmp_path, "no *.safetensors weights")


def test_truncated_safetensors(model, capsys, monkeypatch, tmp_path):
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])
    quantize_fails([model], capsys, monkeypatch, tmp_path, "corrupt or truncated safetensors")


def test_corrupt_safetensors(model, capsys, monkeypatch, tmp_path):
    (model / "model.safetensors").write_bytes(b"\xff" * 4096)
    quantize_fails([model], capsys, monkeypatch, tmp_path, "corrupt or truncated safetensors")


def test_unsupported_architecture(model, capsys, monkeypatch, tmp_path):
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "model_type": "bloom"}))
    quantize_fails([model], capsys, monkeypatch, tmp_path, "'bloom' is not supported: quantkit handles llama, mistral, qwen2, qwen3")
    (model / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "model_type"}))
    quantize_fails([model], capsys, monkeypatch, tmp_path, "config.json: no model_type, so no architecture")


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_nan_or_inf_weights(model, capsys, monkeypatch, tmp_path, bad):
    state = load_file(model / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"][3, 5] = float(bad)
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    quantize_fails([model], capsys, monkeypatch, tmp_path, "model.layers.1.mlp.up_proj.weight contains NaN or Inf")


@pytest.mark.parametrize("args,match", [(["--bits", "5"], "--bits 5 is an unsupported bit width"),
                                        (["--group-size", "0"], "--group-size 0 is invalid"),
                                        (["--method", "magic"], "unknown method 'magic'"),
                                        (["--format", "onnx"], "unknown export format 'onnx'"),
                                        (["--bits", "nan"], "--bits nan is not a width"),
                                        # options the method or format would ignore
                                        (["--act-order"], "--act-order/--no-act-order is not an option of --method rtn"),
                                        (["--method", "nf4", "--group-size", "32"],
                                         "--group-size is not an option of --method nf4"),
                                        (["--method", "awq", "--mse"], "--mse/--no-mse is not an option of --method awq"),
                                        (["--format", "gguf", "--bits", "8"], "--bits does not apply to --format gguf"),
                                        (["--calib-samples", "8"], "--calib-samples sets the calibration, and --method rtn "
                                         "quantizes without one"),
                                        (["--method", "nf4", "--calib-data", "x.txt"], "--calib-data sets the calibration"),
                                        (["--eval-windows", "3"], "--eval-windows sets the perplexity check that "
                                         "--eval-data turns on")])
def test_bad_options(model, capsys, monkeypatch, tmp_path, args, match):
    quantize_fails([model, *args], capsys, monkeypatch, tmp_path, match)


@pytest.mark.parametrize("options,match", [(dict(method="rtn", act_order=True), "act_order is not an option of method='rtn'"),
                                           (dict(method="rtn", damp=0.05), "damp is not an option of method='rtn'"),
                                           (dict(method="nf4", group_size=32), "group_size is not an option of method='nf4'"),
                                           (dict(method="awq", mse=True), "mse is not an option of method='awq'"),
                                           (dict(method="rtn", format="gguf", bits=8), "bits does not apply to format='gguf'"),
                                           (dict(method="rtn", target_bpw=4.5, group_size=32),
                                            "group_size does not apply with target_bpw")])
def test_api_refuses_what_the_method_would_ignore(tiny_dir, tmp_path, options, match):
    """The API took these and ignored them (RTN's damp and static_groups were even written into the GPTQ
    config); as on the command line, a value other than the field's default that the method or format does
    not read is refused, before any work."""
    import quantkit

    with pytest.raises(quantkit.QuantkitError, match=re.escape(match)):
        quantkit.quantize(str(tiny_dir), out=tmp_path / "q", progress=False, **options)
    fmt = options.pop("format", "safetensors")  # the same settings built into a QuantConfig first
    with pytest.raises(quantkit.QuantkitError, match=re.escape(match)):
        quantkit.quantize(str(tiny_dir), quantkit.QuantConfig(**options), out=tmp_path / "q", format=fmt, progress=False)
    assert not (tmp_path / "q").exists()
    # the defaults, given: harmless, and what a loop over methods passes
    quantkit.quantize(str(tiny_dir), method="rtn", act_order=False, damp=0.01, group_size=32, progress=False)


def test_api_refuses_a_shard_size_for_one_file(tiny_dir, tmp_path):
    """max_shard_size with format="gguf" was taken and ignored by the API (not a QuantConfig field), refused on
    the command line."""
    import quantkit

    for config in ({"config": quantkit.QuantConfig(method="rtn")}, {"method": "rtn"}):
        with pytest.raises(quantkit.QuantkitError, match="max_shard_size does not apply to format='gguf', which "
                                                         "writes one file: drop it"):
            quantkit.quantize(str(tiny_dir), **config, format="gguf", max_shard_size="1GB", out=tmp_path / "q.gguf",
                              progress=False)
    assert not (tmp_path / "q.gguf").exists()


def test_api_refuses_the_exports_options_without_an_export(tiny_dir):
    """format (awq, compressed-tensors), overwrite and max_shard_size without out were taken and ignored:
    the kept Model's export later wrote the GPTQ layout, and 3-bit compressed-tensors was never checked."""
    for options, given in ((dict(format="compressed-tensors", bits=3), "format='compressed-tensors' describes"),
                           (dict(method="nf4", format="awq"), "format='awq' describes"),
                           (dict(overwrite=True), "overwrite=True describes"),
                           (dict(max_shard_size="1GB", overwrite=True), "overwrite=True, max_shard_size='1GB' describe")):
        with pytest.raises(quantkit.QuantkitError, match=re.escape(given) + " the export, and no out is given: pass "
                                                         "out"):
            quantkit.quantize(str(tiny_dir), progress=False, **options)


@pytest.mark.parametrize("method", ["rtn", "awq", "nf4"])
def test_api_takes_a_configs_own_fields_back(tiny_dir, method):
    """A QuantConfig's fields (to_dict(), an export's meta) passed back as keywords were refused: the values
    the method fills in (RTN's and AWQ's block_size 128, NF4's sym) read as options it does not take."""
    config = quantkit.QuantConfig(method=method, **({} if method == "nf4" else {"group_size": 32}))
    calibration = dict(calib_data=VALID, calib_samples=4, calib_seqlen=32) if method == "awq" else {}
    assert quantkit.quantize(str(tiny_dir), **config.to_dict(), **calibration, progress=False).qconfig == config


@pytest.mark.parametrize("options,words", [(dict(format="awq", bits=3), "use bits=4 or format='safetensors'"),
                                           (dict(format="compressed-tensors", bits=3),
                                            "use bits=4 or bits=8, or format='safetensors'"),
                                           (dict(format="awq", group_size=-1), "use group_size=64 or group_size=32 or "
                                            "group_size=128 or format='safetensors'")])
def test_api_format_refusals_name_keywords(tiny_dir, tmp_path, options, words):
    """The layouts' refusals named the command line's flags (--bits 4 or --format safetensors) to the API."""
    with pytest.raises(quantkit.QuantkitError) as e:
        quantkit.quantize(str(tiny_dir), method="rtn", out=tmp_path / "q", progress=False, **options)
    assert words in str(e.value) and "--" not in str(e.value), str(e.value)


def test_api_export_refuses_a_model_evaluate_converted(tiny_dir, tmp_path):
    """evaluate with a dtype converts the Model it is given, and export then wrote the embedding and head
    rounded to bfloat16 without a word (quantize refused such a Model)."""
    m = quantkit.quantize(str(tiny_dir), method="rtn", group_size=32, progress=False)
    quantkit.export(m, tmp_path / "a", progress=False)
    quantkit.evaluate(m, VALID, ctx=32, max_windows=1, dtype="bfloat16", progress=False)
    with pytest.raises(quantkit.QuantkitError, match=r"converted to torch\.bfloat16 in memory .*: export before "
                                                     "evaluating with a dtype or device"):
        quantkit.export(m, tmp_path / "b", progress=False)
    assert not (tmp_path / "b").exists()


def test_api_export_refuses_a_gguf_name_for_a_directory_and_closes_a_failed_exports_spill(tiny_dir, tmp_path,
                                                                                          monkeypatch):
    """export(m, "x.gguf") wrote a safetensors directory named x.gguf (quantize(out="x.gguf") refused it); a failed
    export removed its partial directory but kept its spill open, deleted, holding its space while the failure
    was kept (as a notebook keeps the last traceback: here pytest's)."""
    import errno

    from quantkit.exporters import checkpoint

    m = quantkit.quantize(str(tiny_dir), method="rtn", group_size=32, keep=True, progress=False)
    with pytest.raises(quantkit.QuantkitError, match="names a GGUF file, and format='safetensors' writes a directory"):
        quantkit.export(m, tmp_path / "a.gguf", progress=False)
    assert not (tmp_path / "a.gguf").exists()
    add = checkpoint.CheckpointWriter.add

    def full(self, key, t):
        if key == "model.norm.weight":  # after the layers: the open shard's spill holds them
            raise OSError(errno.ENOSPC, "No space left on device")
        return add(self, key, t)

    monkeypatch.setattr(checkpoint.CheckpointWriter, "add", full)
    with pytest.raises(quantkit.QuantkitError, match="out of disk space") as failure:
        quantkit.export(m, tmp_path / "b", progress=False)
    assert failure.tb is not None and sorted(p.name for p in tmp_path.iterdir()) == []
    fds = Path("/proc/self/fd")
    if fds.is_dir():
        held = []
        for fd in fds.iterdir():
            try:
                held.append(os.readlink(fd))
            except OSError:  # closed since the listing
                pass
        assert not [t for t in held if ".spill-" in t], held


def test_api_exports_gguf_blocks_kept_and_no_other_grids(tiny256, tmp_path):
    """export(m, "x.gguf", format="gguf") of a Model quantized to another grid said "pass both or neither
    (gguf_type)", an argument export does not take; GGUF blocks kept export as quantize writes them."""
    kw = dict(method="rtn", keep=True, progress=False)
    m = quantkit.quantize(str(tiny256), format="gguf", gguf_type="Q4_0", out=tmp_path / "a.gguf", **kw)
    quantkit.export(m, tmp_path / "b.gguf", format="gguf", progress=False)
    assert (tmp_path / "b.gguf").read_bytes() == (tmp_path / "a.gguf").read_bytes()
    with pytest.raises(quantkit.QuantkitError, match="max_shard_size does not apply to format='gguf'"):
        quantkit.export(m, tmp_path / "c.gguf", format="gguf", max_shard_size="1GB", progress=False)
    rtn = quantkit.quantize(str(tiny256), **kw)
    with pytest.raises(quantkit.QuantkitError, match="this Model is quantized to rtn's grids, not GGUF blocks: quantize "
                                                     "the float model with format='gguf'"):
        quantkit.export(rtn, tmp_path / "c.gguf", format="gguf", progress=False)
    # a misspelt format was answered as a directory format given a .gguf name
    with pytest.raises(quantkit.QuantkitError, match="unknown export format 'gguff'"):
        quantkit.export(rtn, tmp_path / "c.gguf", format="gguff", progress=False)
    assert not (tmp_path / "c.gguf").exists()


def test_the_calibration_text_is_checked_before_the_first_evaluation(model, capsys, monkeypatch, tmp_path):
    """A fault in --calib-data came out after the "before" perplexity had run (its 40 windows wasted)."""
    import quantkit.api

    (tmp_path / "calib.bin").write_bytes(bytes(range(256)))
    monkeypatch.setattr(quantkit.api, "evaluate", lambda *a, **k: pytest.fail("evaluated before the check"))
    quantize_fails([model, "--method", "gptq", "--calib-data", tmp_path / "calib.bin", "--eval-data", VALID],
                   capsys, monkeypatch, tmp_path, "calib.bin: not UTF-8 text")
    # Windows' "Unicode" text: the way to convert it named
    (tmp_path / "calib.txt").write_bytes("a text saved as UTF-16\n".encode("utf-16"))
    quantize_fails([model, "--method", "gptq", "--calib-data", tmp_path / "calib.txt"], capsys, monkeypatch, tmp_path,
                   "calib.txt: UTF-16 text, not UTF-8: convert it (iconv -f UTF-16 -t UTF-8")


@pytest.mark.parametrize("call,match", [
    # wrong types: tracebacks from deep inside (or a string kept as a setting, failing at export)
    (lambda q, m, t: q.quantize(m, method="gptq", calib_samples="4"), "calib_samples='4': pass a whole number"),
    (lambda q, m, t: q.quantize(m, method="gptq", seed=None), "seed=None: pass a whole number"),  # unseeded windows
    (lambda q, m, t: q.quantize(m, method="rtn", sym="no"), "sym='no' is a str, where bool or None belongs"),
    (lambda q, m, t: q.quantize(m, method="gptq", damp="x"), "damp='x' is a str, where float belongs"),
    (lambda q, m, t: q.QuantConfig(method="gptq", block_size=64.5), "block_size=64.5 is a float, where int or None"),
    (lambda q, m, t: q.evaluate(m, t, ctx="64"), "ctx='64': pass a whole number"),
    (lambda q, m, t: q.evaluate(m, t, max_windows=2.0), "max_windows=2.0: pass a whole number"),
    (lambda q, m, t: q.lm_eval(m, ["wikitext"], limit="2"), "limit='2': pass a whole number of documents"),
    (lambda q, m, t: q.lm_eval(m, ["wikitext"], limit=float("inf")), "limit=inf: pass a whole number of documents"),
    (lambda q, m, t: q.lm_eval(m, ["wikitext"], seed=-1), "seed=-1: pass a whole number of at least 0"),
    (lambda q, m, t: q.lm_eval(m, ["wikitext"], batch_size=0), "batch_size=0: pass a whole number of at least 1"),
    (lambda q, m, t: q.train(m, data=t, out="x", steps="1"), "steps='1' is a str, where int or None belongs"),
    # the ways of passing options
    (lambda q, m, t: q.quantize(m, method="rtn", bitz=4), "quantize takes no option 'bitz' (did you mean 'bits'?)"),
    (lambda q, m, t: q.quantize(m, {"method": "rtn"}), "config is a dict: pass a QuantConfig"),
    (lambda q, m, t: q.quantize(m, q.QuantConfig(), bits=8), "pass a QuantConfig or its fields as keywords, not both"),
    (lambda q, m, t: q.train(m, data=t, out="x", rnak=4), "train takes no option 'rnak' (did you mean 'rank'?)"),
    (lambda q, m, t: q.train(m, {"rank": 4}, data=t, out="x"), "config is a dict: pass a TrainConfig"),
    # quantized for nothing, or for another format than asked
    (lambda q, m, t: q.quantize(m, method="rtn", keep=False), "keep=False writes the quantized layers to out"),
    (lambda q, m, t: q.quantize(m, method="rtn", format="gptq"), "unknown export format 'gptq'"),
    (lambda q, m, t: q.quantize(m, method="rtn", gguf_type="Q4_K_M"), "gguf_type chooses a GGUF mix, and format='safetensors' is not GGUF: add format='gguf'"),
    (lambda q, m, t: q.export(str(m), "x"), "export writes a Model in memory, not a str"),
    (lambda q, m, t: q.api.export_gguf(str(m), "x.gguf"), "export_gguf writes a Model in memory, not a str"),
    (lambda q, m, t: q.quantize(5, out="q"), "model is an int, not a model: pass a model directory"),
    (lambda q, m, t: q.compare(m, None, TEST), "base is None, not a model: pass a model directory"),
    (lambda q, m, t: q.quantize(m, out="q", targets=5), "targets=5 is not consumer names"),
    (lambda q, m, t: q.quantize(m, out="q", targets={"vllm", 5}), "is not consumer names"),
    (lambda q, m, t: q.quantize(m, out="q", checked=5), "checked=5 is not Callable"),
    (lambda q, m, t: q.train(m, data=TEST, out="a", callback=5), "callback=5 is not Callable"),
    (lambda q, m, t: q.quantize(m, out="q.gguf"), "out q.gguf names a GGUF file, and format='safetensors' writes a "
                                                      "directory"),
    (lambda q, m, t: q.quantize(m, out="q", format="gguf", tensor_type=[5]), "tensor_type 5 is not PATTERN=TYPE"),
    (lambda q, m, t: q.quantize(m, out="q", format="gguf", tensor_type=["bad"]), "tensor_type 'bad' is not "
                                                                                    "PATTERN=TYPE"),
    (lambda q, m, t: q.quantize(m, out="q", gguf_type="Q9", format="gguf"), "in gguf_type"),
    (lambda q, m, t: q.quantize(m, out="q", method="rtn", damp=0.05), "(see QuantConfig)"),
    (lambda q, m, t: q.compare(m, m, TEST, dtype="int8"), "unknown dtype 'int8'")])
def test_api_arguments_are_checked_with_one_error(tiny_dir, call, match, tmp_path, monkeypatch):
    """Each was a TypeError, ValueError or AttributeError from deep inside, or accepted and ignored."""
    import quantkit

    monkeypatch.chdir(tmp_path)  # where a call not refused would write its out
    with pytest.raises(quantkit.QuantkitError, match=re.escape(match)):
        call(quantkit, str(tiny_dir), TEST)


def test_a_model_quantized_or_converted_in_memory_is_not_quantized_again(tiny_dir, tmp_path):
    """quantize(m) twice rounded the first result again; a Model streamed to an export could not be
    quantized again, with advice that did not help; after evaluate in bfloat16 the weights quantized
    were bfloat16's. A GGUF option with format="gguf" was refused as if no GGUF were asked for."""
    import quantkit

    m = quantkit.load(str(tiny_dir))
    quantkit.quantize(m, method="rtn", group_size=32, progress=False)
    with pytest.raises(quantkit.QuantkitError, match="this Model was quantized already in this process: quantize "
                                                     "quantkit.load\\(path\\) again"):
        quantkit.quantize(m, method="rtn", bits=8, group_size=32, progress=False)
    m = quantkit.load(str(tiny_dir))
    quantkit.evaluate(m, TEST, ctx=64, max_windows=1, dtype="bfloat16", progress=False)
    with pytest.raises(quantkit.QuantkitError, match="weights were converted to torch.bfloat16 in memory"):
        quantkit.quantize(m, method="rtn", group_size=32, progress=False)
    quantkit.quantize(str(tiny_dir), method="rtn", format="gguf", pure=True, out=tmp_path / "q.gguf", progress=False)
    assert (tmp_path / "q.gguf").is_file()


def test_the_api_as_a_pipeline_calls_it(tiny_dir, tmp_path):
    """Paths as pathlib.Path in every setting that takes one, and None where a pipeline's YAML gives null
    for no settings (refused, or a TypeError); a Model streamed to its export, and a packed= that a
    Model passed in cannot follow, named for what they are ("not quantized"; packed ignored)."""
    import quantkit

    c = quantkit.QuantConfig(gguf_type="Q4_0", imatrix_file=tmp_path / "x.imatrix", rules=None, tensor_type=None)
    assert c.imatrix_file == str(tmp_path / "x.imatrix") and c.rules == () and c.tensor_type == ()
    c = quantkit.QuantConfig(method="gptq", target_bpw=3.5, measurement=tmp_path / "m.json")
    assert c.measurement == str(tmp_path / "m.json")
    streamed = quantkit.quantize(tiny_dir, method="rtn", group_size=32, targets=None, out=tmp_path / "q",
                                 progress=False)
    with pytest.raises(quantkit.QuantkitError, match="written to .* and not kept in memory: that is its export"):
        quantkit.export(streamed, tmp_path / "again")
    packed = quantkit.load(tmp_path / "q", packed=True)
    with pytest.raises(quantkit.QuantkitError, match="holds packed linears, and packed=False asks for the other"):
        quantkit.evaluate(packed, TEST, ctx=64, max_windows=1, packed=False, progress=False)
    kept = quantkit.quantize(str(tiny_dir), method="rtn", group_size=32, progress=False)
    with pytest.raises(quantkit.QuantkitError, match="holds dequantized linears, and packed=True asks for the other"):
        quantkit.compare(kept, tiny_dir, TEST, ctx=64, max_windows=1, packed=True, progress=False)
    assert quantkit.evaluate(packed, TEST, ctx=64, max_windows=1, packed=True, progress=False).perplexity == \
        pytest.approx(quantkit.evaluate(kept, TEST, ctx=64, max_windows=1, progress=False).perplexity, rel=1e-4)


def test_errors_name_options_as_the_caller_wrote_them(tiny_dir, capsys, monkeypatch, tmp_path):
    """The API's errors named the command line's flags: EXL2's advice (--bits 4.125) could not be
    followed there (bits=4.125 is refused: the keyword is exl2), nor --for (targets) looked up."""
    import quantkit

    calibration = dict(calib_data=VALID, calib_samples=2)
    for call, flags, api, cli_ in [
        (dict(calibration, method="gptq", group_size=32, calib_seqlen=4096), ["--method", "gptq", "--calib-data", VALID, "--calib-seqlen", 4096],
         "calib_seqlen=4096 is longer than the model's context of 512 tokens: use calib_seqlen=512 or less",
         "--calib-seqlen 4096 is longer than the model's context of 512 tokens: use --calib-seqlen 512 or less"),
        (dict(method="rtn", group_size=32, targets=("onnx",)), ["--group-size", 32, "--for", "onnx"],
         "unknown consumer 'onnx' for targets", "unknown consumer 'onnx' for --for"),
        (dict(method="rtn", pure=True), ["--pure"], "pure chooses among the types of a quantized GGUF mix: use it with "
         "format='gguf' and a gguf_type such as Q4_K_M", "--pure chooses among the types of a quantized GGUF mix: use "
         "it with --format gguf and a --gguf-type such as Q4_K_M")]:
        with pytest.raises(quantkit.QuantkitError, match=re.escape(api)):
            quantkit.quantize(str(tiny_dir), out=tmp_path / "q", progress=False, **call)
        code, err = run(["quantize", tiny_dir, "--out", tmp_path / "q", *flags], capsys, monkeypatch)
        assert code == 2 and cli_ in err, err
    with pytest.raises(quantkit.QuantkitError, match=re.escape("format='exl2' takes a target bits per weight "
                                                               "(exl2=4.125)")):
        quantkit.quantize(str(tiny_dir), method="gptq", format="exl2", out=tmp_path / "q", progress=False,
                          **calibration)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("out,args,match", [
    ("taken", ["--format", "gguf"], "taken is a directory, and this output is a file"),  # an empty directory
    (".", [], "--out '.' names no new file or directory"),
    ("taken/..", ["--overwrite"], "--out 'taken/..' names no new file or directory"),
])
def test_outputs_that_cannot_be_written(model, capsys, monkeypatch, tmp_path, out, args, match):
    """An output path that is not one: found before the work, not at the final rename (a GGUF file onto a
    directory failed there, and '..' with --overwrite set about renaming the directory the run was in)."""
    (tmp_path / "work" / "taken").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    code, line = run(["quantize", model, "--out", out, *args], capsys, monkeypatch)
    assert code == 2 and line.startswith("error: ") and match in line, line
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["taken"] and not any((tmp_path / "work" / "taken").iterdir())


def test_eval_windows_must_be_counted(model, capsys, monkeypatch):
    code, line = run(["eval", model, "--data", TEST, "--max-windows", 0], capsys, monkeypatch)
    assert code == 2 and "'--max-windows': 0 is not in the range x>=1" in line, line


GPU_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free."
CPU_OOM = ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
           "21474836480 bytes. Error code 12 (Cannot allocate memory)")


@pytest.mark.parametrize("command,error,match", [
    (["eval", "--data", TEST, "--ctx", 32, "--max-windows", 1], "gpu",
     "out of GPU memory (it asked for 2.00 GiB more): score on the CPU (--device cpu)"),
    (["quantize", "--method", "gptq", "--calib-data", VALID, "--calib-samples", 4, "--calib-seqlen", 32, "--out", "OUT"],
     "cpu", "out of memory (it asked for 21.5 GB more): calibrate on fewer tokens (--calib-samples, --calib-seqlen)"),
    (["lm-eval", "--tasks", "dolly_mc", "--limit", 1], "python", "out of memory: lower --batch-size or --max-length"),
])
def test_running_out_of_memory_is_one_line_naming_what_to_lower(tiny_dir, capsys, monkeypatch, tmp_path, command, error,
                                                                match):
    import torch
    from transformers.models.llama import modeling_llama

    def runs_out(*args, **kwargs):
        raise {"gpu": torch.OutOfMemoryError(GPU_OOM), "cpu": RuntimeError(CPU_OOM), "python": MemoryError()}[error]

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", runs_out)
    code, line = run([command[0], tiny_dir, *[tmp_path / "q" if a == "OUT" else a for a in command[1:]]], capsys,
                     monkeypatch)
    assert code == 2 and line.startswith(f"error: {match}"), line
    assert not (tmp_path / "q").exists()


def test_eval_names_its_own_text_option_where_the_hub_is_shadowed(tiny_dir, capsys, monkeypatch, tmp_path):
    """datasets would read ./wikitext instead of the hub's: the error names eval's --data, not quantize's --eval-data."""
    (tmp_path / "wikitext").mkdir()
    monkeypatch.chdir(tmp_path)
    code, line = run(["eval", tiny_dir, "--max-windows", 1], capsys, monkeypatch)
    assert code == 2 and line.endswith("pass a local text file (--data)"), line


def test_windows_longer_than_the_models_context(model, capsys, monkeypatch, tmp_path):
    """The tiny model's context is 512: longer windows were scored, and calibrated on, from positions it never saw."""
    code, line = run(["eval", model, "--data", TEST, "--ctx", 1024, "--max-windows", 1], capsys, monkeypatch)
    assert code == 2 and "--ctx 1024 is longer than the model's context of 512 tokens: use --ctx 512" in line, line
    quantize_fails([model, "--method", "gptq", "--calib-data", TEST, "--calib-samples", 2, "--calib-seqlen", 600],
                   capsys, monkeypatch, tmp_path, "--calib-seqlen 600 is longer than the model's context of 512")


@pytest.mark.parametrize("rope,limit", [
    (None, 32768),
    ({"rope_type": "linear", "factor": 2.0}, 65536),
    # Llama 3.1: max_position_embeddings is the scaled length already
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 4096}, 32768),
    # Qwen2.5's and Qwen3's YaRN setting: the original length, 4 times over (was refused past 32768)
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072)])
def test_a_rope_scalings_context(rope, limit):
    from types import SimpleNamespace

    from quantkit.modelio import check_context

    config = SimpleNamespace(max_position_embeddings=32768, rope_parameters=rope)
    check_context(config, limit, "ctx")
    with pytest.raises(quantkit.QuantkitError, match=f"ctx={limit + 1} is longer than the model's context of {limit} tokens"):
        check_context(config, limit + 1, "ctx")


def test_an_unknown_format_is_named_before_the_model_loads(capsys, monkeypatch, tmp_path):
    """It was named after the model loaded (the embedded one downloaded first on a fresh machine)."""
    code, line = run(["quantize", tmp_path / "no-model", "--out", tmp_path / "q", "--format", "gptq"], capsys,
                     monkeypatch)
    assert code == 2 and line == ("error: unknown export format 'gptq': use one of safetensors, awq, gguf, "
                                  "compressed-tensors, exl2")


def test_shape_the_gptq_layout_cannot_pack(capsys, monkeypatch, tmp_path):
    odd = make_tiny(tmp_path / "odd", hidden=48, intermediate=96)  # in_features 48: not a multiple of 32
    quantize_fails([odd], capsys, monkeypatch, tmp_path, "needs in_features a multiple of 32")


def test_corrupt_gguf(capsys, monkeypatch, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 20)
    quantize_fails([bad], capsys, monkeypatch, tmp_path, "not a readable GGUF file")


def test_empty_eval_data(model, capsys, monkeypatch, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    code, line = run(["eval", model, "--data", tmp_path / "empty.txt"], capsys, monkeypatch)
    assert code == 2 and "is empty: pass a file with text to evaluate on" in line


def test_eval_text_shorter_than_a_window(model, capsys, monkeypatch, tmp_path):
    (tmp_path / "short.txt").write_text(TEST.read_text()[:500])
    code, line = run(["eval", model, "--data", tmp_path / "short.txt", "--ctx", 512], capsys, monkeypatch)
    assert code == 2 and "fewer than one window of 512" in line


def test_existing_output(model, capsys, monkeypatch, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("keep")
    code, line = run(["quantize", model, "--out", tmp_path / "out"], capsys, monkeypatch)
    assert code == 2 and "already exists" in line and (tmp_path / "out" / "x").read_text() == "keep"


@pytest.mark.parametrize("text,match", [("", "is empty"), ("a few words only", "too few for 128 windows of 512")])
def test_calibration_text_too_short_for_gptq(model, capsys, monkeypatch, tmp_path, text, match):
    (tmp_path / "calib.txt").write_text(text)
    quantize_fails([model, "--method", "gptq", "--calib-data", tmp_path / "calib.txt"], capsys, monkeypatch, tmp_path,
                   match)


def test_missing_calibration_file(model, capsys, monkeypatch, tmp_path):
    quantize_fails([model, "--method", "gptq", "--calib-data", tmp_path / "nope.txt"], capsys, monkeypatch, tmp_path,
                   "no such file")


@pytest.fixture
def sharded(tiny_dir, tmp_path):
    """The tiny model in several shards with their index, as big checkpoints come."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(tiny_dir).save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(tmp_path / "sharded")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    return tmp_path / "sharded"


def test_shard_named_by_the_index_but_missing(sharded, capsys, monkeypatch, tmp_path):
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    quantize_fails([sharded], capsys, monkeypatch, tmp_path, f"shard {shard.name} is named by model.safetensors.index.json")


def test_truncated_shard(sharded, capsys, monkeypatch, tmp_path):
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    quantize_fails([sharded], capsys, monkeypatch, tmp_path, f"{shard.name}: corrupt or truncated safetensors")


def test_tensor_shape_disagrees_with_the_config(model, capsys, monkeypatch, tmp_path):
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    quantize_fails([model], capsys, monkeypatch, tmp_path, "model.layers.0.mlp.gate_proj.weight has shape (128, 64) "
                   "but config.json implies (96, 64)")


def test_quantized_checkpoint_whose_config_does_not_say_so(tiny_dir, capsys, monkeypatch, tmp_path):
    import quantkit

    quantkit.quantize(str(tiny_dir), bits=4, group_size=32, out=tmp_path / "gptq", progress=False)
    cfg = json.loads((tmp_path / "gptq" / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "gptq" / "quantize_config.json").unlink()  # else it reads as older AutoGPTQ's checkpoints do
    quantize_fails([tmp_path / "gptq"], capsys, monkeypatch, tmp_path, "already quantized by GPTQ or AWQ")


def edit_bnb_state(path, change: dict) -> None:
    """Each linear's bitsandbytes quant_state (JSON held as uint8 tensors) updated with change."""
    import torch

    f = path / "model.safetensors"
    state = load_file(f)
    for key in [k for k in state if ".quant_state.bitsandbytes__" in k]:
        meta = json.loads(bytes(state[key].tolist())) | change
        state[key] = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)
    save_file(state, f, metadata={"format": "pt"})


def edit_quantization_config(path, change: dict) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] |= change
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("fields,match", [({"bits": 4.0}, "bits=4.0 is a float, where int belongs"),
                                          ({"bits": True}, "bits=True is a bool, where int belongs"),
                                          ({"group_size": 32.0}, "group_size=32.0 is a float, where int belongs"),
                                          # accepted, then read as the directory "."
                                          ({"imatrix_file": "", "gguf_type": "Q4_0"}, "imatrix_file is empty"),
                                          # EXL2's target is the command line's --bits, and exl2= in the API
                                          ({"bits": 4.125}, "for an EXL2 target of 4.125 bits per weight pass "
                                                            "exl2=4.125 with format='exl2'"),
                                          ({"rules": 5}, "rules=5 is a int, where a rules file's path or rules"),
                                          ({"tensor_type": 5, "gguf_type": "Q4_0"}, "tensor_type=5 is a int")])
def test_settings_through_the_api_that_are_not_whole(fields, match):
    """QuantConfig(bits=4.0) passed `in (2, 3, 4, 8)` and broke the packing with a TypeError."""
    from quantkit import QuantConfig, QuantkitError

    with pytest.raises(QuantkitError, match=match):
        QuantConfig(method="rtn", **fields)


@pytest.mark.parametrize("call,match", [
    # TypeErrors from pathlib, a traceback away from the keyword
    (lambda m, t, d: quantkit.quantize(m, out=5), "out=5 is not str or PathLike or None: pass out as one (a path"),
    (lambda m, t, d: quantkit.evaluate(m, 123), "data=123 is not str or PathLike or None"),
    (lambda m, t, d: quantkit.compare(m, m, t, save_base=7), "save_base=7 is not str or PathLike or None"),
    (lambda m, t, d: quantkit.trainer.train(m, data=None, out=d / "a"), "data=None is not str or PathLike: pass data"),
    (lambda m, t, d: quantkit.trainer.merge(m, 5), "out=5 is not str or PathLike: pass out as one"),
    # taken as True
    (lambda m, t, d: quantkit.load(m, packed="no"), "packed='no' is not bool: pass packed as one"),
    (lambda m, t, d: quantkit.evaluate(m, t, packed="no"), "packed='no' is not bool or None: pass packed as one"),
    (lambda m, t, d: quantkit.quantize(m, out=d / "q", alone="no"), "alone='no' is not bool: pass alone as one")])
def test_api_arguments_of_another_type(tiny_dir, tmp_path, call, match):
    """A path or a switch of the wrong type is one QuantkitError naming the keyword, before any work; a
    number or numpy's bool is a switch."""
    import numpy as np

    text = tmp_path / "t.txt"
    text.write_text("some text " * 100)
    with pytest.raises(quantkit.QuantkitError, match=re.escape(match)):
        call(str(tiny_dir), text, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]
    assert quantkit.load(str(tiny_dir), packed=np.False_).tensors == {}  # argparse's counts, numpy's settings


@pytest.mark.parametrize("method,change,match", [
    ("rtn", {"bits": 4.0}, "bits is 4.0, not a whole number"),
    ("rtn", {"group_size": 32.0}, "group_size is 32.0, not a whole number"),
    ("nf4", {"blocksize": 64.0}, "blocksize is 64.0, not a whole number"),
    ("nf4", {"nested_offset": float("nan")}, "offset nan: the checkpoint's quant_state is corrupt"),
])
def test_quantization_settings_that_are_not_whole_or_finite(tiny_dir, capsys, monkeypatch, tmp_path, method, change,
                                                            match):
    """JSON's 4.0 passes `in (2, 3, 4, 8)` and broke the packed layers' indexing at the first forward; a NaN
    offset made every logit NaN. The packed load (eval's default) refuses them, as the dequantized one did."""
    import quantkit

    out = tmp_path / "q"
    quantkit.quantize(str(tiny_dir), method=method, bits=4, out=out, progress=False,
                      **({"double_quant": True} if method == "nf4" else {"group_size": 32}))
    (edit_bnb_state if method == "nf4" else edit_quantization_config)(out, change)
    code, line = run(["eval", out, "--data", TEST, "--max-windows", 1], capsys, monkeypatch)
    assert code == 2 and line.startswith("error: ") and match in line, line


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="there is a GPU here")
def test_cuda_without_a_gpu(model, capsys, monkeypatch, tmp_path):
    quantize_fails([model, "--device", "cuda"], capsys, monkeypatch, tmp_path, "torch sees no CUDA GPU")


def test_ctrl_c_says_what_was_kept_and_how_to_go_on(tiny_dir, capsys, monkeypatch, tmp_path):
    """Ctrl-C (or SIGTERM) after a finished layer printed only "aborted", though the same command goes on."""
    from quantkit import pipeline

    real = stopping_saves(monkeypatch)
    args = ["quantize", tiny_dir, "--group-size", 32, "--out", tmp_path / "q"]
    code, _, err = cli(args, capsys, monkeypatch)
    stopped = (f"stopped: the finished layers are kept beside {tmp_path / 'q'} (.q.progress.pt): run the same command "
               "to go on from them")
    assert code == 130 and [line for line in err if line][-2:] == [stopped, "aborted"], err
    monkeypatch.setattr(pipeline, "save_progress", real)
    code, _, err = cli(args, capsys, monkeypatch)
    assert code == 0 and any("resuming after layer 1/2" in line for line in err), err


def test_out_of_disk_space_keeps_what_was_finished_and_resumes(tiny_dir, capsys, monkeypatch, tmp_path):
    """The disk fills up in layer 1: a one-line error, no output, and once there is space again the
    same command resumes after layer 0 and writes what an uninterrupted run writes."""
    import errno

    from quantkit.exporters import shards

    args = ["quantize", tiny_dir, "--method", "gptq", "--group-size", 32, "--calib-data", TEST, "--calib-samples", 4,
            "--calib-seqlen", 48, "--max-shard-size", "30kB"]
    real, seen = shards.ShardWriter.add, []

    def add(self, name, tensor):
        if name.startswith("model.layers.1.") and not seen:
            seen.append(name)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, name, tensor)

    monkeypatch.setattr(shards.ShardWriter, "add", add)
    code, line = run([*args, "--out", tmp_path / "q"], capsys, monkeypatch)
    assert code == 2 and line.startswith(f"error: out of disk space writing {tmp_path / 'q'}: the export needs about ")
    assert "resumes" in line
    assert not (tmp_path / "q").exists() and (tmp_path / ".q.partial").is_dir() and (tmp_path / ".q.progress.pt").is_file()
    monkeypatch.setattr(sys, "argv", ["quantkit", *map(str, args), "--out", tmp_path / "q"])
    main()
    assert "resuming after layer 1/2" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["quantkit", *map(str, args), "--out", tmp_path / "whole"])
    main()
    for f in (tmp_path / "whole").iterdir():
        assert (tmp_path / "q" / f.name).read_bytes() == f.read_bytes(), f.name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "whole"]


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_an_output_that_appears_during_the_run_keeps_what_was_finished(tiny_dir, capsys, monkeypatch, tmp_path, fmt):
    """Something else writes --out while the run works: the writer refuses to finish (one line, exit
    2) before it touches what it wrote, so the finished layers stay resumable; once the other output
    is moved away the same command resumes after the last layer and writes what an uninterrupted run
    writes."""
    from quantkit import atomic

    method = ["--method", "gptq", "--group-size", 32] if fmt == "safetensors" else \
        ["--method", "rtn", "--imatrix", "--format", "gguf", "--gguf-type", "Q4_0"]
    args = ["quantize", tiny_dir, *method, "--calib-data", TEST, "--calib-samples", 4, "--calib-seqlen", 48]
    name = "q" if fmt == "safetensors" else "q.gguf"
    out = tmp_path / name
    real = atomic.Staged.check

    def appears(self):
        if fmt == "gguf":
            self.out.write_text("theirs")
        else:
            self.out.mkdir()
            (self.out / "theirs").write_text("theirs")
        return real(self)

    monkeypatch.setattr(atomic.Staged, "check", appears)
    code, line = run([*args, "--out", out], capsys, monkeypatch)
    assert code == 2 and line == (f"error: {out} appeared while this run was writing it: move it away (or pass "
                                  "--overwrite) and run the same command again")
    assert (out.read_text() if fmt == "gguf" else (out / "theirs").read_text()) == "theirs"
    assert (tmp_path / f".{name}.partial").exists() and (tmp_path / f".{name}.progress.pt").is_file()
    monkeypatch.setattr(atomic.Staged, "check", real)
    atomic.remove(out)
    monkeypatch.setattr(sys, "argv", ["quantkit", *map(str, args), "--out", out])
    main()
    assert "resuming after layer 2/2" in capsys.readouterr().err
    whole = tmp_path / f"whole{out.suffix}"
    monkeypatch.setattr(sys, "argv", ["quantkit", *map(str, args), "--out", whole])
    main()
    if fmt == "gguf":
        assert out.read_bytes() == whole.read_bytes()
    else:
        assert {f.name: f.read_bytes() for f in out.iterdir()} == {f.name: f.read_bytes() for f in whole.iterdir()}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, whole.name])


def test_two_runs_writing_the_same_output(model, capsys, monkeypatch, tmp_path):
    from quantkit.atomic import Staged

    holder = Staged(tmp_path / "out")  # another process's run, mid-way: it holds the lock
    # with --target-bpw, before the measurement pass (minutes), not when the output is opened after it
    monkeypatch.setattr("quantkit.api.measured", lambda *a, **kw: pytest.fail("measured"))
    try:
        for options in ([], ["--method", "gptq", "--target-bpw", 3.6, "--calib-data", TEST, "--calib-samples", 4,
                             "--calib-seqlen", 48]):
            code, line = run(["quantize", model, *options, "--out", tmp_path / "out"], capsys, monkeypatch)
            assert code == 2 and "is being written by another quantkit process" in line
    finally:
        holder.abort()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option", ["--bits", "--exl2-bits"])
def test_report_widths_that_are_not_numbers(option, capsys, monkeypatch, tmp_path):
    code, line = run(["report", "--out", tmp_path / "r", "--data", TEST, option, "4,x"], capsys, monkeypatch)
    assert code == 2 and line.startswith(f"error: {option} '4,x': give comma-separated numbers"), line
    assert not (tmp_path / "r").exists()


def test_an_out_that_is_or_holds_the_model_is_refused(model, capsys, monkeypatch, tmp_path):
    """With --overwrite, writing --out replaced the directory it names: the model read, and with a
    parent directory as --out, everything beside the model too."""
    before = sorted(p.name for p in model.iterdir())
    (tmp_path / "notes.txt").write_text("keep")
    for out, match in ((tmp_path, f"--out {tmp_path} holds {model}"), (model, f"--out {model} is {model}")):
        code, line = run(["quantize", model, "--out", out, "--overwrite"], capsys, monkeypatch)
        assert code == 2 and line.startswith("error: ") and match in line, line
    assert sorted(p.name for p in model.iterdir()) == before and (tmp_path / "notes.txt").read_text() == "keep"


def test_a_stray_safetensors_beside_the_model_is_not_read(model):
    """Without an index every *.safetensors was read, and a stale copy beside model.safetensors silently
    replaced the model's tensors (those of the file sorting last); then a tensor in two files was
    refused. transformers reads model.safetensors alone there, and so does quantkit now."""
    import torch

    state = load_file(model / "model.safetensors")
    save_file({k: torch.randn_like(v) for k, v in state.items()}, model / "old.safetensors")
    got = state_of(model)  # with the tied head beside them
    assert state.keys() <= got.keys() and all(torch.equal(got[k], state[k].float()) for k in state)


def state_of(path):
    """Every weight of the model at path as quantkit reads it."""
    import quantkit

    m = quantkit.load(str(path))
    m.materialize()
    return m.module.state_dict()


def test_a_tied_config_over_a_checkpoint_with_its_own_head(tmp_path):
    """config.json said tied while the checkpoint stored a different lm_head: the head was dropped for
    the embedding, silently (transformers uses the stored head, untied). A stored head equal to the
    embedding stays tied; a head stored alone gives the embedding too."""
    import torch

    model = make_tiny(tmp_path / "untied", tie_word_embeddings=False)
    stored = load_file(model / "model.safetensors")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": True}))
    with pytest.warns(UserWarning, match="the stored head is used, untied, as transformers does"):
        state = state_of(model)
    assert torch.equal(state["lm_head.weight"], stored["lm_head.weight"])
    assert torch.equal(state["model.embed_tokens.weight"], stored["model.embed_tokens.weight"])
    tied = make_tiny(tmp_path / "tied")
    want = state_of(tied)
    weights = load_file(tied / "model.safetensors")
    head = weights.pop("model.embed_tokens.weight")
    save_file(weights | {"lm_head.weight": head}, tied / "model.safetensors", metadata={"format": "pt"})
    got = state_of(tied)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_weights_saved_without_the_model_prefix_load(tiny_dir, tmp_path):
    """Keys saved from the base model's class (layers.0..., embed_tokens.weight) were read as a model of
    0 layers, "from different models"; transformers loads them."""
    import torch

    model = shutil.copytree(tiny_dir, tmp_path / "model")
    weights = load_file(model / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in weights.items()}, model / "model.safetensors",
              metadata={"format": "pt"})
    got, want = state_of(model), state_of(tiny_dir)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("change,match", [
    # Qwen2's biases under a Llama config: dropped, the model run without them
    (lambda w: w | {"model.layers.0.self_attn.q_proj.bias": w["model.layers.0.self_attn.q_proj.weight"][:, 0].clone()},
     "holds model.layers.0.self_attn.q_proj.bias (1 such), which config.json does not call for"),
    # a traceback from the NaN check
    (lambda w: w | {"model.layers.0.mlp.up_proj.weight": w["model.layers.0.mlp.up_proj.weight"].to(__import__(
        "torch").float8_e4m3fn)}, "already quantized to FP8 (model.layers.0.mlp.up_proj.weight)"),
    # a tensor that is no bias: the advice to fix attention_bias in config.json did not fit
    (lambda w: w | {"model.position_ids": __import__("torch").arange(8)},
     "holds model.position_ids (1 such), which config.json does not call for, so it would be dropped: remove them from "
     "model.safetensors, or pass the model"),
    # refused only when the pipeline reached layer 1
    (lambda w: w | {"model.layers.1.mlp.down_proj.weight": w["model.layers.1.mlp.down_proj.weight"][:, :96].clone()},
     "tensor model.layers.1.mlp.down_proj.weight has shape (64, 96) but config.json implies (64, 128)")])
def test_weights_that_disagree_with_the_config_are_refused_at_load(model, tmp_path, change, match):
    import quantkit

    weights = load_file(model / "model.safetensors")
    save_file(change(weights), model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(quantkit.QuantkitError, match=re.escape(match)):
        quantkit.load(str(model))


def test_the_index_says_which_shard_holds_a_tensor(model):
    """With an index, a stale copy of a tensor in another shard was read when its file sorted last."""
    import quantkit
    import torch

    weights = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    key, one, two = "model.layers.0.mlp.down_proj.weight", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    first = {k: v for k, v in weights.items() if ".layers.0." in k}
    save_file(first, model / one, metadata={"format": "pt"})
    rest = {k: v for k, v in weights.items() if k not in first}
    save_file(rest | {key: torch.zeros_like(weights[key])}, model / two, metadata={"format": "pt"})  # sorts last
    index = {k: one if k in first else two for k in weights}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    assert torch.equal(state_of(model)[key], weights[key])
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index | {"model.norm.weight": one}}))
    with pytest.raises(quantkit.QuantkitError, match=f"puts model.norm.weight in {one}, which does not hold it"):
        quantkit.load(str(model))
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(quantkit.QuantkitError, match="names no tensors: restore it"):
        quantkit.load(str(model))


def test_a_shard_this_user_cannot_read_is_named(model, monkeypatch):
    """It was called corrupt or truncated (root, who runs the suite, reads any file: os.access stands in)."""
    import os

    import quantkit

    shard = model / "model.safetensors"
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != shard and real(p, mode, **kw))
    with pytest.raises(quantkit.QuantkitError, match="model.safetensors: not readable by this user"):
        quantkit.load(str(model))


def test_a_weights_file_alone_and_a_hub_cache_folder_are_named(model, tmp_path, monkeypatch):
    """A safetensors file with no config beside it was called a damaged GGUF; a hub cache folder's hint
    named the snapshot sorting last, not the one its main branch points to; a hub id, a model object and
    a config naming custom code are named too."""
    import quantkit

    (tmp_path / "loose").mkdir()
    shutil.copy(model / "model.safetensors", tmp_path / "loose" / "model.safetensors")
    with pytest.raises(quantkit.QuantkitError, match="a weights file alone is not a model: pass the directory"):
        quantkit.load(str(tmp_path / "loose" / "model.safetensors"))
    hub = tmp_path / "models--org--tiny"
    for revision in ("abc123", "fff000"):
        shutil.copytree(model, hub / "snapshots" / revision)
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("abc123")
    with pytest.raises(quantkit.QuantkitError, match=f"holds its files in {re.escape(str(hub))}/snapshots/abc123"):
        quantkit.load(str(hub))
    with pytest.raises(quantkit.QuantkitError, match="nor in the local hub cache, and models are not fetched from the "
                                                      "hub: download it first, e.g. with huggingface-cli download "
                                                      "SomeOrg/some-model"):
        quantkit.load("SomeOrg/some-model")
    odd = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9"))  # Latin-1's byte for an e with an accent
    shutil.copytree(model, odd)
    with pytest.raises(quantkit.QuantkitError, match="the path is not UTF-8 .*: rename it"):  # every shard "corrupt"
        quantkit.load(str(odd))
    (tmp_path / "models").mkdir()  # a typo under a local directory: not a hub name
    monkeypatch.chdir(tmp_path)
    with pytest.raises(quantkit.QuantkitError, match=r"models/mymodel: no such file or directory: pass a model"):
        quantkit.load("models/mymodel")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(quantkit.QuantkitError, match="this is a LoRA adapter: quantkit merge it into its base first"):
        quantkit.load(str(adapter))
    with pytest.raises(quantkit.QuantkitError, match="model is a dict, not a model: pass a model directory"):
        quantkit.quantize({})  # a model object, say: was a TypeError from pathlib
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"auto_map": {"AutoModelForCausalLM": "modeling.MyLlama"}}))
    with pytest.warns(UserWarning, match="names custom code \\(auto_map\\), which quantkit does not run"):
        quantkit.load(str(model))


def test_checkpoints_that_are_not_float_causal_models_say_what_they_are(model, tiny_dir, capsys, monkeypatch,
                                                                         tmp_path):
    """A weights file passed for its directory was called a damaged GGUF; a float64 checkpoint already
    quantized; a classifier (tied, so no head was missing) was quantized as a causal model, its head
    dropped; an integer weight was found when its layer was reached, the layers before it quantized; an
    adapter's file beside model.safetensors was read as the model's."""
    import torch

    import quantkit
    from quantkit.errors import QuantkitError

    quantize_fails([model / "model.safetensors"], capsys, monkeypatch, tmp_path, "is a file of the model directory")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"architectures": ["LlamaForSequenceClassification"]}))
    quantize_fails([model], capsys, monkeypatch, tmp_path, "a LlamaForSequenceClassification, not a causal language")
    (model / "config.json").write_text(json.dumps(cfg))
    state = load_file(model / "model.safetensors")
    save_file({k: v.to(torch.float64) for k, v in state.items()}, model / "model.safetensors")
    quantize_fails([model], capsys, monkeypatch, tmp_path, "float64 weights")
    # an integer weight in the last layer: refused at load, from the header, not after the layers before it
    last = "model.layers.1.mlp.down_proj.weight"
    save_file(state | {last: state[last].to(torch.int8)}, model / "model.safetensors")
    with pytest.raises(QuantkitError, match=f"tensor {last} is I8, not a float type"):
        quantkit.load(model)
    # files beside model.safetensors that transformers does not read (an adapter kept beside its merge)
    # were read as weights, and the model refused for tensors its config does not call for
    save_file(state, model / "model.safetensors")
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 64)},
              model / "adapter_model.safetensors")
    assert quantkit.load(model).module.state_dict().keys() == quantkit.load(tiny_dir).module.state_dict().keys()


def test_one_part_of_a_split_gguf_is_refused(capsys, monkeypatch, tmp_path):
    """Its layer count disagreed with its tensors ("from different models"); export said it right."""
    from .test_gguf import small_gguf

    quantize_fails([small_gguf(tmp_path / "s.gguf", **{"split.count": 2})], capsys, monkeypatch, tmp_path,
                   "is one of 2 parts of a split GGUF: merge them first")


def test_exports_over_what_they_read_are_refused(model, capsys, monkeypatch, tmp_path):
    """quantkit export of a GGUF onto itself, and quantkit.export of a checkpoint into the directory
    that holds it, replaced what they read."""
    import quantkit
    from quantkit.errors import QuantkitError

    src = tmp_path / "m.gguf"
    quantkit.quantize(str(model), method="rtn", format="gguf", gguf_type="F16", out=src, progress=False)
    before = src.read_bytes()
    code, line = run(["export", src, "--out", src, "--gguf-type", "Q8_0", "--overwrite"], capsys, monkeypatch)
    assert code == 2 and line.startswith("error: ") and "which this command reads" in line, line
    assert src.read_bytes() == before
    (tmp_path / "q").mkdir()
    q = quantkit.quantize(str(model), method="rtn", bits=4, group_size=32, out=tmp_path / "q" / "ck", keep=True,
                          progress=False)
    with pytest.raises(QuantkitError, match="holds .*ck, which this command reads"):
        quantkit.export(quantkit.load(tmp_path / "q" / "ck"), tmp_path / "q", overwrite=True)
    assert q.tensors and (tmp_path / "q" / "ck" / "config.json").is_file()
    calib = tmp_path / "calib.txt"  # no --overwrite: the refusal names the input, not the existing file
    calib.write_text("text")
    with pytest.raises(QuantkitError, match="is .*calib.txt, which this command reads"):
        quantkit.quantize(str(model), method="gptq", calib_data=calib, out=calib, progress=False)


def test_an_out_that_a_models_linked_weights_lie_in_is_refused(model, capsys, monkeypatch, tmp_path):
    """A model directory whose weights are a link into --out (as the hub's cache links into blobs/):
    quantize --out that --overwrite replaced the directory, and the model's weights with it."""
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(model, b)
    a.mkdir()
    for f in model.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, a)
    (a / "model.safetensors").symlink_to(b / "model.safetensors")
    weights = (b / "model.safetensors").read_bytes()
    code, line = run(["quantize", a, "--out", b, "--overwrite", "--method", "rtn", "--group-size", 32], capsys,
                     monkeypatch)
    assert code == 2 and f"holds {a / 'model.safetensors'} (a link to {b / 'model.safetensors'}), which this command " \
        "reads" in line, line
    assert (b / "model.safetensors").read_bytes() == weights


def test_merge_over_the_base_its_adapter_names_is_refused(model, capsys, monkeypatch, tmp_path):
    """The base comes from the adapter's config when --base is not given: an --out holding it replaced
    the base model (and everything beside it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    get_peft_model(AutoModelForCausalLM.from_pretrained(model), LoraConfig(r=2, target_modules=["q_proj"])) \
        .save_pretrained(tmp_path / "adapter")
    before = sorted(p.name for p in model.iterdir())
    code, line = run(["merge", tmp_path / "adapter", "--out", model, "--overwrite"], capsys, monkeypatch)
    assert code == 2 and line.startswith("error: ") and f"is {model}, which this command reads" in line, line
    assert sorted(p.name for p in model.iterdir()) == before
