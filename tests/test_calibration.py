import gzip
import json
import re
import sys

import pytest
import torch

from quantkit import QuantkitError
from quantkit.calibration import load_text, sample_windows
from quantkit.calibration.records import Rendered
from quantkit.modelio import load_tokenizer

from .conftest import DATA, TEST, VALID, tokenizer_adding_bos


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir)


def test_windows_are_seeded_and_disjoint(tok):
    """Seeded, whole slices of the text, none twice, in the sample's order: sorted, the parts that take
    the first few windows (the measurement's Fisher, AWQ's attention loss) took the start of the text."""
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
    assert len(set(starts)) == 8 and starts != sorted(starts)
    with pytest.raises(QuantkitError, match="seed=-3 is negative"):  # the same sample as seed 3
        sample_windows(tok, text, 8, 64, seed=-3)


def test_windows_start_with_bos_where_the_tokenizer_adds_it(tok, tiny_dir):
    """As llama-imatrix's chunks and the evaluation's windows: the same slices of the text with BOS in
    front, the first token BOS (they were cut from the text without it: one token off)."""
    from quantkit.evals.perplexity import windows

    text = load_text(VALID)[:100_000]
    with_bos = tokenizer_adding_bos(tiny_dir)
    plain, first = sample_windows(tok, text, 8, 64, seed=3), sample_windows(with_bos, text, 8, 64, seed=3)
    assert (first[:, 0] == with_bos.bos_token_id).all() and (plain[:, 0] != with_bos.bos_token_id).any()
    chunks = {tuple(w[1:].tolist()) for w in windows(with_bos, text, ctx=64)}
    assert all(tuple(w[1:].tolist()) in chunks for w in first)


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


def test_a_byte_order_mark_is_not_text(tmp_path):
    """A BOM (Windows editors write one) was kept as a character and tokenized; the trainer dropped it."""
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfone\r\ntwo")
    assert load_text(tmp_path / "bom.txt") == "one\r\ntwo"


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


def test_record_files_by_any_spelling_of_their_suffix(chat_dir, tmp_path):
    """.JSONL and .ndjson are JSON lines too: they were read as plain text, JSON and all."""
    tok = load_tokenizer(chat_dir)
    record = json.dumps({"instruction": "Name a colour.", "response": "Blue\u2028and green."}, ensure_ascii=False)
    texts = []
    for name in ("d.jsonl", "d.JSONL", "d.ndjson"):  # U+2028 unescaped, as json.dumps writes it: one line still
        (tmp_path / name).write_text(record + "\n" + record + "\n")
        texts.append(load_text(tmp_path / name, tokenizer=tok))
    assert texts[0] == texts[1] == texts[2] and texts[0].count("Blue\u2028and green.") == 2
    assert "instruction" not in texts[0]


@pytest.mark.parametrize("name,content,match", [
    ("d.jsonl", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}',
     "line 1: messages must be a list of {\"role\", \"content\"} objects, each with text in both"),
    ("d.jsonl", '{"messages": [{"role": 1, "content": "hi"}]}', "line 1: messages must be a list"),
    ("d.jsonl", '{"messages": [{"role": "user", "content": null}]}', "line 1: messages must be a list"),
    ("d.jsonl", '{"instruction": "a", "context": ["b"], "response": "c"}', "context (or input) is list"),
    ("d.json", '{"instruction": "a", "response": "b"}', "holds one JSON object (keys: instruction, response)"),
    ("d.json", '{"data": [{"instruction": "a", "response": "b"}]}', "holds one JSON object (keys: data)"),
    ("d.json", "[]", "d.json: holds no records"),
    ("d.json", '[{"instruction": "a", "response": "b"}, {"prompt": 1}]', "d.json, item 2: the record's prompt is int"),
    # half an emoji: a traceback from the tokenizer
    ("d.jsonl", '{"instruction": "a \\ud800 b", "response": "c"}', "line 1: holds half of a character")])
def test_bad_records_are_named(chat_dir, tmp_path, name, content, match):
    (tmp_path / name).write_text(content + "\n")
    with pytest.raises(QuantkitError, match=re.escape(match)):
        load_text(tmp_path / name, tokenizer=load_tokenizer(chat_dir))


def test_a_chat_without_a_reply_calibrates(chat_dir, tmp_path):
    """Calibration takes the text of any chat; only the trainer needs a reply to learn."""
    (tmp_path / "d.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi there"}]}) + "\n")
    assert "hi there" in load_text(tmp_path / "d.jsonl", tokenizer=load_tokenizer(chat_dir))


