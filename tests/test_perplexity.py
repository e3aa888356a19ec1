import math

import pytest
import torch

from quantkit import QuantkitError
from quantkit.evals import perplexity
from quantkit.modelio import adds_bos

from .conftest import TEST, loaded, tokenizer_adding_bos


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return loaded(tiny_dir)


@pytest.fixture(scope="module")
def text():
    return TEST.read_text()[:60_000]


def test_wikitext_protocol_scores_every_token(tiny, text):
    r = perplexity(tiny.module, tiny.tokenizer, text, "wikitext", ctx=128, max_windows=5, progress=False)
    assert (r.windows, r.tokens) == (5, 5 * 127)
    ids = torch.tensor(tiny.tokenizer(text)["input_ids"][: 5 * 128]).view(5, 128)
    with torch.no_grad():
        loss = tiny.module(ids, labels=ids).loss  # mean over all 5 x 127 predictions
    assert r.perplexity == pytest.approx(math.exp(loss.item()), rel=1e-5)


def test_llamacpp_protocol_scores_the_second_half(tiny, text):
    r = perplexity(tiny.module, tiny.tokenizer, text, "llamacpp", ctx=128, max_windows=3, progress=False)
    assert (r.windows, r.tokens) == (3, 3 * (128 - 64 - 1))
    ids = torch.tensor(tiny.tokenizer(text)["input_ids"][: 3 * 128]).view(3, 128)
    with torch.no_grad():
        logp = torch.log_softmax(tiny.module(ids).logits.double(), -1)
    nll = -logp[:, 64:127].gather(-1, ids[:, 65:, None]).mean()
    assert r.perplexity == pytest.approx(math.exp(nll.item()), rel=1e-6)



def test_the_head_computes_only_the_scored_positions(tiny, text):
    """The head made logits for every position of every window and the float64 log-softmax took a whole
    batch of them: the README's main command peaked at 2.61 GiB there (1.86 GiB since)."""
    seen = []
    hook = tiny.module.lm_head.register_forward_hook(lambda mod, args, out: seen.append(tuple(out.shape)))
    try:
        perplexity(tiny.module, tiny.tokenizer, text, "llamacpp", ctx=128, max_windows=3, progress=False)
    finally:
        hook.remove()
    assert seen == [(3, 64, tiny.module.config.vocab_size)]  # positions 64..127; the last predicts nothing scored


def test_bos_replaces_the_first_token_only_when_the_tokenizer_adds_it(tiny, tiny_dir, text):
    with_bos_tok = tokenizer_adding_bos(tiny_dir)  # the shared fixture's tokenizer is left as it is
    assert adds_bos(with_bos_tok) and not adds_bos(tiny.tokenizer)
    firsts = []
    hook = tiny.module.model.embed_tokens.register_forward_pre_hook(lambda mod, args: firsts.append(args[0][:, 0].tolist()))
    try:
        base = perplexity(tiny.module, tiny.tokenizer, text, "llamacpp", ctx=64, max_windows=2, progress=False)
        with_bos = perplexity(tiny.module, with_bos_tok, text, "llamacpp", ctx=64, max_windows=2, progress=False)
    finally:
        hook.remove()
    bos = with_bos_tok.bos_token_id
    assert bos not in firsts[0] and firsts[1] == [bos, bos]
    assert with_bos.tokens == base.tokens and with_bos.perplexity != base.perplexity


def test_too_short_text_and_bad_protocol(tiny):
    with pytest.raises(QuantkitError, match="fewer than one window"):
        perplexity(tiny.module, tiny.tokenizer, "too short", "llamacpp", ctx=512, progress=False)
    with pytest.raises(QuantkitError, match="unknown perplexity protocol"):
        perplexity(tiny.module, tiny.tokenizer, "text", "nope", progress=False)


