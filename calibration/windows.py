from __future__ import annotations

import hashlib
import os
import random
import shlex
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from quantkit import hub
from quantkit.blocks import threads
from quantkit.errors import QuantkitError, count, one_line, option
from quantkit.modelio import adds_bos, with_bos

from . import records

HUB_DATASET = ("wikitext", "wikitext-2-raw-v1")
PURPOSE = {"train": "calibrate on", "test": "evaluate on"}  # what each split's text is for


# files that are not text, by their first bytes: what to do with each
PACKED = {b"\x1f\x8b": "gzip-compressed: decompress it (gunzip) and pass the text",
          b"BZh": "bzip2-compressed: decompress it (bunzip2) and pass the text",
          b"\xfd7zXZ\x00": "xz-compressed: decompress it (unxz) and pass the text",
          b"\x28\xb5\x2f\xfd": "zstd-compressed: decompress it (unzstd) and pass the text",
          b"PK\x03\x04": "a zip archive: extract the text file from it and pass that",
          b"PAR1": "a Parquet table: write its text column as a text file, or its rows as JSON lines (.jsonl)"}
# byte-order marks of the wider Unicode encodings, UTF-32's first: it begins with UTF-16's
WIDE = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16", b"\xfe\xff": "UTF-16"}
TABLES = (".csv", ".tsv")


def load_text(source: str | os.PathLike | None = None, split: str = "train", tokenizer=None) -> str:
    """The text of a local file, or (source None) a WikiText-2 split from the hub (train to
    calibrate, test to evaluate). With the model's tokenizer, a .jsonl/.json file of chat or
    instruction records (the trainer's) is the records as the chat template writes them."""
    if source is None:
        return hub_text(split)
    text = read_file(source, PURPOSE.get(split, "use"))
    return chats(source, text, tokenizer) if tokenizer is not None else text


def read_file(source: str | os.PathLike, purpose: str = "use") -> str:
    """A local file's text, its bytes as they are ("\\r\\n" kept: llama.cpp reads them so) but for a
    byte-order mark; a file that is not text is refused, naming what to pass instead."""
    p = Path(source)
    try:
        kind = "directory" if p.is_dir() else "missing" if not p.exists() else "file" if p.is_file() else "special"
    except OSError as e:  # a name too long (text passed where its path belongs), a parent not searchable
        shown = str(p) if len(str(p)) <= 80 else str(p)[:77] + "..."
        raise QuantkitError(f"{shown}: not a file this system can open ({e.strerror}): pass the path of a text file "
                            "(text itself: write it to a file first)") from None
    if kind == "directory":
        raise QuantkitError(f"{p} is a directory: pass a text file (or JSON lines of chats) to {purpose}")
    if kind == "missing":
        raise QuantkitError(f"{p}: no such file: pass an existing text file")
    if kind == "special":  # /dev/null, <(zcat text.gz): read more than once, or nothing at all
        raise QuantkitError(f"{p} is not a regular file (a pipe or a device): write the text to a file and pass that")
    if p.suffix.lower() in TABLES:
        raise QuantkitError(f"{p}: a table, which would be read as text with its commas and quotes: write its text "
                            "column as a text file, or its rows as JSON lines (.jsonl)")
    try:
        with open(p, "rb") as f:
            head = f.read(8)
        kind = next((what for magic, what in PACKED.items() if head.startswith(magic)), None)
        if kind is not None:
            raise QuantkitError(f"{p}: {kind}")
        with open(p, encoding="utf-8-sig", newline="") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        wide = next((name for bom, name in WIDE.items() if head.startswith(bom)), None)
        if wide is not None:  # Windows' "Unicode" text
            raise QuantkitError(f"{p}: {wide} text, not UTF-8: convert it (iconv -f {wide} -t UTF-8 "
                                f"{shlex.quote(str(p))} > {shlex.quote(p.stem + '-utf8' + p.suffix)})") from None
        raise QuantkitError(f"{p}: not UTF-8 text ({e}): convert it (Latin-1, say: iconv -f LATIN1 -t UTF-8 "
                            f"{shlex.quote(str(p))} > {shlex.quote(p.stem + '-utf8' + p.suffix)}), or pass a text file") from None
    except OSError as e:
        raise QuantkitError(f"{p}: cannot read it ({e.strerror}): make it readable, or pass another file") from None
    if not text.strip():
        raise QuantkitError(f"{p}: the file is empty: pass a file with text to {purpose}")
    if "\x00" in text:  # valid UTF-8, not text: UTF-16 without its byte-order mark (a NUL in every other place), or zeros
        head = text[:200]
        nul = sorted(head[i::2].count("\x00") / max(len(head[i::2]), 1) for i in (0, 1))
        if nul[0] < 0.1 and nul[1] > 0.9:
            raise QuantkitError(f"{p}: UTF-16 text without a byte-order mark, not UTF-8: convert it (iconv -f UTF-16LE "
                                f"-t UTF-8 {shlex.quote(str(p))} > {shlex.quote(p.stem + '-utf8' + p.suffix)})")
        raise QuantkitError(f"{p}: holds NUL bytes, which text does not: pass a text file")
    return text


