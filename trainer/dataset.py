"""Training examples: plain text packed into fixed-length windows (every token scored), or JSON
lines of chats and instruction records rendered with the tokenizer's chat template (only the
assistant's tokens scored). Batches are fixed by the seed: step s always sees the same sequences."""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from quantkit.calibration import read_file, token_ids
from quantkit.calibration.windows import tokenize
from quantkit.calibration.records import chat_text, check_template, is_records, messages_of, parse, plain
from quantkit.errors import QuantkitError, option

IGNORE = -100  # label of an unscored token (torch's cross-entropy ignore_index)


@dataclass
class Example:
    ids: torch.Tensor  # int64 [L]
    labels: torch.Tensor  # int64 [L]: the token to score at each position, or IGNORE

    @property
    def scored(self) -> int:
        """Tokens predicted (each position after the first whose label is kept)."""
        return int((self.labels[1:] != IGNORE).sum())


def read(path: str | os.PathLike, tokenizer, seqlen: int, progress: bool = True) -> list[Example]:
    """A .jsonl/.json file as chat or instruction records (or, records of {"text": ...} alone, their
    text), anything else as plain text."""
    p = Path(path)
    text = read_file(p, "train on")
    if not is_records(p):
        return windows(p, text, tokenizer, seqlen, progress)
    parsed = parse(p, text)
    if plain(parsed) is None:
        return records(p, parsed, tokenizer, seqlen)
    return documents(p, [record["text"] for _, record in parsed], tokenizer, seqlen, progress)


def documents(p: Path, texts: list[str], tokenizer, seqlen: int, progress: bool = True) -> list[Example]:
    """Records of plain text ({"text": ...}): each a document tokenized and ended by the end-of-sequence
    token, as TRL packs them (packed without it, a model never learns where a text stops), then cut into
    windows; joined by a blank line where the tokenizer has no such token."""
    eos = tokenizer.eos_token_id
    if eos is None:
        return windows(p, "\n\n".join(texts), tokenizer, seqlen, progress)
    end = torch.tensor([eos])
    ids = [part for text in tqdm(texts, desc="tokenizing", unit="record", leave=False, file=sys.stderr,
                                 disable=not progress or len(texts) < 1000)
           for part in (tokenize(tokenizer, text, split=True, progress=False), end)]
    return packed(p, torch.cat(ids), seqlen)


def windows(p: Path, text: str, tokenizer, seqlen: int, progress: bool = True) -> list[Example]:
    """Language modelling: the text tokenized once, cut into windows of seqlen tokens."""
    return packed(p, token_ids(tokenizer, text, progress), seqlen)


def packed(p: Path, ids: torch.Tensor, seqlen: int) -> list[Example]:
    """Token ids cut into windows of seqlen tokens, every token scored (the last partial window dropped)."""
    n = ids.numel() // seqlen
    if n == 0:
        raise QuantkitError(f"{p} is too short: {ids.numel()} tokens, not one window of {option('seqlen', seqlen)}: "
                            f"pass more text or a smaller {option('seqlen')}")
    return [Example(w, w.clone()) for w in ids[: n * seqlen].view(n, seqlen)]


def records(p: Path, parsed: list[tuple[str, dict]], tokenizer, seqlen: int) -> list[Example]:
    chats = [(where, messages_of(record, where)) for where, record in parsed]
    check_template(p, tokenizer)  # after the records: a file that is not chats is named as such first
    out, cut, short = [], 0, 0
    for where, msgs in chats:
        example, whole = render(msgs, tokenizer, seqlen, where)
        if example.scored:
            out.append(example)
            short += not whole
        else:
            cut += 1
    if not out:
        raise QuantkitError(f"{p}: no record has a reply within {option('seqlen', seqlen)} tokens: raise {option('seqlen')}")
    if cut:
        warnings.warn(f"{cut} records of {p} have no reply within {option('seqlen', seqlen)} tokens and were skipped")
    if short:  # the end of the turn is never learnt from these
        warnings.warn(f"{short} records of {p} have their last reply cut at {option('seqlen', seqlen)} tokens: raise "
                      f"{option('seqlen')} to train on them whole")
    return out


