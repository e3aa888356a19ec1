"""Chat and instruction records in JSON: what the trainer trains on and what calibration and
evaluation text can be rendered from, read one way. A .jsonl (.ndjson) file holds an object per
line; a .json file a list of them (or an object per line)."""
from __future__ import annotations

import json
from pathlib import Path

import jinja2

from quantkit.errors import QuantkitError, one_line

SUFFIXES = (".jsonl", ".ndjson", ".json")


class Rendered(str):
    """Text a chat template wrote: the special tokens' strings in it are the template's markers of the
    turns, read as those tokens (in other text they are text, as llama.cpp reads them)."""


def is_records(p: Path) -> bool:
    return p.suffix.lower() in SUFFIXES


def parse(p: Path, text: str) -> list[tuple[str, dict]]:
    """Each record with where it is (for messages): the file's lines, or the items of a JSON list."""
    text = text.removeprefix("\ufeff")  # a byte-order mark, as Windows editors write
    lines = text.split("\n")  # not splitlines(): JSON strings may hold U+2028 and the like unescaped
    whole = None
    if p.suffix.lower() == ".json" and text.lstrip().startswith(("[", "{")):
        try:
            whole = json.loads(text)
        except RecursionError:
            raise QuantkitError(f"{p}: nested too deeply to be records: pass a JSON list of flat records") from None
        except ValueError as e:  # JSONDecodeError, or an integer of more digits than Python reads
            if text.lstrip().startswith("["):
                raise QuantkitError(f"{p}: not valid JSON ({e}): pass a JSON list or JSON lines") from None
            whole = None  # an object per line
        if isinstance(whole, dict):
            raise QuantkitError(f"{p}: holds one JSON object (keys: {', '.join(sorted(whole)[:5]) or 'none'}), and a .json "
                                "file holds a list of records: put the records in a list, or one per line in a .jsonl file")
        if whole is not None:
            lines = [json.dumps(r) for r in whole]
    out, unit = [], "line" if whole is None else "item"
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p}, {unit} {n}"
        try:
            record = json.loads(line)
        except RecursionError:
            raise QuantkitError(f"{where}: nested too deeply to be a record: write one flat JSON object per line") from None
        except json.JSONDecodeError as e:
            raise QuantkitError(f"{where}: not valid JSON ({e.msg}): write one JSON object per line") from None
        except ValueError as e:  # an integer of more digits than Python reads
            raise QuantkitError(f"{where}: not valid JSON here ({e}): write one JSON object per line") from None
        if not isinstance(record, dict):
            raise QuantkitError(f"{where}: a JSON object per line is needed, not {type(record).__name__}")
        try:  # JSON's \ud800 escapes give half a character, which no tokenizer takes
            json.dumps(record, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise QuantkitError(f"{where}: holds half of a character (an unpaired surrogate escape such as \\ud800, "
                                "from text cut in the middle of an emoji): fix or drop the record") from None
        out.append((where, record))
    if not out:
        raise QuantkitError(f"{p}: holds no records: write one JSON object per line (a .json file: a list of them)")
    return out


def messages_of(record: dict, where: str, reply: bool = True) -> list[dict]:
    """A record's chat: `messages` (role/content), or instruction [+ context or input] + response or
    output (Dolly, Alpaca), or prompt + completion. reply: whether it must have an assistant turn (the
    trainer's: something to learn)."""
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
            raise QuantkitError(f"{where}: messages must be a list of {{\"role\", \"content\"}} objects, each with "
                                "text in both (content as a string, not a list of parts)")
        if reply and not any(m["role"] == "assistant" for m in msgs):
            raise QuantkitError(f"{where}: the chat has no assistant turn, so nothing to learn: add the reply "
                                "as {\"role\": \"assistant\", \"content\": ...}")
        return msgs

    def field(*keys: str) -> str | None:  # the first of keys that the record has: its text
        key = next((k for k in keys if k in record), None)
        if key is not None and not isinstance(record[key], str):
            kind = "null" if record[key] is None else type(record[key]).__name__
            raise QuantkitError(f"{where}: the record's {key} is {kind}, where text belongs")
        return None if key is None else record[key]

    prompt, answer = field("instruction", "prompt"), field("response", "output", "completion")
    if prompt is None or answer is None:
        raise QuantkitError(f"{where}: a record needs messages, instruction and response (or output), or prompt "
                            f"and completion; this one has {', '.join(sorted(record)) or 'no fields'}")
    context = record.get("context") or record.get("input") or ""
    if not isinstance(context, str):
        raise QuantkitError(f"{where}: the record's context (or input) is {type(context).__name__}, where text belongs")
    user = f"{prompt}\n\n{context}" if context else prompt
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def check_template(p: Path, tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise QuantkitError(f"{p}: chat records need the tokenizer's chat template and this model's tokenizer has "
                            "none: use a model with one (an instruct model), or pass plain text")


def chat_text(turns: list[dict], tokenizer, where: str, **kw) -> str:
    """The turns as the model's chat template writes them, on a fixed date for templates that print
    today's (Llama 3.x): the same records give the same text, and a resumed run the same windows, any day."""
    try:  # transformers renders in jinja's sandbox: an escape attempt is a SecurityError, a TemplateError
        return tokenizer.apply_chat_template(turns, tokenize=False, **{"date_string": DATE, **kw})
    except (jinja2.TemplateError, RecursionError, MemoryError, OverflowError) as e:  # the last three: its own work
        raise QuantkitError(f"{where}: the model's chat template fails ({type(e).__name__}: {one_line(e)}): "
                            "fix the template in its tokenizer files, or pass plain text") from None


def rendered(p: Path, text: str, tokenizer) -> str:
    """Every record of the file as its chat template writes it, one after another: text to calibrate on
    that looks like what the model will be given, not like JSON; records of plain text alone, that text."""
    parsed = parse(p, text)
    joined = plain(parsed)
    if joined is not None:
        return joined
    chats = [(where, messages_of(record, where, reply=False)) for where, record in parsed]
    check_template(p, tokenizer)  # after the records: a file that is not chats is named as such first
    return Rendered("".join(chat_text(turns, tokenizer, where) for where, turns in chats))


def plain(parsed: list[tuple[str, dict]]) -> str | None:
    """The text of records that hold plain text alone ({"text": ...}, as pile-val and C4 are shipped),
    joined as the GPTQ reference joins C4's; None for chat or instruction records."""
    if all(isinstance(r.get("text"), str) and not r.keys() & CHAT_FIELDS for _, r in parsed):
        return "\n\n".join(r["text"] for _, r in parsed)
    return None


CHAT_FIELDS = {"messages", "instruction", "prompt", "response", "output", "completion"}
DATE = "26 Jul 2024"  # Llama 3.1's templates' own fallback when no date is given
