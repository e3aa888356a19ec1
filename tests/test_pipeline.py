import json
import os
import shutil

import pytest
import torch

import quantkit
from quantkit.calibration import load_text, sample_windows
from quantkit.errors import QuantkitError
from quantkit.layers import GROUPS, LINEARS
from quantkit.modelio import Model
from quantkit.pipeline import quantize_layers
from quantkit.quantizers import rtn

from .conftest import TEST, VALID, cli, loaded, make_tiny, refused, stopping_saves


def hessians_of(module, windows, layer_ids, groups):
    """2 X^T X / n of the inputs of the given linears, from one full forward pass."""
    out, handles = {}, []
    for i in layer_ids:
        for g in groups:
            name = f"model.layers.{i}.{g[0]}"

            def hook(m, args, name=name):
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                out[name] = 2 * x.T @ x / x.shape[0]

            handles.append(module.get_submodule(name).register_forward_pre_hook(hook))
    with torch.no_grad():
        module(windows, use_cache=False)
    for h in handles:
        h.remove()
    return out


def test_hessians_follow_the_quantized_layers(tiny_dir):
    m = loaded(tiny_dir)
    windows = sample_windows(m.tokenizer, load_text(VALID), 6, 64, seed=1)
    before = hessians_of(m.module, windows, [0], GROUPS)
    seen = {}

    def record(name, w, h):
        seen[name] = h.matrix()
        return rtn.quantize(w, 3, 32, sym=True)

    tensors = quantize_layers(m, record, windows, batch_size=4, progress=False)
    assert set(tensors) == {f"model.layers.{i}.{n}" for i in range(2) for n in LINEARS}
    # layer 0 sees the float model's activations
    for name, h in before.items():
        torch.testing.assert_close(seen[name], h.float(), rtol=1e-4, atol=1e-5)
    # layer 1's first group sees the outputs of the quantized layer 0, as the final model does
    after = hessians_of(m.module, windows, [1], GROUPS[:1])
    for name, h in after.items():
        torch.testing.assert_close(seen[name], h.float(), rtol=1e-4, atol=1e-5)
        assert not torch.allclose(seen[name], hessians_of(loaded(tiny_dir).module, windows, [1], GROUPS[:1])[name].float(), rtol=1e-4, atol=1e-5)
    # linears that share an input share its statistics
    assert torch.equal(seen["model.layers.0.self_attn.q_proj"], seen["model.layers.0.self_attn.v_proj"])


def test_rtn_without_calibration_quantizes_each_weight(tiny_dir):
    m = loaded(tiny_dir)
    original = {n: m.module.get_submodule(n).weight.clone() for n in (f"model.layers.{i}.{l}" for i in range(2) for l in LINEARS)}
    q = quantkit.quantize(m, bits=4, group_size=32, progress=False)
    for name, w in original.items():
        ref = rtn.quantize(w, 4, 32, True)
        assert torch.equal(q.tensors[name].codes, ref.codes)
        assert torch.equal(q.module.get_submodule(name).weight, ref.dequantize())


def test_true_sequential_feeds_quantized_outputs_within_a_layer(tiny_dir):
    m = quantkit.load(tiny_dir)  # read layer by layer as the pipeline goes
    windows = sample_windows(m.tokenizer, load_text(VALID), 4, 64, seed=2)
    seen = {}

    def record(name, w, h):
        seen[name] = h.matrix()
        return rtn.quantize(w, 3, 32, sym=True)

    quantize_layers(m, record, windows, batch_size=4, sequential=True, progress=False)
    # every group, in every layer, saw what the finished quantized model feeds it
    final = hessians_of(m.module, windows, [0, 1], GROUPS)
    for name, h in final.items():
        torch.testing.assert_close(seen[name], h.float(), rtol=1e-4, atol=1e-5)


def test_gptq_through_the_pipeline_beats_rtn(tiny_dir):
    base = quantkit.load(tiny_dir)
    ref = quantkit.evaluate(base, TEST, "wikitext", 128, 8, progress=False).perplexity
    errors = {}
    for method in ("rtn", "gptq"):
        m = quantkit.quantize(str(tiny_dir), method=method, bits=3, group_size=32, calib_data=VALID,
                              calib_samples=16, calib_seqlen=128, progress=False)
        errors[method] = quantkit.evaluate(m, TEST, "wikitext", 128, 8, progress=False).perplexity
        if method == "gptq":
            assert len(m.losses) == 14 and all(v > 0 for v in m.losses.values())
    assert abs(errors["gptq"] - ref) < abs(errors["rtn"] - ref), (ref, errors)


def files(directory):
    return {f.name: f.read_bytes() for f in sorted(directory.iterdir())}


@pytest.mark.parametrize("method,target", [("gptq", "quantkit.quantizers.gptq.quantize"),
                                           ("awq", "quantkit.quantizers.awq.quantize_layer")])
