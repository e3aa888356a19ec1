"""The security promises: no pickle runs from a file we are given (torch.load only with
weights_only=True), no model code runs from a model directory (trust_remote_code off), chat
templates render only in jinja's sandbox, and names and paths read from a file never take a
write (or a read) outside the directories they belong to."""
import ast
import functools
import json
import shutil
from pathlib import Path

import jinja2
import pytest
import torch
from safetensors.torch import load_file, save_file

import quantkit
from quantkit import modelio
from quantkit.atomic import progress_path
from quantkit.exporters import shards
from quantkit.atomic import partial_path
from quantkit.pipeline import read_progress, save_progress
from quantkit.trainer.loop import Checkpoints

from .conftest import ROOT, VALID, cli, refused, stopping_saves

PRODUCT = ["quantkit", "exporters", "evals", "calibration", "trainer"]
PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
FAST = ["--seqlen", 32, "--batch-size", 2, "--rank", 4, "--warmup", 0, "--eval-fraction", 0]
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@functools.cache
def product_nodes():
    """Every AST node of the product's source, with where it is (file:line)."""
    return [(f"{f.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}", node)
            for folder in PRODUCT for f in sorted((ROOT / folder).rglob("*.py"))
            for node in ast.walk(ast.parse(f.read_text(), str(f)))]


def dotted(node):
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def calls(*names):
    """(where, call) for each call of a function whose dotted name ends with one of names."""
    return [(where, node) for where, node in product_nodes()
            if isinstance(node, ast.Call) and dotted(node.func).endswith(names)]


def keyword(call, name):
    """The value node of keyword name in call; None when it is not passed by name."""
    return next((k.value for k in call.keywords if k.arg == name), None)


def is_const(node, value):
    return isinstance(node, ast.Constant) and node.value is value


def test_torch_load_only_with_weights_only():
    """And no other way into pickle: no pickling module, no torch.load by another name, no np.load
    with allow_pickle."""
    loads = calls("torch.load")
    assert loads, "the progress files are read with torch.load: the search finds none, so it is broken"
    assert [where for where, call in loads if not is_const(keyword(call, "weights_only"), True)] == []
    assert [where for where, call in calls("np.load", "numpy.load")
            if keyword(call, "allow_pickle") is not None and not is_const(keyword(call, "allow_pickle"), False)] == []
    imports = [(where, getattr(node, "module", None), alias.name) for where, node in product_nodes()
               if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names]
    assert [where for where, module, name in imports
            if (module or name).split(".")[0] in PICKLERS or (module == "torch" and name == "load")] == []


def test_trust_remote_code_is_never_on():
    """quantkit has no --trust-remote-code: every call that takes the flag passes False, or leaves
    transformers' default, which for the architectures we accept (checked first) is False; a call
    with **kwargs must pass False itself, so nothing can slip True in."""
    loaders = calls("from_pretrained", "from_config", "load_dataset", "pipeline", "HFLM")
    assert loaders, "the search finds no loader, so it is broken"

    def may_trust(call):
        flag = keyword(call, "trust_remote_code")
        return not is_const(flag, False) and (flag is not None or any(k.arg is None for k in call.keywords))

    assert [where for where, call in loaders if may_trust(call)] == []


