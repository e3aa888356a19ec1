"""GGUF for the models people export besides SmolLM2: Llama 3's rope, linear and YaRN rope scaling,
Qwen2 (NeoX rope, q/k/v biases), Qwen3 (per-head q/k norms, heads wider than hidden / heads),
Mistral, sentencepiece tokenizers (Llama 2, Mistral). Judged by
llama.cpp's own converter (the same metadata and tensors from the same checkpoint) and by
llama.cpp itself (it tokenizes as transformers does, and scores our files as we do)."""
import json
import shutil

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

import quantkit
from quantkit.errors import QuantkitError
from quantkit.evals.perplexity import windows
from quantkit.exporters import gguf as G
from quantkit.modelio import default_model_dir

from .conftest import TEST, VALID, gguf_tensors

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "factor": 2.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0}
# the embedded model's tokenizer (a Llama's is SmolLM2's own, whose pre-tokenizer the converter knows;
# a Qwen2's takes Qwen2's pre-tokenizer in transformers), or a sentencepiece one; a Llama with biases
# (llamafied Qwen1.5 and Yi: q/k biases in the rope's order like the rows)
CASES = {"llama-llama3": ("llama", LLAMA3, "smollm"), "mistral-linear-sentencepiece": ("mistral", LINEAR, "sentencepiece"),
         "qwen2-yarn": ("qwen2", YARN, "smollm"), "llama-sentencepiece": ("llama", None, "sentencepiece"),
         "qwen3": ("qwen3", None, "smollm"),
         "llama-biases": ("llama", None, "smollm", {"attention_bias": True, "mlp_bias": True})}
QWENS = ("qwen2", "qwen3")  # tied embeddings, as their small ones have


def sentencepiece_tokenizer(path):
    """A Llama 2 style tokenizer (sentencepiece BPE with byte fallback, 400 pieces) trained on the
    calibration text, written as Llama 2's repositories ship it: tokenizer.model beside transformers'
    files, the special tokens listed in tokenizer_config.json, BOS added."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(VALID.read_text()[:300_000].splitlines()), model_prefix=str(path / "tokenizer"),
        model_type="bpe", vocab_size=400, byte_fallback=True, split_digits=True, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    (path / "tokenizer.vocab").unlink()
    LlamaTokenizer.from_pretrained(path, add_bos_token=True).save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    config["added_tokens_decoder"] = {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                               "normalized": False, "single_word": False}
                                      for i, t in enumerate(["<unk>", "<s>", "</s>"])}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def write_model(path, arch: str, rope: dict | None, tokenizer: str, extra: dict | None = None):
    """A random model of arch (2 layers, float32) with the rope and tokenizer named and the extra config,
    saved as a checkpoint."""
    path.mkdir()
    if tokenizer == "sentencepiece":
        sentencepiece_tokenizer(path)
        vocab = 400
    else:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(default_model_dir() / f, path)
        vocab = 49152
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                  tie_word_embeddings=arch in QWENS, rope_parameters={"rope_theta": 10000.0, **(rope or {})},
                                  bos_token_id=1, eos_token_id=2, **(extra or {}))
    module = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):  # transformers starts biases at zero, which would test nothing
                p.normal_(0, 0.5)
            if "_norm." in name:  # and Qwen3's q/k norms at one (its heads are 128 wide: hidden / heads is 16)
                p.normal_(1, 0.2)
    module.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    return {name: write_model(root / name, *case) for name, case in CASES.items()}


def fields(path) -> dict:
    """A GGUF's key-values, but the naming ones the converter derives from the directory's name, and
    add_sep_token, which it guesses from a tokenizer's pair template (a pair of texts never reaches a
    causal model's file)."""
    return {f.name: f.contents() for f in gguf.GGUFReader(path).fields.values()
            if not f.name.startswith("GGUF.") and f.name not in
            ("general.name", "general.basename", "general.finetune", "general.size_label", "general.type",
             "tokenizer.ggml.add_sep_token")}


