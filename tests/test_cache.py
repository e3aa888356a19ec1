"""The embedded model's cache fill: made once when processes race for it, never left looking
complete by a process killed while writing."""
import multiprocessing
import os
import time
from pathlib import Path

from quantkit.modelio import fill_cache


def slow_fill(target: str, log: str, die: bool = False) -> None:
    def write(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "part").write_text("half")
        if die:
            os._exit(9)  # as kill -9 would leave it
        time.sleep(1)
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        (tmp / "config.json").write_text("{}")

    fill_cache(Path(target), write, lambda t: (t / "config.json").is_file())


def run(*args) -> multiprocessing.Process:
    p = multiprocessing.get_context("fork").Process(target=slow_fill, args=args)
    p.start()
    return p


def test_racing_processes_fill_once_and_both_get_it(tmp_path):
    target, log = tmp_path / "model", tmp_path / "log"
    procs = [run(str(target), str(log)) for _ in range(3)]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert len(log.read_text().split()) == 1  # one process wrote; the others waited and reused it
    assert (target / "config.json").is_file() and (target / "part").is_file()
    assert sorted(f.name for f in tmp_path.iterdir()) == [".model.lock", "log", "model"]


def test_a_killed_fill_leaves_nothing_that_looks_complete(tmp_path):
    target, log = tmp_path / "model", tmp_path / "log"
    p = run(str(target), str(log), True)
    p.join(30)
    assert p.exitcode == 9 and not target.exists()
    assert [f.name for f in tmp_path.glob(".model.tmp-*")] == [f".model.tmp-{p.pid}"]
    slow_fill(str(target), str(log))  # the next fill clears the dead one's temporary and completes
    assert (target / "config.json").is_file() and not list(tmp_path.glob(".model.tmp-*"))


def test_a_filled_entry_is_readable_as_the_umask_allows(tmp_path):
    """The embedded model's model.safetensors was 0600 (safetensors' writer), unreadable by the other
    users of a shared cache; the files beside it were 0644."""
    def write(tmp: Path) -> None:
        tmp.mkdir()
        os.close(os.open(tmp / "model.safetensors", os.O_WRONLY | os.O_CREAT, 0o600))
        os.close(os.open(tmp / "run", os.O_WRONLY | os.O_CREAT, 0o700))
        (tmp / "config.json").write_text("{}")

    mask = os.umask(0o027)
    try:
        fill_cache(tmp_path / "model", write, lambda t: (t / "config.json").is_file())
    finally:
        os.umask(mask)
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "model").iterdir()}
    assert modes == {"model.safetensors": 0o640, "run": 0o740, "config.json": 0o640}