def test_a_model_in_memory_is_scored_where_and_as_it_is(tiny_dir):
    """evaluate(m) without a device or dtype read a Model held whole in memory (trained in bf16, say, or on
    a GPU) onto the CPU in float32, against its documented promise to leave it as it is."""
    import quantkit

    m = quantkit.load(tiny_dir)
    m.materialize(dtype=torch.bfloat16)
    quantkit.evaluate(m, TEST, ctx=32, max_windows=1, progress=False)
    assert {p.dtype for p in m.module.parameters()} == {torch.bfloat16}
    lazy = quantkit.load(tiny_dir)  # not read yet: read in float32 on the CPU, as before
    quantkit.evaluate(lazy, TEST, ctx=32, max_windows=1, progress=False)
    assert {p.dtype for p in lazy.module.parameters()} == {torch.float32}


def test_long_windows_go_a_few_at_a_time_with_the_same_figures(tiny, text, monkeypatch):
    """Four windows a batch at any context: at 8192 tokens and a 128k vocabulary their float32 logits alone
    took 8 GB beside the model. A batch now holds TOKENS tokens at most (one window at least), and the
    log-probabilities go to float64 ROWS predictions at a time; the figures are those of the whole batches."""
    import importlib

    module = importlib.import_module("quantkit.evals.perplexity")
    whole = perplexity(tiny.module, tiny.tokenizer, text, "llamacpp", 64, 6, progress=False)
    sizes = []
    hook = tiny.module.register_forward_pre_hook(lambda m, args, kwargs: sizes.append(kwargs["input_ids"].shape[0])
                                                 if "input_ids" in kwargs else sizes.append(args[0].shape[0]),
                                                 with_kwargs=True)
    monkeypatch.setattr(module, "TOKENS", 128)
    monkeypatch.setattr(module, "ROWS", 5)
    try:
        cut = perplexity(tiny.module, tiny.tokenizer, text, "llamacpp", 64, 6, progress=False)
    finally:
        hook.remove()
    assert sizes == [2, 2, 2]
    assert math.isclose(cut.perplexity, whole.perplexity, rel_tol=1e-12)


def test_a_model_larger_than_free_memory_is_scored_a_layer_at_a_time_with_the_same_figures(tmp_path, monkeypatch,
                                                                                           capsys):
    """evaluate read the whole model onto the device: a 70B float model (140 GB in float16) could not be
    scored on one GPU, nor the base of a comparison. Past FITS of the free memory it now runs a layer at a
    time over every window, each layer read once and dropped, to the same figure."""
    import warnings

    import quantkit
    from quantkit import api, distributed
    from quantkit.errors import Note

    from .conftest import make_tiny

    model = make_tiny(tmp_path / "m", layers=3)
    whole = quantkit.evaluate(model, TEST, ctx=64, max_windows=5, progress=False, layerwise=False)
    m = quantkit.load(model)
    held = []  # at each run of a layer read into memory (not the embedding's capture): the layers in memory
    for layer in m.layers:
        layer.register_forward_pre_hook(lambda mod, args: None if next(mod.parameters()).is_meta else held.append(
            sum(not next(x.parameters()).is_meta for x in m.layers)))
    monkeypatch.setattr(api, "free_bytes", lambda dev: 2**16)  # 64 KiB free: the model does not fit
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apart = quantkit.evaluate(m, TEST, ctx=64, max_windows=5, progress=False)
    assert any(issubclass(w.category, Note) and "scored a layer at a time" in str(w.message) for w in caught)
    assert apart == whole  # every field: the same float32 arithmetic, a layer at a time
    assert held == [1] * 3 * 2  # 3 layers, each alone, run on 2 batches (4 windows and 1)
    assert "scoring a layer at a time" not in capsys.readouterr().err  # progress=False
    assert all(t.is_meta for t in m.module.state_dict(keep_vars=True).values())  # nothing left in memory
    with warnings.catch_warnings(record=True) as caught:  # whole as asked (lm-eval's run too): said to be a risk
        warnings.simplefilter("always")
        assert quantkit.evaluate(model, TEST, ctx=64, max_windows=5, progress=False, layerwise=False) == whole
    assert any("it runs whole as asked, and may run out of memory" in str(w.message) for w in caught)
    monkeypatch.setattr(api, "free_bytes", lambda dev: 2**40)
    monkeypatch.setattr(distributed, "world", lambda: 2)  # quantize --eval-data's "before" under torchrun: rank 0's
    assert quantkit.evaluate(model, TEST, ctx=64, max_windows=5, progress=False, layerwise=True) == whole


