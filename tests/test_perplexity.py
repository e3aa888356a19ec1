import importlib
import math

import pytest
import torch

import quantkit
from quantkit import QuantkitError
from quantkit.evals import perplexity

from .conftest import TEST


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return quantkit.load(tiny_dir)


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


def test_bos_replaces_the_first_token_only_when_the_tokenizer_adds_it(tiny, text, monkeypatch):
    ppl = importlib.import_module("quantkit.evals.perplexity")  # the module, not the function of that name
    base = perplexity(tiny.module, tiny.tokenizer, text, "llamacpp", ctx=64, max_windows=2, progress=False)
    seen = []
    forward = tiny.module.forward
    monkeypatch.setattr(tiny.module, "forward", lambda ids, **kw: seen.append(ids[:, 0].tolist()) or forward(ids, **kw))
    monkeypatch.setattr(ppl, "adds_bos", lambda tok: True)
    monkeypatch.setattr(tiny.tokenizer, "bos_token_id", 7, raising=False)
    with_bos = perplexity(tiny.module, tiny.tokenizer, text, "llamacpp", ctx=64, max_windows=2, progress=False)
    assert seen == [[7, 7]] and with_bos.tokens == base.tokens and with_bos.perplexity != base.perplexity


def test_too_short_text_and_bad_protocol(tiny):
    with pytest.raises(QuantkitError, match="fewer than one window"):
        perplexity(tiny.module, tiny.tokenizer, "too short", "llamacpp", ctx=512, progress=False)
    with pytest.raises(QuantkitError, match="unknown perplexity protocol"):
        perplexity(tiny.module, tiny.tokenizer, "text", "nope", progress=False)
