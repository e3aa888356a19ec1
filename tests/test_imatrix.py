"""llama.cpp's importance-matrix files read for GGUF quantization (`--imatrix FILE`): both layouts give
llama-quantize's bytes from the same file, and a file that does not fit the model is refused first."""
import struct
import warnings

import gguf
import numpy as np
import pytest
import torch

import quantkit
from quantkit.calibration import imatrix
from quantkit.exporters.gguf import gguf_name

from .conftest import VALID, cli, gguf_tensors, make_tiny, refused


NCALL = 7  # chunks the importance was "measured" on


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("imatrix") / "model", hidden=256, intermediate=512)


def importance(model_dir) -> dict[str, np.ndarray]:
    """A mean square per input column of every linear, by GGUF name, skewed so that it changes the fits."""
    m = quantkit.load(model_dir)
    g = torch.Generator().manual_seed(1)
    out = {}
    for name, module in m.module.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            k = module.weight.shape[1]
            out[gguf_name(f"{name}.weight")] = (torch.rand(k, generator=g) ** 4 * 50 + 0.01).numpy()
    return out


def write_legacy(path, table: dict[str, np.ndarray]) -> None:
    """llama-imatrix's legacy layout: the values are the mean times ncall."""
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(table)))
        for name, v in table.items():
            f.write(struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", NCALL, v.size))
            f.write((v * NCALL).astype("<f4").tobytes())
        f.write(struct.pack("<i", NCALL) + struct.pack("<i", 4) + b"test")


def write_gguf(path, table: dict[str, np.ndarray], datasets: list = ("test",)) -> None:
    """llama-imatrix's GGUF layout: sums of squares and the count of inputs."""
    w = gguf.GGUFWriter(path, arch=None)
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", list(datasets))
    w.add_uint32("imatrix.chunk_count", NCALL)
    w.add_uint32("imatrix.chunk_size", 64)
    for name, v in table.items():
        w.add_tensor(f"{name}.in_sum2", (v * NCALL * 64).astype(np.float32))
        w.add_tensor(f"{name}.counts", np.array([NCALL * 64], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("layout", ["dat", "gguf"])
def test_both_layouts_read_as_the_mean_square(tiny, tmp_path, layout):
    table = importance(tiny)
    path = tmp_path / f"m.{layout}"
    (write_legacy if layout == "dat" else write_gguf)(path, table)
    back, _ = imatrix.read_recorded(path)
    assert back.keys() == table.keys()
    for name, v in table.items():
        assert torch.allclose(back[name], torch.from_numpy(v), rtol=1e-6), name


def test_a_long_key_value_array_is_not_read_element_by_element(tiny, tmp_path):
    """gguf-py's reader builds numpy objects for every element of every key-value array: a 1M-entry
    array (an 8 MB file) took 1.5 GB and seconds; the importance needs only the tensors and the
    first dataset's name."""
    import tracemalloc

    table = importance(tiny)
    write_gguf(tmp_path / "long.gguf", table, datasets=["wiki", *[""] * 1_000_000])
    tracemalloc.start()
    try:
        back, chunks, datasets = imatrix.parse(tmp_path / "long.gguf")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20e6, peak
    assert back.keys() == table.keys() and chunks == NCALL and datasets[0] == "wiki"


def test_files_that_do_not_fit_are_refused_before_any_work(tiny, tmp_path, capsys, monkeypatch):
    table = importance(tiny)
    args = ["quantize", tiny, "--format", "gguf", "--gguf-type", "Q4_K_M", "--out", tmp_path / "q.gguf", "--imatrix"]
    write_legacy(tmp_path / "m.dat", table)
    raw = (tmp_path / "m.dat").read_bytes()
    (tmp_path / "cut.dat").write_bytes(raw[:len(raw) // 2])
    refused([*args, tmp_path / "cut.dat"], capsys, monkeypatch, "cut short in entry")
    write_legacy(tmp_path / "other.dat", {f"x.{k}": v for k, v in table.items()})
    refused([*args, tmp_path / "other.dat"], capsys, monkeypatch, "no entry for this model's tensors")
    write_legacy(tmp_path / "wide.dat", {k: np.concatenate([v, v]) for k, v in table.items()})
    refused([*args, tmp_path / "wide.dat"], capsys, monkeypatch, "values for 256 input columns")
    write_legacy(tmp_path / "nan.dat", {k: v * np.nan for k, v in table.items()})
    refused([*args, tmp_path / "nan.dat"], capsys, monkeypatch, "negative or not finite")
    refused([*args, tmp_path], capsys, monkeypatch, "a directory, not an importance matrix")
    write_gguf(tmp_path / "ints.gguf", table, datasets=[1, 2])  # was a TypeError, and left the output's lock
    refused([*args, tmp_path / "ints.gguf"], capsys, monkeypatch, "imatrix.datasets holds other values than names")
    assert not (tmp_path / ".q.gguf.lock").exists()
    refused([*args, tmp_path / "m.dat", "--method", "gptq"], capsys, monkeypatch, "use it with --method rtn")
    assert not (tmp_path / "q.gguf").exists()
    code, _, _ = cli([*args, tmp_path / "m.dat"], capsys, monkeypatch)
    assert code == 0 and (tmp_path / "q.gguf").is_file()


def test_an_importance_nothing_reads_is_refused_and_a_partial_one_is_named(tiny, tmp_path, capsys, monkeypatch):
    """--imatrix with a mix that takes no importance (F16, Q8_0) was taken and ignored, after a whole
    calibration pass without a file; a file with entries for layer 0 only was applied without a word
    (llama-quantize names each tensor it did not find). Smaller: /dev/null was "no such file", and
    --calib-data beside --imatrix FILE was told that --imatrix calibrates."""
    table = importance(tiny)
    write_legacy(tmp_path / "m.dat", table)
    args = ["quantize", tiny, "--format", "gguf", "--out", tmp_path / "q.gguf"]
    for mix in ("Q8_0", "F16"):
        for given in ([tmp_path / "m.dat"], []):
            refused([*args, "--gguf-type", mix, "--imatrix", *given], capsys, monkeypatch,
                    f"and {mix} has none that takes it: drop --imatrix")
    refused([*args, "--imatrix", "/dev/null"], capsys, monkeypatch, "--imatrix /dev/null: not a regular file")
    refused([*args, "--imatrix", tmp_path / "m.dat", "--calib-data", tmp_path / "m.dat"], capsys, monkeypatch,
            "--imatrix FILE reads the importance instead: drop it, or pass --imatrix alone")
    refused(["quantize", tiny, "--out", tmp_path / "q", "--imatrix", tmp_path / "m.dat"], capsys, monkeypatch,
            "use it with --method rtn --format gguf")
    assert "GPTQ" not in capsys.readouterr().err
    assert not (tmp_path / "q.gguf").exists()
    # a Q8_0 mix with a tensor overridden to a type that takes importance reads it
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the whole file read: no warning
        code, _, err = cli([*args, "--gguf-type", "Q8_0", "--tensor-type", "ffn_down=Q4_K", "--imatrix",
                            tmp_path / "m.dat"], capsys, monkeypatch)
    assert code == 0, err
    write_legacy(tmp_path / "layer0.dat", {k: v for k, v in table.items() if k.startswith("blk.0.")})
    layers = sum(k.startswith("blk.") for k in table)
    with pytest.warns(UserWarning) as caught:
        code, _, err = cli([*args, "--gguf-type", "Q4_K_M", "--imatrix", tmp_path / "layer0.dat", "--overwrite"],
                           capsys, monkeypatch)
    assert code == 0 and [str(w.message) for w in caught] == [
        f"{tmp_path / 'layer0.dat'} has no entry for {layers - 7} of the model's {layers} layer weights "
        "(blk.1.attn_q.weight, ...): they are quantized without importance; use the imatrix computed for this model"]


@pytest.mark.slow
@pytest.mark.parametrize("layout,mix", [("dat", "Q4_K_M"), ("gguf", "Q4_K_M"), ("dat", "Q4_0"), ("gguf", "Q3_K_M")])
def test_bytes_equal_llama_quantize_with_the_same_file(tiny, tmp_path, layout, mix):
    """llama-quantize --imatrix FILE from our F32 file and quantkit --imatrix FILE from the model: every
    tensor's type and bytes are the same, and differ from the unweighted ones."""
    from . import llamacpp

    path = tmp_path / f"m.{layout}"
    (write_legacy if layout == "dat" else write_gguf)(path, importance(tiny))
    quantkit.api.export_gguf(quantkit.load(tiny), tmp_path / "f32.gguf", "F32", progress=False)
    llamacpp.quantize(tmp_path / "f32.gguf", tmp_path / "theirs.gguf", mix, "--imatrix", str(path))
    quantkit.quantize(tiny, method="rtn", format="gguf", gguf_type=mix, imatrix_file=str(path),
                      out=tmp_path / "ours.gguf", progress=False)
    quantkit.quantize(tiny, method="rtn", format="gguf", gguf_type=mix, out=tmp_path / "plain.gguf", progress=False)
    ours, theirs, plain = (gguf_tensors(tmp_path / f"{n}.gguf") for n in ("ours", "theirs", "plain"))
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if ours[k] != theirs[k]] == []
    assert [k for k in ours if k.startswith("blk.") and ours[k] != plain[k]]
    assert len(recorded(tmp_path / "theirs.gguf")) == 4
    assert recorded(tmp_path / "ours.gguf") == recorded(tmp_path / "theirs.gguf")


def recorded(path) -> dict:
    """The file's record of the importance matrix it was quantized with."""
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if k.startswith("quantize.imatrix.")}


def test_the_file_records_the_importance_matrix(tiny, tmp_path):
    """llama-quantize records the file, its dataset, entries and chunks (quantize.imatrix.*); quantkit's
    file recorded nothing. From a model directory and from a GGUF, whose own record is replaced, and for
    an importance computed here."""
    table = importance(tiny)
    write_legacy(tmp_path / "m.dat", table)
    want = {"quantize.imatrix.file": str(tmp_path / "m.dat"), "quantize.imatrix.dataset": "test",
            "quantize.imatrix.entries_count": len(table), "quantize.imatrix.chunks_count": NCALL}
    quantkit.quantize(tiny, method="rtn", format="gguf", gguf_type="Q4_0", imatrix_file=str(tmp_path / "m.dat"),
                      out=tmp_path / "a.gguf", progress=False)
    assert recorded(tmp_path / "a.gguf") == want
    write_gguf(tmp_path / "m.gguf", table)
    quantkit.quantize(str(tmp_path / "a.gguf"), method="rtn", format="gguf", gguf_type="Q4_K_M",
                      imatrix_file=str(tmp_path / "m.gguf"), out=tmp_path / "b.gguf", progress=False)
    assert recorded(tmp_path / "b.gguf") == want | {"quantize.imatrix.file": str(tmp_path / "m.gguf")}
    assert gguf_tensors(tmp_path / "b.gguf")["blk.0.attn_q.weight"][0] == "Q4_K"
    quantkit.quantize(tiny, method="rtn", format="gguf", gguf_type="Q4_0", out=tmp_path / "plain.gguf", progress=False)
    assert recorded(tmp_path / "plain.gguf") == {}
    # quantized in memory, then exported: the record is the model's, the file is not read again
    m = quantkit.quantize(tiny, method="rtn", format="gguf", gguf_type="Q4_0", imatrix_file=str(tmp_path / "m.dat"),
                          progress=False)
    (tmp_path / "m.dat").unlink()
    quantkit.export(m, tmp_path / "c.gguf", "gguf", progress=False)
    assert recorded(tmp_path / "c.gguf") == want
    # computed from the calibration text (recorded nothing before): no file to name; the text, every
    # layer's linears, the windows
    quantkit.quantize(tiny, method="rtn", format="gguf", gguf_type="Q4_0", imatrix=True, calib_data=VALID,
                      calib_samples=3, calib_seqlen=32, out=tmp_path / "d.gguf", progress=False)
    assert recorded(tmp_path / "d.gguf") == {"quantize.imatrix.dataset": str(VALID),
                                             "quantize.imatrix.entries_count": len(table),
                                             "quantize.imatrix.chunks_count": 3}
    # and from a GGUF that records a file: the new record replaces the old whole (it kept the old file's name)
    quantkit.quantize(str(tmp_path / "b.gguf"), method="rtn", format="gguf", gguf_type="Q4_0", imatrix=True,
                      calib_data=VALID, calib_samples=3, calib_seqlen=32, out=tmp_path / "e.gguf", progress=False)
    assert recorded(tmp_path / "e.gguf") == recorded(tmp_path / "d.gguf")