def test_layerwise_is_refused_for_a_model_held_whole(tiny_dir, tmp_path, capsys, monkeypatch):
    """A quantized export is read whole into memory: there is no layer to read from disk as it runs."""
    from .conftest import refused

    import quantkit

    out = tmp_path / "q"
    quantkit.quantize(tiny_dir, method="rtn", bits=4, group_size=32, out=out, progress=False)
    refused(["eval", out, "--data", TEST, "--ctx", "64", "--max-windows", "1", "--layerwise"], capsys, monkeypatch,
            "--layerwise scores a float model or a GGUF file a layer at a time; drop it")
    assert quantkit.evaluate(out, TEST, ctx=64, max_windows=1, progress=False).windows == 1  # whole, by default


def test_a_gguf_file_scores_the_same_a_layer_at_a_time(tiny256, tmp_path):
    """Each layer dequantized from the file as it is reached, its linears under llama.cpp's arithmetic; the
    GGUF file against its float base, both a layer at a time."""
    import quantkit

    f = tmp_path / "q.gguf"
    quantkit.api.export_gguf(quantkit.load(tiny256), f, "Q4_K_M", progress=False)
    whole = quantkit.evaluate(f, TEST, ctx=64, max_windows=3, progress=False, layerwise=False)
    assert quantkit.evaluate(f, TEST, ctx=64, max_windows=3, progress=False, layerwise=True) == whole
    kw = dict(data=TEST, ctx=64, max_windows=3, progress=False)
    assert quantkit.compare(f, tiny256, **kw, layerwise=True) == quantkit.compare(f, tiny256, **kw, layerwise=False)


def test_a_containers_page_cache_counts_as_free(tmp_path):
    """Under a cgroup (v2) memory limit, what the group uses includes the page cache, which fills to
    the limit as a checkpoint is read: counted as used, a model that fits looked like none would,
    and its windows ran in parts of a batch, each reading the model again. The cache the kernel
    drops first (inactive files) is free, as the host's MemAvailable counts it."""
    from quantkit.pipeline import cgroup_left

    gib = 2**30
    job = tmp_path / "system.slice" / "job.scope"  # the process's own group, below the root (no namespace)
    job.mkdir(parents=True)
    (job / "memory.max").write_text(f"{8 * gib}\n")
    (job / "memory.current").write_text(f"{int(7.5 * gib)}\n")
    (job / "memory.stat").write_text(f"anon {gib}\nfile {int(6.5 * gib)}\ninactive_file {4 * gib}\n")
    assert cgroup_left(tmp_path, "/system.slice/job.scope") == int(4.5 * gib)
    (job / "memory.stat").unlink()  # without the breakdown: the limit less all that is used
    assert cgroup_left(tmp_path, "/system.slice/job.scope") == gib // 2
    (tmp_path / "system.slice" / "memory.max").write_text(f"{gib}\n")  # a tighter limit above it
    (tmp_path / "system.slice" / "memory.current").write_text(f"{2 * gib}\n")  # over it: none left, not less
    assert cgroup_left(tmp_path, "/system.slice/job.scope") == 0
    for path in (job / "memory.max", tmp_path / "system.slice" / "memory.max"):
        path.write_text("max\n")  # no limit
    assert cgroup_left(tmp_path, "/system.slice/job.scope") is None
    assert cgroup_left(tmp_path, "/") is None and cgroup_left(tmp_path / "none", "/") is None


def test_a_run_stopped_in_a_layer_leaves_the_model_lazy(tiny_dir, monkeypatch):
    """Stopped in a layer, the layer stayed in memory: the Model was no longer read lazily, so the next
    evaluate of it ran it whole (a 70B out of memory) or refused layerwise=True."""
    import quantkit
    from quantkit import pipeline

    m = quantkit.load(tiny_dir)
    real = pipeline.run_layer

    def stopped(layer, batches):
        if layer is m.layers[1]:
            raise KeyboardInterrupt
        return real(layer, batches)

    monkeypatch.setattr(pipeline, "run_layer", stopped)
    with pytest.raises(KeyboardInterrupt):
        quantkit.evaluate(m, TEST, ctx=64, max_windows=2, progress=False, layerwise=True)
    assert m.lazy and all(t.is_meta for t in m.module.state_dict(keep_vars=True).values())
    monkeypatch.setattr(pipeline, "run_layer", real)
    assert quantkit.evaluate(m, TEST, ctx=64, max_windows=2, progress=False, layerwise=True) == \
        quantkit.evaluate(tiny_dir, TEST, ctx=64, max_windows=2, progress=False, layerwise=False)