def test_an_interrupted_export_resumes_after_the_last_finished_layer(tiny_dir, tmp_path, monkeypatch, capsys, method,
                                                                     target):
    """Killed in layer 1 of 2, in the middle of a shard: the same command goes on from layer 1 and
    writes the same bytes as a run that was never interrupted (AWQ: with layer 0's folded norms)."""
    kw = dict(method=method, bits=4, group_size=32, calib_data=VALID, calib_samples=4, calib_seqlen=48,
              max_shard_size="30kB", progress=False)
    quantkit.quantize(str(tiny_dir), out=tmp_path / "whole", **kw)
    module, name = target.rsplit(".", 1)
    real, calls, killed = getattr(__import__(module, fromlist=[name]), name), [], []

    def dies_in_layer_1(*args, **kwargs):
        calls.append(kwargs.get("name") or kwargs.get("prefix"))
        if "layers.1." in calls[-1] and not killed:
            killed.append(calls[-1])
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(target, dies_in_layer_1)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tiny_dir), out=tmp_path / "q", **kw)
    assert not (tmp_path / "q").exists() and (tmp_path / ".q.partial").is_dir()
    calls.clear()
    quantkit.quantize(str(tiny_dir), out=tmp_path / "q", **kw)
    assert "resuming after layer 1/2" in capsys.readouterr().err
    assert calls and all("layers.1." in c for c in calls)
    assert files(tmp_path / "q") == files(tmp_path / "whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "whole"]  # no progress, partial or lock left


def test_a_run_killed_in_its_commit_resumes(tiny_dir, tmp_path, monkeypatch, capsys):
    """Killed once its files are complete but before the output is in place, the same command resumes
    instead of starting afresh, also with the model's path spelled another way; killed between the
    renames of an --overwrite, it leaves no copy of the previous output behind."""
    from quantkit.atomic import Staged

    kw = dict(method="rtn", max_shard_size="30kB", progress=False)
    quantkit.quantize(str(tiny_dir), out=tmp_path / "whole", **kw)
    real = Staged.commit

    def killed(self, scratch=()):
        raise KeyboardInterrupt

    for overwrite in (False, True):
        monkeypatch.setattr(Staged, "commit", killed)
        with pytest.raises(KeyboardInterrupt):
            quantkit.quantize(str(tiny_dir), out=tmp_path / "q", overwrite=overwrite, **kw)
        partial = tmp_path / ".q.partial"
        assert (partial / "config.json").is_file() and len(list(partial.glob("model-*-of-*.safetensors"))) > 1
        if overwrite:  # as a kill after commit's first rename leaves it
            (tmp_path / "q").rename(tmp_path / ".q.old-4242")
        monkeypatch.setattr(Staged, "commit", real)
        monkeypatch.chdir(tiny_dir.parent)
        quantkit.quantize(tiny_dir.name if overwrite else str(tiny_dir), out=tmp_path / "q", overwrite=overwrite, **kw)
        assert "resuming after layer 2/2" in capsys.readouterr().err
        q, whole = files(tmp_path / "q"), files(tmp_path / "whole")
        for written in (q, whole):  # the model's path as given
            written["config.json"] = {**json.loads(written["config.json"]), "_name_or_path": None}
        assert q == whole
        assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "whole"]


