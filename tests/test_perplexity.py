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