class Payload:
    """Unpickling this creates marker, as a booby-trapped .pt file would run its code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def booby_trap(path, marker):
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(Payload(marker), path)
    assert not marker.exists()


def test_quantize_progress_file_is_not_unpickled(tiny_dir, tmp_path, capsys, monkeypatch):
    """A .pt progress file planted beside --out: read with weights_only, refused as unreadable, and the
    run starts afresh. (With weights_only=False the unpickling creates the marker.)"""
    out, marker = tmp_path / "q", tmp_path / "pwned"
    booby_trap(progress_path(out), marker)
    code, _, err = cli(["quantize", tiny_dir, "--out", out, "--group-size", 32], capsys, monkeypatch)
    assert code == 0 and any("ignoring unreadable progress file" in line for line in err), err
    assert not marker.exists() and (out / "model.safetensors").is_file()


def test_train_checkpoint_is_not_unpickled(tiny_dir, tmp_path, capsys, monkeypatch):
    """A planted trainer checkpoint (state.pt): --resume refuses it as damaged, without running it."""
    (tmp_path / "train.txt").write_text(VALID.read_text()[:5000])
    out, marker = tmp_path / "out", tmp_path / "pwned"
    booby_trap(Checkpoints(partial_path(out)).path / "state.pt", marker)
    refused(["train", tiny_dir, "--data", tmp_path / "train.txt", "--out", out, *FAST, "--steps", 2, "--resume"],
            capsys, monkeypatch, "the checkpoint is damaged")
    assert not marker.exists()


def with_remote_code(directory, marker):
    """directory's config and tokenizer point at evil.py beside them, which creates marker when imported."""
    for name, auto_map in [("config.json", {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}),
                           ("tokenizer_config.json", {"AutoTokenizer": ["evil.EvilTokenizer", None]})]:
        cfg = json.loads((directory / name).read_text())
        (directory / name).write_text(json.dumps({**cfg, "auto_map": auto_map}))
    (directory / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    return directory


def test_remote_code_in_a_model_is_not_run(tiny_dir, tmp_path, capsys, monkeypatch):
    """A model whose config names its own code (auto_map) loads as the llama its model_type says,
    for quantize and eval, and so does its export (read by the exporters' own AutoConfig call)."""
    marker, out = tmp_path / "pwned", tmp_path / "q"
    model = with_remote_code(shutil.copytree(tiny_dir, tmp_path / "model"), marker)
    (tmp_path / "text.txt").write_text(VALID.read_text()[:3000])
    code, _, err = cli(["quantize", model, "--out", out, "--group-size", 32], capsys, monkeypatch)
    assert not marker.exists() and code == 0, err
    with_remote_code(out, marker)
    for path in (model, out):
        code, _, err = cli(["eval", path, "--data", tmp_path / "text.txt", "--ctx", 64, "--max-windows", 2],
                           capsys, monkeypatch)
        assert not marker.exists() and code == 0, err


ESCAPES = ["{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
           "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{% if c.__name__ == 'catch_warnings' %}"
           "{{ c()._module.__builtins__['open']('MARKER', 'w') }}{% endif %}{% endfor %}"]


def escaping(chat_dir, tmp_path, escape):
    """A copy of chat_dir whose chat template runs escape (checked to create the marker outside the
    sandbox), with chat data for it; (model, data, marker)."""
    marker = tmp_path / "pwned"
    template = escape.replace("MARKER", str(marker)) + "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    jinja2.Environment().from_string(template).render(messages=[])
    assert marker.exists(), "the escape does not work even unsandboxed: the test would prove nothing"
    marker.unlink()
    model = shutil.copytree(chat_dir, tmp_path / "model")
    (model / "chat_template.jinja").write_text(template)
    data = tmp_path / "data.jsonl"
    data.write_text(f"{json.dumps(CHAT)}\n" * 2)
    return model, data, marker


@pytest.mark.parametrize("escape", ESCAPES, ids=["globals", "subclasses"])
def test_chat_template_is_sandboxed(chat_dir, tmp_path, escape):
    """The trainer renders chat records through transformers' sandboxed jinja, which refuses the escape."""
    model, data, marker = escaping(chat_dir, tmp_path, escape)
    with pytest.raises(quantkit.QuantkitError, match="SecurityError"):  # the sandbox refused it
        quantkit.train(str(model), data=data, out=tmp_path / "out", steps=1, seqlen=32, batch_size=2, rank=4,
                       eval_fraction=0, progress=False)
    assert not marker.exists()


def test_chat_template_escape_is_one_error_line(chat_dir, tmp_path, capsys, monkeypatch):
    model, data, marker = escaping(chat_dir, tmp_path, ESCAPES[0])
    refused(["train", model, "--data", data, "--out", tmp_path / "out", *FAST, "--steps", 1], capsys, monkeypatch,
            "chat template")
    assert not marker.exists()


@pytest.mark.parametrize("where", ["../outside.safetensors", "sub/../../outside.safetensors", "absolute"])
def test_shard_index_outside_the_model_is_refused(tiny_dir, tmp_path, capsys, monkeypatch, where):
    """model.safetensors.index.json naming a shard outside the model directory: refused before any
    shard is opened, so nothing outside is read (without the check, the shard there is read and used)."""
    model = shutil.copytree(tiny_dir, tmp_path / "model")
    outside = shutil.copy(model / "model.safetensors", tmp_path / "outside.safetensors")
    shard = (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")  # read by the index
    names = sorted(load_file(shard))
    weight_map = {n: shard.name for n in names} | {names[0]: str(outside) if where == "absolute" else where}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    opened, real = [], modelio.safe_open
    monkeypatch.setattr(modelio, "safe_open", lambda f, *a, **kw: opened.append(f) or real(f, *a, **kw))
    refused(["quantize", model, "--out", tmp_path / "out"], capsys, monkeypatch,
            "names a shard outside the model directory")
    assert [f for f in opened if model.resolve() not in Path(f).resolve().parents] == []


def tree(root, out):
    """Every path under root but out (and what a run writing out keeps beside it while it runs),
    each file with its size and modification time."""
    return sorted((str(p.relative_to(root)), *((p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else ()))
                  for p in root.rglob("*") if out not in (p, *p.parents) and not p.name.startswith(f".{out.name}."))


@pytest.fixture
def evil_names(tiny_dir, tmp_path):
    """tiny_dir, two folders down from tmp_path, with extra tensors named as paths out of there."""
    model = shutil.copytree(tiny_dir, tmp_path / "a" / "b" / "model")
    state = load_file(model / "model.safetensors")
    for name in ["../../evil", "../../../evil", str(tmp_path / "evil"),
                 "model.embed_tokens.weight/../../../evil"]:
        state[name] = torch.ones(4)
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    return model


@pytest.mark.parametrize("args", [["quantize", "--out", "out", "--group-size", 32], ["export", "--out", "out.gguf"]])
def test_tensor_names_as_paths_are_refused_at_load(evil_names, tmp_path, capsys, monkeypatch, args):
    """The extra tensors are not the model's: the load refuses them, naming one, before anything is
    written, so nothing appears or changes outside (or at) --out. Every command that reads a model
    directory (quantize, export, eval, merge's base) goes through that load."""
    out = evil_names.parent / args[2]
    before = tree(tmp_path, out)
    code, _, err = cli([args[0], evil_names, "--out", out, *args[3:]], capsys, monkeypatch)
    assert code == 2 and "which config.json does not call for" in err[-1] and "evil" in err[-1], err
    assert not any("Traceback" in line for line in err)
    assert not out.exists() and tree(tmp_path, out) == before


def test_progress_shard_names_stay_in_the_output(tiny_dir, tmp_path, monkeypatch):
    """A progress file naming a shard '../../victim' (its digest recomputed, as anyone can): the
    resumed run must not move that file outside the output into it."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone else's file")
    out = tmp_path / "a" / "q"
    out.parent.mkdir()
    kw = dict(bits=4, group_size=32, max_shard_size="30kB", progress=False)
    real = shards.ShardWriter.add

    def dies_in_layer_1(self, name, tensor):
        if name.startswith("model.layers.1."):
            raise KeyboardInterrupt
        return real(self, name, tensor)

    monkeypatch.setattr(shards.ShardWriter, "add", dies_in_layer_1)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tiny_dir), out=out, **kw)
    monkeypatch.setattr(shards.ShardWriter, "add", real)
    state = read_progress(progress_path(out))
    assert state["writer"]["shards"]["shards"], "no shard was finished before the kill: the test would prove nothing"
    state["writer"]["shards"]["shards"][0][0] = "../../victim"  # from out's partial directory: tmp_path/victim
    save_progress(progress_path(out), state)
    quantkit.quantize(str(tiny_dir), out=out, **kw)
    assert victim.read_bytes() == b"someone else's file"


def stopped_after_layer_0(tiny_dir, out, monkeypatch, **kw) -> dict:
    """Run quantize until its first progress save, then stop it, as a kill would: the saved state."""
    from quantkit import pipeline

    real = stopping_saves(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        quantkit.quantize(str(tiny_dir), method="rtn", out=out, progress=False, **kw)
    monkeypatch.setattr(pipeline, "save_progress", real)
    return read_progress(progress_path(out))


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_a_resumed_run_writes_through_no_planted_link(tiny_dir, tmp_path, monkeypatch, fmt):
    """Whoever can write beside --out can forge its progress (the digest is recomputable, the key made of
    public facts) and plant a symbolic link where the resumed run writes: the open shard's spill, or the
    partial GGUF file. The run truncated and rewrote the file the link named, outside --out."""
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's file\n" * 100)
    out = tmp_path / "w" / ("q.gguf" if fmt == "gguf" else "q")
    out.parent.mkdir()
    kw = dict(format="gguf", gguf_type="Q8_0") if fmt == "gguf" else dict(group_size=32)
    state = stopped_after_layer_0(tiny_dir, out, monkeypatch, **kw)
    if fmt == "gguf":
        state["writer"] = {"data_start": 0, "header": 0, "done": {}}  # the CRC of no bytes is 0
        target = partial_path(out)
    else:
        written = state["writer"]["shards"]
        assert written["entries"], "no tensor in the open shard: the test would prove nothing"
        written["used"], written["crc"] = 0, 0
        target = partial_path(out) / f".spill-{len(written['shards'])}"
    save_progress(progress_path(out), state)
    target.unlink()
    target.symlink_to(victim)
    quantkit.quantize(str(tiny_dir), method="rtn", out=out, progress=False, **kw)
    assert victim.read_text() == "someone else's file\n" * 100
    assert not out.is_symlink() and quantkit.load(out).module is not None


def test_links_at_the_lock_and_partial_paths_are_not_followed(tiny_dir, tmp_path, capsys, monkeypatch):
    """A link at .NAME.lock created its target anywhere; one at .NAME.partial to a directory was a
    FileExistsError traceback (and that directory must stay as it was)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "kept.txt").write_text("kept")
    out = tmp_path / "w" / "q"
    out.parent.mkdir()
    partial_path(out).symlink_to(elsewhere, target_is_directory=True)
    code, _, err = cli(["quantize", tiny_dir, "--out", out, "--group-size", 32], capsys, monkeypatch)
    assert code == 0 and (out / "model.safetensors").is_file(), err[-3:]
    assert sorted(p.name for p in elsewhere.iterdir()) == ["kept.txt"]
    lock = out.with_name(".q2.lock")
    lock.symlink_to(elsewhere / "created")
    refused(["quantize", tiny_dir, "--out", out.with_name("q2"), "--group-size", 32], capsys, monkeypatch,
            "is a symbolic link, not quantkit's lock")
    assert not (elsewhere / "created").exists()


def test_glob_characters_in_out_touch_no_other_output(tiny_dir, tmp_path, monkeypatch):
    """--out 'w/[ab]' matched w/.a.progress.pt as a pattern, and deleted another run's progress."""
    out = tmp_path / "w" / "a"
    out.parent.mkdir()
    stopped_after_layer_0(tiny_dir, out, monkeypatch, group_size=32)
    before = sorted(p.name for p in out.parent.iterdir())
    assert ".a.progress.pt" in before
    quantkit.quantize(str(tiny_dir), method="rtn", group_size=32, out=out.with_name("[ab]"), progress=False)
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([*before, "[ab]"])


def test_an_out_replacing_a_file_of_the_model_is_refused(tiny_dir, tmp_path, capsys, monkeypatch):
    """--out MODEL/model.safetensors --overwrite wrote the GGUF over the weights it read."""
    model = shutil.copytree(tiny_dir, tmp_path / "model")
    before = (model / "model.safetensors").read_bytes()
    refused(["quantize", model, "--format", "gguf", "--gguf-type", "Q8_0", "--out", model / "model.safetensors",
             "--overwrite"], capsys, monkeypatch, "would replace model.safetensors in")
    assert (model / "model.safetensors").read_bytes() == before


def test_a_compressed_progress_file_is_not_inflated(tiny_dir, tmp_path, capsys, monkeypatch):
    """torch.load inflates a DEFLATE entry whole before the digest is looked at (a thousandfold); torch.save
    never compresses one, so such a file is ignored as unreadable without reading it."""
    import zipfile

    out = tmp_path / "q"
    plain = tmp_path / "plain.pt"
    torch.save({"digest": "x", "state": torch.zeros(10_000_000, dtype=torch.uint8)}, plain)
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(progress_path(out), "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
    assert progress_path(out).stat().st_size < 100_000
    code, _, err = cli(["quantize", tiny_dir, "--out", out, "--group-size", 32], capsys, monkeypatch)
    assert code == 0 and any("compressed entries" in line for line in err), err


def test_a_planted_report_log_link_is_not_followed(tiny_dir, tmp_path, capsys, monkeypatch):
    """report opened logs/NAME.log through a link planted there, truncating the file it named."""
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's file")
    (tmp_path / "text.txt").write_text(VALID.read_text()[:20000])
    args = ["report", tiny_dir, "--out", tmp_path / "r", "--data", tmp_path / "text.txt", "--methods", "rtn",
            "--bits", 4, "--group-size", 32, "--windows", 2, "--ctx", 64]
    code, _, err = cli(args, capsys, monkeypatch)
    assert code == 0, err[-3:]
    (tmp_path / "r" / "points" / "rtn-w4.json").unlink()  # the point runs again, into its log
    (tmp_path / "r" / "logs" / "rtn-w4.log").unlink()
    (tmp_path / "r" / "logs" / "rtn-w4.log").symlink_to(victim)
    code, _, err = cli(args, capsys, monkeypatch)
    assert code == 0, err[-3:]
    assert victim.read_text() == "someone else's file"
    assert not (tmp_path / "r" / "logs" / "rtn-w4.log").is_symlink()


def test_hostile_records_templates_and_states_are_one_error_line(tiny_dir, chat_dir, tmp_path, capsys, monkeypatch):
    """Each was a traceback: JSON nested past Python's recursion limit, a chat template that recurses, a
    report state of the wrong shape, a trainer checkpoint without its key."""
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    refused(["eval", chat_dir, "--data", deep, "--ctx", 32, "--max-windows", 1], capsys, monkeypatch,
            "nested too deeply")
    model = shutil.copytree(chat_dir, tmp_path / "recursing")
    (model / "chat_template.jinja").write_text("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}")
    (tmp_path / "one.jsonl").write_text(json.dumps(CHAT) + "\n")
    refused(["eval", model, "--data", tmp_path / "one.jsonl", "--ctx", 32, "--max-windows", 1], capsys, monkeypatch,
            "chat template fails (RecursionError")
    (tmp_path / "text.txt").write_text(VALID.read_text()[:20000])
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "settings.json").write_text("[1, 2]")
    refused(["report", tiny_dir, "--out", tmp_path / "r", "--data", tmp_path / "text.txt", "--methods", "rtn",
             "--windows", 2, "--ctx", 64], capsys, monkeypatch, "settings.json is damaged")
    out = tmp_path / "out"
    checkpoint = Checkpoints(partial_path(out)).path
    checkpoint.mkdir(parents=True)
    save_progress(checkpoint / "state.pt", {"step": 1})
    save_file({}, checkpoint / "adapter_model.safetensors")
    refused(["train", tiny_dir, "--data", tmp_path / "text.txt", "--out", out, *FAST, "--steps", 2, "--resume"],
            capsys, monkeypatch, "its state lacks bad, best, best_loss")


def test_a_wikitext_folder_here_is_not_taken_for_the_hubs(tmp_path, monkeypatch):
    """datasets reads ./wikitext before the hub's wikitext: the default text silently became that folder's."""
    from quantkit import calibration

    monkeypatch.chdir(tmp_path)
    (tmp_path / "wikitext").mkdir()
    with pytest.raises(quantkit.QuantkitError, match="./wikitext exists"):
        calibration.load_text(None)
