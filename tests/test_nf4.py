"""NF4/FP4: bit-exact with bitsandbytes 0.50 on the CPU, its checkpoint layout, transformers loads it."""
import json

import pytest
import torch

import quantkit
from quantkit import QuantkitError
from quantkit.config import QuantConfig
from quantkit.qlinear import NF4Linear
from quantkit.quantizers import nf4

bnb = pytest.importorskip("bitsandbytes")
F = bnb.functional


def reference_dequantize(q, absmax, code, block_size, shape, dtype):
    """bitsandbytes' own torch dequantization (its default backend), run eagerly."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    with torch.compiler.set_stance("force_eager"):
        return _dequantize_4bit_compute(q.view(-1), absmax, code, block_size, shape, dtype)


def packed(qt):
    return NF4Linear.from_tensor(qt).packed  # what the export writes


def assert_matches_bnb(w, kind, block_size, double):
    q, state = F.quantize_4bit(w, blocksize=block_size, compress_statistics=double, quant_type=kind)
    qt = nf4.quantize(w, kind, block_size, double)
    assert torch.equal(packed(qt), q.view(-1))
    if double:
        assert torch.equal(qt.nested.codes.view(-1), state.absmax)
        assert torch.equal(qt.nested.scales, state.state2.absmax)
        assert qt.offset == state.offset.item()
        absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
    else:
        assert torch.equal(qt.scales, state.absmax)
        absmax = state.absmax
    assert torch.equal(qt.scales, absmax)
    ours = qt.dequantize(w.dtype)
    assert torch.equal(ours, reference_dequantize(q, absmax, state.code, block_size, w.shape, w.dtype))
    if w.shape[1] % block_size == 0:
        # bitsandbytes' native CPU kernel agrees too where blocks do not straddle rows (where they
        # do, it scales some values with the wrong block's absmax: its own round trip is off)
        assert torch.equal(ours, F.dequantize_4bit(q, state))


def test_code_tables_are_bitsandbytes():
    assert torch.equal(nf4.NF4, F.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(nf4.FP4, F.get_4bit_type("fp4", device="cpu"))
    assert torch.equal(nf4.dynamic_map(), F.create_dynamic_map())


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bit_exact_every_block_size(kind, double, dtype):
    g = torch.Generator().manual_seed(0)
    for shape in [(96, 576), (33, 577), (700, 160)]:  # rows that blocks straddle; odd element counts
        w = (torch.randn(shape, generator=g) * 0.02).to(dtype)
        w[1] = 0  # a row of zeros: blocks with absmax 0
        w[2, 5] = 0.3  # an outlier
        for block_size in nf4.BLOCK_SIZES:
            assert_matches_bnb(w, kind, block_size, double)


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_tensor_smaller_than_a_block(kind):
    w = torch.randn(3, 5)
    for block_size in (32, 4096):
        assert_matches_bnb(w, kind, block_size, True)
        assert_matches_bnb(w, kind, block_size, False)


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_compiled_codes_are_the_torch_paths(kind, monkeypatch):
    """The compiled pass (quantkit/kernels/absmax.c) gives the torch path's codes and absmax on values
    at every midpoint between entries and the floats beside them, zeros of both signs, subnormal,
    infinite and NaN values, and a last shorter block (a NaN's bits aside: NaN either way)."""
    from quantkit import blocks

    if blocks.library() is None:
        pytest.skip("the compiled kernels were not built here")
    monkeypatch.setattr(blocks, "threads", lambda: 3)  # shares that start past the first block, on any machine
    g = torch.Generator().manual_seed(0)
    mids, _ = nf4.midpoints(nf4.CODEBOOKS[kind])
    edges = torch.cat([mids, mids.nextafter(torch.tensor(2.0)), mids.nextafter(torch.tensor(-2.0)),
                       torch.tensor([1.0, -1.0, 0.0, -0.0])])
    w = torch.randn(41, 250, generator=g) * 0.02
    w[0, :len(edges)] = edges  # scaled by an absmax of 1 (its block holds 1.0)
    w[1] = 0
    w[2, :64] = -0.0
    w[3] = torch.randn(250, generator=g) * 1e-40
    w[4, 3], w[5, 7], w[6, 9] = float("nan"), float("inf"), -float("inf")
    w[-1, -3] = float("nan")  # in the last, shorter block for most sizes
    for block_size in nf4.BLOCK_SIZES:
        x = w.reshape(-1)
        scaled, absmax = nf4.absmax_scaled(x, block_size, reciprocal=True)
        codes, compiled = nf4.compiled_codes(x, block_size, nf4.CODEBOOKS[kind])
        assert torch.equal(codes, nf4.nearest(scaled.clamp(-1, 1), nf4.CODEBOOKS[kind])), block_size
        torch.testing.assert_close(compiled, absmax, rtol=0, atol=0, equal_nan=True)
    calls = []
    monkeypatch.setattr(nf4, "compiled_codes", lambda *a, f=nf4.compiled_codes: calls.append(a) or f(*a))
    nf4.quantize(w.nan_to_num(0, 0, 0), kind, 64)  # NaN and Inf weights are refused
    assert calls  # quantize takes the compiled path here


def test_compiled_nested_codes_are_the_torch_paths():
    """Double quantization's compiled second level gives the torch path's codes and absmax: blocks of
    zeros (0 / 0, snapped as -1), infinities, NaN, values on and beside the grid's points and the map's
    midpoints, and a last shorter block."""
    from quantkit import blocks

    if blocks.library() is None:
        pytest.skip("the compiled kernels were not built here")
    g = torch.Generator().manual_seed(0)
    table = nf4.dynamic_map()
    mids, _ = nf4.midpoints(table)
    grid = -1 + 2 * torch.arange(0, 65536, 97, dtype=torch.float32) / 65535
    x = torch.cat([torch.randn(256 * 3, generator=g), torch.zeros(256), mids, mids.nextafter(torch.tensor(2.0)),
                   grid, grid.nextafter(torch.tensor(-2.0)), torch.tensor([1.0, -1.0, float("inf"), -float("inf")]),
                   torch.randn(300, generator=g)])
    x[5], x[-7] = float("nan"), float("nan")
    scaled, absmax = nf4.absmax_scaled(x, nf4.NESTED_BLOCK, reciprocal=False)
    codes, compiled = nf4.compiled_nested(x, table)
    assert torch.equal(codes, nf4.nearest(nf4.snap(scaled), table))
    torch.testing.assert_close(compiled, absmax, rtol=0, atol=0, equal_nan=True)


def test_nested_codes_follow_bitsandbytes_table_not_plain_nearest():
    """bitsandbytes' CPU kernel snaps each value to a 65536-point grid before taking the nearest
    8-bit code; a value just below a midpoint can land above it. We reproduce that, and it is not a
    no-op: plain nearest-code rounding would differ here."""
    torch.manual_seed(0)
    x = torch.randn(256 * 64)
    q, state = F.quantize_blockwise(x, blocksize=256)
    scaled, _ = nf4.absmax_scaled(x, 256, reciprocal=False)
    table = nf4.dynamic_map()
    assert torch.equal(nf4.nearest(nf4.snap(scaled), table), q)
    assert not torch.equal(nf4.nearest(scaled, table), q)


def test_bits_per_weight():
    w = torch.randn(256, 512)
    assert nf4.quantize(w, "nf4", 64).bits_per_weight == 4 + 32 / 64
    nblocks = 256 * 512 // 64
    expected = 4 + (nblocks * 8 + (nblocks // 256) * 32 + 32) / w.numel()
    assert nf4.quantize(w, "nf4", 64, double_quant=True).bits_per_weight == pytest.approx(expected)


@pytest.mark.parametrize("block_size", [0, 16, 48, 8192])
def test_unsupported_block_size(block_size):
    with pytest.raises(QuantkitError, match="block size"):
        nf4.quantize(torch.randn(4, 64), "nf4", block_size)
    with pytest.raises(QuantkitError, match=f"block_size={block_size} is not a block size"):
        QuantConfig("nf4", block_size=block_size)


def test_bad_options():
    with pytest.raises(QuantkitError, match="4-bit type"):
        QuantConfig("nf4", bits=3)
    with pytest.raises(QuantkitError, match="double quantization"):
        QuantConfig("rtn", double_quant=True)
    with pytest.raises(QuantkitError, match="unknown 4-bit type"):
        nf4.quantize(torch.randn(4, 64), "nf3")


def test_block_size_defaults_per_method():
    assert QuantConfig("nf4").block_size == 64
    assert QuantConfig("gptq").block_size == 128


@pytest.mark.parametrize("kind,double", [("nf4", True), ("fp4", False)])
def test_export_equals_transformers_own(tiny_dir, tmp_path, kind, double):
    """Every tensor of our export equals what transformers + bitsandbytes save for the same model;
    transformers loads ours and computes our in-memory model's logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    theirs = AutoModelForCausalLM.from_pretrained(
        tiny_dir, device_map="cpu", dtype=torch.float32,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind,
                                               bnb_4bit_use_double_quant=double, bnb_4bit_compute_dtype=torch.float32))
    theirs.save_pretrained(tmp_path / "theirs")
    m = quantkit.quantize(str(tiny_dir), method=kind, double_quant=double, out=tmp_path / "ours", keep=True, progress=False)
    a, b = load_file(tmp_path / "ours" / "model.safetensors"), load_file(tmp_path / "theirs" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in b:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "bitsandbytes" and cfg["load_in_4bit"] and cfg["bnb_4bit_quant_type"] == kind
    assert cfg["bnb_4bit_use_double_quant"] is double

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", device_map="cpu")
    for module in loaded.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            # its CPU default is a bfloat16 kernel; the float32 path shows the weights are ours exactly
            module.support_avx512bf16_for_cpu = False
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, m.module(ids).logits, rtol=1e-5, atol=1e-5)

    back = quantkit.load(tmp_path / "ours")
    for name, qt in m.tensors.items():
        assert torch.equal(back.tensors[name].codes, qt.codes) and torch.equal(back.tensors[name].scales, qt.scales)
    assert back.qconfig.method == kind and back.qconfig.double_quant is double


def test_quant_linear_is_a_frozen_base():
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    qt = nf4.quantize(w, "nf4", 64, double_quant=True)
    layer = NF4Linear.from_tensor(qt, bias=torch.randn(48))
    assert not any(p.requires_grad for p in layer.parameters())
    x = torch.randn(5, 64, requires_grad=True)
    y = layer(x)
    y.square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    torch.nn.functional.linear(x2, qt.dequantize(), layer.bias).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_cli_nf4(tiny_dir, tmp_path, capsys, monkeypatch):
    import sys

    from quantkit.command import main

    out = tmp_path / "nf4"
    monkeypatch.setattr(sys, "argv", ["quantkit", "quantize", str(tiny_dir), "--method", "nf4", "--double-quant",
                                      "--block-size", "128", "--out", str(out)])
    main()
    qt = quantkit.load(out).tensors["model.layers.0.mlp.down_proj"]
    assert qt.group_size == 128 and qt.nested is not None
    monkeypatch.setattr(sys, "argv", ["quantkit", "quantize", str(tiny_dir), "--method", "fp4", "--block-size", "100",
                                      "--out", str(tmp_path / "bad")])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2 and "--block-size 100 is not a block size" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