def test_a_kill_once_the_scratch_files_are_gone_loses_nothing(tmp_path, monkeypatch):
    """commit removed the scratch files (an export's spill, the trainer's checkpoints) before the rename that
    puts the output in place: killed in between, the output was whole but not in place, and nothing was left
    to resume from, so the next run started afresh (hours of layers or of training). The output is now put
    in place first and the scratch removed from it: a kill there leaves the output in place."""
    from quantkit import atomic

    out = tmp_path / "q"
    staged = atomic.Staged(out)
    d = staged.fresh()
    (d / "adapter_model.safetensors").write_text("the adapter")
    (d / "checkpoints").mkdir()
    (d / "checkpoints" / "step-9").write_text("every step")
    real = atomic.remove

    def killed(path):  # the kill lands right after the scratch is gone
        real(path)
        if path.name == "checkpoints":
            raise KeyboardInterrupt

    monkeypatch.setattr(atomic, "remove", killed)
    try:
        with pytest.raises(KeyboardInterrupt):
            staged.commit([d / "checkpoints"])
    finally:
        staged.abort()  # as its writer's caller does
    assert (out / "adapter_model.safetensors").read_text() == "the adapter"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_an_output_moved_aside_by_a_killed_commit_is_put_back(tmp_path):
    """Killed between an --overwrite commit's two renames (the previous output moved aside, the new one
    not yet in place, its progress gone with the scratch files), the next run started afresh and
    deleted the previous output with the rest. It is now put back first; replacing it takes --overwrite."""
    from quantkit.atomic import Staged

    out = tmp_path / "q"
    out.mkdir()
    (out / "config.json").write_text("{}")  # the previous output
    staged = Staged(out, overwrite=True)
    (staged.fresh() / "new").write_text("the new output")
    out.rename(tmp_path / ".q.old-4242")  # as the kill leaves it
    staged.unlock()
    with pytest.raises(QuantkitError, match=r"q is back in place: a run with overwrite=True was stopped while putting "
                                            r"its output there.*pass overwrite=True to replace it"):
        again = Staged(out)
        try:
            again.fresh()
        finally:
            again.abort()  # as its writer's caller does
    assert [p.name for p in out.iterdir()] == ["config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # what the failed start made, removed
    (tmp_path / ".q.old-4242").mkdir()  # the same window again; this run replaces it, as asked
    out.rename(tmp_path / ".q.old-4243")
    (tmp_path / ".q.old-4242").rmdir()
    staged = Staged(out, overwrite=True)
    (staged.fresh() / "new").write_text("the new output")
    staged.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"] and [p.name for p in out.iterdir()] == ["new"]


def test_a_model_rewritten_at_the_same_path_is_not_resumed_from(tmp_path, monkeypatch, capsys):
    """Killed in layer 1, then the checkpoint at that path replaced by another model: the same command
    is refused, keeping the finished layer (they were of other weights); with overwrite it starts afresh
    and writes what a run on the new model writes."""
    kw = dict(method="gptq", bits=4, group_size=32, calib_data=VALID, calib_samples=4, calib_seqlen=48, progress=False)
    make_tiny(tmp_path / "other", seed=1)
    quantkit.quantize(str(tmp_path / "other"), out=tmp_path / "want", **kw)
    make_tiny(tmp_path / "m", seed=0)
    real = quantkit.quantizers.gptq.quantize

    def dies_in_layer_1(*args, **kwargs):
        if "layers.1." in kwargs["name"]:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr("quantkit.quantizers.gptq.quantize", dies_in_layer_1)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tmp_path / "m"), out=tmp_path / "q", **kw)
    monkeypatch.undo()
    shutil.rmtree(tmp_path / "m")
    shutil.copytree(tmp_path / "other", tmp_path / "m")
    kept = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(QuantkitError, match=r"\.q\.partial holds 1 of 2 layers of another run writing .*q \(the "
                                            r"model's files changed since it started\): run that command again to go on "
                                            r"from them, or pass overwrite=True to discard them and start afresh"):
        quantkit.quantize(str(tmp_path / "m"), out=tmp_path / "q", **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == kept and ".q.progress.pt" in kept
    capsys.readouterr()
    quantkit.quantize(str(tmp_path / "m"), out=tmp_path / "q", overwrite=True, **kw)
    assert "ignoring progress file" in capsys.readouterr().err
    got, want = files(tmp_path / "q"), files(tmp_path / "want")
    assert got == want  # config.json too: it names no source path


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_a_model_rewritten_while_it_is_read_stops_the_run(tmp_path, monkeypatch, fmt):
    """The model's file replaced by another model's after layer 0 is quantized (each read opens the
    file afresh, so the rest would come from the new one): the run stops with one error naming the
    file and writes nothing; run again, it starts afresh and writes what a run on the new model writes."""
    make_tiny(tmp_path / "other", seed=1)
    make_tiny(tmp_path / "m", seed=0)
    if fmt == "gguf":  # each model as an F32 GGUF file, quantized to a mix of llama.cpp's types
        for name in ("other", "m"):
            quantkit.api.export_gguf(quantkit.load(tmp_path / name), tmp_path / f"{name}.gguf", "F32", progress=False)
        source, other, file = tmp_path / "m.gguf", tmp_path / "other.gguf", tmp_path / "m.gguf"
        kw, out, want = dict(gguf_type="Q4_K_M", format="gguf"), tmp_path / "q.gguf", tmp_path / "want.gguf"
    else:
        source, other, file = tmp_path / "m", tmp_path / "other", tmp_path / "m" / "model.safetensors"
        kw = dict(method="gptq", bits=4, group_size=32, calib_data=VALID, calib_samples=4, calib_seqlen=48)
        out, want = tmp_path / "q", tmp_path / "want"
    quantkit.quantize(str(other), out=want, progress=False, **kw)
    real, rewritten = Model.release, []

    def rewrites_the_model_after_layer_0(self, prefix):
        real(self, prefix)
        if prefix == "model.layers.0":
            shutil.copy(other / file.name if other.is_dir() else other, tmp_path / "copy")
            os.replace(tmp_path / "copy", file)
            rewritten.append(True)

    monkeypatch.setattr(Model, "release", rewrites_the_model_after_layer_0)
    with pytest.raises(QuantkitError, match="changed or went after the model was loaded") as e:
        quantkit.quantize(str(source), out=out, progress=False, **kw)
    assert rewritten and str(file) in str(e.value)
    assert not out.exists()
    monkeypatch.undo()
    quantkit.quantize(str(source), out=out, progress=False, **kw)
    assert (files(out) == files(want)) if out.is_dir() else out.read_bytes() == want.read_bytes()


def test_a_gguf_replaced_while_its_header_is_read_is_refused_at_the_first_read(tiny_dir, tmp_path, monkeypatch):
    """The file is stamped before its header is read: one replaced in between gave the other file's
    weights at the header's offsets, with no error."""
    from quantkit import modelio

    for name, seed in (("m", 0), ("other", 1)):
        quantkit.api.export_gguf(quantkit.load(make_tiny(tmp_path / name, seed=seed)), tmp_path / f"{name}.gguf", "F32",
                                 progress=False)
    real = modelio.gguf_header

    def replaced_after_the_header(path):
        read = real(path)
        shutil.copy(tmp_path / "other.gguf", tmp_path / "copy")
        os.replace(tmp_path / "copy", path)
        return read

    monkeypatch.setattr(modelio, "gguf_header", replaced_after_the_header)
    m = quantkit.load(tmp_path / "m.gguf")
    monkeypatch.undo()
    with pytest.raises(QuantkitError, match="m.gguf changed or went after the model was loaded"):
        m.materialize()


def test_another_runs_finished_layers_are_kept_until_overwrite(tiny_dir, tmp_path, capsys, monkeypatch):
    """Stopped after layer 0, then run again with other settings: refused with one error line naming
    what differs, the finished layer kept; the first command then goes on from it and writes what an
    uninterrupted run writes, and --overwrite starts the other run afresh. These layers were deleted
    (hours of a large model's, to a mistyped option)."""
    from quantkit import pipeline

    def args(out, *more):
        return ["quantize", tiny_dir, "--group-size", 32, "--out", out, *more]

    for out in ("whole", "whole3"):
        assert cli(args(tmp_path / out, *["--bits", 3] * (out == "whole3")), capsys, monkeypatch)[0] == 0
    real = stopping_saves(monkeypatch)
    assert cli(args(tmp_path / "q"), capsys, monkeypatch)[0] == 130
    monkeypatch.setattr(pipeline, "save_progress", real)
    kept = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith(".q.progress")}
    refused(args(tmp_path / "q", "--bits", 3), capsys, monkeypatch,
            f"{tmp_path / '.q.partial'} holds 1 of 2 layers of another run writing {tmp_path / 'q'} (it ran with "
            "bits=4, this command with bits=3): run that command again to go on from them, or pass --overwrite to "
            "discard them and start afresh")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith(".q.progress")} == kept
    code, _, err = cli(args(tmp_path / "q"), capsys, monkeypatch)
    assert code == 0 and any("resuming after layer 1/2" in line for line in err), err
    assert files(tmp_path / "q") == files(tmp_path / "whole")

    stopping_saves(monkeypatch)
    assert cli(args(tmp_path / "r"), capsys, monkeypatch)[0] == 130
    monkeypatch.setattr(pipeline, "save_progress", real)
    code, _, err = cli(args(tmp_path / "r", "--bits", 3, "--overwrite"), capsys, monkeypatch)
    assert code == 0 and not any("resuming" in line for line in err), err
    assert files(tmp_path / "r") == files(tmp_path / "whole3")


