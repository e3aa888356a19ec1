import json
import sys

import pytest
import torch

from quantkit import QuantkitError
from quantkit.calibration import load_text, sample_windows
from quantkit.modelio import load_tokenizer

from .conftest import DATA, VALID, tokenizer_adding_bos


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir)


def test_windows_are_seeded_and_disjoint(tok):
    text = load_text(VALID)[:100_000]
    a = sample_windows(tok, text, 8, 64, seed=3)
    assert a.shape == (8, 64) and a.dtype == torch.long
    assert torch.equal(a, sample_windows(tok, text, 8, 64, seed=3))
    assert not torch.equal(a, sample_windows(tok, text, 8, 64, seed=4))
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    starts = []
    for w in a:  # each window is a slice of the text at a multiple of 64: no overlaps
        hits = [s for s in range(0, len(ids) - 63, 64) if torch.equal(ids[s : s + 64], w)]
        assert hits
        starts.append(hits[0])
    assert len(set(starts)) == 8


def test_windows_start_with_bos_where_the_tokenizer_adds_it(tok, tiny_dir):
    """As llama-imatrix's chunks and the evaluation's windows: the same slices, the first token BOS."""
    text = load_text(VALID)[:100_000]
    with_bos = tokenizer_adding_bos(tiny_dir)
    plain, first = sample_windows(tok, text, 8, 64, seed=3), sample_windows(with_bos, text, 8, 64, seed=3)
    assert (first[:, 0] == with_bos.bos_token_id).all() and (plain[:, 0] != with_bos.bos_token_id).any()
    assert torch.equal(first[:, 1:], plain[:, 1:])


def test_too_little_text_is_an_error(tok, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("just a few words of text\n")
    with pytest.raises(QuantkitError, match="too few for 4 windows of 64"):
        sample_windows(tok, load_text(short), 4, 64)


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(QuantkitError, match="empty"):
        load_text(tmp_path / "empty.txt")
    with pytest.raises(QuantkitError, match="no such file"):
        load_text(tmp_path / "nope.txt")


def test_no_network_default_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as it does without the package
    with pytest.raises(QuantkitError, match="pass a local text file"):
        load_text(None)


def test_text_is_read_byte_for_byte(tmp_path):
    """wiki.test.raw has CRLF line ends; llama.cpp tokenizes them, so we must not translate them."""
    (tmp_path / "crlf.txt").write_bytes(b"one\r\ntwo\r\n")
    assert load_text(tmp_path / "crlf.txt") == "one\r\ntwo\r\n"


def test_chat_records_calibrate_as_the_chat_template_writes_them(chat_dir, tmp_path):
    """Dolly's JSON lines, passed as calibration data, are the records as the model's template writes
    them (what the model will be given), not JSON; without a template they are refused."""
    tok = load_tokenizer(chat_dir)
    lines = (DATA / "dolly" / "dolly-15k-head.jsonl").read_text().splitlines()[:20]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    text = load_text(tmp_path / "d.jsonl", tokenizer=tok)
    first = json.loads(lines[0])
    assert text.startswith(f"<|im_start|>user\n{first['instruction']}\n\n{first['context']}<|im_end|>\n"
                           f"<|im_start|>assistant\n{first['response']}<|im_end|>\n")
    assert text.count("<|im_start|>assistant") == 20 and '"instruction":' not in text
    assert load_text(tmp_path / "d.jsonl").startswith('{"instruction"')  # as text where no model is given
    with pytest.raises(QuantkitError, match="need the tokenizer's chat template"):
        tok.chat_template = None
        load_text(tmp_path / "d.jsonl", tokenizer=tok)
