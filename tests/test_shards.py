"""Sharded safetensors, written tensor by tensor: safetensors and transformers read them back."""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import quantkit
from quantkit import QuantkitError
from quantkit.exporters.shards import INDEX, ShardWriter, parse_size

from .test_bad_input import run


def tensors():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(64, 32, generator=g), "b.weight": torch.randn(40, 8, generator=g).bfloat16(),
            "c.qweight": torch.randint(-2**31, 2**31 - 1, (16, 24), dtype=torch.int32, generator=g),
            "d.scale": torch.tensor(0.5), "e.empty": torch.zeros(0, 4, dtype=torch.float16),
            "f.flag": torch.tensor([True, False, True]), "g.weight": torch.randn(10, 10, generator=g)}


def read_back(directory):
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out |= {k: (s.get_tensor(k), f.name) for k in s.keys()}
    return out


def test_shards_hold_every_tensor_and_the_index_maps_them(tmp_path):
    ts = tensors()
    w = ShardWriter(tmp_path, max_size=2048)  # a (8192 bytes) alone, b (640; c would pass 2048), c..g (1943)
    for name, t in ts.items():
        w.add(name, t)
    files = w.close()
    for f in w.scratch():  # as the commit does
        f.unlink()
    back = read_back(tmp_path)
    assert back.keys() == ts.keys()
    for name, t in ts.items():
        assert back[name][0].dtype == t.dtype and torch.equal(back[name][0], t), name
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert shards == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*shards, INDEX])  # no spill or temporary file left
    assert [p.name for p in files] == [*shards, INDEX]
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["weight_map"] == {name: file for name, (_, file) in back.items()}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ts.values())
    for f in shards:  # each shard's data within the limit, unless one tensor alone is larger
        with safe_open(str(tmp_path / f), "pt") as s:
            sizes = [s.get_tensor(k).numel() * s.get_tensor(k).element_size() for k in s.keys()]
            assert sum(sizes) <= 2048 or len(sizes) == 1
            assert s.metadata() == {"format": "pt"}


def test_one_shard_is_model_safetensors_without_an_index(tmp_path):
    w = ShardWriter(tmp_path)
    for name, t in tensors().items():
        w.add(name, t)
    assert [p.name for p in w.close()] == ["model.safetensors"]
    for f in w.scratch():
        f.unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert read_back(tmp_path).keys() == tensors().keys()


@pytest.mark.parametrize("size,expected", [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), ("1.5kb", 1500), (4096, 4096)])
def test_sizes_read_as_transformers_reads_them(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["five", "0", "-1GB", "3 parsecs", 0])
def test_bad_sizes_are_refused(size):
    with pytest.raises(QuantkitError, match=r"^max_shard_size=.* is not (a size|positive)"):
        parse_size(size)


def test_sharded_export_loads_in_quantkit_and_transformers(tiny_dir, tmp_path):
    """A GPTQ export in 100 kB shards: quantkit reads back the same quantized weights, and transformers
    (which follows the index) loads the bitsandbytes export's shards."""
    from transformers import AutoModelForCausalLM

    m = quantkit.quantize(tiny_dir, method="rtn", bits=4, group_size=32, out=tmp_path / "q", max_shard_size="100kB",
                          keep=True, progress=False)
    assert len(list((tmp_path / "q").glob("model-*-of-*.safetensors"))) > 1 and (tmp_path / "q" / INDEX).is_file()
    back = quantkit.load(tmp_path / "q")
    for name, qt in m.tensors.items():
        assert torch.equal(back.module.get_submodule(name).weight, qt.dequantize()), name
    nf4 = quantkit.quantize(tiny_dir, method="nf4", out=tmp_path / "nf4", max_shard_size="100kB", keep=True,
                            progress=False)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "nf4", device_map="cpu")
    assert loaded.model.layers[1].mlp.down_proj.weight.numel() == nf4.tensors["model.layers.1.mlp.down_proj"].codes.numel() // 2


def test_the_files_read_are_the_ones_transformers_reads(tiny_dir, tmp_path):
    """transformers reads model.safetensors where there is one, an index left beside it or not (a sharded
    save_pretrained, then a whole one, into the same directory leaves the index); quantkit read the index
    there, and refused the shards it named as missing. Without model.safetensors, the index names the
    files (a stray one beside them sorted after the shards and replaced their tensors); without either,
    a tensor in two files is refused: which one wins would be a matter of file order."""
    out = tmp_path / "q"
    m = quantkit.quantize(tiny_dir, method="rtn", bits=4, group_size=32, out=out, max_shard_size="100kB", keep=True,
                          progress=False)
    other = quantkit.quantize(tiny_dir, method="rtn", bits=4, group_size=32, sym=False, out=tmp_path / "other",
                              progress=False, keep=True)
    name = "model.layers.0.mlp.down_proj"
    assert not torch.equal(other.tensors[name].dequantize(), m.tensors[name].dequantize())
    (tmp_path / "other" / "model.safetensors").rename(out / "model.safetensors")
    # other's (asymmetric) tensors read, not the shards': refused under this config's sym
    with pytest.raises(QuantkitError, match="says sym, but its zero points are not all 8"):
        quantkit.load(out, packed=True)
    (out / "model.safetensors").rename(out / "extra.safetensors")
    for packed in (False, True):
        back = quantkit.load(out, packed=packed)
        layer = back.module.get_submodule(name)
        assert torch.equal(layer.dequantize() if packed else layer.weight, m.tensors[name].dequantize())
    (out / INDEX).unlink()
    with pytest.raises(QuantkitError, match="is in both .*safetensors and .*safetensors: remove the file"):
        quantkit.load(out, packed=True)


def test_an_index_left_by_an_earlier_sharded_save_is_not_read(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    theirs = AutoModelForCausalLM.from_pretrained(tiny_dir)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(tmp_path / "m")
    theirs.save_pretrained(tmp_path / "m", max_shard_size="100KB")
    theirs.save_pretrained(tmp_path / "m")  # removes the shards, not their index
    assert (tmp_path / "m" / INDEX).is_file() and not list((tmp_path / "m").glob("model-*"))
    AutoModelForCausalLM.from_pretrained(tmp_path / "m")  # transformers loads it
    back = quantkit.load(tmp_path / "m")
    back.materialize()
    assert all(torch.equal(back.module.state_dict()[k], v) for k, v in theirs.state_dict().items())


def test_cli_refuses_a_bad_shard_size_before_loading(tiny_dir, tmp_path, capsys, monkeypatch):
    code, line = run(["quantize", tiny_dir, "--out", tmp_path / "q", "--max-shard-size", "big"], capsys, monkeypatch)
    assert code == 2 and line.startswith("error: --max-shard-size big is not a size") and not (tmp_path / "q").exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_spill_released_on_a_full_disk_lets_the_abort_go_on(tmp_path):
    """release() closes the spill, whose close flushes its buffer: on the full disk that failed the run, that
    raised again, and the abort after it (the partial output's removal) was skipped."""
    writer = ShardWriter(tmp_path)
    writer.spill = open("/dev/full", "wb")
    writer.spill.write(b"x" * 100)  # buffered: the close's flush meets ENOSPC
    writer.release()
    assert writer.spill is None