def test_another_calibration_is_named_in_the_refusal(tiny_dir, tmp_path, capsys, monkeypatch):
    """Finished layers calibrated otherwise are refused naming the calibration option that differs; the
    same options on a text changed since say so."""
    from quantkit import pipeline

    text = tmp_path / "calib.txt"
    text.write_text(VALID.read_text()[:200_000])

    def args(*more):
        return ["quantize", tiny_dir, "--method", "gptq", "--group-size", 32, "--calib-data", text, "--calib-samples",
                4, "--calib-seqlen", 32, "--out", tmp_path / "q", *more]

    real = stopping_saves(monkeypatch)
    assert cli(args(), capsys, monkeypatch)[0] == 130
    monkeypatch.setattr(pipeline, "save_progress", real)
    refused(args("--calib-samples", 8, "--seed", 1), capsys, monkeypatch,
            "(it ran with calib_samples=4 and seed=0, this command with calib_samples=8 and seed=1)")
    text.write_text(VALID.read_text()[200_000:400_000])
    refused(args(), capsys, monkeypatch, "(its calibration text or importance matrix has changed since it started)")


def test_a_target_bpw_run_resumes_with_the_settings_it_spent(tiny_dir, tmp_path, monkeypatch, capsys):
    """--target-bpw's progress holds the settings its measurement spent as well as the user's: the same
    command, reading the same measurement (its path spelled another way), goes on from them, not refused
    as another run."""
    from quantkit import pipeline

    kw = dict(method="gptq", target_bpw=3.5, measurement=tmp_path / "m.json", calib_data=VALID, calib_samples=4,
              calib_seqlen=48, progress=False)
    quantkit.quantize(str(tiny_dir), out=tmp_path / "whole", **kw)
    real = stopping_saves(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tiny_dir), out=tmp_path / "q", **kw)
    monkeypatch.setattr(pipeline, "save_progress", real)
    assert pipeline.read_progress(tmp_path / ".q.progress.pt")["key"]["spent"]["rules"], "nothing was spent"
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)  # the measurement by another spelling of its path: the same file
    quantkit.quantize(str(tiny_dir), out=tmp_path / "q", **{**kw, "measurement": "m.json"})
    assert "resuming after layer 1/2" in capsys.readouterr().err
    assert files(tmp_path / "q") == files(tmp_path / "whole")


def test_a_gguf_run_on_a_moved_calibration_text_is_another_run(tiny_dir, tmp_path, monkeypatch):
    """--imatrix records its calibration text's path in the GGUF header, which a run writes first: the
    same windows read from another path resumed onto the killed run's header, and the file differed
    from an uninterrupted run's. Now that is another run, refused, and with overwrite written afresh."""
    from quantkit import pipeline

    moved = shutil.copy(VALID, tmp_path / "moved.txt")
    kw = dict(format="gguf", gguf_type="Q4_K_M", imatrix=True, calib_samples=4, calib_seqlen=48, progress=False)
    quantkit.quantize(str(tiny_dir), out=tmp_path / "whole.gguf", calib_data=moved, **kw)
    real = stopping_saves(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tiny_dir), out=tmp_path / "q.gguf", calib_data=VALID, **kw)
    monkeypatch.setattr(pipeline, "save_progress", real)
    with pytest.raises(QuantkitError, match=r"\(its GGUF header's record of the importance matrix \(quantize\.imatrix\.\*\) "
                                            r"differs; its calibration text \(calib_data\) differs\)"):
        quantkit.quantize(str(tiny_dir), out=tmp_path / "q.gguf", calib_data=moved, **kw)
    with pytest.raises(QuantkitError, match=r"\(it ran with imatrix=True, this command with imatrix=False;"):
        quantkit.quantize(str(tiny_dir), out=tmp_path / "q.gguf", **{**kw, "imatrix": False, "calib_samples": 128,
                                                                       "calib_seqlen": 512})
    quantkit.quantize(str(tiny_dir), out=tmp_path / "q.gguf", calib_data=moved, overwrite=True, **kw)
    assert (tmp_path / "q.gguf").read_bytes() == (tmp_path / "whole.gguf").read_bytes()