def test_a_model_mixing_sliding_window_layers_is_masked_by_kind(tmp_path, monkeypatch, capsys):
    """Every layer got the first layer's attention mask from the captured inputs: a Qwen2 whose later
    layers have a sliding window scored 498.2357 a layer at a time against 498.0522 whole, and GPTQ and
    AWQ calibrated those layers on the wrong mask. The capture now keeps each kind's mask, and each
    layer's attention takes its own: the same figures, and the same layer outputs as the whole model's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import quantkit
    from quantkit.pipeline import capture_inputs, run_layer

    from .conftest import tiny_tokenizer

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "q")
    tiny_tokenizer(tmp_path / "q")
    kw = dict(data=TEST, ctx=64, max_windows=3, progress=False)
    whole = quantkit.evaluate(tmp_path / "q", **kw, layerwise=False)
    assert quantkit.evaluate(tmp_path / "q", **kw, layerwise=True) == whole
    m = quantkit.load(tmp_path / "q")
    m.materialize()
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = m.module(ids, output_hidden_states=True).hidden_states
        batches = capture_inputs(m, ids, 2)
        for i, layer in enumerate(m.layers):
            run_layer(layer, batches)
            assert torch.equal(batches[0][0], want[i + 1]) or i == len(m.layers) - 1  # the last: before the norm
    # GPTQ stopped after layer 1 resumes from masks by kind read back from its progress, to the same bytes
    from quantkit import pipeline

    from .conftest import VALID, stopping_saves

    q = dict(method="gptq", calib_data=VALID, calib_samples=4, calib_seqlen=64, progress=False)
    quantkit.quantize(tmp_path / "q", out=tmp_path / "whole", **q)
    real = stopping_saves(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(tmp_path / "q", out=tmp_path / "resumed", **q)
    monkeypatch.setattr(pipeline, "save_progress", real)
    capsys.readouterr()
    quantkit.quantize(tmp_path / "q", out=tmp_path / "resumed", **q)
    assert "resuming after layer 1/3" in capsys.readouterr().err
    assert (tmp_path / "resumed" / "model.safetensors").read_bytes() == \
        (tmp_path / "whole" / "model.safetensors").read_bytes()
    # AWQ calls the attention alone, with the captured keyword arguments: it takes its own kind's mask too
    quantkit.quantize(tmp_path / "q", out=tmp_path / "awq", **{**q, "method": "awq"})
    assert math.isfinite(quantkit.evaluate(tmp_path / "awq", **kw).perplexity)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rotary_frequencies_stay_float32_in_a_narrower_dtype(tiny_dir, dtype):
    """evaluate(dtype="bfloat16") cast the whole module, the rotary frequencies too, which transformers
    keeps in float32 in any dtype: each position turned by a rounded angle (the embedded model's perplexity
    23.627 against transformers' 23.582 in bfloat16, 8 windows). Found as the layer-at-a-time run, which
    leaves them alone, disagreed with the whole run in bfloat16."""
    from transformers import AutoModelForCausalLM

    import quantkit
    from quantkit import api

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=getattr(torch, dtype))
    m = api.ready(tiny_dir, device="cpu", dtype=dtype)
    assert m.module.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(m.module.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    assert {p.dtype for p in m.module.parameters()} == {getattr(torch, dtype)}
    whole = quantkit.evaluate(tiny_dir, TEST, ctx=64, max_windows=3, progress=False, dtype=dtype, layerwise=False)
    assert quantkit.evaluate(tiny_dir, TEST, ctx=64, max_windows=3, progress=False, dtype=dtype,
                             layerwise=True) == whole
