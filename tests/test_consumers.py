"""The consumer table: who loads an export as written, --for refusing before any work, and the
summary printed after an export."""
from dataclasses import replace

import pytest

from quantkit import consumers
from quantkit.consumers import Export

from .conftest import cli, refused

# SmolLM2-135M's linears (out, in): 576 inputs hold no group of 128 and no Marlin tile
SMOLLM2 = ((192, 576), (576, 576), (576, 1536), (1536, 576))
LLAMA_7B = ((4096, 4096), (4096, 11008), (11008, 4096))


def verdict(e: Export) -> dict[str, str | None]:
    return {c.name: why for c, why in consumers.verdicts(e)}


def test_the_issue_s_gptq_export_of_smollm2():
    """4-bit g128 GPTQ of SmolLM2: GPTQModel's torch kernel reads it; its fused CPU kernel, vLLM's
    Marlin and vLLM's slow gptq kernel do not (K = 576: groups of 128 do not divide it; the slow
    kernel was listed as reading it)."""
    v = verdict(Export("safetensors", "gptq", 4, 128, True, False, SMOLLM2))
    assert v["transformers + GPTQModel (torch kernel)"] is None
    assert "576 inputs in groups of 128" in v["GPTQModel default CPU kernel"]
    assert "576 inputs" in v["vLLM gptq_marlin"]
    assert "576 inputs in groups of 128" in v["vLLM gptq"] and v["ExLlamaV2"] is None
    assert "576 inputs in groups of 128" in verdict(Export("awq", "awq", 4, 128, False, False, SMOLLM2))["vLLM awq"]


def test_a_7b_shape_fits_marlin_and_what_breaks_it():
    assert verdict(Export("safetensors", "gptq", 4, 128, True, True, LLAMA_7B))["vLLM gptq_marlin"] is None
    assert "asymmetric" in verdict(Export("safetensors", "gptq", 4, 128, False, False, LLAMA_7B))["vLLM gptq_marlin"]
    assert "group size 256" in verdict(Export("safetensors", "gptq", 4, 256, True, False, LLAMA_7B))["vLLM gptq_marlin"]
    ct = verdict(Export("compressed-tensors", "gptq", 8, 128, False, False, LLAMA_7B))
    assert "asymmetric 8-bit" in ct["vLLM compressed-tensors (Marlin)"]
    assert ct["transformers + compressed-tensors (dequantized at load)"] is None


def test_gptqmodel_s_group_sizes_and_exllama_s_zero_points():
    """GPTQModel refuses a group size outside each kernel's list unless it is a linear's whole input
    (48 and 256 were listed as loading); ExLlamaV2 misreads gptq_v2's zero points of 0, so no
    asymmetric GPTQ export is listed for it."""
    g48, g256 = (verdict(Export("safetensors", "gptq", 4, g, True, False, LLAMA_7B)) for g in (48, 256))
    assert "group size 48 (it takes 16, 32, 64, 128, 256, 512, 1024" in g48["transformers + GPTQModel (torch kernel)"]
    assert g256["transformers + GPTQModel (torch kernel)"] is None
    assert "group size 256 (it takes 16, 32, 64, 128 or per channel)" in g256["GPTQModel default CPU kernel"]
    awq = {g: verdict(Export("awq", "awq", 4, g, False, False, LLAMA_7B))["transformers + GPTQModel (AWQ)"]
           for g in (48, 128, 256)}
    assert awq[128] is None and "group size 48" in awq[48] and "group size 256" in awq[256]
    one_group = ((4096, 4096),)  # group 4096 is this linear's whole input
    assert verdict(Export("awq", "awq", 4, 4096, False, False, one_group))["transformers + GPTQModel (AWQ)"] is None
    sym, asym = (verdict(Export("safetensors", "gptq", 4, 128, s, False, LLAMA_7B))["ExLlamaV2"] for s in (True, False))
    assert sym is None and "misreads a zero point of 0" in asym


def test_each_format_lists_its_own_loaders():
    def names(fmt, method):
        return {c.name for c, _ in consumers.verdicts(Export(fmt, method, 4, 128, True, False, LLAMA_7B))}

    assert "ExLlamaV2" in names("safetensors", "gptq") and not any("bitsandbytes" in n for n in names("safetensors", "gptq"))
    assert names("safetensors", "nf4") == {"transformers + bitsandbytes (CUDA)", "transformers + bitsandbytes (CPU)"}
    assert "llama.cpp" in names("gguf", "rtn") and "vLLM awq" in names("awq", "awq")
    assert all(n.startswith(("vLLM", "transformers")) for n in names("compressed-tensors", "rtn"))


