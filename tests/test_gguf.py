"""GGUF blocks, mixes and files: the fast part runs on random weights and a tiny Llama; the slow
part is judged by llama.cpp itself (llama-quantize's bytes, llama-perplexity's scores)."""

import re
import warnings

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import quantkit
from quantkit import evals
from quantkit.errors import Note, QuantkitError, size
from quantkit.exporters import gguf as G
from quantkit.quantizers import ggml, rtn

from .conftest import TEST, VALID, cli, gguf_tensors, loaded, make_tiny, refused

QUANTIZED = ggml.LEGACY_TYPES + ggml.K_TYPES


def weights(n=64, k=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.linspace(0.2, 2, k) + 0.1 * torch.rand(n, 1, generator=g)


@pytest.mark.parametrize("kind", QUANTIZED)
@pytest.mark.parametrize("imatrix", [False, True])
def test_blocks_hold_what_the_fit_chose(kind, imatrix):
    """gguf-py's dequantization of our bytes equals value = scale * (code - off) - min of every sub-block:
    the packing is ggml-common.h's layout for every type."""
    w = weights()
    f = ggml.fit_blocks(kind, w, torch.rand(512) + 0.1 if imatrix else None)
    sub = f.scale.shape[1]
    codes = f.codes.view(f.codes.shape[0], sub, -1)
    own = f.scale[:, :, None] * (codes - f.off) - (0 if f.min is None else f.min[:, :, None])
    theirs = gguf.quants.dequantize(ggml.pack(kind, f), gguf.GGMLQuantizationType[kind])
    assert torch.equal(own.reshape(-1), torch.from_numpy(theirs).reshape(-1))


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "F16", "Q5_0"])
def test_quantizing_rows_a_slice_at_a_time_gives_the_same_bytes(kind, monkeypatch):
    """Big matrices (a 32000-row embedding) are quantized a few rows at a time to bound the search's
    temporaries: rows are independent, so the bytes are those of the whole matrix at once."""
    w = torch.randn(300, 512, generator=torch.Generator().manual_seed(5)) * 0.02
    imp = torch.rand(512, generator=torch.Generator().manual_seed(6)) if kind == "Q5_0" else None
    monkeypatch.setattr(ggml, "CHUNK", 2**40)
    whole = ggml.quantize(w, kind, imp)
    monkeypatch.setattr(ggml, "CHUNK", 7 * 512)  # 7 rows at a time: a last slice of 6
    assert torch.equal(ggml.quantize(w, kind, imp).codes, whole.codes)


@pytest.mark.parametrize("kind", ggml.LEGACY_TYPES)
def test_own_legacy_fits_equal_gguf_py(kind):
    """Our fits (which GPTQ and the importance matrix build on) reproduce the reference rounding exactly."""
    w = weights(256)
    ours = ggml.pack(kind, ggml.fit_blocks(kind, w, None))
    assert np.array_equal(ours, gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[kind]).reshape(ours.shape))


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_importance_lowers_the_weighted_error(kind):
    w = weights(128)
    imp = torch.rand(512) ** 4 * 10 + 1e-3  # a few inputs matter much more than the rest
    def err(qt):
        return float(((qt.dequantize() - w) ** 2 * imp).sum())
    assert err(ggml.quantize(w, kind, imp)) < err(ggml.quantize(w, kind))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q3_K", "Q6_K"])
def test_gptq_on_the_grid_lowers_the_output_error(kind):
    g = torch.Generator().manual_seed(1)
    # correlated inputs, as a layer's activations are: a few strong directions plus noise
    x = torch.randn(2048, 64, generator=g) @ torch.randn(64, 512, generator=g) + 0.3 * torch.randn(2048, 512, generator=g)
    w = weights(96)
    h = 2 * x.T @ x / x.shape[0]
    def out_err(qt):
        return float(((x @ (qt.dequantize() - w).T) ** 2).mean())
    before = h.clone()
    r = ggml.gptq(w, h, kind, h.diagonal())  # H's own diagonal, as the pipeline passes it
    assert r.tensor.ggml == kind and r.tensor.shape == (96, 512)
    assert out_err(r.tensor) < 0.9 * out_err(ggml.quantize(w, kind, h.diagonal()))
    # H is lent to the factor and whole again; its diagonal was read as it was, not as the factor's
    assert torch.equal(h, before)
    assert torch.equal(ggml.gptq(w, before.clone(), kind, before.diagonal().clone()).tensor.codes, r.tensor.codes)


def test_mix_falls_back_when_rows_do_not_fill_256():
    """SmolLM2's shapes: 576-wide rows fall back to 32-value types, ffn_down (1536) keeps its K-quant."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    with torch.device("meta"):
        module = LlamaForCausalLM(cfg)
    t = G.tensor_types(module, "Q4_K_M")
    assert t["model.embed_tokens"] == "Q8_0"  # tied: the output matrix, Q6_K -> Q8_0
    assert t["model.layers.3.self_attn.q_proj"] == "Q5_0"  # Q4_K -> Q5_0
    assert t["model.layers.0.self_attn.v_proj"] == "Q8_0"  # use_more_bits: Q6_K -> Q8_0
    assert t["model.layers.0.mlp.down_proj"] == "Q6_K" and t["model.layers.2.mlp.down_proj"] == "Q4_K"
    assert set(G.tensor_types(module, "Q4_K_M", pure=True).values()) == {"Q4_K", "Q5_0"}


@pytest.mark.parametrize("mix", ["F32", "BF16", "Q8_0", "Q4_1", "Q4_K_M", "Q2_K"])
def test_file_reads_back_as_the_quantized_model(tiny256, tmp_path, mix):
    """Our GGUF reader, and for two mixes transformers' (llama.cpp's layout: names, q/k rows permuted,
    tokenizer), give back exactly the weights we quantized, and the same tokenization."""
    m = quantkit.quantize(tiny256, method="rtn", format="gguf", gguf_type=mix, out=tmp_path / "m.gguf", keep=True,
                          progress=False)
    back = quantkit.load(tmp_path / "m.gguf")
    assert back.module.model.layers[0].mlp.up_proj.weight.is_meta  # read when needed, like a checkpoint
    back.materialize()
    readers = [back.module.state_dict()]
    if mix in ("BF16", "Q4_K_M"):
        readers.append(AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).state_dict())
    for theirs in readers:
        for key, t in m.module.state_dict().items():
            assert torch.equal(t, theirs[key]), key
    text = VALID.read_text()[:2000]
    assert back.tokenizer(text)["input_ids"] == m.tokenizer(text)["input_ids"]
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    assert r.fields["general.file_type"].contents() == G.MIXES[mix][0]
    assert r.fields["tokenizer.ggml.pre"].contents() == "gpt-2"


@pytest.mark.parametrize("mix", ["Q3_K_M", "Q4_K_M", "Q5_K_M"])
def test_fallback_types_read_back(tiny_dir, tmp_path, mix):
    """Rows of 64 do not fill a K-quant block of 256, so the mixes fall back to legacy types (IQ4_NL,
    Q5_0, Q5_1) that transformers' GGUF reader does not size; the file still loads, weights exact."""
    m = quantkit.quantize(tiny_dir, method="rtn", format="gguf", gguf_type=mix, out=tmp_path / "m.gguf", keep=True,
                          progress=False)
    back = quantkit.load(tmp_path / "m.gguf")
    assert set(back.gguf_types.values()) & {"IQ4_NL", "Q5_0", "Q5_1"}
    back.materialize()
    theirs = back.module.state_dict()
    for key, t in m.module.state_dict().items():
        assert torch.equal(t, theirs[key]), key