def chats(source: str | os.PathLike | None, text: str, tokenizer) -> str:
    """text read from source, as the model sees it: a file of chat or instruction records rendered
    by the tokenizer's chat template; other text as it is."""
    if source is None or not records.is_records(Path(source)):
        return text
    return records.rendered(Path(source), text, tokenizer)


def given(split: str) -> str:
    """The option that gives a split's text: the calibration's, or an evaluation's (only eval and report
    score the hub's text: quantize scores --eval-data when given, and nothing else)."""
    return option("calib_data" if split == "train" else "data")


def hub_text(split: str) -> str:
    name, config = HUB_DATASET
    if Path(name).exists():  # datasets reads a local path of that name before the hub: other text, silently
        raise QuantkitError(f"./{name} exists, and the hub's {name} would be read from it: run from another directory, "
                            f"or pass a local text file ({given(split)})")
    try:
        import datasets

        with hub.reached():
            rows = datasets.load_dataset(name, config, split=split)["text"]
    except Exception as e:  # no network, no `datasets`, a hub error: all mean "use a local file"
        raise QuantkitError(
            f"could not load the default text to {PURPOSE.get(split, 'use')}, {name}/{config} {split}, from the hub "
            f"({type(e).__name__}: {one_line(e)}): pass a local text file ({given(split)}), or install "
            "`datasets` and allow network access"
        ) from None
    return "\n\n".join(rows)  # how the GPTQ reference joins the rows


TOKENIZED: dict[tuple[str, str], torch.Tensor] = {}  # the last few texts' ids, by tokenizer and text
KEPT = 8  # a WikiText-2 file is about 2.4 MB of ids
LARGEST = 4_000_000  # characters: a training corpus is not held twice (most of a GB of ids each)


def token_ids(tokenizer, text: str, progress: bool = True) -> torch.Tensor:
    """The text's token ids without special tokens added (LongTensor [n]). A special token's string in
    the text ("<|endoftext|>" in a web page) is text, as llama-perplexity and llama-imatrix read it,
    but in chats a template rendered (records.Rendered), whose markers they are. A run tokenizes the
    same text more than once (calibration and its evaluation, the base and the model compared with
    it), seconds for a WikiText-2 file each time: a fast tokenizer's KEPT most recently used results
    are kept, by its own definition (a copy of it loaded again hits) and the text's digest; texts up
    to LARGEST characters. progress: a bar for a long text."""
    split = not isinstance(text, records.Rendered)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or len(text) > LARGEST:  # a slow (Python) tokenizer has no definition to key on
        return tokenize(tokenizer, text, split, progress)
    try:
        definition = backend.to_str()
    except Exception:  # a backend with a Python-side part (a custom pre-tokenizer) does not serialize
        return tokenize(tokenizer, text, split, progress)
    kind = type(tokenizer)
    definition = f"{kind.__module__}.{kind.__qualname__}|{split}|{definition}"
    key = (hashlib.sha256(definition.encode()).hexdigest(),
           hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest())
    ids = TOKENIZED.pop(key, None)  # a hit goes back to the end: the least recently used goes first
    if ids is None:
        ids = tokenize(tokenizer, text, split, progress)
        while len(TOKENIZED) >= KEPT:
            TOKENIZED.pop(next(iter(TOKENIZED), None), None)  # another thread may take it first
    TOKENIZED[key] = ids
    return ids.clone()  # the caller's to change


CHUNK = 1 << 20  # characters tokenized in one piece: a tokenizer holds about 120 bytes a character while it works
OVERLAP = 1 << 13  # characters two neighbouring pieces share: each tokenizes their middle half as the whole text does
SHOWN = 8 * CHUNK  # texts from this long show their progress (seconds of work)