@pytest.mark.parametrize("args,match", [
    (["--for", "vllm", "--format", "compressed-tensors", "--group-size", "32"],
     "vLLM compressed-tensors (Marlin) refuses a linear of 32 outputs and 64 inputs"),
    (["--for", "exllama", "--format", "compressed-tensors", "--group-size", "32"], "use --format exl2 or safetensors"),
    (["--for", "llama.cpp"], "use --format gguf"),
    (["--for", "vllm", "--method", "nf4"], "with --method rtn or gptq"),
    (["--for", "exllama", "--group-size", "48"], "group size 48 (it takes powers of two)"),
    (["--for", "vlm"], "unknown consumer 'vlm'"),
    # the GGUF types' notes (the tiny model's rows take fallback types) came before the error
    (["--for", "exllama", "--format", "gguf"], "exllama does not read the gguf format"),
    # with --target-bpw: after the types' notes, and the candidates' "none of the grids fits" for any mistake
    (["--for", "exllama", "--format", "gguf", "--target-bpw", "4.5"], "exllama does not read the gguf format"),
    (["--for", "vlm", "--target-bpw", "4.5"], "unknown consumer 'vlm'"),
    (["--for", "llama.cpp", "--target-bpw", "4.5"], "use --format gguf"),
])
def test_for_refuses_before_any_work(tiny_dir, tmp_path, capsys, monkeypatch, args, match):
    err = refused(["quantize", str(tiny_dir), "--out", str(tmp_path / "q"), *args], capsys, monkeypatch, match)
    assert not (tmp_path / "q").exists() and not [line for line in err if line.startswith("note:")]


def test_export_names_who_loads_it(tiny_dir, tmp_path, capsys, monkeypatch):
    code, out, _ = cli(["quantize", str(tiny_dir), "--out", str(tmp_path / "q"), "--group-size", "32",
                        "--for", "vllm", "--for", "transformers"], capsys, monkeypatch)
    assert code == 0
    lines = out.splitlines()
    start = lines.index("who loads it, from their documented limits:")
    # the tiny model's 64 inputs are not a Marlin tile: vLLM reads it with its slow kernel
    assert any(line.split()[0] == "no" and "vLLM gptq_marlin" in line for line in lines[start + 1:])
    assert any(line.split()[0] == "yes" and "vLLM gptq " in line for line in lines[start + 1:])


def test_loaders_refuse_the_exports_they_would_misload(tiny_dir, tmp_path, capsys, monkeypatch):
    """Found against transformers 5.23 and bitsandbytes 0.50.2. transformers' GPTQConfig drops
    `dynamic`, so a --rules export was "yes transformers + GPTQModel" and is built at the base setting
    (other widths fail to load, skipped linears load empty). bitsandbytes' CPU kernel misreads blocks
    that straddle rows: NF4 --block-size 128 on SmolLM2's 576 inputs crashed, or scored perplexity
    1.1M against 27.6; on CUDA its blocks run over the flat weight."""
    base = Export("safetensors", "gptq", 4, 128, True, False, LLAMA_7B)
    assert verdict(replace(base, parts=(base,)))["transformers + GPTQModel (torch kernel)"] is None
    for mixed in (replace(base, parts=(base, replace(base, bits=8))), replace(base, parts=(base,), skipped=True)):
        v = verdict(mixed)
        assert "drops `dynamic`" in v["transformers + GPTQModel (torch kernel)"] and v["vLLM gptq"] is None
        assert "drops `dynamic`" in v["GPTQModel default CPU kernel"]
    nf4 = verdict(Export("safetensors", "nf4", 4, 128, True, False, SMOLLM2))
    assert nf4["transformers + bitsandbytes (CUDA)"] is None
    assert "blocks of 128 across rows of 576 inputs" in nf4["transformers + bitsandbytes (CPU)"]
    for block in (64, 2048):
        assert verdict(Export("safetensors", "nf4", 4, block, True, False, SMOLLM2))[
            "transformers + bitsandbytes (CPU)"] is None
    # from the command line: the block size and the rules reach the table
    (tmp_path / "rules.yaml").write_text("- {match: 'layers\\.0\\.', skip: true}\n")
    refused(["quantize", str(tiny_dir), "--out", str(tmp_path / "q"), "--rules", str(tmp_path / "rules.yaml"), "--for",
             "transformers"], capsys, monkeypatch, "transformers cannot load this export: transformers + GPTQModel")
    code, out, _ = cli(["quantize", str(tiny_dir), "--out", str(tmp_path / "n"), "--method", "nf4", "--block-size",
                        "128", "--for", "transformers"], capsys, monkeypatch)
    assert code == 0 and "  no   transformers + bitsandbytes (CPU): refuses blocks of 128 across rows of 64" in out