def test_a_target_bpw_run_whose_measurement_spends_otherwise_is_another_run(tiny_dir, tmp_path, monkeypatch):
    """--for exllama narrows the measurement's candidates, so the same options without it spend the bits
    otherwise: that run is refused once its measurement is made (the check after it never ran, and the
    finished layers were deleted)."""
    from quantkit import pipeline

    kw = dict(method="rtn", target_bpw=4.9, out=tmp_path / "q", calib_data=VALID, calib_samples=16, calib_seqlen=64,
              progress=False)
    real = stopping_saves(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tiny_dir), targets=("exllama",), **kw)
    monkeypatch.setattr(pipeline, "save_progress", real)
    kept = (tmp_path / ".q.progress.pt").read_bytes()
    with pytest.raises(QuantkitError, match=r"another run writing .*q \(its measurement for target_bpw gave other "
                                            r"settings\)"):
        quantkit.quantize(str(tiny_dir), **kw)
    assert (tmp_path / ".q.progress.pt").read_bytes() == kept


def test_train_quantize_refuses_another_runs_layers_before_training(tiny_dir, tmp_path, capsys, monkeypatch):
    """train --quantize over another run's finished layers at --quantize-out: refused before the training
    (it was refused after training and merging, with advice that trained again)."""
    from quantkit import pipeline

    text = tmp_path / "train.txt"
    text.write_text(VALID.read_text()[:30_000])
    real = stopping_saves(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tiny_dir), method="gptq", group_size=32, out=tmp_path / "a-gptq", calib_data=VALID,
                          calib_samples=4, calib_seqlen=48, progress=False)
    monkeypatch.setattr(pipeline, "save_progress", real)
    args = ["train", tiny_dir, "--data", text, "--steps", 2, "--seqlen", 32, "--batch-size", 2, "--rank", 4,
            "--out", tmp_path / "a", "--quantize", "gptq", "--group-size", 32, "--calib-data", VALID,
            "--calib-samples", 4, "--calib-seqlen", 48]
    refused(args, capsys, monkeypatch, f"holds 1 of 2 layers of another run writing {tmp_path / 'a-gptq'} (this "
                                       "command first makes the model it quantizes): run that command again")
    assert not (tmp_path / "a").exists() and not (tmp_path / "a-merged").exists()
    assert (tmp_path / ".a-gptq.progress.pt").is_file() and (tmp_path / ".a-gptq.partial").is_dir()


def test_a_torchrun_jobs_layers_are_kept_from_one_process(tiny_dir, tmp_path, monkeypatch):
    """A job of 2 processes stopped after layer 0, run again in one process: its progress files have
    other names (.q.progress-0.pt), and were dropped unread; now the run is refused, naming the processes."""
    from quantkit import pipeline
    from quantkit.atomic import progress_path

    out = tmp_path / "q"
    real = stopping_saves(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tiny_dir), group_size=32, out=out, progress=False)
    monkeypatch.setattr(pipeline, "save_progress", real)
    state = pipeline.read_progress(progress_path(out))
    state["key"]["processes"] = 2  # as rank 0 of that job saved it
    pipeline.save_progress(progress_path(out, 0), state)
    progress_path(out).unlink()
    with pytest.raises(QuantkitError, match=r"\(it ran with processes=2, this command with processes=1\)"):
        quantkit.quantize(str(tiny_dir), group_size=32, out=out, progress=False)
    assert progress_path(out, 0).is_file()


def test_a_progress_saved_by_an_earlier_format_starts_afresh(tiny_dir, tmp_path, monkeypatch, capsys):
    """A run stopped under a quantkit whose progress meant something else (format 1: one attention mask
    for every kind of layer) is the same run by its key, but its layers are not gone on from: the
    command says so and writes what an uninterrupted run writes."""
    from quantkit import pipeline
    from quantkit.atomic import progress_path

    kw = dict(method="gptq", bits=4, group_size=32, calib_data=VALID, calib_samples=4, calib_seqlen=48, progress=False)
    quantkit.quantize(str(tiny_dir), out=tmp_path / "whole", **kw)
    real = stopping_saves(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tiny_dir), out=tmp_path / "q", **kw)
    monkeypatch.setattr(pipeline, "save_progress", real)
    state = pipeline.read_progress(progress_path(tmp_path / "q"))
    del state["format"]  # as quantkit saved it before the format had a number
    pipeline.save_progress(progress_path(tmp_path / "q"), state)
    capsys.readouterr()
    quantkit.quantize(str(tiny_dir), out=tmp_path / "q", **kw)
    err = capsys.readouterr().err
    assert f"ignoring progress file {progress_path(tmp_path / 'q')}: another version of quantkit saved it " \
           f"(format 1, this one reads {pipeline.LAYERS_FORMAT}), so the run starts afresh" in err
    assert "resuming" not in err
    assert files(tmp_path / "q") == files(tmp_path / "whole")


def test_progress_is_saved_behind_the_next_layer(tiny_dir, tmp_path, monkeypatch):
    """Layer 0's progress is written while layer 1 is quantized (it waited on the disk: 3.3 s a layer for
    a 7B's 128 windows), and holds layer 0's end: held back until layer 1 has replaced the calibration
    activations and written its tensors, then stopped there, the run resumes into what an uninterrupted
    run writes."""
    import threading

    from quantkit import pipeline
    from quantkit.modelio import Model

    kw = dict(method="gptq", bits=4, group_size=32, calib_data=VALID, calib_samples=4, calib_seqlen=48, progress=False)
    quantkit.quantize(str(tiny_dir), out=tmp_path / "whole", **kw)
    real_save, real_release, released = pipeline.save_progress, Model.release, threading.Event()

    def release(self, prefix):  # after the layer's tensors went to the writer
        real_release(self, prefix)
        if prefix == "model.layers.1":
            released.set()

    def save_late(path, state):
        assert released.wait(60), "the save held up the next layer"
        real_save(path, state)
        raise KeyboardInterrupt

    monkeypatch.setattr(Model, "release", release)
    monkeypatch.setattr(pipeline, "save_progress", save_late)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tiny_dir), out=tmp_path / "q", **kw)
    monkeypatch.setattr(pipeline, "save_progress", real_save)
    assert pipeline.read_progress(tmp_path / ".q.progress.pt")["next_layer"] == 1
    quantkit.quantize(str(tiny_dir), out=tmp_path / "q", **kw)
    assert files(tmp_path / "q") == files(tmp_path / "whole")


