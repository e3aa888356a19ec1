"""quantkit report: the sweep's table, JSON and plots, a failed point recorded, and a resumed run."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from .conftest import DATA, TEST, VALID, cli, make_tiny


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """TEST's first 200,000 characters, where every window scored here lies: each point's process reads
    its text whole."""
    head = TEST.read_text(encoding="utf-8")[:200_000]
    path = tmp_path_factory.mktemp("text") / TEST.name
    path.write_text(head[: head.rindex("\n") + 1], encoding="utf-8")
    return path


def both(args, capsys, monkeypatch) -> tuple[int, str]:
    """The exit status, and what the command printed: its progress (stderr), then its result (stdout)."""
    code, out, err = cli(args, capsys, monkeypatch)
    return code, "\n".join([*err, out])


def test_sweep_resume_and_refusal(tiny_dir, tmp_path, capsys, monkeypatch, text):
    out = tmp_path / "report"
    common = ["report", tiny_dir, "--out", out, "--data", text, "--calib-data", VALID, "--calib-samples", 4,
              "--methods", "rtn,nf4,gguf,exl2", "--bits", "4", "--gguf-types", "Q8_0", "--exl2-bits", "4.0,9",
              "--group-size", 32,
              "--tasks", "dolly_mc", "--lm-eval-limit", 4, "--ctx", 128]
    args = [*common, "--windows", 3]
    code, printed = both(args, capsys, monkeypatch)
    r = json.loads((out / "report.json").read_text())
    by_name = {p["name"]: p for p in r["points"]}
    assert code == 1 and list(by_name) == ["rtn-w4", "nf4", "gguf-Q8_0", "exl2-4", "exl2-9"]
    # a point that fails on the model (EXL2 reaches 8.19 bits on these linears), not on the options
    assert by_name["exl2-9"]["status"] == "failed" and "outside what EXL2 reaches" in by_name["exl2-9"]["error"]
    assert "failed: exl2-9" in printed and "base: 100%" in printed  # the base's windows scored with a bar (none)
    ok = [p for p in r["points"] if p["status"] == "ok"]
    assert len(ok) == 4 and all(p["bytes"] > 0 and p["peak_rss"] > 2**20 and p["quantize_s"] > 0 for p in ok)
    assert by_name["gguf-Q8_0"]["bpw_linear"] == pytest.approx(8.5)  # 34 bytes per block of 32 weights
    assert 4.5 < by_name["rtn-w4"]["bpw_linear"] < 5.5  # 4-bit codes, fp16 scale and 4-bit zero per 32, g_idx
    assert 3.5 < by_name["exl2-4"]["bpw_linear"] <= 4.0  # the target, counted as the file holds it
    assert by_name["gguf-Q8_0"]["kld_mean"] < by_name["rtn-w4"]["kld_mean"]
    assert all(p["bpw"] > 0 and 0 <= p["same_top"] <= 1 and 0 <= p["lm_eval"]["dolly_mc"]["acc"] <= 1 for p in ok)
    md = (out / "report.md").read_text()
    assert "| dolly_mc:acc | dolly_mc:acc_norm |" in md
    base = r["base"]["lm_eval"]["dolly_mc"]  # the float model's scores head the table, with standard errors
    assert "| base (float) |" in md and f"| {base['acc']:.4f} ± {base['acc_stderr']:.4f} |" in md
    rtn = by_name["rtn-w4"]["lm_eval"]["dolly_mc"]
    assert f"| {rtn['acc_norm']:.4f} ± {rtn['acc_norm_stderr']:.4f} |" in md
    assert all(f"| {name} |" in md for name in by_name) and "failed: error: --exl2-bits 9 is outside" in md
    for png in ("perplexity.png", "kld.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "exports").exists()  # exports measured, then dropped

    stamps = {p: (out / "points" / f"{p}.json").stat().st_mtime_ns for p in by_name}
    code, printed = both(args, capsys, monkeypatch)  # again: only the failed point runs
    assert code == 1 and "[5/5] exl2-9" in printed and "rtn-w4" not in printed
    assert all((out / "points" / f"{p}.json").stat().st_mtime_ns == stamps[p] for p in ("rtn-w4", "nf4", "gguf-Q8_0", "exl2-4"))

    code, _, err = cli([*common, "--windows", 2], capsys, monkeypatch)
    assert code == 2 and err[-1].startswith(f"error: {out} holds a report of other settings (--windows 2 here, "
                                            "--windows 3 in the report)")

    # another sweep with the same settings: its points join the report's, none is dropped from it
    code, printed = both(["report", tiny_dir, "--out", out, "--data", text, "--calib-data", VALID, "--calib-samples",
                            4, "--methods", "rtn", "--bits", "4,8,8", "--group-size", 32, "--tasks", "dolly_mc",
                            "--lm-eval-limit", 4, "--ctx", 128, "--windows", 3], capsys, monkeypatch)
    names = [p["name"] for p in json.loads((out / "report.json").read_text())["points"]]
    assert names == ["rtn-w4", "rtn-w8", "exl2-4", "exl2-9", "gguf-Q8_0", "nf4"]  # the sweep's, then earlier ones
    assert "[2/2] rtn-w8" in printed and "also in the report, from earlier runs" in printed


def test_a_point_whose_lm_eval_fails_keeps_its_figures(tiny_dir, tmp_path, capsys, monkeypatch, text):
    """lm-eval failing in a point took the point's size, perplexity and divergence with it (recorded as failed,
    measured for nothing); now they stand, the table and the exit status name the missing scores, and the same
    command runs the point again. The fault is planted in the point's own process by a sitecustomize."""
    planted = tmp_path / "site"
    planted.mkdir()
    (planted / "sitecustomize.py").write_text(
        "import quantkit.api\n"
        "def broken(*args, **kwargs):\n"
        "    raise RuntimeError('the harness broke\\nits traceback')\n"
        "quantkit.api.lm_eval = broken\n")
    out = tmp_path / "report"
    args = ["report", tiny_dir, "--out", out, "--data", text, "--methods", "rtn", "--bits", "4", "--group-size", 32,
            "--windows", 1, "--ctx", 64, "--tasks", "dolly_mc", "--lm-eval-limit", 2]
    with monkeypatch.context() as planting:
        planting.setenv("PYTHONPATH", os.pathsep.join([str(planted), os.environ.get("PYTHONPATH", "")]))
        code, printed = both(args, capsys, monkeypatch)
    point = json.loads((out / "points" / "rtn-w4.json").read_text())
    assert code == 1 and "lm-eval failed: the harness broke" in printed and "failed: rtn-w4 (lm-eval)" in printed
    assert point["status"] == "ok" and point["perplexity"] > 0 and point["lm_eval_error"] == "the harness broke"
    assert "rtn-w4: lm-eval failed (the harness broke)" in (out / "report.md").read_text()
    code, printed = both(args, capsys, monkeypatch)
    point = json.loads((out / "points" / "rtn-w4.json").read_text())
    assert code == 0 and "[1/1] rtn-w4" in printed and "lm_eval_error" not in point and point["lm_eval"]["dolly_mc"]