@pytest.mark.parametrize("case", CASES)
def test_file_equals_llama_cpps_converter(models, tmp_path, case):
    """From the same checkpoint, our F32 file and convert_hf_to_gguf.py's hold the same key-values
    (architecture, rope scaling, vocabulary with sentencepiece scores and types, special tokens) and
    the same tensors byte for byte (q/k rows in each architecture's rope order, biases, Llama 3's
    rope factors). The converter cannot name the pre-tokenizer of the Qwen2's made-up vocabulary
    (it knows pre-tokenizers by a hash of known models' tokens), so there it is pinned to "qwen2";
    that llama.cpp splits text under that name as transformers does is the tokenization test's."""
    from . import llamacpp

    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    quantkit.api.export_gguf(quantkit.load(models[case]), ours, "F32", progress=False)
    llamacpp.convert(models[case], theirs, pre="qwen2" if CASES[case][0] == "qwen2" else None)
    a, b = fields(ours), fields(theirs)
    if "tokenizer.ggml.add_bos_token" not in b:  # we always say it, from transformers' tokenizer; the
        del a["tokenizer.ggml.add_bos_token"]  # converter when the tokenizer's files do (the BOS test is llama.cpp's)
    assert {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)} == {}
    a, b = gguf_tensors(ours), gguf_tensors(theirs)
    assert a.keys() == b.keys()
    assert [k for k in a if a[k] != b[k]] == []


def unmark_special(path, token, name):
    """token, an added token, renamed name and no longer marked special (in tokenizer.json and
    tokenizer_config.json)."""
    for f, entries in (("tokenizer.json", lambda d: d["added_tokens"]),
                       ("tokenizer_config.json", lambda d: d.get("added_tokens_decoder", {}).values())):
        d = json.loads((path / f).read_text())
        for e in entries(d):
            if e["content"] == token:
                e["content"], e["special"] = name, False
        if f == "tokenizer.json":
            d["model"]["vocab"][name] = d["model"]["vocab"].pop(token)
        (path / f).write_text(json.dumps(d))


def edit_json(path, name, **changes):
    d = json.loads((path / name).read_text())
    d.update(changes)
    (path / name).write_text(json.dumps(d))


