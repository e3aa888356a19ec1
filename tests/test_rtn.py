import math

import pytest
import torch

from quantkit import QuantkitError
from quantkit.quantizers import rtn


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [-1, 32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
def test_error_within_half_step(bits, group_size, sym):
    torch.manual_seed(bits * 100 + group_size)
    w = torch.randn(48, 256)
    qt = rtn.quantize(w, bits, group_size, sym)
    assert qt.codes.dtype == torch.uint8 and int(qt.codes.max()) <= 2**bits - 1
    g = qt.g_idx.long()
    step, zero = qt.scales.float()[:, g], qt.zeros.float()[:, g]
    err = (qt.dequantize() - w).abs()
    inside = (w >= step * -zero) & (w <= step * (2**bits - 1 - zero))
    # inside the grid rounding moves a weight by at most half a step; the range ends (where the
    # rounded zero point or float16 scale cut the grid short) by at most one step
    assert (err[inside] <= step[inside] / 2 * (1 + 1e-5)).all()
    assert (err <= step * (1 + 1e-5)).all()
    if sym:
        assert (qt.zeros == 2 ** (bits - 1)).all()


def test_group_that_does_not_divide_in_features():
    torch.manual_seed(0)
    w = torch.randn(16, 576)  # SmolLM2's hidden size: 4.5 groups of 128
    qt = rtn.quantize(w, 4, 128, sym=False)
    assert qt.n_groups == math.ceil(576 / 128) == qt.scales.shape[1]
    assert qt.g_idx.tolist() == [k // 128 for k in range(576)]
    tail = rtn.quantize(w[:, 512:], 4, 128, sym=False)  # the short last group alone
    assert torch.equal(qt.codes[:, 512:], tail.codes) and torch.equal(qt.scales[:, 4:], tail.scales)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_weights_on_the_grid_are_kept_exactly(bits):
    torch.manual_seed(bits)
    maxq = 2**bits - 1
    codes = torch.randint(0, maxq + 1, (8, 64))
    codes[:, 0], codes[:, 1] = 0, maxq  # each row spans the whole grid
    zero = torch.randint(1, maxq, (8, 1))
    scale = (torch.rand(8, 1) + 0.5).half().float()
    w = scale * (codes - zero)
    qt = rtn.quantize(w, bits, -1, sym=False)
    assert torch.equal(qt.codes.long(), codes)
    assert torch.equal(qt.dequantize(), w)


def test_all_zero_rows_do_not_divide_by_zero():
    qt = rtn.quantize(torch.zeros(4, 32), 4, 32, sym=False)
    assert torch.equal(qt.dequantize(), torch.zeros(4, 32))


@pytest.mark.parametrize("bits,group_size", [(5, 128), (16, 128), (4, 0), (4, -7)])
def test_bad_arguments_are_refused(bits, group_size):
    with pytest.raises(QuantkitError):
        rtn.quantize(torch.randn(4, 64), bits, group_size)


def test_mse_clipping_lowers_the_weight_error():
    torch.manual_seed(0)
    w = torch.randn(32, 256)
    w[:, 7] *= 12  # outliers stretch every row's range
    plain = (rtn.quantize(w, 3, -1, False).dequantize() - w).pow(2).sum()
    clipped = (rtn.quantize(w, 3, -1, False, mse=True).dequantize() - w).pow(2).sum()
    assert clipped < plain