def tokenize(tokenizer, text: str, split: bool, progress: bool = True) -> torch.Tensor:
    """The text's ids as the tokenizer gives them for the whole text, computed a piece at a time (a few
    pieces at once, on all cores) so that memory holds a few pieces' work and the ids, not the whole
    text's work (12 GB for 100 MB of text). Neighbouring pieces overlap and are joined where both
    tokenize the middle half of their overlap alike (the edges of a piece tokenize differently: a
    word cut in two, a space a tokenizer puts in front of a text); where they do not (a run of
    thousands of characters the tokenizer reads as one word), the pieces are tokenized as one (a run of
    R such characters costs R^2 / 2 CHUNK characters more). Agreement over the middle half is taken
    to mean both equal the whole text's tokens there: true of tokenizers whose context is local (tests:
    byte-level BPE with GPT-2's and Llama 3's splits, SentencePiece's BPE)."""
    def encode(spans: list[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:  # (ids, offsets) each
        out = tokenizer([text[a:b] for a, b in spans], add_special_tokens=False, split_special_tokens=split,
                        return_offsets_mapping=True, return_attention_mask=False)
        return [(torch.tensor(ids, dtype=torch.long), torch.from_numpy(np.array(offsets, dtype=np.int64)).view(-1, 2) + a)
                for ids, offsets, (a, _) in zip(out["input_ids"], out["offset_mapping"], spans)]

    if len(text) <= CHUNK or not getattr(tokenizer, "is_fast", False):  # a slow tokenizer gives no offsets
        return torch.tensor(tokenizer(text, add_special_tokens=False, split_special_tokens=split)["input_ids"],
                            dtype=torch.long)
    spans, a = [], 0
    while not spans or spans[-1][1] < len(text):
        spans.append((a, min(a + CHUNK, len(text))))
        a = spans[-1][1] - OVERLAP
    width = min(8, max(2, threads()))  # pieces per call: the tokenizer encodes a batch on every core
    kept, done, held = [], 0, None  # the ids taken, where those still to take begin, the piece not yet joined
    with tqdm(total=len(text), desc="tokenizing", unit="char", unit_scale=True, leave=False, file=sys.stderr,
              disable=not progress or len(text) < SHOWN or os.environ.get("RANK", "0") != "0") as bar:  # torchrun's first shows it
        for i in range(0, len(spans), width):
            for (a2, b2), (ids2, offsets2) in zip(spans[i:i + width], encode(spans[i:i + width])):
                if held is None:
                    held = (a2, b2, ids2, offsets2)
                    continue
                a, b, ids, offsets = held
                lo, hi = a2 + OVERLAP // 4, b - OVERLAP // 4  # the overlap's middle half
                mine, theirs = (offsets[:, 0] >= lo) & (offsets[:, 0] < hi), (offsets2[:, 0] >= lo) & (offsets2[:, 0] < hi)
                if mine.any() and torch.equal(ids[mine], ids2[theirs]) and torch.equal(offsets[mine], offsets2[theirs]):
                    cut = int(offsets[mine][0, 0])
                    kept.append(ids[(offsets[:, 0] >= done) & (offsets[:, 0] < cut)])
                    done, held = cut, (a2, b2, ids2, offsets2)
                else:  # no agreement: the two pieces as one
                    held = (a, b2, *encode([(a, b2)])[0])
                bar.update(done - bar.n)
        kept.append(held[2][held[3][:, 0] >= done])
        bar.update(len(text) - bar.n)
    return torch.cat(kept)


def sample_windows(tokenizer, text: str, n: int, seqlen: int, seed: int = 0, progress: bool = True) -> torch.Tensor:
    """n non-overlapping windows of seqlen tokens at seeded random places: LongTensor [n, seqlen]. When
    the tokenizer puts BOS in front of a text, each window's first token is BOS, as in llama-imatrix's
    chunks and the evaluation's windows: the model is calibrated on what it runs on."""
    if n < 1 or seqlen < 2:
        raise QuantkitError(f"{n} windows of {seqlen} tokens asked for: ask for at least 1 window "
                            f"({option('calib_samples')}) of at least 2 tokens ({option('calib_seqlen')})")
    if seed < 0:  # Python's Random takes -3 as 3: two seeds, one sample
        raise QuantkitError(f"{option('seed', seed)} is negative: use 0 or more")
    ids = token_ids(tokenizer, text, progress)
    bos = adds_bos(tokenizer)
    ids = with_bos(tokenizer, ids)  # one BOS for the whole text, cut, then each window's first token BOS: llama-imatrix's
    slots = len(ids) // seqlen
    if slots < n:
        raise QuantkitError(
            f"calibration text has {len(ids)} tokens, too few for {count(n, 'window')} of {seqlen} "
            f"({n * seqlen} tokens; {slots} fit): use a longer text, fewer samples ({option('calib_samples')}) or shorter windows "
            f"({option('calib_seqlen')})"
        )
    # in the sample's order, not the text's: the parts that take the first few windows (the measurement's
    # Fisher, AWQ's attention loss) take a random few, not the start of the text
    picks = random.Random(seed).sample(range(slots), n)
    windows = torch.stack([ids[i * seqlen : (i + 1) * seqlen] for i in picks])
    if bos:
        windows[:, 0] = tokenizer.bos_token_id
    return windows
