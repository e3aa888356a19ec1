"""Per-layer mixed precision: rules read from a file, each a regular expression searched in a linear's
module name and what the linears it matches get: other bits, another group size, or skip (left in
float). The first rule that matches wins; a linear no rule matches keeps the run's settings.

    [{"match": "layers\\.(0|29)\\.mlp\\.down_proj", "bits": 8},
     {"match": "self_attn\\.[qk]_proj", "group_size": 64},
     {"match": "layers\\.15\\.", "skip": true}]

The same list in YAML reads the same.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import QuantkitError, untrusted

KEYS = ("match", "bits", "group_size", "skip")


@dataclass(frozen=True)
class Rule:
    match: str
    bits: int | None = None
    group_size: int | None = None
    skip: bool = False

    def matches(self, name: str) -> bool:
        return re.search(self.match, name) is not None


def exact(names) -> str:
    """A pattern matching the names given and nothing else."""
    return f"^(?:{'|'.join(re.escape(n) for n in names)})$"


def parse(entries: object, source: str) -> tuple[Rule, ...]:
    """Rules from a list of mappings, each checked; source names them in errors."""
    from .qtensor import check_bits_group, whole  # here, not above: QuantConfig's field types are read without torch

    if not isinstance(entries, list) or not entries:
        raise QuantkitError(f"{source}: rules are a non-empty list of {{match, bits, group_size, skip}} entries: "
                            'write e.g. [{"match": "down_proj", "bits": 8}]')
    rules = []
    for i, e in enumerate(entries, 1):
        where = f"{source}: rule {i}"
        if not isinstance(e, dict) or not isinstance(e.get("match"), str):
            raise QuantkitError(f"{where} is not a mapping with a match pattern: write e.g. "
                                '{"match": "down_proj", "bits": 8}')
        unknown = sorted(set(e) - set(KEYS))
        if unknown:
            raise QuantkitError(f"{where} has unknown key {unknown[0]!r}: use {', '.join(KEYS)}")
        try:
            re.compile(e["match"])
        except re.error as x:
            raise QuantkitError(f"{where}: {e['match']!r} is not a regular expression ({x})") from None
        bits, group, skip = e.get("bits"), e.get("group_size"), e.get("skip", False)
        if not isinstance(skip, bool) or any(v is not None and not whole(v) for v in (bits, group)):
            raise QuantkitError(f"{where}: bits and group_size are whole numbers and skip true or false")
        if skip == (bits is not None or group is not None):
            raise QuantkitError(f"{where} must either skip the linears it matches or give them bits or a group "
                                "size, not both or neither")
        if not skip:
            try:
                check_bits_group(bits if bits is not None else 4, group if group is not None else -1)
            except QuantkitError as x:
                raise QuantkitError(f"{where}: {x}") from None
        rules.append(Rule(e["match"], bits, group, skip))
    return tuple(rules)


def read(path: str | Path) -> tuple[Rule, ...]:
    """The rules in a JSON or YAML file."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise QuantkitError(f"{path}: no such rules file: give a JSON or YAML list of rules")
    with untrusted(path, "not a JSON or YAML rules file", 'write a list such as [{"match": "down_proj", "bits": 8}]'):
        text = path.read_text()
        entries = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    return parse(entries, str(path))


def check(rules: tuple[Rule, ...], names: list[str], source: str = "--rules") -> None:
    """Refuse a rule that decides no linear of the model: one that matches none (a typo), or whose every
    match an earlier rule takes; either would silently change nothing."""
    for i, r in enumerate(rules, 1):
        matched = [n for n in names if r.matches(n)]
        if not matched:
            raise QuantkitError(f"{source}: rule {i} ({r.match!r}) matches no linear of the model, whose names "
                                f"read like {names[0]}: fix its pattern")
        if all(any(e.matches(n) for e in rules[:i - 1]) for n in matched):
            first = next(j for j, e in enumerate(rules, 1) if e.matches(matched[0]))
            raise QuantkitError(f"{source}: rule {i} ({r.match!r}) decides no linear: rule {first} comes first for "
                                f"{matched[0]}, and earlier rules for the rest of its matches; move it up or drop it")