def test_rows_that_fill_no_block_are_named_and_patterns_of_a_file_without_weights_refused():
    """A row that fills neither a type's blocks nor its fallback's is written as F16 with a note (llama-quantize
    refuses a file of such rows for a type without a fallback); rows that take a fallback type are counted in
    a note, as llama-quantize counts them (the file is larger than the mix's name says)."""
    from quantkit.requant import choose

    rows = [("blk.0.attn_q.weight", 4100), ("blk.0.attn_k.weight", 4096)]
    with pytest.warns(Note, match=r"^1 weight written as F16: rows of 4100 values \(blk.0.attn_q.weight\) do not fill "
                                  r"Q4_0's blocks of 32 \(llama-quantize refuses such a file\)$"):
        assert choose(rows, "Q4_0", 1, 1, pure=True) == {"blk.0.attn_q.weight": "F16", "blk.0.attn_k.weight": "Q4_0"}
    with pytest.warns(Note, match=r"fill neither Q4_K's blocks of 256 nor Q5_0's of 32 \(llama-quantize writes F16"):
        choose(rows, "Q4_K_M", 1, 1, pure=True)
    with pytest.warns(Note, match=r"^1 of 2 weights take llama-quantize's fallback types: rows of 576 values "
                                  r"\(blk.0.attn_q.weight\) do not fill Q4_K's blocks of 256, so Q5_0 \(5.5 bits a weight "
                                  r"where Q4_K has 4.5\)$"):
        assert choose([("blk.0.attn_q.weight", 576), ("blk.0.attn_k.weight", 4096)], "Q4_K_M", 1, 1, pure=True) == \
            {"blk.0.attn_q.weight": "Q5_0", "blk.0.attn_k.weight": "Q4_K"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose([("blk.0.attn_q.weight", 4096)], "Q4_K_M", 1, 1, pure=True) == {"blk.0.attn_q.weight": "Q4_K"}
    with pytest.raises(QuantkitError, match="matches no quantized tensor of this model \\(it has no 2-D weights\\)"):
        choose([], "Q4_K_M", 1, 1, overrides=("attn_v=Q8_0",))


def test_checkpoint_grid_exports_its_codes(tiny256, tmp_path):
    """A 4-bit symmetric g32 checkpoint becomes Q4_0 blocks with the same values, bit for bit."""
    m = quantkit.quantize(tiny256, method="rtn", bits=4, group_size=32, sym=True, out=tmp_path / "ckpt", keep=True,
                          progress=False)
    quantkit.api.export_gguf(quantkit.load(tmp_path / "ckpt"), tmp_path / "m.gguf")
    back = quantkit.load(tmp_path / "m.gguf")
    back.materialize()
    for name, qt in m.tensors.items():
        assert torch.equal(back.module.get_submodule(name).weight, qt.dequantize()), name


def test_grids_gguf_cannot_hold_are_refused(tiny256, tmp_path):
    w = weights(8, 256)
    with pytest.raises(QuantkitError, match="x: a 4-bit symmetric grid in groups of 128 has no GGUF block type: "
                                            "quantize with bits=4 or bits=8 and group_size=32"):
        ggml.from_grid(rtn.quantize(w, 4, 128), "x")
    # 8 bits in groups of 32 were told to be what they were: Q8_0 is symmetric, and there is no Q8_1 file type
    with pytest.raises(QuantkitError, match=r"an 8-bit asymmetric grid in groups of 32 has no GGUF block type: quantize "
                                            r"with sym=True \(8 bits have no asymmetric GGUF type\)"):
        ggml.from_grid(rtn.quantize(w, 8, 32, sym=False), "x")
    with pytest.raises(QuantkitError, match="do not fill Q4_K blocks"):
        ggml.quantize(weights(8, 96), "Q4_K")


def test_activations_round_as_llama_cpp_rounds_them():
    """Blocks of 32 for the 32-value types, of 256 for the K-quants, each at most 255 levels with the
    largest magnitude at 127 steps; float16 scales for the former; no change for F32 weights."""
    x = weights(4, 512)
    for kind, block in (("Q4_0", 32), ("Q4_K", 256)):
        y = ggml.round_activations(x, kind).view(-1, block)
        step = y.abs().amax(dim=1, keepdim=True) / 127
        assert torch.allclose(y / step, (y / step).round(), atol=1e-3)
        assert (y - x.view(-1, block)).abs().max() <= step.max() / 2 * 1.01
    assert torch.equal((x.view(-1, 32).abs().amax(1) / 127).half().float(),
                       ggml.round_activations(x, "Q4_0").view(-1, 32).abs().amax(1) / 127)
    assert torch.equal(ggml.round_activations(x, "F32"), x)


def test_truncated_gguf_is_a_clear_error(tiny256, tmp_path):
    m = quantkit.quantize(tiny256, method="rtn", format="gguf", gguf_type="Q8_0", out=tmp_path / "m.gguf", progress=False)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(QuantkitError, match="truncated"):
        quantkit.load(tmp_path / "cut.gguf")
    assert m.tensors


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    from transformers import GemmaConfig, GemmaForCausalLM

    with torch.device("meta"):
        module = GemmaForCausalLM(GemmaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, head_dim=16,
                                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(QuantkitError, match="llama, mistral, qwen2, qwen3 models, not 'gemma'"):
        G.check(module, "Q4_K_M")


# ---- judged by llama.cpp (slow: the embedded model, and llama.cpp built once into the cache) ----

class Embedded:
    """The embedded model in float32, its F32 GGUF (llama-quantize's input), and our file of each mix,
    quantized once and shared by the tests that judge it."""

    def __init__(self, directory):
        self.dir, self.files = directory, {}
        quantkit.api.export_gguf(quantkit.load(), self.dir / "f32.gguf", "F32", progress=False)

    def llama_quantized(self, mix: str, *flags: str):
        """llama-quantize's file of the F32 file in the mix (with flags), made once."""
        from . import llamacpp

        theirs = self.dir / f"lq-{mix}{''.join(flags)}.gguf"
        if not theirs.exists():  # a run that failed part way leaves no file for the next test to take
            part = theirs.with_suffix(".part.gguf")
            llamacpp.quantize(self.dir / "f32.gguf", part, mix, *flags)
            part.rename(theirs)
        return theirs

    def quantized(self, mix: str, pure: bool):
        """Our file of the mix and the quantized model it holds."""
        if (mix, pure) not in self.files:
            q = quantkit.load()
            out = self.dir / f"ours-{mix}{'-pure' if pure else ''}.gguf"
            quantkit.quantize(q, method="rtn", format="gguf", gguf_type=mix, pure=pure, out=out, keep=True, progress=False)
            self.files[mix, pure] = out, q
        return self.files[mix, pure]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    from . import llamacpp

    llamacpp.binaries()
    return Embedded(tmp_path_factory.mktemp("gguf"))


def noted(run):
    """run()'s result, and the notes (quantkit's advice, a warning category of its own) it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run()
    return result, [str(w.message) for w in caught if issubclass(w.category, Note)]


@pytest.mark.slow
@pytest.mark.parametrize("mix,pure", [("Q8_0", False), ("Q4_0", False), ("Q4_1", False), ("Q4_K_M", False),
                                      ("Q2_K", False), ("Q3_K_M", True), ("Q5_K_M", True), ("Q6_K", False)])
def test_bytes_equal_llama_quantize(embedded, mix, pure):
    """From the same F32 input, every tensor's type and bytes equal llama-quantize's: the legacy types
    and the K-quants (llama.cpp's searches, float32 sums in its order), the mix's choices and fallbacks."""
    theirs = embedded.llama_quantized(mix, *(["--pure"] if pure else []))
    a, b = gguf_tensors(embedded.quantized(mix, pure)[0]), gguf_tensors(theirs)
    assert a.keys() == b.keys()
    assert [k for k in a if a[k] != b[k]] == []


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K"])
def test_requantized_file_is_llama_quantizes(embedded, tmp_path, capsys, monkeypatch, mix):
    """quantkit export of a GGUF file (quantkit.requant, the compiled quantizer) writes the file
    llama-quantize writes from it, byte for byte: metadata, tensor order, every block."""
    src, ours = embedded.dir / "f32.gguf", tmp_path / "ours.gguf"
    assert cli(["export", src, "--out", ours, "--gguf-type", mix], capsys, monkeypatch)[0] == 0
    assert ours.read_bytes() == embedded.llama_quantized(mix).read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["Q8_0", "Q4_K_M"])
def test_requantized_f16_file_is_llama_quantizes(embedded, tmp_path, capsys, monkeypatch, mix):
    """From an F16 file (ours, itself llama-quantize's F16 of the F32 file, byte for byte): the same."""
    from . import llamacpp

    f16 = tmp_path / "f16.gguf"
    assert cli(["export", embedded.dir / "f32.gguf", "--out", f16, "--gguf-type", "F16"], capsys, monkeypatch)[0] == 0
    assert f16.read_bytes() == embedded.llama_quantized("F16").read_bytes()
    llamacpp.quantize(f16, tmp_path / "theirs.gguf", mix)
    assert cli(["export", f16, "--out", tmp_path / "ours.gguf", "--gguf-type", mix], capsys, monkeypatch)[0] == 0
    assert (tmp_path / "ours.gguf").read_bytes() == (tmp_path / "theirs.gguf").read_bytes()


def small_gguf(path, arch="llama", extra=(), endian=gguf.GGUFEndian.LITTLE, **keys):
    """A GGUF file of one layer's q weight (random) and norm, with these key-values and extra (name,
    array) tensors."""
    w = gguf.GGUFWriter(path, arch, endianess=endian)
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_context_length(64)
    w.add_embedding_length(96)
    w.add_feed_forward_length(128)
    w.add_layer_norm_rms_eps(1e-5)
    for key, value in keys.items():
        w.add_uint32(key, value)
    w.add_tensor("blk.0.attn_q.weight", np.random.default_rng(0).standard_normal((64, 96), dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(96, dtype=np.float32))
    for name, t in extra:
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_requantize_refuses_what_it_cannot_write(tmp_path):
    from quantkit.requant import requantize

    requantize(small_gguf(tmp_path / "ok.gguf"), tmp_path / "ok-q8.gguf", "Q8_0", progress=False)
    assert {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "ok-q8.gguf").tensors} == {
        "blk.0.attn_q.weight": "Q8_0", "blk.0.attn_norm.weight": "F32"}
    refusals = {
        "a 'gemma' GGUF: quantkit requantizes llama, qwen2, qwen3": small_gguf(tmp_path / "g.gguf", "gemma"),
        "one of 2 parts of a split GGUF": small_gguf(tmp_path / "s.gguf", **{"split.count": 2}),
        "not all positive numbers": small_gguf(tmp_path / "b.gguf", **{"llama.block_count": 0}),
        "a mixture-of-experts GGUF (4 experts)": small_gguf(tmp_path / "e.gguf", **{"llama.expert_count": 4}),
        "a mixture-of-experts GGUF (None experts)": small_gguf(
            tmp_path / "e3.gguf", extra=[("blk.0.ffn_up_exps.weight", np.ones((4, 32, 96), dtype=np.float32))]),
        "a big-endian GGUF": small_gguf(tmp_path / "be.gguf", endian=gguf.GGUFEndian.BIG),
    }
    key = b"general.architecture"
    (tmp_path / "a.gguf").write_bytes((tmp_path / "ok.gguf").read_bytes().replace(key, key[:-1] + b"X", 1))
    refusals["has no general.architecture: the file is damaged"] = tmp_path / "a.gguf"
    data = (tmp_path / "ok.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) - 64])
    refusals["runs past the end of the file"] = tmp_path / "cut.gguf"
    for match, path in refusals.items():
        with pytest.raises(QuantkitError, match=re.escape(match)):
            requantize(path, tmp_path / "out.gguf", "Q8_0", progress=False)
        assert not (tmp_path / "out.gguf").exists() and not list(tmp_path.glob(".out.gguf*"))


def test_gguf_tensors_lie_end_to_end_and_hyperparameters_are_there(tmp_path):
    """A GGUF whose tensors overlap (an offset pointing into another tensor's data) was read with
    another's bytes: scored to a plausible perplexity, and requantized into a file llama.cpp loads.
    llama.cpp refuses it (each tensor starts where the one before it ends), and now both our readers do.
    Requantizing a GGUF without a hyperparameter llama.cpp requires was not refused, as loading it is."""
    from quantkit.requant import requantize

    overlap = small_gguf(tmp_path / "overlap.gguf")
    r = gguf.GGUFReader(overlap, "r+")
    r.tensors[1].field.parts[-1][0] = 0  # the norm read from the start of the q weight's data
    r.data.flush()
    del r
    gap = small_gguf(tmp_path / "gap.gguf")
    r = gguf.GGUFReader(gap, "r+")
    r.tensors[1].field.parts[-1][0] += 32  # aligned, and past where the q weight ends
    r.data.flush()
    del r
    with open(gap, "ab") as f:  # inside the file
        f.write(bytes(32))
    for path, at in ((overlap, 0), (gap, 24608)):
        match = rf"tensor blk.0.attn_norm.weight starts at byte {at} of the data, where the tensor before it ends at 24576"
        for read in (quantkit.load, lambda p: requantize(p, tmp_path / "out.gguf", "Q8_0", progress=False)):
            with pytest.raises(QuantkitError, match=match):
                read(path)
    key = b"llama.embedding_length"
    (tmp_path / "e.gguf").write_bytes(small_gguf(tmp_path / "ok.gguf").read_bytes().replace(key, key[:-1] + b"X", 1))
    with pytest.raises(QuantkitError, match=r"e.gguf has no llama.embedding_length: the file is damaged"):
        requantize(tmp_path / "e.gguf", tmp_path / "out.gguf", "Q8_0", progress=False)
    assert not (tmp_path / "out.gguf").exists()


def damaged(f32, f16, tmp_path) -> dict[tuple[str, str], object]:
    """Copies of a model's F32 and F16 GGUF that llama-quantize refuses, by the mix and what our refusal
    names: NaN or infinity in a weight that is quantized, in one that keeps its type (a norm), in an
    F16 source; a value F16 cannot hold."""
    def patched(src, name, tensor, index, value):
        dst = tmp_path / name
        dst.write_bytes(src.read_bytes())
        r = gguf.GGUFReader(dst, "r+")
        next(t for t in r.tensors if t.name == tensor).data.reshape(-1)[index] = value
        r.data.flush()
        return dst

    q, norm = "blk.0.attn_q.weight", "blk.0.attn_norm.weight"
    return {
        ("Q8_0", f"{q} holds NaN or infinite values"): patched(f32, "nan.gguf", q, 1000, np.nan),
        ("Q4_0", f"{norm} holds NaN or infinite values"): patched(f32, "inf.gguf", norm, 7, np.inf),
        ("Q4_0", f"{q} holds NaN or infinite values"): patched(f16, "nan16.gguf", q, 5, np.nan),
        ("F16", f"{q} holds values too large for F16"): patched(f32, "big.gguf", q, 12, 1e6),
    }


@pytest.fixture(scope="module")
def float_ggufs(tiny256, tmp_path_factory):
    """tiny256 as F32 and F16 GGUF files, which llama-quantize reads."""
    d = tmp_path_factory.mktemp("floats")
    quantkit.api.export_gguf(quantkit.load(tiny256), d / "f32.gguf", "F32", progress=False)
    quantkit.api.export_gguf(quantkit.load(tiny256), d / "f16.gguf", "F16", progress=False)
    return d / "f32.gguf", d / "f16.gguf"


def test_a_gguf_scores_with_llama_cpp_s_arithmetic_under_either_protocol(float_ggufs, tmp_path):
    """Under --protocol wikitext a GGUF was scored without llama.cpp's rounding of the activations:
    the same file, two models, depending on the protocol."""
    q4 = tmp_path / "q4.gguf"
    quantkit.quantize(str(float_ggufs[0]), method="rtn", gguf_type="Q4_0", format="gguf", out=q4, progress=False)
    text = TEST.read_text()[:30000]
    (tmp_path / "text.txt").write_text(text)
    got = quantkit.evaluate(q4, tmp_path / "text.txt", "wikitext", ctx=128, max_windows=3, progress=False,
                            device="cpu").perplexity
    m = quantkit.load(q4)
    m.materialize()
    with evals.llamacpp_arithmetic(m.module, m.gguf_types):
        want = evals.perplexity(m.module, m.tokenizer, text, "wikitext", 128, 3, progress=False).perplexity
    plain = evals.perplexity(m.module, m.tokenizer, text, "wikitext", 128, 3, progress=False).perplexity
    assert got == want and plain != want


def test_requantize_refuses_values_llama_quantize_refuses(float_ggufs, tmp_path, capsys, monkeypatch):
    """NaN or infinity in the source, or a value the target's float16 cannot hold: llama-quantize
    refuses them (tensor has invalid data / quantized data validation failed); they were written,
    a NaN as a finite code and an infinity as a block of NaN. A value of 1e6 fits Q8_0's scale."""
    from quantkit.requant import requantize

    for (mix, match), src in damaged(*float_ggufs, tmp_path).items():
        refused(["export", src, "--out", tmp_path / "out.gguf", "--gguf-type", mix], capsys, monkeypatch, match)
        assert not (tmp_path / "out.gguf").exists() and not list(tmp_path.glob(".out.gguf*"))
    requantize(tmp_path / "big.gguf", tmp_path / "q8.gguf", "Q8_0", progress=False)
    t = next(t for t in gguf.GGUFReader(tmp_path / "q8.gguf").tensors if t.name == "blk.0.attn_q.weight")
    assert t.tensor_type.name == "Q8_0" and np.isfinite(gguf.quants.dequantize(t.data, t.tensor_type)).all()
    # requantized as llama-quantize --allow-requantize does, with a word on what that costs (the 1e6 above
    # would overflow Q4_0's scales, and is refused there)
    requantize(float_ggufs[0], tmp_path / "clean-q8.gguf", "Q8_0", progress=False)
    (code, _, err), said = noted(lambda: cli(["export", tmp_path / "clean-q8.gguf", "--out", tmp_path / "q4.gguf",
                                              "--gguf-type", "Q4_0"], capsys, monkeypatch))
    assert code == 0, err
    assert said[0].find("already quantized (Q8_0)") > 0 and "add the new type's" in said[0]
    # into a float mix nothing is rounded again: the note said "add the new type's" there too
    (code, _, err), said = noted(lambda: cli(["export", tmp_path / "clean-q8.gguf", "--out", tmp_path / "f16.gguf"],
                                             capsys, monkeypatch))
    assert code == 0 and "written as F16, they keep that rounding error, in a larger file" in said[0], said


@pytest.mark.slow
def test_a_bad_scale_in_a_type_only_read_is_refused_for_every_mix(float_ggufs, tmp_path, capsys, monkeypatch):
    """The check of a quantized source knew the types quantkit writes: an IQ4_NL block with a NaN scale was
    written as 32 NaN into F32 and BF16 files, and named as too large for F16; llama-quantize refuses it."""
    from . import llamacpp

    iq = tmp_path / "iq.gguf"
    llamacpp.quantize(float_ggufs[1], iq, "IQ4_NL")
    assert cli(["export", iq, "--out", tmp_path / "ok.gguf", "--gguf-type", "F32"], capsys, monkeypatch)[0] == 0
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(iq.read_bytes())
    r = gguf.GGUFReader(bad, "r+")
    t = next(t for t in r.tensors if t.tensor_type.name == "IQ4_NL")
    t.data.reshape(-1).view(np.uint8)[:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)  # the first d
    r.data.flush()
    for mix in ("F32", "BF16", "F16", "Q8_0"):
        refused(["export", bad, "--out", tmp_path / "out.gguf", "--gguf-type", mix], capsys, monkeypatch,
                f"tensor {t.name} holds a block whose float16 scale is NaN or infinite")
        assert not (tmp_path / "out.gguf").exists()
    with pytest.raises(RuntimeError, match="invalid data"):
        llamacpp.quantize(bad, tmp_path / "theirs.gguf", "F32", "--allow-requantize")


def test_too_little_space_is_the_last_line(tmp_path, capsys, monkeypatch):
    """The refusal came glued to a progress bar drawn before the check, and the bar again after it."""
    from quantkit import errors

    monkeypatch.setattr(errors, "free_space", lambda path: 1000)
    refused(["export", small_gguf(tmp_path / "m.gguf"), "--out", tmp_path / "q.gguf", "--gguf-type", "Q8_0"], capsys,
            monkeypatch, "free some space")
    assert not capsys.readouterr().err


@pytest.mark.slow
def test_llama_quantize_refuses_the_same_values(float_ggufs, tmp_path):
    from . import llamacpp

    for (mix, _), src in damaged(*float_ggufs, tmp_path).items():
        with pytest.raises(RuntimeError, match="invalid data|validation failed"):
            llamacpp.quantize(src, tmp_path / "theirs.gguf", mix)


@pytest.mark.slow
def test_one_part_split_and_any_file_name_requantize_as_llama_quantize_does(float_ggufs, tmp_path, capsys,
                                                                            monkeypatch):
    """llama-gguf-split writes a model that fits in one part with split.* keys; llama-quantize drops
    them (they were copied). A GGUF named otherwise than *.gguf is requantized too (it went through
    the float path, which writes the metadata anew)."""
    from . import llamacpp

    def split_keys(w):
        w.add_uint16("split.no", 0)
        w.add_uint16("split.count", 1)
        w.add_int32("split.tensors.count", len(gguf.GGUFReader(float_ggufs[0]).tensors))
    src = by_name(float_ggufs[0], tmp_path / "m.gguf", split_keys)
    llamacpp.quantize(src, tmp_path / "theirs.gguf", "Q8_0")
    assert "split.count" not in gguf.GGUFReader(tmp_path / "theirs.gguf").fields
    for name in ("m.gguf", "M.GGUF", "model"):
        if name != "m.gguf":
            (tmp_path / name).write_bytes(src.read_bytes())
        assert cli(["export", tmp_path / name, "--out", tmp_path / "ours.gguf", "--gguf-type", "Q8_0", "--overwrite"],
                   capsys, monkeypatch)[0] == 0
        assert (tmp_path / "ours.gguf").read_bytes() == (tmp_path / "theirs.gguf").read_bytes(), name


def test_requantizing_a_gguf_file_starts_without_torch(tmp_path):
    """quantkit export FILE.gguf imports neither torch nor transformers, nor numpy and the gguf package
    to quantize a float file: a user times the whole command, and importing them takes longer than
    llama-quantize's whole run on a small model (numpy and gguf: about a fifth of it)."""
    import subprocess
    import sys

    src, out = small_gguf(tmp_path / "m.gguf"), tmp_path / "q.gguf"
    code = ("import sys\nfrom quantkit.command import main\n"
            f"sys.argv = ['quantkit', 'export', {str(src)!r}, '--out', {str(out)!r}, '--gguf-type', 'Q8_0']\n"
            "try:\n    main()\nfinally:\n    print(sorted({'torch', 'transformers', 'numpy', 'gguf'} & set(sys.modules)))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [f"wrote {out} ({size(out.stat().st_size)})", "[]"]


def test_requantizing_through_numpy_writes_the_same_bytes(tmp_path, monkeypatch):
    """Where the file cannot be mapped for the compiled quantizer, it goes through numpy: the same file,
    from F32 and F16 (in slices of 8 rows, each split over 3 threads)."""
    import contextlib

    from quantkit import requant

    from quantkit import blocks

    if blocks.library() is None:
        pytest.skip("the compiled quantizer was not built here")
    f32 = small_gguf(tmp_path / "m.gguf")
    f16 = requant.requantize(f32, tmp_path / "f16.gguf", "F16", progress=False)
    monkeypatch.setattr(requant, "CHUNK", 8 * 96)
    monkeypatch.setattr(blocks, "threads", lambda: 3)
    calls = []
    monkeypatch.setattr(blocks, "quantize_at", lambda *a, f=blocks.quantize_at: calls.append(a) or f(*a))
    for src in (f32, f16):
        mapped = requant.requantize(src, tmp_path / "mapped.gguf", "Q4_0", overwrite=True, progress=False).read_bytes()
        assert calls and all(a[1] == (src == f16) for a in calls)  # the map was read, as float16 from F16
        calls.clear()
        with monkeypatch.context() as m:
            m.setattr(requant, "mapped", lambda path: contextlib.nullcontext())
            through = requant.requantize(src, tmp_path / "numpy.gguf", "Q4_0", overwrite=True, progress=False)
        assert not calls and through.read_bytes() == mapped


def test_a_type_gguf_py_cannot_dequantize_is_refused_at_load(float_ggufs, tmp_path, capsys, monkeypatch):
    """A GGUF holding a type gguf-py has no dequantizer for (Q8_K here; Q1_0, the integer types) loaded,
    and its first read of that tensor ended in gguf-py's NotImplementedError, a traceback."""
    r = gguf.GGUFReader(float_ggufs[0])
    w = gguf.GGUFWriter(tmp_path / "q8k.gguf", r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.name == "token_embd.weight":
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K]
            data = np.zeros((data.shape[0], data.shape[1] // block * size), np.uint8)
            w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_K)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    refused(["eval", tmp_path / "q8k.gguf", "--data", TEST, "--max-windows", 1], capsys, monkeypatch,
            "tensor token_embd.weight is Q8_K, which quantkit cannot read (gguf-py has no dequantizer for it)")


@pytest.mark.parametrize("source", ["BF16", "Q8_0"])
def test_a_bf16_or_quantized_source_requantizes_a_slice_of_rows_at_a_time(float_ggufs, tmp_path, monkeypatch, source):
    """Only F32 and F16 sources went a slice at a time: a BF16 (the converter's usual output) or quantized
    source's tensor was made whole in float32 first, twice where it was checked (a 70B model's embedding:
    8 GB). Rows at a time now, with the same bytes."""
    from quantkit import requant

    src = requant.requantize(float_ggufs[0], tmp_path / f"{source}.gguf", source, progress=False)
    whole = requant.requantize(src, tmp_path / "whole.gguf", "Q4_K_M", progress=False).read_bytes()
    monkeypatch.setattr(requant, "CHUNK", 8 * 256)  # 8 rows of 256 at a time
    rows = []
    real = requant.Header.array
    monkeypatch.setattr(requant.Header, "array", lambda self, *a: rows.append(len(out := real(self, *a))) or out)
    cut = requant.requantize(src, tmp_path / "cut.gguf", "Q4_K_M", progress=False).read_bytes()
    assert cut == whole and rows and max(rows) <= 8


def test_an_interrupted_requantization_resumes_after_its_last_saved_tensor(float_ggufs, tmp_path, monkeypatch, capsys):
    """A killed requantization started afresh (hours of a 70B model's tensors lost); now the same command goes on
    after the last tensor saved (each save after an fsync, every SAVED_EVERY bytes) with the bytes of a run never
    stopped, and another requantization's or quantization's work there is refused without overwrite."""
    from quantkit import requant

    src = float_ggufs[1]  # F16
    whole = requant.requantize(src, tmp_path / "whole.gguf", "Q4_K_M", progress=False).read_bytes()
    monkeypatch.setattr(requant, "SAVED_EVERY", 1)  # a save after every tensor
    real, calls, killed = requant.write_tensor, [], []

    def dies_at_the_fifth(f, h, t, kind, base):
        calls.append(t.name)
        if len(calls) == 5 and not killed:
            killed.append(t.name)
            raise KeyboardInterrupt
        return real(f, h, t, kind, base)

    monkeypatch.setattr(requant, "write_tensor", dies_at_the_fifth)
    with pytest.raises(KeyboardInterrupt):
        requant.requantize(src, tmp_path / "q.gguf", "Q4_K_M", progress=False)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == [".q.gguf.partial", ".q.gguf.progress.json", "whole.gguf"]
    n = len(gguf_tensors(tmp_path / "whole.gguf"))
    with pytest.raises(QuantkitError, match=rf"holds 4 of {n} tensors of another requantization writing .*q.gguf \(it "
                                            r"ran with mix='Q4_K_M'\).*pass overwrite=True"):
        requant.requantize(src, tmp_path / "q.gguf", "Q5_K_M", progress=False)
    with pytest.raises(QuantkitError, match=r"holds the finished work of another run writing .*q.gguf \(the finished "
                                            r"tensors of a GGUF requantization\)"):
        quantkit.quantize(str(src), method="rtn", format="gguf", gguf_type="Q4_K_M", out=tmp_path / "q.gguf",
                          progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == kept
    calls.clear()
    requant.requantize(src, tmp_path / "q.gguf", "Q4_K_M", progress=False)
    assert f"resuming after tensor 4/{n}" in capsys.readouterr().err
    assert calls[0] == killed[0] and len(calls) == n - 4
    assert (tmp_path / "q.gguf").read_bytes() == whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.gguf", "whole.gguf"]


def by_name(src, dst, keys=lambda w: None, drop=()):
    """src rewritten with its tensors in name order (blk.0, blk.1, blk.10, ..., blk.2), as a converter
    that sorts a checkpoint's keys writes them; keys(writer) adds key-values, those named in drop go."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture" and name not in drop:
            w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    keys(w)
    for t in sorted(r.tensors, key=lambda t: t.name):
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.slow
def test_layer_rules_count_layers_in_llama_quantizes_order(tmp_path, capsys, monkeypatch):
    """A file whose tensors run blk.0, blk.1, blk.10, ...: the mixes' layer rules (which attn_v and
    ffn_down layers get more bits) count layers by number, as llama-quantize does, not in file order."""
    from . import llamacpp

    model = make_tiny(tmp_path / "model", hidden=256, intermediate=512, layers=12)
    quantkit.api.export_gguf(quantkit.load(model), tmp_path / "f32.gguf", "F32", progress=False)
    src = by_name(tmp_path / "f32.gguf", tmp_path / "sorted.gguf")
    assert [t.name for t in gguf.GGUFReader(src).tensors if t.name.endswith("attn_v.weight")][2] == "blk.10.attn_v.weight"
    for mix in ("Q4_K_M", "Q3_K_M"):
        llamacpp.quantize(src, tmp_path / "theirs.gguf", mix)
        assert cli(["export", src, "--out", tmp_path / "ours.gguf", "--gguf-type", mix, "--overwrite"], capsys,
                   monkeypatch)[0] == 0
        assert (tmp_path / "ours.gguf").read_bytes() == (tmp_path / "theirs.gguf").read_bytes(), mix


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["70B", "65B"])
def test_80_layers_get_llama_quantizes_70b_rule(tmp_path, capsys, monkeypatch, kv_heads):
    """llama.cpp calls a llama of 80 layers with grouped KV heads 70B (without them, 65B), and gives
    its attn_v Q5_K where a mix gives Q3_K or Q4_K: every Llama-70B file was typed as a smaller model's.
    Requantized and exported from the model directory, the types (and bytes) are llama-quantize's."""
    from . import llamacpp

    model = make_tiny(tmp_path / "model", hidden=256, intermediate=256, layers=80, num_key_value_heads=kv_heads)
    src = tmp_path / "f32.gguf"
    quantkit.api.export_gguf(quantkit.load(model), src, "F32", progress=False)
    for mix in ("Q4_K_M", "Q3_K_M", "Q2_K"):
        llamacpp.quantize(src, tmp_path / "theirs.gguf", mix)
        theirs = gguf_tensors(tmp_path / "theirs.gguf")
        v = {kind for name, (kind, _) in theirs.items() if name.endswith("attn_v.weight")}
        assert (v == {"Q5_K"}) == (kv_heads == 2) or mix == "Q4_K_M" and v == {"Q5_K", "Q6_K"}, (mix, v)
        assert cli(["export", src, "--out", tmp_path / "ours.gguf", "--gguf-type", mix, "--overwrite"], capsys,
                   monkeypatch)[0] == 0
        assert (tmp_path / "ours.gguf").read_bytes() == (tmp_path / "theirs.gguf").read_bytes(), mix
        types = quantkit.exporters.gguf.tensor_types(quantkit.load(model).module, mix)
        assert {G.gguf_name(f"{n}.weight"): t for n, t in types.items()} == {n: k for n, (k, _) in theirs.items()
                                                                              if n.endswith(".weight") and "norm" not in n}


@pytest.mark.slow
def test_degenerate_blocks_requantize_as_llama_quantize_does(tmp_path, capsys, monkeypatch):
    """Weights that reach every corner of the block searches (tests/test_blocks.py's: ties, zeros of
    both signs, all-zero blocks, subnormal values, outliers), one kind per linear, requantized into
    every mix: the file is llama-quantize's, byte for byte."""
    from safetensors.torch import load_file, save_file

    from . import llamacpp
    from .test_blocks import cases

    model = make_tiny(tmp_path / "model", hidden=256, intermediate=512)
    state = load_file(model / "model.safetensors")
    linears = [k for k, t in state.items() if t.dim() == 2 and ".layers." in k]
    assert len(linears) >= len(cases())
    for key, w in zip(linears, cases().values()):
        state[key] = w.reshape(-1).repeat(-(-state[key].numel() // w.numel()))[:state[key].numel()].reshape(
            state[key].shape).contiguous()
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    src = tmp_path / "f32.gguf"
    quantkit.api.export_gguf(quantkit.load(model), src, "F32", progress=False)
    for mix in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K"):
        llamacpp.quantize(src, tmp_path / f"theirs-{mix}.gguf", mix)
        assert cli(["export", src, "--out", tmp_path / f"ours-{mix}.gguf", "--gguf-type", mix], capsys, monkeypatch)[0] == 0
        assert (tmp_path / f"ours-{mix}.gguf").read_bytes() == (tmp_path / f"theirs-{mix}.gguf").read_bytes(), mix


@pytest.mark.slow
def test_q4_1_export_reproduces_the_shipped_file(embedded):
    """The embedded model shipped as Q4_1 (token_embd Q8_0): exported again as Q4_1, every tensor's bytes
    are the shipped ones."""
    from quantkit.modelio import default_gguf

    ours, shipped = gguf_tensors(embedded.quantized("Q4_1", False)[0]), gguf_tensors(default_gguf())
    assert ours.keys() == shipped.keys()
    assert [k for k in ours if ours[k] != shipped[k]] == []


@pytest.mark.slow
@pytest.mark.parametrize("mix,pure", [("F16", False), ("BF16", False), ("Q4_1", False), ("Q2_K", True),
                                      ("Q3_K_M", True), ("Q4_K_M", False), ("Q5_K_M", True)])
def test_llama_perplexity_agrees_with_ours(embedded, mix, pure):
    """llama.cpp loads every type we write (F16, BF16, Q4_1, and in the mixes Q8_0, Q4_0, Q5_0, Q5_1 and
    each K-quant) and its perplexity of the file is within 1% of ours for the model the file holds
    (the tiny tests show a file reads back as that model). Ours rounds each matmul's activations as
    llama.cpp's CPU backend does (8-bit blocks for quantized weights); without that the two differ
    by 1-2% at Q2_K. So is the "+/-" it prints beside it, the standard error quantkit prints too."""
    from . import llamacpp

    path, q = embedded.quantized(mix, pure)
    theirs, theirs_unc = llamacpp.estimate(path, TEST, 8)
    ours = quantkit.evaluate(q, TEST, max_windows=8, progress=False)
    assert abs(ours.perplexity / theirs - 1) < 0.01, (set(q.gguf_types.values()), ours, theirs)
    assert abs(ours.perplexity_unc / theirs_unc - 1) < 0.02, (ours.perplexity_unc, theirs_unc)


@pytest.fixture(scope="module")
def real_inputs():
    """The inputs of layer 3's down_proj (1536 wide: whole 256-value blocks) in the embedded model,
    from 8 calibration windows of 512 tokens, and its weight."""
    from quantkit.calibration import load_text, sample_windows
    from quantkit.pipeline import capture_inputs, run_layer

    m = loaded()
    windows = sample_windows(m.tokenizer, load_text(VALID), 8, 512)
    with torch.no_grad():
        batches = capture_inputs(m, windows, 4)
        for layer in m.layers[:3]:
            batches = run_layer(layer, batches)
        down = m.layers[3].mlp.down_proj
        xs = []
        hook = down.register_forward_pre_hook(lambda mod, args: xs.append(args[0].reshape(-1, args[0].shape[-1])))
        run_layer(m.layers[3], batches)
        hook.remove()
    return torch.cat(xs), down.weight.detach().clone()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "Q4_K"])
def test_calibration_lowers_the_output_error_on_real_weights(real_inputs, kind):
    """On a real layer with its real inputs, the importance-weighted search and GPTQ onto the block grid
    both give outputs closer to the float layer's than llama.cpp's plain search (the whole-model
    perplexities against llama-quantize are benchmarks/gguf_bench.py's)."""
    x, w = real_inputs
    h = 2 * x.T @ x / x.shape[0]

    def out_err(qt):
        return float(((x @ (qt.dequantize() - w).T) ** 2).mean())

    plain = out_err(ggml.quantize(w, kind))
    assert out_err(ggml.quantize(w, kind, h.diagonal())) < plain
    assert out_err(ggml.gptq(w, h, kind, h.diagonal()).tensor) < plain


def test_cli_export_and_its_refusal(tiny256, tmp_path, capsys, monkeypatch):
    import sys

    from quantkit.command import main

    from .test_bad_input import run

    monkeypatch.setattr(sys, "argv", ["quantkit", "export", str(tiny256), "--out", str(tmp_path / "m.gguf"),
                                      "--gguf-type", "Q8_0"])
    main()
    assert quantkit.load(tmp_path / "m.gguf").gguf_types["model.layers.0.mlp.up_proj"] == "Q8_0"
    quantkit.quantize(tiny256, method="rtn", bits=4, group_size=128, out=tmp_path / "g128", progress=False)
    code, line = run(["export", tmp_path / "g128", "--out", tmp_path / "x.gguf"], capsys, monkeypatch)
    assert code == 2 and "has no GGUF block type" in line and not (tmp_path / "x.gguf").exists()


@pytest.mark.slow
def test_kl_divergence_agrees_with_llama_perplexity(embedded, tmp_path):
    """Q4_K_M, Q3_K_M (pure) and Q2_K files against the F32 file, 16 windows of 512: llama-perplexity
    --kl-divergence and ours agree (mean KLD within 5%, same top token within 0.5 points). Each tool
    saves its own base, in the same layout: the same tokens, and log-probabilities within float noise.
    Our base is the float model the F32 file holds; our quantized models are the ones our files hold,
    scored with llama.cpp's arithmetic, with attention in float32 on both sides (llama.cpp's default
    float16 flash attention flipped near-tied top tokens: 0.54 points at Q4_K_M on an AVX2 build, 0.02
    in float32)."""
    from . import llamacpp

    theirs_base, ours_base = tmp_path / "theirs.logits", tmp_path / "ours.logits"
    llamacpp.save_base(embedded.dir / "f32.gguf", TEST, theirs_base, 16, flags=llamacpp.F32_ATTENTION)
    for i, (mix, pure) in enumerate([("Q4_K_M", False), ("Q3_K_M", True), ("Q2_K", False)]):
        path, q = embedded.quantized(mix, pure)
        theirs = llamacpp.kl_divergence(path, theirs_base, flags=llamacpp.F32_ATTENTION)
        base = {"base": quantkit.load(), "save_base": ours_base} if i == 0 else {"base": ours_base}
        ours = quantkit.compare(q, data=TEST, max_windows=16, progress=False, **base)
        assert abs(ours.kld_mean / theirs["kld_mean"] - 1) < 0.05, (mix, ours.kld_mean, theirs)
        assert abs(ours.same_top - theirs["same_top"]) < 0.005, (mix, ours.same_top, theirs)
        if i == 0:
            a, b = quantkit.evals.BaseFile(ours_base), quantkit.evals.BaseFile(theirs_base)
            assert (a.n, a.ctx, a.n_vocab) == (b.n, b.ctx, b.n_vocab) and torch.equal(a.windows, b.windows)
            kept = b.logprobs(0) > -10
            assert (a.logprobs(0) - b.logprobs(0))[kept].abs().max() < 0.02


def test_tensor_type_overrides_take_the_first_match_and_shift_the_mix_count(tiny256):
    """--tensor-type as llama-quantize applies it: the first matching pattern wins, even under --pure;
    the mix's layer rules then count only the tensors they decided, so overriding layer 0's ffn_down
    makes layer 1's the first of Q4_K_M's use_more_bits count (Q4_K where it was Q6_K)."""
    module = quantkit.load(tiny256).module
    plain = G.tensor_types(module, "Q4_K_M")
    assert plain["model.layers.1.mlp.down_proj"] == "Q6_K"
    types = G.tensor_types(module, "Q4_K_M", overrides=(r"blk\.0\.ffn_down=q8_0", "ffn_down=Q5_K", "ATTN_Q=q4_0"))
    assert types["model.layers.0.mlp.down_proj"] == "Q8_0" and types["model.layers.1.mlp.down_proj"] == "Q5_K"
    assert types["model.layers.0.self_attn.q_proj"] == "Q4_0"
    shifted = G.tensor_types(module, "Q4_K_M", overrides=(r"blk\.0\.ffn_down=q8_0",))
    assert shifted["model.layers.1.mlp.down_proj"] == "Q4_K"
    assert G.tensor_types(module, "Q4_K_M", pure=True, overrides=("attn_v=Q8_0",))["model.layers.1.self_attn.v_proj"] \
        == "Q8_0"
    for bad, match in [("attn_v", "not PATTERN=TYPE"), ("attn_v=Q9_K", "unknown GGUF type"), ("(=Q8_0", "not a regular"),
                       ("attn_vv=Q8_0", "pattern 'attn_vv' matches no quantized tensor")]:  # was accepted, and did nothing
        with pytest.raises(QuantkitError, match=match):
            G.tensor_types(module, "Q4_K_M", overrides=(bad,))
    with pytest.raises(QuantkitError, match="quantized GGUF mix"):
        quantkit.QuantConfig(gguf_type="F16", tensor_type=("attn_v=Q8_0",))


@pytest.mark.slow
@pytest.mark.parametrize("mix,overrides", [("Q4_K_M", [r"blk\.0\.ffn_down=q8_0", "attn_v=q4_0", "output=q5_k"]),
                                           ("Q3_K_M", ["ffn_.*=Q6_K", r"blk\.1\.attn_q=F16"])])
def test_tensor_type_bytes_equal_llama_quantize(tiny256, tmp_path, mix, overrides):
    """The same overrides through llama-quantize --tensor-type from our F32 file and through quantkit:
    every tensor's type and bytes are the same."""
    from . import llamacpp

    quantkit.api.export_gguf(quantkit.load(tiny256), tmp_path / "f32.gguf", "F32", progress=False)
    llamacpp.quantize(tmp_path / "f32.gguf", tmp_path / "theirs.gguf", mix,
                      *[a for o in overrides for a in ("--tensor-type", o)])
    quantkit.quantize(tiny256, method="rtn", format="gguf", gguf_type=mix, tensor_type=tuple(overrides),
                      out=tmp_path / "ours.gguf", progress=False)
    ours, theirs = gguf_tensors(tmp_path / "ours.gguf"), gguf_tensors(tmp_path / "theirs.gguf")
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if ours[k] != theirs[k]] == []
    for path, read in ((tmp_path / "ours.gguf", ours), (tmp_path / "theirs.gguf", theirs)):  # the tests' reader
        assert read == {t.name: (t.tensor_type.name, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(path).tensors}
    plain = G.tensor_types(quantkit.load(tiny256).module, mix)["model.layers.1.mlp.down_proj"]
    assert ours["blk.1.ffn_down.weight"][0] != plain  # the overrides changed what the mix would give


# ---- GGUF files llama.cpp made, given to quantkit (tiny256's F16 file, edited as llama.cpp would write it) ----

def key_values(path) -> dict:
    return {f.name: f.contents() for f in gguf.GGUFReader(path).fields.values() if not f.name.startswith("GGUF.")}


def more_keys(w):
    """Key-values llama.cpp's converter writes that a model directory's config does not give."""
    w.add_string("general.name", "Tiny Model")
    w.add_string("general.license", "apache-2.0")
    w.add_array("general.tags", ["text-generation"])
    w.add_uint32("tokenizer.ggml.eot_token_id", 0)
    w.add_uint32("tokenizer.ggml.fim_pre_token_id", 1)
    w.add_string("tokenizer.chat_template.tool_use", "{{ tools }}")
    w.add_bool("tokenizer.ggml.add_space_prefix", False)


def test_a_gguf_keeps_its_metadata_through_quantize(float_ggufs, tmp_path, capsys, monkeypatch):
    """quantize x.gguf --format gguf and export_gguf(load(x.gguf)) write the source's key-values, as
    quantkit export (llama-quantize) does: its licence, tags, EOT/FIM ids, named chat templates and
    pre-tokenizer were lost, the metadata made again from the config, and general.name the file's stem."""
    src = by_name(float_ggufs[1], tmp_path / "src.gguf", more_keys, drop=("general.name",))
    requantized, quantized = tmp_path / "requantized.gguf", tmp_path / "quantized.gguf"
    assert cli(["export", src, "--out", requantized, "--gguf-type", "Q8_0"], capsys, monkeypatch)[0] == 0
    (code, _, err), said = noted(lambda: cli(["quantize", src, "--format", "gguf", "--gguf-type", "Q8_0", "--out",
                                              quantized], capsys, monkeypatch))
    assert code == 0 and not said, err  # from F16: nothing to say
    quantkit.api.export_gguf(quantkit.load(src), tmp_path / "api.gguf", "Q8_0", progress=False)
    want = key_values(requantized)
    assert want["general.name"] == "Tiny Model" and want["tokenizer.chat_template.tool_use"] == "{{ tools }}"
    assert {k: v for k, v in want.items() if k not in ("general.file_type", "general.quantization_version")} == \
        {k: v for k, v in key_values(src).items() if k not in ("general.file_type", "general.quantization_version")}
    for out in (quantized, tmp_path / "api.gguf"):
        assert key_values(out) == want, out
        assert gguf_tensors(out) == gguf_tensors(requantized), out
    assert quantkit.load(tmp_path / "api.gguf").tokenizer("Hello 123")["input_ids"] == \
        quantkit.load(src).tokenizer("Hello 123")["input_ids"]


@pytest.mark.parametrize("pre,match", [("deepseek-llm", "pre-tokenizer 'deepseek-llm' (tokenizer.ggml.pre) is not one "
                                                         "quantkit reproduces (gpt-2, smollm,"),
                                       (None, "has no tokenizer.ggml.pre, and llama.cpp's 'default' pre-tokenizer")],
                         ids=["unknown", "missing"])
def test_a_pre_tokenizer_quantkit_does_not_reproduce_is_refused(float_ggufs, tmp_path, pre, match):
    """llama.cpp splits a byte-level BPE's text by tokenizer.ggml.pre, without it by its 'default'
    expressions (punctuation runs, numbers, then GPT-2's), not GPT-2's split alone: such a file was
    tokenized the GPT-2 way, silently, and scored another perplexity than llama-perplexity's."""
    def keys(w):
        if pre is not None:
            w.add_tokenizer_pre(pre)
    src = by_name(float_ggufs[1], tmp_path / "m.gguf", keys, drop=("tokenizer.ggml.pre",))
    with pytest.raises(QuantkitError, match=re.escape(match) + ".*evaluate it with llama-perplexity, or convert"):
        quantkit.load(src)


def test_a_tensor_type_gguf_py_does_not_know_is_named(tmp_path):
    """A type of a newer llama.cpp than the installed gguf-py (llama-quantize's Q2_0, 42) was called a
    damaged file, to be downloaded again."""
    import struct

    from quantkit.requant import requantize

    data = bytearray(small_gguf(tmp_path / "m.gguf").read_bytes())
    at = data.index(b"blk.0.attn_q.weight") + len("blk.0.attn_q.weight") + 4 + 2 * 8  # past its name and 2 dims
    data[at:at + 4] = struct.pack("<I", 250)
    (tmp_path / "m.gguf").write_bytes(data)
    match = "tensor blk.0.attn_q.weight has GGML type 250, which quantkit does not read: requantize the file to Q8_0"
    with pytest.raises(QuantkitError, match=match):
        quantkit.load(tmp_path / "m.gguf")
    with pytest.raises(QuantkitError, match=match):
        requantize(tmp_path / "m.gguf", tmp_path / "q.gguf", "Q8_0", progress=False)


def test_a_big_endian_gguf_is_named_as_one_by_the_loader(tmp_path):
    """eval, quantize and load called it corrupt, where quantkit export named it."""
    with pytest.raises(QuantkitError, match="a big-endian GGUF: .* convert the model again without --bigendian"):
        quantkit.load(small_gguf(tmp_path / "be.gguf", endian=gguf.GGUFEndian.BIG))


@pytest.mark.parametrize("key", ["block_count", "context_length", "embedding_length", "feed_forward_length",
                                 "attention.head_count", "attention.layer_norm_rms_epsilon"])
def test_a_missing_hyperparameter_is_named(float_ggufs, tmp_path, key):
    """llama.cpp refuses a file without these; transformers' default stood in for them, taken silently
    (a context of 2048, an epsilon of 1e-6) or reported as the metadata's value against the weights'."""
    src = by_name(float_ggufs[1], tmp_path / "m.gguf", drop=(f"llama.{key}",))
    with pytest.raises(QuantkitError, match=re.escape(f"m.gguf has no llama.{key}: the file is damaged; convert")):
        quantkit.load(src)


def test_quantizing_a_quantized_gguf_says_so_as_export_does(float_ggufs, tmp_path, capsys, monkeypatch):
    """quantkit export says that requantized blocks keep their rounding error; quantize said nothing."""
    from quantkit.requant import requantize, requantized_note

    q8 = requantize(float_ggufs[1], tmp_path / "q8.gguf", "Q8_0", progress=False)
    (code, _, err), said = noted(lambda: cli(["quantize", q8, "--format", "gguf", "--gguf-type", "Q4_0", "--out",
                                              tmp_path / "q4.gguf"], capsys, monkeypatch))
    assert code == 0 and said == [requantized_note(q8, ["Q8_0"])], err


def test_quantizing_a_gguf_keeps_the_blocks_already_of_their_type(float_ggufs, tmp_path, capsys, monkeypatch):
    """llama-quantize (and quantkit export) keeps a tensor already of the type it would get; quantize
    rounded its dequantized blocks again: 17 of the embedded model's 211 quantized tensors in Q4_K_M
    came out different (perplexity 29.3776 -> 29.4134), said to be "requantized". A weight changed in
    memory is no longer its blocks."""
    from quantkit.requant import requantize, requantized_note

    q4 = requantize(float_ggufs[1], tmp_path / "q4.gguf", "Q4_K_M", progress=False)
    source = gguf_tensors(q4)
    for mix in ("Q4_K_M", "Q5_K_M"):
        out, theirs = tmp_path / f"ours-{mix}.gguf", tmp_path / f"export-{mix}.gguf"
        (code, _, err), said = noted(lambda: cli(["quantize", q4, "--format", "gguf", "--gguf-type", mix, "--out", out],
                                                 capsys, monkeypatch))
        assert code == 0, err
        ours = gguf_tensors(out)
        assert gguf_tensors(requantize(q4, theirs, mix, progress=False)) == ours
        kept = [n for n in ours if ours[n][0] == source[n][0]]
        assert [n for n in kept if ours[n] != source[n]] == []
        again = sorted({source[n][0] for n in ours if n not in kept})
        assert again == ([] if mix == "Q4_K_M" else ["Q4_K"])  # Q6_K stays Q6_K in Q5_K_M
        assert said == ([requantized_note(q4, again)] if again else [])
    m = quantkit.load(q4)
    m.materialize()
    with torch.no_grad():
        m.module.model.layers[1].mlp.down_proj.weight.neg_()
    quantkit.quantize(m, method="rtn", format="gguf", gguf_type="Q4_K_M", out=tmp_path / "changed.gguf", progress=False)
    changed = gguf_tensors(tmp_path / "changed.gguf")
    assert [n for n in changed if changed[n] != source[n]] == ["blk.1.ffn_down.weight"]


def test_mixes_are_named_as_llama_quantize_names_them(float_ggufs, tmp_path, capsys, monkeypatch):
    """llama-quantize takes any case and Q3_K/Q4_K/Q5_K for the _M mixes; its mixes quantkit does not
    write were called unknown. The name downstream is the canonical one: the file's type, the config's."""
    from quantkit.requant import check_mix

    assert [check_mix(m) for m in ("q4_k_m", "Q3_K", "q4_k", "Q5_K", "bf16")] == \
        ["Q4_K_M", "Q3_K_M", "Q4_K_M", "Q5_K_M", "BF16"]
    for name in ("Q4_K_S", "iq4_xs", "Q3_K_L", "Q2_K_S", "TQ1_0"):
        with pytest.raises(QuantkitError, match=f"does not write {name.upper()}: use one of F32, .*, or llama-quantize"):
            check_mix(name)
    f16 = float_ggufs[1]
    refused(["export", f16, "--out", tmp_path / "x.gguf", "--gguf-type", "q4_k_s"], capsys, monkeypatch,
            "quantkit does not write Q4_K_S")
    refused(["quantize", f16, "--format", "gguf", "--gguf-type", "IQ4_XS", "--out", tmp_path / "x.gguf"], capsys,
            monkeypatch, "quantkit does not write IQ4_XS")
    refused(["quantize", f16, "--format", "gguf", "--tensor-type", "attn_v=iq4_xs", "--out", tmp_path / "x.gguf"],
            capsys, monkeypatch, "--tensor-type 'attn_v=iq4_xs': quantkit does not write IQ4_XS: use one of F32")
    refused(["quantize", f16, "--format", "gguf", "--tensor-type", "attn_v=q9_k", "--out", tmp_path / "x.gguf"],
            capsys, monkeypatch, "unknown GGUF type 'Q9_K'")
    assert not (tmp_path / "x.gguf").exists()
    assert cli(["export", f16, "--out", tmp_path / "a.gguf", "--gguf-type", "q4_k"], capsys, monkeypatch)[0] == 0
    assert cli(["export", f16, "--out", tmp_path / "b.gguf", "--gguf-type", "Q4_K_M"], capsys, monkeypatch)[0] == 0
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    m = quantkit.quantize(f16, method="rtn", format="gguf", gguf_type="q8_0", out=tmp_path / "c.gguf", keep=True,
                          progress=False)
    assert m.qconfig.gguf_type == "Q8_0"
    assert key_values(tmp_path / "c.gguf")["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert quantkit.QuantConfig(gguf_type="q5_k").gguf_type == "Q5_K_M"


def test_export_requantizes_with_pure_and_tensor_types(float_ggufs, tmp_path, capsys, monkeypatch):
    """export of a GGUF took no --pure or --tensor-type (only quantize, 10x slower, had them); its tensors
    now equal quantize's with the same options, which equal llama-quantize's (tests above)."""
    f16 = float_ggufs[1]
    for options in (["--pure"], ["--tensor-type", r"blk\.0\.ffn_down=Q8_0", "--tensor-type", "attn_k=Q5_0"]):
        exported, quantized = tmp_path / "e.gguf", tmp_path / "q.gguf"
        assert cli(["export", f16, "--out", exported, "--gguf-type", "Q4_K_M", *options, "--overwrite"], capsys,
                   monkeypatch)[0] == 0
        assert cli(["quantize", f16, "--format", "gguf", "--gguf-type", "Q4_K_M", *options, "--out", quantized,
                    "--overwrite"], capsys, monkeypatch)[0] == 0
        assert gguf_tensors(exported) == gguf_tensors(quantized)
        kinds = {name: kind for name, (kind, _) in gguf_tensors(exported).items() if name.startswith("blk.")}
        if options == ["--pure"]:
            assert set(kinds.values()) == {"Q4_K", "F32"}, kinds  # the norms stay float
        else:
            assert kinds["blk.0.ffn_down.weight"] == "Q8_0" and kinds["blk.1.attn_k.weight"] == "Q5_0", kinds
    refused(["export", "--out", tmp_path / "x.gguf", "--pure"], capsys, monkeypatch,
            "--pure requantizes a GGUF file: for a model directory, quantkit quantize MODEL --format gguf takes it")
    # a float mix has no types to choose among: both were accepted and ignored (a misspelt pattern too), and
    # so was an empty --gguf-type (a script's empty variable), taken for the default F16
    for options, match in ((["--tensor-type", "attn_v=q8_0"], "--tensor-type chooses among the types of a quantized "
                                                              "mix, and F16 stores every weight as F16: pass a quantized "
                                                              "--gguf-type such as Q4_K_M"),
                           (["--gguf-type", "BF16", "--pure"], "--pure chooses among the types of a quantized mix, "
                                                               "and BF16 stores every weight as BF16"),
                           (["--gguf-type", ""], "unknown GGUF")):
        refused(["export", f16, "--out", tmp_path / "x.gguf", *options], capsys, monkeypatch, match)
    refused(["quantize", f16, "--format", "gguf", "--gguf-type", "F16", "--pure", "--out", tmp_path / "x.gguf"],
            capsys, monkeypatch, "--pure chooses among the types of a quantized GGUF mix: use it with --format gguf "
                                 "and a --gguf-type such as Q4_K_M")
    assert not (tmp_path / "x.gguf").exists()
