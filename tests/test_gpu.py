"""The same quantization on the GPU and on the CPU (issue 13). Runs only where torch sees a CUDA GPU;
the CPU machines of CI skip it. RTN and NF4 give the same codes; GPTQ and
AWQ (and the searches of MSE clipping and llama.cpp's K-quants) agree within float rounding, whose
size the test prints (pytest -s) and bounds."""
import pytest
import torch

import quantkit

from .conftest import VALID, make_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 256 columns: llama.cpp's K-quant blocks fit every linear, so the mix runs without fallbacks
    return make_tiny(tmp_path_factory.mktemp("gpu") / "model", hidden=256, intermediate=512)


def both(path, **options):
    """model.tensors of the same run on the CPU and on the GPU."""
    runs = [quantkit.quantize(str(path), device=dev, calib_data=VALID, calib_samples=16, calib_seqlen=128,
                              progress=False, **options) for dev in ("cpu", "cuda")]
    cpu, gpu = ({name: t.to("cpu") if hasattr(t, "to") else t for name, t in m.tensors.items()} for m in runs)
    assert cpu.keys() == gpu.keys() and cpu
    return cpu, gpu, runs


@pytest.mark.parametrize("options", [dict(method="rtn", bits=4), dict(method="rtn", bits=3, group_size=-1),
                                     dict(method="nf4")], ids=["rtn-w4", "rtn-w3-channel", "nf4"])
def test_same_codes_on_the_gpu(model_dir, options):
    cpu, gpu, _ = both(model_dir, **options)
    for name in cpu:
        assert torch.equal(cpu[name].codes, gpu[name].codes), name
        assert torch.equal(cpu[name].scales, gpu[name].scales), name


@pytest.mark.parametrize("options", [dict(method="gptq", bits=4, group_size=64), dict(method="awq", bits=4, group_size=64),
                                     dict(method="rtn", bits=3, mse=True), dict(method="rtn", gguf_type="Q4_K_M")],
                         ids=["gptq", "awq", "rtn-mse", "Q4_K_M"])
def test_searches_within_rounding_on_the_gpu(model_dir, options):
    """Methods that search or feed errors forward: a sum taken in another order on the GPU can tip a
    near tie, so a few weights may land one step apart."""
    cpu, gpu, runs = both(model_dir, **options)
    differ = total = 0
    worst = 0.0
    for name in cpu:
        a, b = cpu[name].dequantize(), gpu[name].dequantize()
        differ, total = differ + int((a != b).sum()), total + a.numel()
        worst = max(worst, float((a - b).abs().max() / a.abs().max()))
    print(f"{options}: {differ} of {total} weights differ ({differ / total:.4%}), the largest difference "
          f"{worst:.4f} of its tensor's largest weight")
    assert differ / total < 0.01
    for name, loss in runs[0].losses.items():  # GPTQ's per-linear losses (the other methods record none)
        assert runs[1].losses[name] == pytest.approx(loss, rel=0.01), name
