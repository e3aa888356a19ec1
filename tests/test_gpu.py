"""The same quantization on the GPU and on the CPU (issue 13). Runs only where torch sees a CUDA GPU;
the CPU machines of CI skip it. RTN, NF4 and llama.cpp's block types give the same codes; GPTQ and
AWQ agree within float rounding, whose size the test prints (pytest -s) and bounds."""
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


@pytest.mark.parametrize("options", [dict(method="rtn", bits=4), dict(method="rtn", bits=3, mse=True),
                                     dict(method="nf4"), dict(method="rtn", gguf_type="Q4_K_M")],
                         ids=["rtn-w4", "rtn-w3-mse", "nf4", "Q4_K_M"])
def test_same_codes_on_the_gpu(model_dir, options):
    cpu, gpu, _ = both(model_dir, **options)
    for name in cpu:
        assert torch.equal(cpu[name].codes, gpu[name].codes), name
        if cpu[name].scales is not None:
            assert torch.equal(cpu[name].scales, gpu[name].scales), name


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_and_awq_within_rounding_on_the_gpu(model_dir, method):
    cpu, gpu, runs = both(model_dir, method=method, bits=4, group_size=64)
    differ = sum(int((cpu[n].codes != gpu[n].codes).sum()) for n in cpu)
    total = sum(cpu[n].codes.numel() for n in cpu)
    worst = max(float(((cpu[n].dequantize() - gpu[n].dequantize()).abs().max()
                       / cpu[n].scales.float().abs().max())) for n in cpu)
    print(f"{method}: {differ} of {total} codes differ ({differ / total:.4%}), "
          f"largest weight difference {worst:.3f} of the tensor's largest grid step")
    assert differ / total < 0.01
    if method == "gptq":  # the per-layer losses the pipeline records (AWQ keeps none)
        for name, loss in runs[0].losses.items():
            assert runs[1].losses[name] == pytest.approx(loss, rel=0.01), name
