import pytest
import torch

from quantkit.packing import pack, unpack
from quantkit.qlinear import GPTQLinear
from quantkit.quantizers import rtn

from .conftest import autogptq_quantlinear


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_unpack_inverts_pack(bits):
    torch.manual_seed(bits)
    v = torch.randint(0, 2**bits, (96, 40), dtype=torch.uint8)
    packed = pack(v, bits)
    assert packed.dtype == torch.int32 and packed.shape == (96 * bits // 32, 40)
    assert torch.equal(unpack(packed, bits), v.int())


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_rows_in_whole_words_not_whole_runs(bits):
    """Zero points are packed along N: 40 outputs fill whole words at 4 bits, not a run of 32."""
    v = torch.randint(0, 2**bits, (32 // bits * 5, 3), dtype=torch.uint8)
    assert torch.equal(unpack(pack(v, bits), bits), v.int())


def test_3bit_values_straddle_words():
    v = torch.zeros(32, 1, dtype=torch.uint8)
    v[10] = 0b111  # bits 30..32: two in word 0, one in word 1
    words = pack(v, 3).view(-1).tolist()
    assert words[0] == -(2**31) + 2**30 and words[1] == 1 and words[2] == 0


def reference_pack(qt, bits, group_size, zeros):
    """auto-gptq's QuantLinear.pack on the codes of qt, with the zero points it is given."""
    QuantLinear = autogptq_quantlinear()
    n, k = qt.shape
    ql = QuantLinear(bits, group_size, k, n, bias=False)
    linear = torch.nn.Linear(k, n, bias=False)
    g = qt.g_idx.long()
    scales = qt.scales.float()
    # a weight that auto-gptq's round((W + z*s) / s) turns back into exactly our codes
    linear.weight.data = scales[:, g] * (qt.codes.float() - zeros.float()[:, g])
    ql.pack(linear, scales, zeros.float(), qt.g_idx)
    return ql


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 128])
def test_symmetric_pack_equals_autogptq(bits, group_size):
    torch.manual_seed(bits + group_size)
    qt = rtn.quantize(torch.randn(64, 256), bits, group_size, sym=True)
    ref = reference_pack(qt, bits, group_size, qt.zeros)
    layer = GPTQLinear.from_tensor(qt)  # what the export writes
    assert torch.equal(layer.qweight, ref.qweight)
    assert torch.equal(layer.qzeros, ref.qzeros)  # v1 checkpoints store zero - 1


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_asymmetric_v2_zeros_equal_autogptq(bits):
    """v2 stores raw zeros; auto-gptq subtracts one, so give it zero + 1 (and the matching weight)."""
    torch.manual_seed(bits)
    qt = rtn.quantize(torch.randn(64, 128), bits, 32, sym=False)
    ref = reference_pack(qt, bits, 32, qt.zeros.int() + 1)
    layer = GPTQLinear.from_tensor(qt)
    assert torch.equal(layer.qweight, ref.qweight)
    assert torch.equal(layer.qzeros, ref.qzeros)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_any_rows_dequantize_as_their_slice_of_the_whole(bits):
    """Rows from a start off a multiple of 32: the zero points were unpacked from the word holding the
    start as if it began there (wrong values at 2, 4 and 8 bits; at 3, a run of 3 words cut short)."""
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(96, 64, generator=g)
    layer = GPTQLinear.from_tensor(rtn.quantize(w, bits=bits, group_size=32, sym=False))
    whole = layer.dequantize()
    for start, stop in ((0, 96), (32, 64), (8, 24), (3, 10), (1, 96), (40, 41), (95, 96)):
        assert torch.equal(layer.dequantize(torch.float32, start, stop), whole[start:stop]), (start, stop)
