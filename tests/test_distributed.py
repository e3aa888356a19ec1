"""torchrun: two CPU processes (gloo) write the bytes one process writes; a process that dies stops the
job, and the same command resumes it."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit.errors import QuantkitError

from .conftest import VALID, measurement_stopped_in_layer_1

ROOT = Path(__file__).resolve().parents[1]


def torchrun(*args, script=("-m", "quantkit"), command="quantize") -> subprocess.CompletedProcess:
    with socket.socket() as s:  # a free port: jobs of parallel test runs must not meet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # torchrun polls its workers every second here, so the survivor has time to report before it is stopped
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "--monitor-interval", "1",
           *script, *([command] if command else []), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def one_process(*args, command="quantize") -> subprocess.CompletedProcess:
    """One thread, as torchrun gives each of its processes: float32 matmuls round differently with the
    number of threads (a GPTQ run with 2 threads differs from one with 1 in 2 of layer 0's down_proj
    scales), while splitting the work across processes changes nothing."""
    return subprocess.run([sys.executable, "-m", "quantkit", command, *map(str, args)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def refused_while_locked(held: Path, *args, command: str = "quantize") -> list[str]:
    """The error lines of a torchrun job run while another run holds held's lock: one from each process."""
    from quantkit import atomic

    _, lock = atomic.lock(held, "out")
    try:
        job = torchrun(*args, command=command)
    finally:
        lock.close()
    assert job.returncode != 0
    errors = [line for line in job.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2, job.stderr[-3000:]
    return errors


def files(directory: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(directory.iterdir())}


@pytest.mark.parametrize("args", [
    ["--method", "gptq", "--group-size", 32, "--act-order"],
    ["--method", "rtn", "--imatrix", "--format", "gguf", "--gguf-type", "Q4_0"],
    ["--method", "gptq", "--format", "exl2", "--bits", "4.0"],
    ["--method", "gptq", "--group-size", 32, "--rules", "RULES"],
    ["--method", "gptq", "--target-bpw", "3.6"],
    ["--method", "awq", "--bits", "3", "--group-size", 32],
    ["--method", "awq", "--group-size", 32, "--awq-loss", "output"],
], ids=["gptq", "gguf-imatrix", "exl2-measured", "gptq-rules", "gptq-target", "awq-descent", "awq-output"])
def test_two_processes_write_what_one_writes(tiny_dir, tmp_path, args):
    """24 windows in 3 batches: rank 0 calibrates on two, rank 1 on one; the Hessians are summed and
    each rank quantizes every other linear (a linear the rules skip travels as nothing). The files
    equal a single process's, byte for byte. AWQ takes 40 windows of 128 in 5 batches: with the descent
    (the default) its attention loss then runs on the first 2 batches, one on each process, and its MLP
    loss on every third token of all 5 (every other would take the same positions of every window),
    every process searching those scales together; the output loss's searches (all of them with
    --awq-loss output) and each linear's clipping are shared out among the processes."""
    if "RULES" in args:
        rules = tmp_path.with_name(f"{tmp_path.name}-rules.json")
        rules.write_text(json.dumps([{"match": r"layers\.0\.mlp\.down_proj", "bits": 8},
                                     {"match": r"layers\.1\.self_attn\.o_proj", "skip": True}]))
        args = [rules if a == "RULES" else a for a in args]
    windows = [40, 128] if "awq" in args else [24, 64]
    common = [tiny_dir, *args, "--calib-data", VALID, "--calib-samples", windows[0], "--calib-seqlen", windows[1]]
    suffix = ".gguf" if "gguf" in args else ""
    # the loss's gradients and each block's error measured on each process's batches, the sums gathered
    measured = "exl2" in args or "--target-bpw" in args

    def out(name: str) -> list:
        return ["--out", tmp_path / f"{name}{suffix}", *(["--measurement", tmp_path / f"{name}.json"] if measured else [])]

    single = one_process(*common, *out("one"))
    assert single.returncode == 0, single.stderr[-3000:]
    job = torchrun(*common, *out("two"))
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stdout.count("exported to") == 1  # rank 0 reports
    if suffix:
        assert (tmp_path / "two.gguf").read_bytes() == (tmp_path / "one.gguf").read_bytes()
    else:
        assert files(tmp_path / "two") == files(tmp_path / "one")
    made = [f"one{suffix}", f"two{suffix}", *(["one.json", "two.json"] if measured else [])]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(made)
    if measured:
        assert (json.loads((tmp_path / "two.json").read_text())["units"]
                == json.loads((tmp_path / "one.json").read_text())["units"])


def test_a_process_that_dies_stops_the_job_and_the_same_command_resumes(tiny_dir, tmp_path):
    args = ("--method", "gptq", "--group-size", 32, "--calib-data", VALID, "--calib-samples", 24,
            "--calib-seqlen", 64, "--out", tmp_path / "q")
    job = torchrun(tiny_dir, *args, script=(str(ROOT / "tests" / "torchrun_dies.py"),))
    assert job.returncode != 0
    errors = [line for line in job.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "another process of this torchrun job stopped" in errors[0], job.stderr[-3000:]
    assert not (tmp_path / "q").exists()
    assert sorted(p.name for p in tmp_path.glob(".q.progress-*.pt")) == [".q.progress-0.pt", ".q.progress-1.pt"]
    job = torchrun(tiny_dir, *args)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "resuming after layer 1/" in job.stderr and job.stderr.count("resuming") == 1  # one process says so
    assert not list(tmp_path.glob(".q*"))
    whole = one_process(tiny_dir, *args[:-1], tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert files(tmp_path / "q") == files(tmp_path / "whole")


@pytest.mark.parametrize("killed", ["0", "1"], ids=["writer", "other"])
def test_a_process_killed_between_the_saves_of_a_layer_resumes(tiny_dir, tmp_path, monkeypatch, killed):
    """A job killed after one process had replaced its saved progress and before another had (a kill of
    the whole job lands there as often as a save takes) started afresh without a word: each process
    now writes its state whole before any replaces its last one, and a process behind takes its own
    (the writer's names the partial output as it was then)."""
    monkeypatch.setenv("KILLED", killed)
    args = ("--method", "gptq", "--group-size", 32, "--calib-data", VALID, "--calib-samples", 24,
            "--calib-seqlen", 64, "--out", tmp_path / "q")
    job = torchrun(tiny_dir, *args, script=(str(ROOT / "tests" / "torchrun_dies_saving.py"),))
    assert job.returncode != 0
    job = torchrun(tiny_dir, *args)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "resuming after layer 1/" in job.stderr, job.stderr[-3000:]
    assert not list(tmp_path.glob(".q*"))
    whole = one_process(tiny_dir, *args[:-1], tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert files(tmp_path / "q") == files(tmp_path / "whole")


def test_a_fault_in_the_input_one_process_finds_leaves_nothing(tiny_dir, tmp_path):
    """Rank 1 quantizes k_proj, whose values no float16 scale holds: it refused it, and rank 0 called the
    job resumable and kept every process's progress, so the same command resumed into the same fault,
    forever. The process that finds a fault removes its progress, and the job keeps nothing."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = shutil.copytree(tiny_dir, tmp_path / "model")
    weights = load_file(model / "model.safetensors")
    weights["model.layers.1.self_attn.k_proj.weight"][0, 0] = 1e9
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    job = torchrun(model, "--method", "rtn", "--group-size", 32, "--out", tmp_path / "q")
    assert job.returncode != 0
    errors = [line for line in job.stderr.splitlines() if line.startswith("error: ")]
    assert any("model.layers.1.self_attn.k_proj holds values up to 1e+09" in e for e in errors), job.stderr[-3000:]
    assert not [e for e in errors if "resume" in e], errors
    assert any("another process of this torchrun job stopped" in e and "nothing was kept" in e for e in errors), errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_pipelines_own_process_group(tiny_dir, tmp_path):
    """A pipeline that made its own process group and called quantize or train on rank 0 alone waited
    forever (30 minutes, then a timeout) for the other ranks to join its collectives; alone=True works in
    that one process. Called on every rank, quantize shares the work over the caller's group, and writes
    what the one process wrote (as test_two_processes_write_what_one_writes checks under quantize's own
    group)."""
    job = torchrun(tiny_dir, VALID, tmp_path, script=(str(ROOT / "tests" / "torchrun_pipeline.py"),), command=None)
    assert job.returncode == 0, job.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "alone", "every"]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert files(tmp_path / "every") == files(tmp_path / "alone")


def test_a_process_working_alone_ignores_its_environment_and_joins_again_after(monkeypatch):
    """alone=True refused a WORLD_SIZE its pipeline set for its own launcher; joined(False) ends with
    its block, an error included, so the command line's rank checks after it see the job again."""
    import torch
    from quantkit import distributed

    monkeypatch.setenv("WORLD_SIZE", "several")
    with pytest.raises(ValueError), distributed.joined(False):
        distributed.init(torch.device("cpu"))  # nothing to join, nothing read
        assert distributed.world() == 1 and not distributed.JOINS.get()
        raise ValueError
    assert distributed.JOINS.get()
    with pytest.raises(QuantkitError, match="WORLD_SIZE='several'"):
        distributed.init(torch.device("cpu"))


def test_a_numbered_gpu_under_torchrun_is_refused(monkeypatch):
    """--device cuda:1 under torchrun put every process on GPU 1, where NCCL fails at the first sum,
    said as a peer that stopped."""
    import torch
    from quantkit import distributed

    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(QuantkitError, match=r"^device='cuda:1' under torchrun: each process takes the GPU of its "
                                            r"LOCAL_RANK: pass device='cuda'"):
        distributed.init(torch.device("cuda", 1))
    assert distributed.world() == 1  # refused before joining


def test_awq_with_fewer_batches_than_processes_is_refused_before_the_work(tiny_dir, tmp_path, monkeypatch):
    """A process without a calibration batch has no statistics for AWQ's searches (it failed with an
    IndexError traceback while the others waited): refused on every process, before any layer."""
    import quantkit
    from quantkit import QuantkitError, distributed

    monkeypatch.setattr(distributed, "world", lambda: 2)
    monkeypatch.setattr("quantkit.api.quantize_layers", lambda *a, **kw: pytest.fail("quantized"))
    with pytest.raises(QuantkitError, match=r"in each of its 2 processes, and calib_samples=4 gives 1: pass "
                                            "calib_samples=16 or more"):
        quantkit.quantize(str(tiny_dir), method="awq", group_size=32, calib_data=VALID, calib_samples=4,
                          calib_seqlen=64, out=tmp_path / "q", progress=False)


@pytest.mark.parametrize("held", ["q", "m.json"], ids=["output", "measurement"])
def test_a_job_refused_its_output_stops_every_process_before_the_work(tiny_dir, tmp_path, held):
    """Another job writes the output (or the measurement file): only rank 0 takes its lock, and every
    process stops there with an error of input, before any layer (the others went on to wait for
    rank 0, then reported a stopped process and a resumable run); the other job's progress stays."""
    theirs = tmp_path / ".q.progress-1.pt"
    theirs.write_bytes(b"the other job's progress")
    measure = ["--target-bpw", 3.6, "--measurement", tmp_path / held] if held == "m.json" else []
    errors = refused_while_locked(tmp_path / held, tiny_dir, "--method", "gptq", *(measure or ["--group-size", 32]),
                                  "--calib-data", VALID, "--calib-samples", 8, "--calib-seqlen", 64, "--out", tmp_path / "q")
    assert any(f"{tmp_path / held} is being written by another quantkit process" in e for e in errors), errors
    assert any(f"the first process of this torchrun job could not {'open' if held == 'q' else 'lock'} "
               f"{tmp_path / held}" in e for e in errors), errors
    assert theirs.read_bytes() == b"the other job's progress"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([theirs.name, f".{held}.lock"])


def test_a_full_disk_in_a_process_that_does_not_write_the_output_is_one_line(tiny_dir, tmp_path, monkeypatch):
    """Under torchrun the other processes save only their progress, beside the output: a full disk there gave
    their raw OSError traceback where rank 0 gave one line. Rank 1 is played here in one process."""
    import errno

    import quantkit
    from quantkit import distributed, pipeline
    from quantkit.errors import ResumableError

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(distributed, "rank", lambda: 1)
    monkeypatch.setattr(pipeline, "save_progress", full)
    with pytest.raises(ResumableError, match=f"out of disk space writing {tmp_path / 'q'}: this process's progress did "
                                             "not fit, .* free some space and run the same command again"):
        quantkit.quantize(str(tiny_dir), method="gptq", group_size=32, calib_data=VALID, calib_samples=4,
                          calib_seqlen=64, out=tmp_path / "q", progress=False)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("command,args", [("export", ["M", "--out", "OUT"]), ("eval", ["M", "--max-windows", 1]),
                                          ("merge", ["M", "--out", "OUT"]), ("lm-eval", ["M", "--tasks", "dolly_mc"]),
                                          ("report", ["M", "--out", "OUT", "--data", VALID])])
def test_commands_of_one_process_are_refused_under_torchrun(tiny_dir, tmp_path, command, args):
    """Every process ran the whole command: two exports raced for one file and called it a stopped job to resume,
    lm-eval's second process died in a traceback, eval printed each result twice."""
    args = [tiny_dir if a == "M" else tmp_path / "out" if a == "OUT" else a for a in args]
    job = torchrun(*args, command=command)
    errors = [line for line in job.stderr.splitlines() if line.startswith("error: ")]
    workers = job.stderr.split("failed (exitcode")[0]  # then torchrun's own traceback, which it always prints
    assert job.returncode != 0 and "Traceback" not in workers, workers[-3000:]
    assert len(errors) == 2 and all(f"quantkit {command} runs in one process" in e for e in errors), job.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("env,said", [
    ({}, "WORLD_SIZE=2 is set, but not RANK, MASTER_ADDR, MASTER_PORT"),
    ({"RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "RANK='2' is not a process of a job of"),
    ({"RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"}, "MASTER_PORT='99999' is not a port"),
    # the rendezvous retried the name for its whole timeout (300 s) before failing
    ({"RANK": "0", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29500"},
     "MASTER_ADDR='no-such-host.invalid' does not resolve"),
])
def test_world_size_without_torchrun_is_refused(tiny_dir, tmp_path, capsys, monkeypatch, env, said):
    """A process that inherited WORLD_SIZE from a torchrun or SLURM job printed torch's env:// traceback; a
    rank outside the job waited for peers, a bad port was called another process stopped, to resume."""
    from .conftest import cli

    for name, value in {"WORLD_SIZE": "2", **env}.items():
        monkeypatch.setenv(name, value)
    code, _, err = cli(["quantize", tiny_dir, "--out", tmp_path / "q"], capsys, monkeypatch)
    assert code == 2 and err[-1].startswith(f"error: {said}"), err
    assert not (tmp_path / "q").exists()
    # the commands of one process told such a process to run without torchrun, and refused their --help
    code, _, err = cli(["eval", tiny_dir, "--max-windows", 1], capsys, monkeypatch)
    assert code == 2 and err[-1].startswith(f"error: {said}"), err
    assert cli(["eval", "--help"], capsys, monkeypatch)[0] == 0


def test_a_process_whose_peers_never_join_says_so_and_exits(tiny_dir, tmp_path):
    """With torchrun's variables inherited but no other process, it waited silently in the rendezvous for
    30 minutes, SIGTERM and Ctrl-C held off until then."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    run = ("import sys, quantkit.distributed as d; d.JOIN_S = 2; from quantkit.command import main; "
           f"sys.argv = ['quantkit', 'quantize', {str(tiny_dir)!r}, '--out', {str(tmp_path / 'q')!r}]; main()")
    r = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and r.stderr.splitlines()[-1].startswith(
        f"error: the other processes of this job (WORLD_SIZE=2) did not join at 127.0.0.1:{port} within 2 s"), r.stderr
    assert not (tmp_path / "q").exists()


def test_an_eval_text_only_the_first_process_reads_is_checked_in_every_process(tiny_dir, tmp_path):
    """A missing --eval-data (or one too short) stopped rank 0 alone, and rank 1 then called it a stopped job
    to resume."""
    job = torchrun(tiny_dir, "--method", "gptq", "--group-size", 32, "--calib-data", VALID, "--calib-samples", 16,
                   "--calib-seqlen", 64, "--eval-data", tmp_path / "none.txt", "--out", tmp_path / "q")
    errors = [line for line in job.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and all("none.txt: no such file" in e for e in errors), job.stderr[-3000:]
    assert "resume" not in job.stderr and not (tmp_path / "q").exists()
    # a fault the first process alone meets in scoring it: the other says so
    (tmp_path / "short.txt").write_text("too short for a window")
    job = torchrun(tiny_dir, "--method", "gptq", "--group-size", 32, "--calib-data", VALID, "--calib-samples", 16,
                   "--calib-seqlen", 64, "--eval-data", tmp_path / "short.txt", "--ctx", 64, "--out", tmp_path / "q")
    errors = [line for line in job.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and any("the first process of this torchrun job could not score the model" in e
                                    for e in errors), job.stderr[-3000:]
    assert "resume" not in job.stderr and not (tmp_path / "q").exists()


def test_a_job_refuses_a_single_process_measurements_layers(tiny_dir, tmp_path):
    """A measurement stopped in layer 1 in one process, then run by a torchrun job into the same file:
    refused, its progress kept. The job's first process looked at its own name
    (.m.json.progress-measurement-0.pt) alone, measured afresh, and swept the other away."""
    calib = dict(calib_data=VALID, calib_samples=16, calib_seqlen=64)
    measurement_stopped_in_layer_1(tiny_dir, tmp_path / "q", method="gptq", format="exl2", exl2=4.0,
                                   measurement=str(tmp_path / "m.json"), **calib)
    progress = tmp_path / ".m.json.progress-measurement.pt"
    kept = progress.read_bytes()
    job = torchrun(tiny_dir, "--method", "gptq", "--format", "exl2", "--bits", "4.0", "--measurement",
                   tmp_path / "m.json", "--out", tmp_path / "q2", *[a for k, v in calib.items()
                                                                    for a in (f"--{k.replace('_', '-')}", v)])
    assert job.returncode != 0, job.stderr[-3000:]
    assert f"error: {progress} holds 1 of 2 layers of another run measuring into" in job.stderr, job.stderr[-3000:]
    assert progress.read_bytes() == kept and not (tmp_path / "m.json").exists()