@pytest.mark.parametrize("name,content,match", [
    ("valid.gz", gzip.compress(b"some text"), "gzip-compressed: decompress it (gunzip)"),
    # valid UTF-8, and not text: they were calibrated on
    ("u16.txt", "plain ASCII text, two bytes a character".encode("utf-16-le") * 10, "UTF-16 text without a byte-order mark"),
    ("zeros.txt", bytes(1000), "holds NUL bytes, which text does not"),
    ("latin1.txt", "caf\u00e9 au lait".encode("latin-1"), "convert it (Latin-1, say: iconv -f LATIN1 -t UTF-8"),
    ("valid.zip", b"PK\x03\x04" + bytes(20), "a zip archive: extract the text file"),
    ("d.parquet", b"PAR1" + bytes(20), "a Parquet table: write its text column as a text file"),
    ("d.csv", b"text,label\nhello,1\n", "a table, which would be read as text"),
    ("d.TSV", b"text\tlabel\nhello\t1\n", "a table, which would be read as text")])
def test_files_that_are_not_text_are_named(tmp_path, name, content, match):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(QuantkitError, match=re.escape(match)):
        load_text(tmp_path / name)


def test_a_directory_is_named(tmp_path):
    with pytest.raises(QuantkitError, match="is a directory: pass a text file"):
        load_text(tmp_path)
    # text passed where its path belongs: the name is too long for the file system (a traceback)
    with pytest.raises(QuantkitError, match=r"not a file this system can open \(File name too long\): pass the path"):
        load_text("A lobster is a crustacean. " * 20)


def test_records_of_plain_text_calibrate_as_that_text(tmp_path, tok):
    """{"text": ...} lines, as pile-val and C4 are shipped, were refused as neither chats nor instructions."""
    (tmp_path / "pile.jsonl").write_text("\n".join(json.dumps({"text": t, "meta": {"set": "x"}}) for t in ("One.", "Two.")))
    assert load_text(tmp_path / "pile.jsonl", tokenizer=tok) == "One.\n\nTwo."


def test_special_tokens_strings_are_text_but_in_rendered_chats(chat_dir, tmp_path):
    """"<|endoftext|>" written in a text was read as the special token, where llama-perplexity and
    llama-imatrix read it as text (a web page holding it scored 60.2 here and 16.7 there); in chats
    the template wrote, it is the turn's marker."""
    from quantkit.evals.perplexity import windows

    tok = load_tokenizer(chat_dir)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}"
    end = tok.convert_tokens_to_ids("<|endoftext|>")
    (tmp_path / "t.txt").write_text("A lobster. <|endoftext|> " * 200)
    assert end not in windows(tok, load_text(tmp_path / "t.txt", split="test", tokenizer=tok), ctx=64)
    (tmp_path / "d.jsonl").write_text((json.dumps({"instruction": "A lobster?", "response": "Yes."}) + "\n") * 20)
    assert end in windows(tok, load_text(tmp_path / "d.jsonl", split="test", tokenizer=tok), ctx=64)


def test_templates_that_print_the_date_render_the_same_any_day(chat_dir, tmp_path):
    """A Llama 3.x template prints today's date where none is given: the same records and seed gave
    other windows the next day, and a run resumed after midnight started afresh."""
    tok = load_tokenizer(chat_dir)
    tok.chat_template = "{{ 'Today Date: ' + strftime_now('%d %b %Y') if date_string is not defined else " \
                        "'Today Date: ' + date_string }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "d.jsonl").write_text(json.dumps({"instruction": "A lobster?", "response": "Yes."}) + "\n")
    assert load_text(tmp_path / "d.jsonl", tokenizer=tok).startswith("Today Date: 26 Jul 2024")