def test_progress_is_saved_at_once_where_a_copy_would_not_fit(tiny_dir, tmp_path, monkeypatch):
    """Where the activations take more than half the free host memory, each save is made by the run
    itself before the next layer begins (a thread would hold a second copy of them)."""
    import threading

    from quantkit import pipeline

    real_save, by = pipeline.save_progress, []

    def save(path, state):
        by.append(threading.current_thread() is threading.main_thread())
        real_save(path, state)

    monkeypatch.setattr(pipeline, "save_progress", save)
    monkeypatch.setattr(pipeline, "free_bytes", lambda device: 1)
    quantkit.quantize(str(tiny_dir), method="gptq", group_size=32, calib_data=VALID, calib_samples=4, calib_seqlen=48,
                      out=tmp_path / "q", progress=False)
    assert by == [True, True]


def test_another_runs_progress_is_not_used(tiny_dir, tmp_path, capsys):
    kw = dict(method="gptq", bits=4, group_size=32, calib_data=VALID, calib_samples=4, calib_seqlen=48, progress=False)
    (tmp_path / ".q.progress.pt").write_bytes(b"cut short by a kill")
    quantkit.quantize(str(tiny_dir), out=tmp_path / "q", **kw)
    assert "ignoring unreadable progress file" in capsys.readouterr().err


def test_layers_stream_one_at_a_time_in_the_checkpoints_dtype(tiny_dir, tmp_path, monkeypatch):
    """A bf16 checkpoint: each layer is read when its turn comes, in bf16, and dropped after; never two
    decoder layers in memory. RTN of the bf16 weights read this way equals RTN of their float32 values."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(tmp_path / "bf16")
    m = quantkit.load(tmp_path / "bf16")
    assert all(p.is_meta for p in m.module.parameters())
    real, seen = quantkit.Model.materialize, []

    def materialize(self, prefix="", device="cpu", dtype=torch.float32):
        module = real(self, prefix, device, dtype)
        resident = [i for i, layer in enumerate(self.layers) if not next(layer.parameters()).is_meta]
        seen.append((prefix, module.weight.dtype if hasattr(module, "weight") else next(module.parameters()).dtype,
                     resident))
        return module

    monkeypatch.setattr(quantkit.Model, "materialize", materialize)
    quantkit.quantize(m, bits=4, group_size=32, out=tmp_path / "q", progress=False)
    layers = [(p, dt, r) for p, dt, r in seen if p.startswith("model.layers.")]
    assert [p for p, _, _ in layers] == ["model.layers.0", "model.layers.1"]
    assert all(dt == torch.bfloat16 and len(r) == 1 for _, dt, r in layers), layers
    assert all(p.is_meta for p in m.module.parameters())  # all dropped again
    with pytest.raises(quantkit.QuantkitError, match="written to .* and not kept in memory"):
        m.materialize()
    back = quantkit.load(tmp_path / "q")
    w = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").model.layers[1].mlp.down_proj.weight
    assert torch.equal(back.tensors["model.layers.1.mlp.down_proj"].codes, rtn.quantize(w.float(), 4, 32, True).codes)


def test_a_streamed_layer_keeps_its_linears_small_and_quantizes_as_in_memory(tiny_dir, tmp_path, monkeypatch):
    """Streamed GPTQ of a bf16 checkpoint: while a linear is quantized, no other linear of its layer
    holds float32 weights (those waiting are bf16, those done only their codes), and the export is
    what the run that keeps the whole float32 model in memory makes, code for code."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.quantizers import gptq

    AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(tmp_path / "bf16")
    m, real, seen = quantkit.load(tmp_path / "bf16"), gptq.quantize, []

    def spy(w, h, *args, name="layer", **kwargs):
        layer = m.layers[int(name.split(".")[2])]
        others = [layer.get_submodule(other).weight for other in LINEARS if not name.endswith(other)]
        seen.append((name, w.dtype, sorted({(t.dtype, t.numel() > 0) for t in others}, key=str)))
        return real(w, h, *args, name=name, **kwargs)

    monkeypatch.setattr(gptq, "quantize", spy)
    settings = dict(method="gptq", bits=4, group_size=32, calib_data=VALID, calib_samples=8, calib_seqlen=64,
                    progress=False)
    quantkit.quantize(m, out=tmp_path / "q", **settings)
    assert len(seen) == 14
    assert all(dtype == torch.bfloat16 for _, dtype, _ in seen)
    assert all(others in ([(torch.bfloat16, True)], [(torch.bfloat16, False)], [(torch.bfloat16, False), (torch.bfloat16, True)])
               for _, _, others in seen), seen
    monkeypatch.setattr(gptq, "quantize", real)
    kept = quantkit.quantize(quantkit.load(tmp_path / "bf16"), **settings)  # float32 in memory throughout
    back = quantkit.load(tmp_path / "q")
    for name, qt in kept.tensors.items():
        assert torch.equal(back.tensors[name].codes, qt.codes) and torch.equal(back.tensors[name].scales, qt.scales)


