"""Every row of the bad-input catalogue (tests/catalogue.py) through the command line: one line on
stderr starting `error:` with the row's words, exit status 2, no traceback, nothing left in {tmp}
but what was there."""
import shutil

import pytest

from .catalogue import CATALOGUE
from .conftest import TEST, cli


@pytest.mark.parametrize("name", CATALOGUE)
def test_bad_input(name, tiny_dir, capsys, monkeypatch, tmp_path):
    bad = CATALOGUE[name]
    model = shutil.copytree(tiny_dir, tmp_path / "model")
    if bad.damage:
        bad.damage(model)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 24)
    (tmp / "empty.txt").write_text("")
    text = tmp_path / "text.txt"
    text.write_text(TEST.read_text()[:3000])
    before = sorted(tmp.iterdir())
    args = bad.args.format(model=model, text=text, tmp=tmp).split()
    code, _, err = cli(args, capsys, monkeypatch)
    assert code == 2 and err and err[-1].startswith("error: ") and bad.match in err[-1], err[-3:]
    assert [line for line in err if line.startswith("error")] == err[-1:], err
    assert not any("Traceback" in line for line in err)
    assert sorted(tmp.iterdir()) == before
