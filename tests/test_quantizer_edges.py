"""Degenerate weights in the quantizer cores: NaN, Inf and values past float16 scales are refused, not
written as scales that the export's reader then refuses as damaged; groups of zeros stay finite."""
import math

import pytest
import torch

from quantkit import QuantkitError
from quantkit.quantizers import exl2, nf4, rtn


def weight(value: float) -> torch.Tensor:
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    w[3, 5] = value
    return w


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("sym,mse", [(True, False), (False, False), (False, True)])
def test_rtn_refuses_nan_and_inf(value, sym, mse):
    with pytest.raises(QuantkitError, match="NaN or Inf"):
        rtn.quantize(weight(value), 4, 32, sym, mse)


@pytest.mark.parametrize("bits,sym", [(4, True), (2, False)])
def test_rtn_refuses_values_past_float16_scales(bits, sym):
    """A weight of 1e6 needs a 4-bit step of 1.3e5, past float16's 65504: it was stored as Inf."""
    with pytest.raises(QuantkitError, match="too large for float16 scales"):
        rtn.quantize(weight(1e6), bits, 32, sym)
    assert torch.isfinite(rtn.quantize(weight(1e4), bits, 32, sym).dequantize()).all()


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("kind", ["nf4", "fp4"])
@pytest.mark.parametrize("double", [False, True])
def test_nf4_refuses_nan_and_inf(value, kind, double):
    with pytest.raises(QuantkitError, match="NaN or Inf"):
        nf4.quantize(weight(value), kind, 64, double)


def dead_inputs_hessian(k: int, dead: slice) -> torch.Tensor:
    """H of inputs where those in dead never fire: prepare() gives them diagonal 1, which puts them
    together in act-order (between the strong inputs and the weak ones), a whole group of zeros."""
    x = torch.randn(1024, k, generator=torch.Generator().manual_seed(1))
    x[:, : k // 2] *= 5
    x[:, k // 2:] *= 0.2
    x[:, dead] = 0
    return x.T @ x / len(x)


@pytest.mark.parametrize("setting", [exl2.Setting((4,), (1.0,)), exl2.Setting((5, 4), (0.5, 0.5))])
def test_exl2_group_of_zeros_stays_finite(setting):
    """scale_max of a group of zeros was 0 in float16: 0 / 0 in GPTQ's loop, NaN in every later group."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    r = exl2.quantize(w, dead_inputs_hessian(256, slice(90, 170)), setting)
    q = r.tensor.dequantize()
    assert math.isfinite(r.loss) and torch.isfinite(q).all() and (r.tensor.scale_max > 0).all()
    assert torch.equal(q[:, 90:170], torch.zeros(64, 80))  # dead inputs: their weights are zeroed
    assert (q - w)[:, :90].abs().max() < 0.02
    zero = exl2.quantize(torch.zeros(32, 64), torch.eye(64), setting).tensor
    assert torch.equal(zero.dequantize(), torch.zeros(32, 64))


@pytest.mark.parametrize("value,match", [(math.nan, "NaN or Inf"), (math.inf, "NaN or Inf"),
                                         (1e7, "too large for float16 scales")])
def test_exl2_refuses_nan_inf_and_values_past_float16_scales(value, match):
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    w[3, 5] = value
    with pytest.raises(QuantkitError, match=f"model.layers.0.mlp.down_proj.*{match}"):
        exl2.quantize(w, torch.eye(64), exl2.Setting((4,), (1.0,)), name="model.layers.0.mlp.down_proj")


def test_gptq_refuses_values_past_float16_scales_by_the_linears_name():
    from quantkit.quantizers import gptq

    with pytest.raises(QuantkitError, match="q_proj holds values up to .* too large for float16 scales"):
        gptq.quantize(weight(1e6), torch.eye(64), 4, 32, name="q_proj")
    assert torch.isfinite(gptq.quantize(weight(1e4), torch.eye(64), 4, 32).tensor.dequantize()).all()