def test_a_streamed_gguf_layer_dequantizes_each_linear_once(tiny256, tmp_path, monkeypatch):
    """GGUF blocks dequantize only on the CPU (gguf-py's numpy): a streamed layer with calibration dequantized
    each quantized linear again at every call, 9 times a batch and layer (a 70B layer: minutes a batch)."""
    from quantkit.qtensor import QuantizedTensor

    real, calls = QuantizedTensor.dequantize, []

    def counted(self, *args, **kwargs):
        calls.append(self.ggml)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(QuantizedTensor, "dequantize", counted)
    quantkit.quantize(str(tiny256), method="rtn", format="gguf", gguf_type="Q4_0", imatrix=True, calib_data=VALID,
                      calib_samples=16, calib_seqlen=32, out=tmp_path / "q.gguf", progress=False)  # 2 batches
    assert calls == ["Q4_0"] * 7 * 2


def test_an_importance_matrix_sums_only_the_hessians_diagonal(tiny256, tmp_path, monkeypatch):
    """GGUF's RTN reads only diag(H), yet the whole X^T X was summed (down_proj of a 70B model: 3.3 GB of
    sums a layer, reduced over torchrun's processes and copied to the CPU whole): now only the diagonal,
    the whole's to float32's precision. GPTQ onto GGUF types still sums the whole."""
    from quantkit import pipeline

    x = torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(0))
    whole, diagonal = pipeline.Hessian(96), pipeline.Hessian(96, diagonal=True)
    for h in (whole, diagonal):
        h.add_batch(x)
        h.add_batch(3 * x[:1])
    assert not diagonal.blocks and diagonal.count == whole.count == 160
    assert torch.allclose(diagonal.diagonal(), whole.matrix().diagonal(), rtol=1e-6, atol=0)
    made = []

    class Seen(pipeline.Hessian):
        def __init__(self, cols, device="cpu", diagonal=False):
            made.append(diagonal)
            super().__init__(cols, device, diagonal)

    monkeypatch.setattr(pipeline, "Hessian", Seen)
    kw = dict(format="gguf", gguf_type="Q4_0", calib_data=VALID, calib_samples=4, calib_seqlen=32, progress=False)
    quantkit.quantize(str(tiny256), method="rtn", imatrix=True, out=tmp_path / "rtn.gguf", **kw)
    assert made and all(made)
    made.clear()
    quantkit.quantize(str(tiny256), method="gptq", out=tmp_path / "gptq.gguf", **kw)
    assert made and not any(made)


def test_a_lean_layer_is_whole_again_when_quantization_fails(tiny_dir):
    """A quantizer failing midway through a layer leaves it whole: every linear float32 with its own
    forward again (the ones already quantized dequantized)."""
    m = loaded(tiny_dir)
    windows = sample_windows(m.tokenizer, load_text(VALID), 4, 64, seed=1)
    done = {}

    def failing(name, w, h):
        if len(done) == 4:
            raise RuntimeError("out of patience")
        done[name] = rtn.quantize(w, 4, 32, sym=True)
        return done[name]

    with pytest.raises(RuntimeError, match="patience"):
        quantize_layers(m, failing, windows, batch_size=4, sequential=True, keep=False, progress=False)
    layer = m.layers[0]
    for name in LINEARS:
        linear = layer.get_submodule(name)
        assert "forward" not in vars(linear) and linear.weight.dtype == torch.float32
        if f"model.layers.0.{name}" in done:
            assert torch.equal(linear.weight, done[f"model.layers.0.{name}"].dequantize())
        else:
            assert linear.weight.shape == (linear.out_features, linear.in_features)


def test_progress_whose_partial_output_is_gone_starts_afresh(tiny_dir, tmp_path, monkeypatch, capsys):
    kw = dict(method="gptq", bits=4, group_size=32, calib_data=VALID, calib_samples=4, calib_seqlen=48, progress=False)
    quantkit.quantize(str(tiny_dir), out=tmp_path / "whole", **kw)
    real = quantkit.quantizers.gptq.quantize

    def dies_in_layer_1(*args, **kwargs):
        if "layers.1." in kwargs["name"]:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(quantkit.quantizers.gptq, "quantize", dies_in_layer_1)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tiny_dir), out=tmp_path / "q", **kw)
    monkeypatch.setattr(quantkit.quantizers.gptq, "quantize", real)
    for spill in (tmp_path / ".q.partial").glob(".spill-*"):  # as a kill while closing leaves it
        spill.unlink()
    quantkit.quantize(str(tiny_dir), out=tmp_path / "q", **kw)
    assert "the partial output it describes is gone" in capsys.readouterr().err
    assert files(tmp_path / "q") == files(tmp_path / "whole")


@pytest.mark.parametrize("fmt", ["gptq", "gguf"])
def test_a_partial_output_torn_by_a_power_cut_is_not_resumed(tiny_dir, tmp_path, monkeypatch, capsys, fmt):
    """Progress is saved after each layer without forcing the data to the disk, so after a power cut
    it can outlive the bytes it describes (they read back as zeros here). The CRCs it holds tell, and
    the run starts afresh instead of resuming onto them."""
    from quantkit import pipeline
    from quantkit.atomic import progress_path
    from quantkit.atomic import partial_path

    kw = dict(method="rtn", progress=False, **({"format": "gguf", "gguf_type": "Q8_0"} if fmt == "gguf" else {}))
    name = "q.gguf" if fmt == "gguf" else "q"
    quantkit.quantize(str(tiny_dir), out=tmp_path / "whole", **kw)
    real = stopping_saves(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tiny_dir), out=tmp_path / name, **kw)
    monkeypatch.setattr(pipeline, "save_progress", real)
    partial = partial_path(tmp_path / name)
    if fmt == "gguf":  # layer 0's tensors, after the header
        start = pipeline.read_progress(progress_path(tmp_path / name))["writer"]["data_start"]
        raw = partial.read_bytes()
        partial.write_bytes(raw[:start] + bytes(len(raw) - start))
    else:  # the open shard's spilled layer 0
        spills = list(partial.glob(".spill-*"))
        assert spills
        for spill in spills:
            spill.write_bytes(bytes(spill.stat().st_size))
    quantkit.quantize(str(tiny_dir), out=tmp_path / name, **kw)
    assert "the partial output it describes is gone or changed" in capsys.readouterr().err
    whole, out = tmp_path / "whole", tmp_path / name
    assert (out.read_bytes() == whole.read_bytes()) if fmt == "gguf" else files(out) == files(whole)