# tokenizers as real models ship them, on the SmolLM2 vocabulary: templates named in a list (as
# tool-use models have them), an added token that looks like a control token but is not marked special
# (command-r, deepseek-coder), no BOS in the tokenizer but bos_token_id in config.json (Qwen2), EOS
# appended by the tokenizer's post-processor
TOKENIZER_CASES = {
    "named-chat-templates": lambda p: edit_json(p, "tokenizer_config.json", chat_template=[
        {"name": "default", "template": "{{ messages }}"}, {"name": "tool_use", "template": "{{ tools }}"}]),
    "unmarked-control-token": lambda p: unmark_special(p, "<repo_name>", "<|repo_name|>"),
    "bos-only-in-config": lambda p: edit_json(p, "tokenizer_config.json", bos_token=None),
    "eos-appended": lambda p: edit_json(p, "tokenizer.json", post_processor={
        "type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}},
                                                 {"SpecialToken": {"id": "<|im_end|>", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_end|>": {"id": "<|im_end|>", "ids": [2], "tokens": ["<|im_end|>"]}}}),
}


@pytest.mark.parametrize("case", TOKENIZER_CASES)
def test_tokenizer_metadata_equals_llama_cpps_converter(models, tmp_path, case):
    """The tokenizer's key-values are the converter's for the tokenizer setups real models have."""
    from . import llamacpp

    d = tmp_path / "m"
    shutil.copytree(models["llama-llama3"], d)
    TOKENIZER_CASES[case](d)
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    quantkit.api.export_gguf(quantkit.load(d), ours, "F32", progress=False)
    llamacpp.convert(d, theirs, pre="smollm")  # an appended EOS changes the tokens it knows SmolLM2's by
    a, b = fields(ours), fields(theirs)
    if "tokenizer.ggml.add_bos_token" not in b:
        del a["tokenizer.ggml.add_bos_token"]
    assert {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)} == {}


@pytest.mark.parametrize("case", CASES)
def test_file_reads_back_as_the_checkpoint(models, tmp_path, case):
    """Loaded from our GGUF (rope scaling from its keys, Llama 3's from its factors tensor, q/k rows
    back in transformers' order, biases), the model gives the checkpoint's logits over 300 positions,
    past the original context the scaled ropes stretch."""
    out = tmp_path / "m.gguf"
    quantkit.api.export_gguf(quantkit.load(models[case]), out, "F32", progress=False)
    reference = AutoModelForCausalLM.from_pretrained(models[case], dtype=torch.float32).eval()
    m = quantkit.load(out)
    m.materialize()
    ids = torch.randint(0, reference.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = reference(ids).logits, m.module(ids).logits
    said = (CASES[case][1] or {}).get("rope_type", "default")  # llama3's is in the frequencies, not the config
    assert m.module.config.rope_parameters["rope_type"] == ("default" if said == "llama3" else said)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_what_llama_cpp_runs_otherwise_is_refused_or_named(models, recwarn):
    """A GELU Llama became a SiLU GGUF, and a Qwen3 with biases a file llama.cpp refuses; a sliding
    window, which llama.cpp's llama leaves out as its converter does, is named."""
    m = quantkit.load(models["llama-llama3"])
    m.module.config.hidden_act = "gelu"
    with pytest.raises(QuantkitError, match="activation is 'gelu', and llama.cpp runs llama models with SiLU"):
        G.check(m.module, "Q8_0")
    m = quantkit.load(models["qwen3"])
    m.module.config.attention_bias = True
    with pytest.raises(QuantkitError, match="Qwen3 with attention biases"):
        G.check(m.module, "Q8_0")
    m = quantkit.load(models["mistral-linear-sentencepiece"])
    m.module.config.sliding_window = 64
    G.check(m.module, "Q8_0")
    assert [str(w.message) for w in recwarn if "windows of 64 tokens" in str(w.message)]


def test_ropes_llama_cpp_cannot_take_are_refused(models):
    m = quantkit.load(models["llama-llama3"])
    m.module.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(QuantkitError, match="rope scaling 'dynamic'.*linear, yarn, llama3"):
        G.check(m.module, "Q8_0")
    m.module.config.model_type = "qwen2"
    m.module.config.rope_parameters = dict(LLAMA3, rope_theta=10000.0)
    with pytest.raises(QuantkitError, match="llama3 for Llama only"):
        G.check(m.module, "Q8_0")


def test_a_model_named_by_dot_keeps_its_name(models, tmp_path, monkeypatch):
    """quantize . --format gguf wrote an empty general.name (the name of the path ".")."""
    monkeypatch.chdir(models["qwen3"])
    quantkit.api.export_gguf(quantkit.load("."), tmp_path / "m.gguf", "F32", progress=False)
    assert gguf.GGUFReader(tmp_path / "m.gguf").fields["general.name"].contents() == "qwen3"


def test_sentencepiece_without_its_model_file_is_refused(models, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(models["llama-sentencepiece"], d)
    (d / "tokenizer.model").unlink()
    with pytest.raises(QuantkitError, match="tokenizer.model is missing"):
        quantkit.api.export_gguf(quantkit.load(d), tmp_path / "m.gguf", "F32", progress=False)
    assert not (tmp_path / "m.gguf").exists()


def test_a_sentencepiece_gguf_writes_its_own_vocabulary_into_gguf(models, tmp_path):
    """A GGUF carries its pieces, scores and types: quantized again into GGUF it writes them (it asked
    for a tokenizer.model beside it, and read any that was there, whichever model it came from). Tokenizer
    files of another model beside it change nothing: its tokenizer is the GGUF's own."""
    src = tmp_path / "src" / "m.gguf"
    src.parent.mkdir()
    quantkit.api.export_gguf(quantkit.load(models["llama-sentencepiece"]), src, "F32", progress=False)
    alone = quantkit.load(src).tokenizer("Hello world 12")["input_ids"]
    for f in ("tokenizer.json", "tokenizer_config.json"):  # a byte-level BPE's, beside it
        shutil.copy(models["llama-llama3"] / f, src.parent)
    assert quantkit.load(src).tokenizer("Hello world 12")["input_ids"] == alone
    out = tmp_path / "q.gguf"
    quantkit.quantize(str(src), method="rtn", format="gguf", gguf_type="Q8_0", out=out, progress=False)
    want = {k: v for k, v in fields(src).items() if k.startswith("tokenizer.")}
    assert {k: v for k, v in fields(out).items() if k.startswith("tokenizer.")} == want


def test_a_llama3_gguf_quantized_again_keeps_its_rope_factors(models, tmp_path):
    """Loading puts rope_freqs into the frequencies and the config says a plain rope, so a Llama 3 GGUF
    quantized again into GGUF lost the tensor, and llama.cpp ran the file with a plain rope."""
    src, out = tmp_path / "src.gguf", tmp_path / "q.gguf"
    quantkit.api.export_gguf(quantkit.load(models["llama-llama3"]), src, "F32", progress=False)
    quantkit.quantize(str(src), method="rtn", format="gguf", gguf_type="Q8_0", out=out, progress=False)
    want, got = gguf_tensors(src), gguf_tensors(out)
    assert "rope_freqs.weight" in want and got["rope_freqs.weight"] == want["rope_freqs.weight"]
    # a checkpoint's config.json cannot say this rope: it would have been written as a plain one
    with pytest.raises(QuantkitError, match="holds Llama 3's rope as factors .* write it as GGUF"):
        quantkit.quantize(str(src), method="rtn", out=tmp_path / "q", progress=False)
    assert not (tmp_path / "q").exists()


# ---- judged by llama.cpp (slow: llama.cpp built once into the cache) ----

@pytest.mark.slow
def test_llama_cpp_tokenizes_sentencepiece_as_transformers(models, tmp_path):
    """The sentencepiece file's tokens in llama.cpp (the windows llama-perplexity saves with its base)
    are transformers' tokens of the same text, BOS first. The text starts with a letter: before a
    leading space sentencepiece (and so llama.cpp) puts its dummy prefix and transformers does not."""
    from . import llamacpp

    path, text = tmp_path / "sp.gguf", tmp_path / "text.txt"
    quantkit.api.export_gguf(quantkit.load(models["llama-sentencepiece"]), path, "F32", progress=False)
    text.write_text(TEST.read_text()[:60_000].lstrip())
    llamacpp.save_base(path, text, tmp_path / "base.logits", 8, ctx=256)
    theirs = quantkit.evals.BaseFile(tmp_path / "base.logits").windows
    ours = windows(quantkit.load(models["llama-sentencepiece"]).tokenizer, text.read_text(), ctx=256)[:8]
    assert theirs.shape == ours.shape and torch.equal(theirs, ours)


def embedded_as(path, arch: str, rope: dict | None):
    """The embedded model's weights under another architecture or rope (a Qwen2 gets random q/k/v
    biases, a Qwen3 random q/k norms), so that llama.cpp and we score a model with real perplexity."""
    path.mkdir()
    src = default_model_dir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, path)
    config = json.loads((src / "config.json").read_text())
    config["model_type"], config["architectures"] = arch, [f"{arch.capitalize()}ForCausalLM"]
    if arch == "qwen3":  # its default head is 128 wide
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    config["rope_scaling"] = config["rope_parameters"] = {"rope_theta": config.get("rope_theta", 100000.0), **(rope or {})}
    (path / "config.json").write_text(json.dumps(config))
    state = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for i in range(config["num_hidden_layers"]):
        for p in ("q", "k", "v") if arch == "qwen2" else ():
            w = state[f"model.layers.{i}.self_attn.{p}_proj.weight"]
            state[f"model.layers.{i}.self_attn.{p}_proj.bias"] = (0.1 * torch.randn(w.shape[0], generator=g)).to(w.dtype)
        for p in ("q", "k") if arch == "qwen3" else ():
            w = state[f"model.layers.{i}.self_attn.{p}_proj.weight"]
            state[f"model.layers.{i}.self_attn.{p}_norm.weight"] = \
                (1 + 0.1 * torch.randn(config["head_dim"], generator=g)).to(w.dtype)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.slow
@pytest.mark.parametrize("arch,rope", [("llama", dict(LLAMA3, original_max_position_embeddings=2048)),
                                       ("llama", LINEAR), ("qwen2", dict(YARN, original_max_position_embeddings=2048)),
                                       ("qwen3", None)],
                         ids=["llama3", "linear", "qwen2-yarn", "qwen3"])
def test_llama_perplexity_agrees_with_ours(tmp_path, arch, rope, embedded_ppl4):
    """The embedded model's weights with Llama 3's rope, a linear-scaled rope, as a Qwen2 with YaRN
    (its original context 8192 / 4, as real configs have it) and as a Qwen3: llama-perplexity of our
    F32 file is within 0.01% of ours, and the change moves the score away from the embedded model's
    (it is not ignored on either side). Both sides compute in float32 throughout (F32 weights, float32
    cache, no flash attention), so only summation order differs: 0.00005% at most on an AVX2 build.
    A Q8_0 file is no judge here: llama.cpp rounds each matmul's input to 8 bits, which moved these
    scores by up to 0.9% depending on the CPU, the build and the attention path (RESULTS.md)."""
    from . import llamacpp

    d = embedded_as(tmp_path / "m", arch, rope)
    path = tmp_path / "m.gguf"
    q = quantkit.load(d)
    quantkit.api.export_gguf(q, path, "F32", progress=False)
    theirs = llamacpp.perplexity(path, TEST, 4, flags=llamacpp.F32_ATTENTION)
    ours = quantkit.evaluate(q, TEST, max_windows=4, progress=False).perplexity
    assert abs(ours / theirs - 1) < 1e-4, (ours, theirs)
    assert abs(ours / embedded_ppl4 - 1) > 0.01, (ours, embedded_ppl4)


@pytest.mark.slow
def test_qwen3_files_are_llama_quantizes(models, tmp_path):
    """A Qwen3 to Q4_K_M (64-wide rows: the types llama-quantize falls back to) requantized from our
    F32 file is byte for byte the file llama-quantize makes of it; quantized from the checkpoint, it
    holds the same key-values and tensors (in the model's order, where llama-quantize sorts them)."""
    from quantkit.requant import requantize

    from . import llamacpp

    f32, theirs = tmp_path / "f32.gguf", tmp_path / "theirs.gguf"
    quantkit.api.export_gguf(quantkit.load(models["qwen3"]), f32, "F32", progress=False)
    llamacpp.quantize(f32, theirs, "Q4_K_M")
    quantkit.quantize(str(models["qwen3"]), method="rtn", format="gguf", gguf_type="Q4_K_M", out=tmp_path / "direct.gguf",
                      progress=False)
    assert fields(tmp_path / "direct.gguf") == fields(theirs)
    assert gguf_tensors(tmp_path / "direct.gguf") == gguf_tensors(theirs)
    assert requantize(f32, tmp_path / "requant.gguf", "Q4_K_M", progress=False).read_bytes() == theirs.read_bytes()