def test_no_network_is_told_at_once(monkeypatch):
    """Where the hub's host does not resolve, the hub's client reads its cache only: no retries with
    sleeps between them (half a minute of warnings) before the error."""
    import socket
    import time

    pytest.importorskip("datasets")

    def unresolved(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    sleeps = []
    monkeypatch.setattr(socket, "getaddrinfo", unresolved)
    monkeypatch.setattr(time, "sleep", sleeps.append)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(QuantkitError, match=r"pass a local text file \(calib_data\)"):
        load_text(None)
    assert sleeps == []


def test_a_template_that_writes_bos_gets_one_bos(tiny_dir, tmp_path):
    """Llama's and Mistral's templates begin with {{ bos_token }}, read as the token in rendered chats; the
    windows put the tokenizer's BOS in front again: [BOS, BOS, ...] in the first window of the text."""
    from quantkit.evals.perplexity import windows

    tok = tokenizer_adding_bos(tiny_dir)
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    lines = (DATA / "dolly" / "dolly-15k-head.jsonl").read_text().splitlines()[:30]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    text = load_text(tmp_path / "d.jsonl", tokenizer=tok)
    assert isinstance(text, Rendered) and text.startswith("<|endoftext|>user: ")
    first = windows(tok, text, ctx=64)[0]
    assert first[0] == tok.bos_token_id and first[1] != tok.bos_token_id
    assert first[1:].tolist() == tok(text[len("<|endoftext|>"):], add_special_tokens=False)["input_ids"][:63]
    picked = sample_windows(tok, text, 4, 64, seed=0)  # the same cuts as the evaluation's (first token BOS)
    chunks = {tuple(w[1:].tolist()) for w in windows(tok, text, ctx=64)}
    assert all(tuple(w[1:].tolist()) in chunks for w in picked)


def test_records_are_evaluated_as_the_model_sees_them(chat_dir, tmp_path):
    """A file of chat records given to evaluate is scored as the template writes the chats, as
    calibration reads it, not as JSON."""
    import quantkit

    tok = load_tokenizer(chat_dir)
    lines = (DATA / "dolly" / "dolly-15k-head.jsonl").read_text().splitlines()[:30]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "d.txt").write_text(load_text(tmp_path / "d.jsonl", tokenizer=tok))
    got, want = (quantkit.evaluate(str(chat_dir), tmp_path / name, ctx=128, max_windows=2, progress=False)
                 for name in ("d.jsonl", "d.txt"))
    assert got.perplexity == want.perplexity and got.tokens == want.tokens


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def tokenizer_of_kind(kind: str, tiny_dir):
    """Tokenizers that read a text's start, its end and its words differently: byte-level BPE with
    GPT-2's split (the tiny model's) and with Llama 3's, the embedded model's (digits one by one, 49k
    tokens), and SentencePiece's BPE as Llama 2's tokenizer.json has it: a word marker put in front
    of the text and no split, the whole text one word, bytes for what the vocabulary lacks."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from quantkit.modelio import default_model_dir

    if kind in ("gpt2", "embedded"):
        return load_tokenizer(tiny_dir if kind == "gpt2" else default_model_dir())
    if kind == "llama3":
        llama3 = load_tokenizer(tiny_dir)
        llama3.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        return llama3
    sp = Tokenizer(models.BPE(byte_fallback=True))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    sp.pre_tokenizer = pre_tokenizers.Metaspace()  # to train on words; Llama 2's reads the text as one
    sp.train_from_iterator([VALID.read_text()[:100_000]], trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<s>"] + [f"<0x{b:02X}>" for b in range(256)]))
    sp.pre_tokenizer = None
    return PreTrainedTokenizerFast(tokenizer_object=sp)


@pytest.mark.parametrize("kind", ["gpt2", "llama3", "sentencepiece", pytest.param("embedded", marks=pytest.mark.slow)])
def test_long_texts_are_tokenized_a_piece_at_a_time(kind, tiny_dir, monkeypatch):
    """A tokenizer given a whole file held about 120 bytes a character (a 100 MB calibration corpus: 12
    GB, more than the machine): it now tokenizes pieces of CHUNK characters, overlapping, joined where
    both agree, with the whole text's ids for every kind of tokenizer, at the ends of a text and of its
    pieces, in runs longer than the overlap (one word to a tokenizer), and for a chat's markers."""
    from quantkit.calibration import windows

    monkeypatch.setattr(windows, "TOKENIZED", {})
    monkeypatch.setattr(windows, "CHUNK", 20_000)
    monkeypatch.setattr(windows, "OVERLAP", 2_000)
    text = TEST.read_text()[:150_000]
    runs = text[:50_000] + "=" * 7_000 + text[50_000:90_000] + " " * 9_000 + "x" + "\n" * 5_000 + text[90_000:]
    chat = Rendered("".join(f"<|endoftext|>{text[i:i + 900]}" for i in range(0, 60_000, 900)))
    tok, seen = tokenizer_of_kind(kind, tiny_dir), []
    call = type(tok).__call__
    monkeypatch.setattr(type(tok), "__call__", lambda self, t, **kw: seen.append(t) or call(self, t, **kw))
    for t in (text, runs, chat, " " + text[:30_000] + " "):
        del seen[:]
        split = not isinstance(t, Rendered)
        want = torch.tensor(call(tok, str(t), add_special_tokens=False, split_special_tokens=split)["input_ids"])
        assert torch.equal(windows.token_ids(tok, t), want)
        longest = max(len(s) for part in seen for s in ([part] if isinstance(part, str) else part))
        assert longest <= (windows.CHUNK if t is not runs else 4 * windows.CHUNK), longest
    if kind != "sentencepiece":  # a marker read as one token, not as its characters
        assert windows.token_ids(tok, chat)[0] == tok.convert_tokens_to_ids("<|endoftext|>")
    # an overlap too short to agree on: pieces joined into longer ones, still the whole text's ids
    monkeypatch.setattr(windows, "OVERLAP", 8)
    del seen[:]
    want = torch.tensor(call(tok, text, add_special_tokens=False)["input_ids"])
    assert torch.equal(windows.tokenize(tok, text, True), want)
    assert max(len(s) for part in seen for s in part) > windows.CHUNK