RECORDER = """
import json, os
import quantkit.api
def recorded(model, tasks, **kw):
    with open(os.environ["LM_EVAL_CALLS"], "a") as f:
        f.write(json.dumps(kw) + "\\n")
    return {"dolly_mc": {"acc": 0.5, "acc_stderr": 0.1}}
quantkit.api.lm_eval = recorded
"""


def test_lm_eval_settings_reach_every_run_and_an_older_report_goes_on(chat_dir, tmp_path, capsys, monkeypatch, text):
    """report ran lm-eval with its defaults only: each task's few-shot count, the model's context, plain
    prompts, the default data directory. Now the base and every point take the report's. A report begun
    before these settings existed goes on with the same command (they are its defaults), and is refused
    with one of them changed. lm-eval is replaced by a recorder, in this process (the base) and in the
    points' (a sitecustomize)."""
    planted, calls, out = tmp_path / "site", tmp_path / "calls.jsonl", tmp_path / "report"
    planted.mkdir()
    (planted / "sitecustomize.py").write_text(RECORDER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(planted), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("LM_EVAL_CALLS", str(calls))
    import quantkit.api

    monkeypatch.setattr(quantkit.api, "lm_eval", quantkit.api.lm_eval)  # put back after the test
    exec(RECORDER, {})  # this process's lm-eval: the base's
    common = ["report", chat_dir, "--out", out, "--data", text, "--methods", "rtn", "--bits", "4", "--group-size", 32,
              "--windows", 1, "--ctx", 64, "--tasks", "dolly_mc", "--lm-eval-limit", 2]
    lm = ["--lm-eval-fewshot", 1, "--lm-eval-max-length", 64, "--lm-eval-chat", "--lm-eval-data-dir", DATA]
    code, _, err = cli([*common, *lm], capsys, monkeypatch)
    assert code == 0, err
    want = {"limit": 2.0, "num_fewshot": 1, "max_length": 64, "data_dir": str(DATA.resolve()), "chat": True}
    assert [json.loads(line) for line in calls.read_text().splitlines()] == [want, want]  # the base, then rtn-w4
    assert "lm-eval: 1-shot, prompts in the chat template, windows of 64 tokens, 2 documents per task." in \
        (out / "report.md").read_text()

    # as a report of an earlier version: its settings.json has none of the new lm-eval settings
    saved = json.loads((out / "settings.json").read_text())
    (out / "settings.json").write_text(json.dumps({k: v for k, v in saved.items() if k not in (
        "lm_eval_fewshot", "lm_eval_max_length", "lm_eval_chat", "lm_eval_data_dir")}))
    code, _, err = cli(common, capsys, monkeypatch)  # its data folder unsaved: the one found now, saved from here
    assert code == 0 and json.loads((out / "settings.json").read_text())["lm_eval_fewshot"] is None, err
    code, _, err = cli([*common, "--lm-eval-fewshot", 0], capsys, monkeypatch)
    assert code == 2 and "holds a report of other settings (--lm-eval-fewshot 0 here, no --lm-eval-fewshot in the report)" in err[-1]
    # the data found elsewhere ($QUANTKIT_DATA): a run saved no folder, and found the records anew each time
    other = tmp_path / "data"
    shutil.copytree(DATA / "dolly", other / "dolly")
    monkeypatch.setenv("QUANTKIT_DATA", str(other))
    code, _, err = cli(common, capsys, monkeypatch)
    assert code == 2 and f"(--lm-eval-data-dir {other.resolve()} here, --lm-eval-data-dir {DATA.resolve()} in the report)" in err[-1]


def test_a_point_ends_with_the_report_killed_under_it(tiny_dir, tmp_path):
    """A report killed with SIGKILL left its point's process running: it went on writing the point's export, and a
    run of the same command meanwhile recorded that point as failed ("being written by another process")."""
    import signal
    import subprocess
    import sys
    import time

    args = ["report", tiny_dir, "--out", tmp_path / "r", "--data", TEST, "--methods", "gptq", "--bits", 4,
            "--group-size", 32, "--calib-data", VALID, "--calib-samples", 64, "--windows", 200, "--ctx", 64]
    report = subprocess.Popen([sys.executable, "-m", "quantkit", *map(str, args)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    children = Path(f"/proc/{report.pid}/task/{report.pid}/children")
    deadline = time.monotonic() + 120
    while not children.read_text().split() and time.monotonic() < deadline:  # the point's process started
        time.sleep(0.2)
    point = int(children.read_text().split()[0])
    time.sleep(1)  # into its work, which takes longer than the wait below
    report.send_signal(signal.SIGKILL)
    report.wait()
    deadline = time.monotonic() + 3
    while Path(f"/proc/{point}").exists() and Path(f"/proc/{point}/stat").read_text().split()[2] != "Z" and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{point}").exists() or Path(f"/proc/{point}/stat").read_text().split()[2] == "Z"


def test_a_model_rewritten_at_its_path_is_not_reported_on_with_the_old_points(tiny_dir, tmp_path, capsys, monkeypatch,
                                                                             text):
    """The points and the base of a report belong to the weights they were made from: the same command
    after the model at that path changed is refused, not answered from the old results."""
    model, out = tmp_path / "m", tmp_path / "report"
    shutil.copytree(tiny_dir, model)
    args = ["report", model, "--out", out, "--data", text, "--methods", "rtn", "--bits", "4", "--group-size", 32,
            "--windows", 1, "--ctx", 64]
    assert cli(args, capsys, monkeypatch)[0] == 0
    shutil.rmtree(model)
    make_tiny(model, seed=1)
    code, _, err = cli(args, capsys, monkeypatch)
    assert code == 2 and err[-1].startswith(f"error: {out} holds a report of other settings")


def test_a_report_whose_every_point_failed_still_draws_its_charts(tiny_dir, tmp_path, capsys, monkeypatch, recwarn,
                                                                  text):
    out = tmp_path / "report"
    code, printed = both(["report", tiny_dir, "--out", out, "--data", text, "--methods", "exl2", "--exl2-bits", "9",
                            "--calib-data", VALID, "--windows", 1, "--ctx", 64], capsys, monkeypatch)
    assert code == 1 and "failed: exl2-9" in printed
    assert (out / "kld.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [w for w in recwarn if "No artists" in str(w.message)]


def test_a_disk_that_fills_while_the_plots_are_drawn(tiny_dir, tmp_path, capsys, monkeypatch, text):
    """The points fitted and the plots did not: a traceback from matplotlib, a part of a PNG left. Now one
    line, no part left, and the same command draws them once there is room."""
    import errno

    from matplotlib.figure import Figure

    out = tmp_path / "report"
    args = ["report", tiny_dir, "--out", out, "--data", text, "--methods", "exl2", "--exl2-bits", "9",
            "--calib-data", VALID, "--windows", 1, "--ctx", 64]  # a point that fails at once: the plots still come
    real = Figure.savefig

    def full(self, path, **kwargs):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full)
    code, printed = both(args, capsys, monkeypatch)
    last = printed.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"error: out of disk space writing {out}") and "Traceback" not in printed
    assert "run the same command again (its points are kept)" in last
    assert sorted(p.name for p in out.glob("*.png")) == [] and not list(out.glob(".*.tmp*"))
    monkeypatch.setattr(Figure, "savefig", real)
    code, printed = both(args, capsys, monkeypatch)
    assert code == 1 and (out / "kld.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,match", [
    (["--methods", "rtn", "--bits", "5"], "--bits 5 is an unsupported bit width"),
    (["--methods", "gguf", "--gguf-types", "Q9"], "unknown GGUF type 'Q9' in --gguf-types"),
    (["--methods", ""], "the sweep has no points"),
    (["--methods", "rtn", "--ctx", 1], "context 1 is too short"),
    (["--methods", "rtn", "--bits", ""], "with widths in --bits"),
    # these failed every point after the base was scored, and the corrected command was then refused
    (["--methods", "rtn", "--bits", "4", "--tasks", "bogus_task"], "lm-eval knows no task 'bogus_task'"),
    (["--methods", "rtn", "--bits", "4", "--tasks", "dolly_mc", "--lm-eval-limit", "-1"],
     "--lm-eval-limit -1.0: pass a whole number of documents per task, or a fraction of each below 1"),
    (["--methods", "rtn", "--bits", "4", "--tasks", "dolly_mc", "--lm-eval-limit", "inf"], "--lm-eval-limit inf: pass"),
    # found by lm-eval after the base was scored, named by its flags (--max-length), the report left to block the fix
    (["--methods", "rtn", "--bits", "4", "--tasks", "dolly_mc", "--lm-eval-max-length", 1024],
     "--lm-eval-max-length 1024 is longer than the model's context of 512 tokens: use --lm-eval-max-length 512"),
    (["--methods", "rtn", "--bits", "4", "--tasks", "dolly_mc", "--lm-eval-chat"],
     "the model's tokenizer has no chat template: drop --lm-eval-chat"),
    (["--methods", "rtn", "--bits", "4", "--tasks", "dolly_mc", "--lm-eval-limit", 1, "--lm-eval-max-length", 256,
      "--lm-eval-fewshot", 5000], "--lm-eval-fewshot 5000 asks for more examples than a task of dolly_mc has"),
    # wikitext scores plain text: lm-eval dropped the few-shot count without a word
    (["--methods", "rtn", "--bits", "4", "--tasks", "wikitext", "--lm-eval-fewshot", 2],
     "wikitext scores rolling windows of plain text, with no prompt for --lm-eval-fewshot to shape: drop"),
    (["--methods", "gptq", "--bits", "4", "--calib-data", "none.txt"], "none.txt: no such file: pass an existing text"),
    (["--methods", "exl2", "--exl2-bits", "0", "--calib-data", VALID], "--exl2-bits 0 is not a target"),
    (["--methods", "exl2", "--exl2-bits", "nan", "--calib-data", VALID], "--exl2-bits nan is not a target"),
    (["--methods", "gptq", "--bits", "4", "--calib-data", VALID, "--calib-samples", 0], "0 calibration windows of 512"),
    # the base was scored, then every calibrated point failed on them
    (["--methods", "gptq", "--bits", "4", "--calib-data", VALID, "--calib-samples", 100000], "too few for 100000"),
    (["--methods", "awq", "--bits", "4", "--calib-data", VALID, "--calib-seqlen", 1024], "longer than the model's"),
    (["--methods", "rtn", "--calib-data", "none.txt"], "none.txt: no such file"),  # a setting of the report still
    # options nothing in the sweep reads: taken and ignored (an invalid --gguf-types too)
    (["--methods", "rtn", "--gguf-types", "Q9_X"], "--gguf-types sets the gguf points, and --methods has none"),
    (["--methods", "gguf", "--bits", "4"], "--bits sets the awq, gptq, rtn points, and --methods has none"),
    (["--methods", "rtn", "--lm-eval-limit", 5], "--lm-eval-limit sets the lm-eval runs, and there are no --tasks"),
])
def test_bad_settings_are_refused_before_the_report_is_made(tiny_dir, tmp_path, capsys, monkeypatch, args, match, text):
    """Settings that every point, or the base, would fail on: one error line, and no report directory
    left to block the corrected command."""
    out = tmp_path / "report"
    code, _, err = cli(["report", tiny_dir, "--out", out, "--data", text, "--windows", 2, *args], capsys, monkeypatch)
    assert code == 2 and err[-1].startswith("error: ") and match in err[-1], err
    assert not out.exists()


def test_the_base_runs_lm_eval_where_the_points_do(tiny_dir, tmp_path, capsys, monkeypatch, text):
    """The points' Models run lm-eval where they were quantized, on the CPU in float32; the base was
    passed by path, which lm-eval runs on a GPU in float16 where there is one."""
    from quantkit import api

    where = []

    def lm_eval(model, tasks, **kw):
        with monkeypatch.context() as gpu:
            gpu.setattr(torch.cuda, "is_available", lambda: True)
            where.append(api.default_device(model, kw.get("device")))
        return {t: {"acc": 0.5} for t in tasks}

    monkeypatch.setattr(api, "lm_eval", lm_eval)
    code, _, err = cli(["report", tiny_dir, "--out", tmp_path / "r", "--data", text, "--methods", "rtn", "--bits", 4,
                        "--windows", 1, "--ctx", 64, "--tasks", "dolly_mc", "--lm-eval-limit", 1], capsys, monkeypatch)
    assert code == 0 and where == [None], err  # the base's call, in this process: the Model stays where it is


def test_exl2_points_share_one_measurement(tiny_dir, tmp_path, capsys, monkeypatch, text):
    """--exl2-measured: the first EXL2 point measures into OUT/exl2-measurement.json, the next reads
    it; each meets its target."""
    out = tmp_path / "report"
    args = ["report", tiny_dir, "--out", out, "--data", text, "--calib-data", VALID, "--calib-samples", 4,
            "--methods", "exl2", "--exl2-bits", "3.0,4.0", "--exl2-measured", "--windows", 2, "--ctx", 128]
    code, _, _ = cli(args, capsys, monkeypatch)
    points = json.loads((out / "report.json").read_text())["points"]
    assert code == 0 and [p["status"] for p in points] == ["ok", "ok"]
    assert all(p["exl2"] - 0.5 < p["bpw_linear"] <= p["exl2"] for p in points)
    measured = json.loads((out / "exl2-measurement.json").read_text())
    assert len(measured["units"]) == 4  # two layers, attention and MLP
    # written during the first point, not again
    assert (out / "exl2-measurement.json").stat().st_mtime_ns < (out / "points" / "exl2-3.json").stat().st_mtime_ns
    assert points[0]["kld_mean"] > points[1]["kld_mean"]


def test_a_directory_that_is_not_a_report_is_not_written_into(tiny_dir, tmp_path, capsys, monkeypatch, text):
    """Its report.md was replaced without --overwrite; a damaged settings.json was a traceback."""
    out = tmp_path / "notes"
    out.mkdir()
    (out / "report.md").write_text("mine")
    args = ["report", tiny_dir, "--out", out, "--data", text, "--methods", "rtn", "--bits", "4", "--windows", 1,
            "--ctx", 64]
    code, _, err = cli(args, capsys, monkeypatch)
    assert code == 2 and "holds other files, not a quantkit report" in err[-1] and (out / "report.md").read_text() == "mine"
    (out / "settings.json").write_text("{")
    code, _, err = cli(args, capsys, monkeypatch)
    assert code == 2 and err[-1].startswith(f"error: {out / 'settings.json'} is damaged")


def test_a_point_file_without_its_figures_is_measured_again_or_named(tiny_dir, tmp_path, capsys, monkeypatch, text):
    """A point's file saying "ok" without the figures (another version's, a hand edit) was a KeyError in
    the table: one of the sweep's runs again, one from an earlier sweep is named; a failed one without
    its reason too."""
    out = tmp_path / "report"
    args = ["report", tiny_dir, "--out", out, "--data", text, "--methods", "rtn", "--bits", "4", "--windows", 1,
            "--ctx", 64]
    assert cli(args, capsys, monkeypatch)[0] == 0
    (out / "points" / "rtn-w4.json").write_text(json.dumps({"name": "rtn-w4", "status": "ok"}))
    code, _, err = cli(args, capsys, monkeypatch)
    assert code == 0 and "[1/1] rtn-w4" in "\n".join(err), err
    assert json.loads((out / "points" / "rtn-w4.json").read_text())["perplexity"] > 1
    for kept in ({"name": "rtn-w8", "status": "ok"}, {"name": "rtn-w8", "status": "failed"}):
        point = out / "points" / "rtn-w8.json"
        point.write_text(json.dumps(kept))
        code, _, err = cli(args, capsys, monkeypatch)
        assert code == 2 and err[-1].startswith(f"error: {point} is damaged"), err


def test_a_point_past_floats_range_is_null_in_the_report_json(tiny_dir, tmp_path, capsys, monkeypatch, text):
    """A point whose perplexity overflowed (e**(mean loss) past float's range) made report.json hold
    `Infinity`, which is not JSON: jq and browsers refuse the whole file. Now null there; the table and
    the chart still name the figure."""
    out = tmp_path / "report"
    args = ["report", tiny_dir, "--out", out, "--data", text, "--methods", "rtn", "--bits", "4", "--windows", 1,
            "--ctx", 64]
    assert cli(args, capsys, monkeypatch)[0] == 0
    point = json.loads((out / "points" / "rtn-w4.json").read_text())
    broken = {**point, "name": "rtn-w3", "perplexity": float("inf"), "ppl_ratio": float("inf")}
    (out / "points" / "rtn-w3.json").write_text(json.dumps(broken))  # as a point's process writes it
    code, _, err = cli(args, capsys, monkeypatch)
    assert code == 0, err

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    report = json.loads((out / "report.json").read_text(), parse_constant=refuse)
    by_name = {p["name"]: p for p in report["points"]}
    assert by_name["rtn-w3"]["perplexity"] is None and by_name["rtn-w3"]["ppl_ratio"] is None
    assert by_name["rtn-w4"]["perplexity"] == point["perplexity"]
    md = (out / "report.md").read_text()
    assert next(row for row in md.splitlines() if row.startswith("| rtn-w3 |")).count("| inf ± ") == 2


def test_the_windows_shown_are_the_ones_scored(tiny_dir, tmp_path, capsys, monkeypatch):
    """A text shorter than --windows: the report said 40 windows where it scored what the text gave."""
    short = tmp_path / "short.txt"
    short.write_text(TEST.read_text()[:1500])
    out = tmp_path / "report"
    code, printed = both(["report", tiny_dir, "--out", out, "--data", short, "--methods", "rtn", "--bits", "4",
                            "--group-size", 32, "--windows", 40, "--ctx", 64], capsys, monkeypatch)
    n = json.loads((out / "base.json").read_text())["windows"]
    assert code == 0 and 1 <= n < 40 and f"the text gives {n} windows of 64" in printed
    md = (out / "report.md").read_text()
    assert f"on {n} windows of 64 tokens of short.txt" in md
    assert "| rtn-w4 | safetensors |" in md and " ± " in md  # the figures with their standard errors
    point = json.loads((out / "report.json").read_text())["points"][0]  # it says what it was scored in
    assert (point["dtype"], point["device"]) == ("float32", "cpu")  # the Model quantized in memory, on the CPU


@pytest.mark.parametrize("log,code,said", [
    ("loading\nerror: 9.0 bits per weight is outside\n", 2, "error: 9.0 bits per weight is outside"),
    ("loading\n", -9, "killed by SIGKILL (out of memory?)"),  # the out-of-memory killer leaves no word
    ("", -15, "killed by SIGTERM"),
    ("Traceback ...\nValueError: x\n", 1, "ValueError: x")])
def test_a_failed_points_reason(log, code, said):
    """A point killed by a signal was recorded as failed with an empty reason."""
    from quantkit.report import failure

    assert failure(log, code) == said


def test_kept_exports_score_as_the_report_says(tiny_dir, tmp_path, capsys, monkeypatch, text):
    """--keep-exports was never run. A point is scored as quantize holds it in memory: the file kept must
    give the same figures loaded from disk, as a user's `quantkit eval --base` would score it."""
    from quantkit import api

    out = tmp_path / "report"
    code, _ = both(["report", tiny_dir, "--out", out, "--data", text, "--methods", "rtn,gguf", "--bits", "4",
                    "--gguf-types", "Q4_K_M", "--group-size", 32, "--windows", 3, "--ctx", 128, "--keep-exports"],
                   capsys, monkeypatch)
    points = json.loads((out / "report.json").read_text())["points"]
    assert code == 0 and sorted(p.name for p in (out / "exports").iterdir()) == ["gguf-Q4_K_M.gguf", "rtn-w4"]
    assert json.loads((out / "base.json").read_text())["bytes"] == (tiny_dir / "model.safetensors").stat().st_size
    for p in points:
        export = out / "exports" / (p["name"] + (".gguf" if p["format"] == "gguf" else ""))
        d = api.compare(export, out / "base.logits", text, 128, 3, progress=False)
        # the weight files, as the base's: a directory's tokenizer and config (2-3% of this model) were counted
        assert p["bytes"] == (export.stat().st_size if export.is_file() else (export / "model.safetensors").stat().st_size)
        # the same file: the figures agree to the arithmetic's rounding (packed kernels against the Model quantize
        # returned), where the float model's KLD is 0 and this one's ~1e-5, so the KLD tells the two apart
        assert p["kld_mean"] > 1e-6 and d.kld_mean == pytest.approx(p["kld_mean"], rel=1e-2)
        assert d.perplexity == pytest.approx(p["perplexity"], rel=1e-4)


def test_a_point_killed_after_its_export_leaves_no_export(tiny_dir, tmp_path, capsys, monkeypatch, text):
    """A point that died after writing its export (killed by the out-of-memory killer while scored, say)
    left the export in OUT/exports, of the model's size, that nobody asked to keep."""
    planted, out = tmp_path / "site", tmp_path / "report"
    planted.mkdir()
    (planted / "sitecustomize.py").write_text("import os\nimport quantkit.api\n"
                                              "quantkit.api.compare = lambda *args, **kwargs: os._exit(9)\n")
    with monkeypatch.context() as planting:
        planting.setenv("PYTHONPATH", os.pathsep.join([str(planted), os.environ.get("PYTHONPATH", "")]))
        code, printed = both(["report", tiny_dir, "--out", out, "--data", text, "--methods", "rtn", "--bits", "4",
                              "--group-size", 32, "--windows", 1, "--ctx", 64], capsys, monkeypatch)
    assert code == 1 and "failed: rtn-w4" in printed
    assert not (out / "exports").exists()


def test_a_report_goes_on_without_its_base_logits_and_not_with_its_text_edited(tiny_dir, tmp_path, capsys,
                                                                                monkeypatch, text):
    """base.logits (a GB for a 49k vocabulary) deleted once a report was done: every later point quantized,
    then failed, naming base.logits as a model path. Now the base is scored again. A --data edited at its
    path was taken for the same text until a point failed on the saved base's tokens; now it is refused
    first. The base's perplexity is exact, as the points' are: the saved rows floor the targets."""
    from quantkit import api

    data = tmp_path / "text.txt"
    shutil.copy(text, data)
    out = tmp_path / "report"
    args = ["report", tiny_dir, "--out", out, "--data", data, "--methods", "rtn", "--group-size", 32,
            "--windows", 2, "--ctx", 64]
    assert both([*args, "--bits", "8"], capsys, monkeypatch)[0] == 0
    base = json.loads((out / "base.json").read_text())
    assert base["perplexity"] == pytest.approx(api.evaluate(tiny_dir, data, "llamacpp", 64, 2, progress=False)
                                               .perplexity, rel=1e-9)
    (out / "base.logits").unlink()
    code, printed = both([*args, "--bits", "4"], capsys, monkeypatch)
    assert code == 0 and f"base: scoring 2 windows of 64 on the float model again ({out / 'base.logits'} is gone)" \
        in printed
    assert json.loads((out / "base.json").read_text()) == base
    assert [p["status"] for p in json.loads((out / "report.json").read_text())["points"]] == ["ok", "ok"]
    data.write_text(data.read_text()[::-1])
    code, _, err = cli([*args, "--bits", "3"], capsys, monkeypatch)
    assert code == 2 and err[-1] == (f"error: {out} holds a report of other settings (the --data or --calib-data file "
                                     "changed since the report began (name, size or time)): run with its settings to "
                                     "go on, or choose another --out")


def test_exl2_targets_that_print_alike_are_two_points():
    """`:g` named 4.123456 and 4.123457 both exl2-4.12346: one point file for two targets."""
    from quantkit.report import points

    names = [p.name for p in points(["exl2"], [4], [], [4.0, 4.125, 4.123456, 4.123457])]
    assert names == ["exl2-4", "exl2-4.125", "exl2-4.123456", "exl2-4.123457"]