def test_a_fresh_start_clears_a_killed_save_of_another_world_size(tmp_path):
    """A torchrun job's rank 1 killed (SIGKILL) while saving its progress leaves .q.progress-1.pt.tmp-PID;
    a run of another world size never loads that path, so its fresh start must clear it."""
    from quantkit.atomic import Staged

    (tmp_path / ".q.progress-1.pt.tmp-999").write_bytes(b"torn")
    (tmp_path / ".q.progress-0.pt").write_bytes(b"old")
    staged = Staged(tmp_path / "q")
    staged.fresh(own="layers")  # as quantize starts afresh, its progress checked (api.check_progress)
    staged.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_outputs_cleanup_leaves_another_outputs_files(tmp_path):
    """`.m.old-*` and `.m.progress*.pt` took the files of a run writing m.old-b (its partial output,
    lock and progress): a run writing m deleted them while that run went on, which then died."""
    from quantkit.atomic import Staged

    theirs = [".m.old-b.partial", ".m.old-b.lock", ".m.old-b.progress.pt", ".m.progress-b.pt",
              ".m.progress.pt.tmp-b.partial"]
    for name in theirs:
        (tmp_path / name).write_bytes(b"another run's")
    ours = [".m.old-4242", ".m.progress.pt", ".m.progress-1.pt", ".m.progress-1.pt.tmp-999"]  # killed runs of m
    for name in ours:
        (tmp_path / name).write_bytes(b"stale")
    (tmp_path / "m").mkdir()  # in place: .m.old-4242 is what a commit killed after its renames left
    (tmp_path / "m" / "config.json").write_text("{}")
    staged = Staged(tmp_path / "m", overwrite=True)
    (staged.fresh() / "weights").write_bytes(b"new")
    (tmp_path / ".m.progress.pt").write_bytes(b"this run's")
    staged.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m", *theirs])


def test_a_run_killed_after_its_commit_leaves_no_progress(tiny_dir, tmp_path, monkeypatch):
    """The progress (as large as the calibration's activations on a real model) was removed after the
    output was in place and its lock gone: a kill between left it beside the finished output."""
    from quantkit.atomic import Staged

    real = Staged.commit

    def killed_after(self, scratch=()):
        real(self, scratch)
        raise KeyboardInterrupt

    monkeypatch.setattr(Staged, "commit", killed_after)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tiny_dir), out=tmp_path / "q.gguf", method="rtn", format="gguf", gguf_type="Q8_0",
                          progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.gguf"]


def test_a_models_fingerprint_is_its_files_not_a_users_beside_them(tiny_dir, tmp_path):
    """A measurement or an export saved beside the weights is not the model: with them in its
    fingerprint, a saved measurement there was never reused."""
    from quantkit.modelio import fingerprint

    model = shutil.copytree(tiny_dir, tmp_path / "m")
    before = fingerprint(model)
    (model / "m.measurement.json").write_text("{}")
    (model / "q.gguf").write_bytes(b"GGUF")
    assert fingerprint(model) == before
    (model / "tokenizer_config.json").write_text((model / "tokenizer_config.json").read_text() + "\n")
    assert fingerprint(model) != before


def test_a_changed_chat_template_is_not_resumed_onto(chat_dir, tmp_path, monkeypatch, capsys):
    """The resumed GGUF kept the header (tokenizer, chat template) the killed run wrote, since only the
    weights and config.json told a model from another: edited in between, the same command is refused
    as another run's, and with overwrite starts afresh and writes what a run on the edited model writes."""
    from quantkit import pipeline

    model = shutil.copytree(chat_dir, tmp_path / "m")
    kw = dict(method="rtn", format="gguf", gguf_type="Q8_0", progress=False)
    real = stopping_saves(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(model), out=tmp_path / "q.gguf", **kw)
    monkeypatch.setattr(pipeline, "save_progress", real)
    config = json.loads((model / "tokenizer_config.json").read_text())
    if "chat_template" in config:
        config["chat_template"] = config["chat_template"].replace("assistant", "model")
        (model / "tokenizer_config.json").write_text(json.dumps(config))
    else:
        template = model / "chat_template.jinja"
        template.write_text(template.read_text().replace("assistant", "model"))
    with pytest.raises(QuantkitError, match="the model's files changed since it started"):
        quantkit.quantize(str(model), out=tmp_path / "q.gguf", **kw)
    quantkit.quantize(str(model), out=tmp_path / "q.gguf", overwrite=True, **kw)
    assert "resuming" not in capsys.readouterr().err
    quantkit.quantize(str(model), out=tmp_path / "whole.gguf", **kw)
    assert (tmp_path / "q.gguf").read_bytes() == (tmp_path / "whole.gguf").read_bytes()