def test_a_text_is_tokenized_once_per_tokenizer(tiny_dir, monkeypatch):
    """Calibration, evaluation and the base of a comparison each tokenized the whole text again (seconds a
    WikiText-2 file): token_ids keeps the last few results, found again by a copy of the same tokenizer and
    never by another tokenizer or text; what it returns is the caller's to change."""
    from quantkit.calibration import windows

    monkeypatch.setattr(windows, "TOKENIZED", {})
    tok, again = load_tokenizer(tiny_dir), load_tokenizer(tiny_dir)
    text = VALID.read_text()[:20_000]
    ids = windows.token_ids(tok, text)
    assert torch.equal(ids, torch.tensor(tok(text, add_special_tokens=False)["input_ids"]))
    ids[:] = -1
    assert torch.equal(windows.token_ids(again, text), torch.tensor(tok(text, add_special_tokens=False)["input_ids"]))
    assert len(windows.TOKENIZED) == 1  # the copy hit
    other = tokenizer_adding_bos(tiny_dir)  # another definition: the same vocabulary with a BOS template
    assert len(windows.token_ids(other, text)) and len(windows.TOKENIZED) == 2
    marked = text + "<|endoftext|>"  # a special token's string: text in a text, a marker in chats a template wrote
    as_text = torch.tensor(tok(marked, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    assert torch.equal(windows.token_ids(tok, marked), as_text)
    chat = windows.token_ids(tok, Rendered(marked))  # the same text, kept apart in the cache
    assert chat[-1] == tok.convert_tokens_to_ids("<|endoftext|>") and len(chat) < len(as_text)
    first, second = list(windows.TOKENIZED)[:2]  # tok's text, then other's
    windows.token_ids(again, text)  # a hit: the evaluation's text outlives one-off texts used since
    for i in range(1, windows.KEPT):
        windows.token_ids(tok, text[i:])
    assert len(windows.TOKENIZED) == windows.KEPT and first in windows.TOKENIZED and second not in windows.TOKENIZED

    class Backend:  # one with a Python pre-tokenizer: tokenizers cannot serialize it
        def to_str(self):
            raise Exception("Custom PreTokenizer cannot be serialized")

    class Custom:  # a tokenizer with such a backend: it tokenizes, uncached
        backend_tokenizer = Backend()

        def __call__(self, *args, **kwargs):
            return tok(*args, **kwargs)

    assert torch.equal(windows.token_ids(Custom(), text), torch.tensor(tok(text, add_special_tokens=False)["input_ids"]))


def test_the_tokenizing_bar_shows_only_where_progress_is_asked_for(tiny_dir, tmp_path, monkeypatch, capsys):
    """A long text's tokenizing bar was drawn by runs given progress=False too (a caller's quiet
    quantize, evaluate or train): it follows progress now."""
    import quantkit
    from quantkit.calibration import windows

    monkeypatch.setattr(windows, "CHUNK", 20_000)
    monkeypatch.setattr(windows, "SHOWN", 40_000)  # longer texts show it
    monkeypatch.delenv("RANK", raising=False)
    text = tmp_path / "text.txt"
    text.write_text(VALID.read_text()[:100_000])
    runs = [lambda progress: quantkit.evaluate(tiny_dir, text, max_windows=1, progress=progress),
            lambda progress: quantkit.quantize(tiny_dir, method="gptq", group_size=32, calib_data=text,
                                               calib_samples=2, calib_seqlen=64, targets=None, progress=progress)]
    for run in runs:
        for progress in (False, True):
            monkeypatch.setattr(windows, "TOKENIZED", {})  # tokenized again, not found
            run(progress)
            assert ("tokenizing" in capsys.readouterr().err) == progress
