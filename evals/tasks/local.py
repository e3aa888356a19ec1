"""Datasets of quantkit's local lm-eval tasks, read from data_dir (task metadata)."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import datasets
from lm_eval.tasks.wikitext.preprocess_wikitext import process_results as wikitext_results
from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

from quantkit.errors import QuantkitError

__all__ = ["dolly", "dolly_prompt", "wikitext", "wikitext_detokenizer", "wikitext_results"]

TITLE = re.compile(r"^ = [^=].* = $")  # an article's title line; sections are " = = ... = = "
CHOICES, CLIP = 4, 200


def wikitext(data_dir: str, **_) -> dict[str, datasets.Dataset]:
    """The WikiText-2 raw test split as pages, one an article (as EleutherAI/wikitext_document_level)."""
    lines = (Path(data_dir) / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8").splitlines(keepends=True)
    pages: list[str] = []
    for line in lines:
        if TITLE.match(line.rstrip("\n")) or not pages:
            pages.append("")
        pages[-1] += line
    return {"test": datasets.Dataset.from_dict({"page": pages})}


def clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= CLIP else text[:CLIP].rsplit(" ", 1)[0]


def dolly(data_dir: str, **_) -> dict[str, datasets.Dataset]:
    path = Path(data_dir) / "dolly" / "dolly-15k-head.jsonl"
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    clipped = [clip(r["response"]) for r in records]
    by_category: dict[str, set[str]] = {}
    for r, c in zip(records, clipped):
        by_category.setdefault(r["category"], set()).add(c)
    few = {c: len(answers) for c, answers in by_category.items() if len(answers) < CHOICES}
    if few:  # a question's wrong choices are other answers of its category
        category, n = next(iter(few.items()))
        raise QuantkitError(f"{path}: category {category!r} has {n} different responses, and each question takes its "
                            f"{CHOICES} choices from its category: use a larger Dolly file")
    docs = []
    for i, (r, answer) in enumerate(zip(records, clipped)):
        rng = random.Random(i)
        others = sorted(by_category[r["category"]] - {answer})
        choices = [answer, *rng.sample(others, CHOICES - 1)]
        rng.shuffle(choices)
        docs.append({"instruction": r["instruction"], "context": r["context"], "category": r["category"],
                     "choices": choices, "gold": choices.index(answer)})
    return {"test": datasets.Dataset.from_list(docs)}


def dolly_prompt(doc: dict) -> str:
    context = f"Context: {doc['context'].strip()}\n" if doc["context"].strip() else ""
    return f"Instruction: {doc['instruction'].strip()}\n{context}Response:"