def render(msgs: list[dict], tokenizer, seqlen: int, where: str) -> tuple[Example, bool]:
    """The chat as the template writes it, first seqlen tokens; the labels keep each assistant turn's
    tokens (from the end of the generation prompt before it to the end of the turn). Also whether the
    last assistant turn ends within the seqlen tokens."""
    def chat(turns: list[dict], **kw) -> str:
        return chat_text(turns, tokenizer, where, **kw)

    full = chat(msgs)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        end = chat(msgs[: i + 1])
        if i:
            start = chat(msgs[:i], add_generation_prompt=True)
            begin = len(start) if full.startswith(start) else -1
        else:  # what the template writes before a first reply (a default system prompt, the turn's header) is not
            # the reply: the part that two other replies share
            shared = os.path.commonprefix([chat([{**m, "content": c}]) for c in ("a", "b")])
            begin = len(shared) if end.startswith(shared) else -1
        stop = len(end) if full.startswith(end) else ended(full, end, m["content"], begin)
        if begin < 0 or stop < 0:
            raise QuantkitError(f"{where}: the chat template does not write earlier turns as a prefix of later ones, "
                                "so the replies cannot be found: use a model with a standard template")
        spans.append((begin, stop))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc.input_ids[:seqlen], dtype=torch.int64)
    starts = torch.tensor([s for s, _ in enc.offset_mapping[:seqlen]])
    keep = torch.zeros(ids.numel(), dtype=torch.bool)
    for a, b in spans:
        keep |= (starts >= a) & (starts < b)
    ends = [s for s, _ in enc.offset_mapping]
    whole = len(ends) <= seqlen or ends[seqlen] >= spans[-1][1]
    return Example(ids, torch.where(keep, ids, IGNORE)), whole


def ended(full: str, end: str, content: str, begin: int) -> int:
    """Where a reply ends in the whole chat when the template writes the last reply of a chat otherwise
    than an earlier one (Qwen3's adds an empty think block before it): the reply's text and what the
    template writes after it (end: the chat up to the reply), found from begin on; -1 when not there."""
    at = end.rfind(content) if content else -1
    if at < 0 or begin < 0:
        return -1
    tail = end[at:]  # the reply and the end of its turn
    found = full.find(tail, begin)
    return found + len(tail) if found >= 0 else -1


def split(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, held out): a seeded random fraction held out, at least one example when fraction > 0."""
    if not fraction:
        return examples, []
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    n = max(1, round(fraction * len(examples)))
    if n >= len(examples):
        raise QuantkitError(f"{len(examples)} examples are too few to hold out {fraction:.0%}: pass more data, "
                            f"{option('eval_data')}, or {option('eval_fraction', 0)}")
    return [examples[i] for i in sorted(order[n:])], [examples[i] for i in sorted(order[:n])]


def sequence(n: int, seed: int, start: int, count: int) -> list[int]:
    """Positions start..start+count of the endless stream of example indices: epoch after epoch, each
    a permutation fixed by (seed, epoch)."""
    out, cache = [], {}
    for j in range(start, start + count):
        epoch = j // n
        if epoch not in cache:
            cache[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch)).tolist()
        out.append(cache[epoch][j % n])
    return out


def collate(examples: list[Example], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, labels, attention mask [b, longest], padded on the right."""
    length = max(e.ids.numel() for e in examples)
    ids = torch.full((len(examples), length), pad, dtype=torch.int64)
    labels = torch.full_like(ids, IGNORE)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        ids[i, : e.ids.numel()], labels[i, : e.ids.numel()], mask[i, : e.ids.numel()] = e.ids, e.labels, 1
    return ids, labels, mask
