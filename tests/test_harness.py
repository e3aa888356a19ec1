"""quantkit lm-eval: lm-eval's tasks on the model quantkit loaded, offline by default."""
import json
import math
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import quantkit
from quantkit import evals
from quantkit.errors import Note, QuantkitError
from quantkit.evals import harness
from quantkit.evals.tasks import local

from .conftest import DATA, cli, make_hot, refused

pytest.importorskip("lm_eval")


def test_dolly_choices_are_built_as_documented():
    docs = local.dolly(str(DATA))["test"]
    records = [json.loads(line) for line in (DATA / "dolly" / "dolly-15k-head.jsonl").read_text().splitlines()]
    assert len(docs) == len(records)
    answers = {}
    for r in records:
        answers.setdefault(r["category"], set()).add(local.clip(r["response"]))
    for doc, r in zip(docs, records):
        choices = doc["choices"]
        assert len(set(choices)) == 4 and choices[doc["gold"]] == local.clip(r["response"])
        assert set(choices) <= answers[r["category"]] and all(len(c) <= 200 for c in choices)
    golds = [d["gold"] for d in docs]
    assert min(golds.count(i) for i in range(4)) > len(docs) / 8  # the answer's place is shuffled
    assert local.dolly(str(DATA))["test"]["choices"] == docs["choices"]  # seeded: the same task every time


def test_wikitext_pages_are_the_test_file_by_article():
    pages = local.wikitext(str(DATA))["test"]["page"]
    raw = (DATA / "wikitext-2-raw" / "wiki.test.raw").read_text()
    assert "".join(pages) == raw and len(pages) == 62  # the hub's wikitext-2 test split holds 62 documents
    assert all(local.TITLE.match(p.splitlines()[0]) for p in pages)


def test_cli_runs_local_tasks_on_the_loaded_model(tiny_dir, capsys, monkeypatch):
    code, out, _ = cli(["lm-eval", tiny_dir, "--tasks", "wikitext,dolly_mc", "--limit", 2, "--max-length", 128,
                        "--json"], capsys, monkeypatch)
    line = json.loads(out.strip().splitlines()[-1])
    result = line["results"]
    assert code == 0 and set(result) == {"wikitext", "dolly_mc"}
    # the settings the scores depend on, as eval's figures carry theirs: none were recorded
    assert line["config"] == {"model": str(tiny_dir), "tasks": ["wikitext", "dolly_mc"], "limit": 2, "num_fewshot": None,
                              "max_length": 128, "batch_size": 4, "seed": None, "chat": False,
                              "data_dir": str(DATA.resolve()), "dtype": "float32", "device": "cpu"}
    assert f"{tiny_dir}: float32 on cpu, 2 documents per task, each task's few-shot count, plain prompts, windows of " \
        "128, lm-eval's seeds" in out
    assert result["wikitext"]["word_perplexity"] > 1 and 0 <= result["dolly_mc"]["acc"] <= 1
    assert result["dolly_mc"]["sample_len"] == 2 and isinstance(result["dolly_mc"]["sample_len"], int)
    d = result["dolly_mc"]  # the text line shows the standard errors too
    assert f"dolly_mc: acc {d['acc']:.4f} ± {d['acc_stderr']:.4f}, acc_norm {d['acc_norm']:.4f} ± " in out
    code, out, _ = cli(["lm-eval", tiny_dir, "--tasks", "dolly_mc", "--limit", 0.01, "--max-length", 128], capsys,
                       monkeypatch)  # it said "0.01 documents per task"
    assert code == 0 and "1% of each task's documents" in out


def test_a_limit_past_what_lm_eval_slices_by_is_every_document():
    """--limit 1e30 reached lm-eval's islice, which takes counts up to sys.maxsize, and ended in its traceback;
    then it was said as "9.22e+18 documents per task". It is no limit."""
    import sys

    assert harness.documents(1e30, "--limit 1e30") is None and harness.documents(sys.maxsize, "") is None
    assert harness.documents(sys.maxsize - 1, "") == sys.maxsize - 1 and harness.documents(3.0, "--limit 3") == 3
    assert harness.documents(0.5, "--limit 0.5") == 0.5


def test_chat_template_on_request(chat_dir, tiny_dir, capsys, monkeypatch):
    """Prompts were always plain; --apply-chat-template renders them with the model's template (lm-eval's
    --apply_chat_template), and a model without one is refused."""
    from transformers import PreTrainedTokenizerBase

    rendered = []
    original = PreTrainedTokenizerBase.apply_chat_template

    def spy(self, *args, **kwargs):
        rendered.append(args[0] if args else kwargs.get("conversation"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "apply_chat_template", spy)
    code, _, _ = cli(["lm-eval", chat_dir, "--tasks", "dolly_mc", "--limit", 2, "--max-length", 256], capsys, monkeypatch)
    assert code == 0 and not rendered
    code, _, _ = cli(["lm-eval", chat_dir, "--tasks", "dolly_mc", "--limit", 2, "--max-length", 256,
                      "--apply-chat-template"], capsys, monkeypatch)
    assert code == 0 and rendered and any("Instruction:" in m["content"] for chat in rendered for m in chat)
    refused(["lm-eval", tiny_dir, "--tasks", "dolly_mc", "--limit", 2, "--apply-chat-template"], capsys, monkeypatch,
            "the model's tokenizer has no chat template: drop --apply-chat-template")


def test_seeds_are_lm_evals_unless_given(tiny_dir, monkeypatch):
    """Seed 0 for all was passed by default, so --num-fewshot drew other examples than `lm_eval` does."""
    from lm_eval import evaluator

    seen = []
    monkeypatch.setattr(evaluator, "simple_evaluate", lambda **kw: seen.append(kw) or {"results": {}})
    for seed in (None, 7):
        quantkit.lm_eval(tiny_dir, ["dolly_mc"], limit=1, seed=seed)
    keys = ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")
    assert not any(k in seen[0] for k in keys) and all(seen[1][k] == 7 for k in keys)


def test_a_few_shot_count_names_the_tasks_it_does_not_reach(tiny_dir, monkeypatch):
    """wikitext scores rolling windows of plain text: lm-eval drops num_fewshot there without a word."""
    from lm_eval import evaluator

    monkeypatch.setattr(evaluator, "simple_evaluate", lambda **kw: {"results": {}})
    with pytest.warns(Note, match="^wikitext scores rolling windows of plain text: num_fewshot applies to dolly_mc "
                                  "only$"):
        quantkit.lm_eval(tiny_dir, ["wikitext", "dolly_mc"], limit=1, num_fewshot=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantkit.lm_eval(tiny_dir, ["wikitext", "dolly_mc"], limit=1)


def test_the_callers_seeds_and_logger_are_left_as_they_were(tiny_dir):
    """lm-eval seeds random, numpy and torch even when no seed is given (numpy's and torch's to 1234), and
    quantkit quieted lm-eval's logger for good: a pipeline's draws after an evaluation were the same each run."""
    import logging
    import random

    import numpy as np

    log = logging.getLogger("lm_eval")
    level = log.level
    try:
        log.setLevel(logging.INFO)
        torch.manual_seed(999), random.seed(999), np.random.seed(999)
        want = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
        quantkit.lm_eval(tiny_dir, ["wikitext"], limit=1, device="cpu")
        assert torch.equal(torch.get_rng_state(), want[0]) and random.getstate() == want[1]
        assert (np.random.get_state()[1] == want[2]).all() and log.level == logging.INFO
    finally:
        log.setLevel(level)


def test_refusals(tiny_dir, tmp_path, capsys, monkeypatch):
    refused(["lm-eval", tiny_dir, "--tasks", "wikitxt"], capsys, monkeypatch,
            "lm-eval knows no task 'wikitxt' (close names: wikitext")
    refused(["lm-eval", tiny_dir, "--tasks", "wikitext", "--data-dir", tmp_path / "none"], capsys, monkeypatch,
            "no such directory, where the local tasks read their data: pass --data-dir")
    refused(["lm-eval", tiny_dir, "--tasks", "wikitext", "--max-length", 1024], capsys, monkeypatch,
            "--max-length 1024 is longer than the model's context of 512 tokens")
    # more few-shot examples than the task's records: random.sample's traceback, exit 1 (a failed gate's)
    refused(["lm-eval", tiny_dir, "--tasks", "dolly_mc", "--limit", 1, "--num-fewshot", 5000, "--max-length", 256],
            capsys, monkeypatch, "--num-fewshot 5000 asks for more examples than a task of dolly_mc has to draw them "
                                 "from: pass fewer")
    for limit in ("inf", "nan", "1.5"):  # inf was a traceback, 1.5 taken as 1, nan named in the API's words
        refused(["lm-eval", tiny_dir, "--tasks", "dolly_mc", "--limit", limit], capsys, monkeypatch,
                f"--limit {limit}: pass a whole number of documents per task, or a fraction of each below 1")
    # an answer longer than the window was lm-eval's bare AssertionError
    refused(["lm-eval", tiny_dir, "--tasks", "dolly_mc", "--limit", 1, "--max-length", 4], capsys, monkeypatch,
            "an answer of dolly_mc is longer than --max-length 4 tokens: raise --max-length")
    # lm-eval scored these as if neither were given, and the header claimed them
    refused(["lm-eval", tiny_dir, "--tasks", "wikitext", "--num-fewshot", 2, "--apply-chat-template"], capsys,
            monkeypatch, "wikitext scores rolling windows of plain text, with no prompt for --num-fewshot or "
                         "--apply-chat-template to shape: drop --num-fewshot and --apply-chat-template")
    for tasks in ([5], 5, None):  # a traceback from difflib, naming no option
        with pytest.raises(QuantkitError, match=re.escape(f"tasks={tasks!r}: pass lm-eval task names")):
            quantkit.lm_eval(tiny_dir, tasks)
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", None)  # as if lm-eval were not installed
    refused(["lm-eval", tiny_dir, "--tasks", "wikitext"], capsys, monkeypatch, "lm-eval is not installed: pip install")


@pytest.mark.slow
def test_hub_task_without_network_is_a_clear_error(tiny_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "quantkit", "lm-eval", str(tiny_dir), "--tasks", "hellaswag",
                        "--limit", "2"], capture_output=True, text=True, env=env, timeout=600)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("error: lm-eval could not load the data of hellaswag"), r.stderr
    assert "hub tasks need the network" in last and "Traceback" not in r.stderr


@pytest.mark.slow
def test_wikitext_word_perplexity_against_our_evaluator():
    """lm-eval's wikitext on the embedded model (the first article, 1397 tokens in 3 windows of 512: the
    next two take 3 minutes more on 2 cores) is the exact log-likelihood
    of lm-eval's rolling windows over the detokenized articles, per word: recomputed here from our
    module it agrees to float noise (lm-eval pads its batches). Our evaluator's wikitext protocol on
    the same text and window length gives a token perplexity within 3% of lm-eval's per-token one;
    they differ by what is scored: lm-eval predicts every token (the first from EOT alone, the
    windows overlapping by one token, a last window ending at the article's end), ours scores ctx - 1
    predictions per whole window and drops the article's tail."""
    from lm_eval.utils import get_rolling_token_windows

    m = quantkit.api.ready(None)
    n, ctx = 1, 512
    result = harness.run(harness.prepare(["wikitext"]), m.module, m.tokenizer, limit=n, max_length=ctx)["wikitext"]
    pages = local.wikitext(str(DATA))["test"]["page"][:n]
    words = sum(len(re.split(r"\s+", p)) for p in pages)
    nll, tokens, ours_nll, ours_tokens = 0.0, 0, 0.0, 0
    with torch.no_grad():
        for page in pages:
            text = local.wikitext_detokenizer({"page": page})
            ids = m.tokenizer(text, add_special_tokens=False)["input_ids"]
            tokens += len(ids)
            for inputs, predicted in get_rolling_token_windows(ids, m.tokenizer.eos_token_id, ctx, 1):
                logp = torch.log_softmax(m.module(torch.tensor([inputs])).logits[0, -len(predicted):].double(), -1)
                nll -= logp.gather(-1, torch.tensor(predicted)[:, None]).sum().item()
            ours = evals.perplexity(m.module, m.tokenizer, text, "wikitext", ctx, progress=False)
            ours_nll += math.log(ours.perplexity) * ours.tokens
            ours_tokens += ours.tokens
    assert result["word_perplexity"] == pytest.approx(math.exp(nll / words), rel=2e-3)
    lm_eval_per_token = math.exp(math.log(result["word_perplexity"]) * words / tokens)
    assert abs(math.exp(ours_nll / ours_tokens) / lm_eval_per_token - 1) < 0.03


def test_no_git_message_outside_a_checkout(tiny_dir, tmp_path, capfd, monkeypatch):
    """lm-eval asked git for the working directory's commit: "fatal: not a git repository" on stderr."""
    import quantkit

    monkeypatch.chdir(tmp_path)
    quantkit.api.lm_eval(tiny_dir, ["dolly_mc"], limit=1, max_length=128)
    assert "not a git repository" not in capfd.readouterr().err


def test_a_dolly_file_too_small_for_four_choices_is_named(tmp_path):
    """A category with fewer than 4 different responses cannot give a question its choices: lm-eval
    reported random.sample's "Sample larger than population", with advice about the network."""
    (tmp_path / "dolly").mkdir()
    lines = (DATA / "dolly" / "dolly-15k-head.jsonl").read_text().splitlines()[:3]
    (tmp_path / "dolly" / "dolly-15k-head.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(quantkit.QuantkitError, match="has 1 different responses, and each question takes its 4 "
                                                      "choices from its category: use a larger Dolly file"):
        harness.prepare(["dolly_mc"], tmp_path)


def test_the_data_directory_is_found_as_the_help_says(tmp_path, monkeypatch):
    """The default was only the shared data beside the checkout, which a non-editable install
    (site-packages/shared/data) never has: now ../shared/data from the working directory first."""
    monkeypatch.delenv("QUANTKIT_DATA", raising=False)
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    assert harness.default_data_dir() == tmp_path / "shared" / "data"
    monkeypatch.chdir(tmp_path)  # no ../shared/data here: the checkout's
    assert harness.default_data_dir() == DATA.resolve()
    monkeypatch.setenv("QUANTKIT_DATA", str(tmp_path / "mine"))
    assert harness.default_data_dir() == tmp_path / "mine"


def test_the_task_index_is_built_once_a_process(monkeypatch):
    """lm-eval's index of its own tasks took some 20 s to build on every call that named one (a pipeline
    scoring several models, each refusal of a misspelt name): the manager is kept, and each call still
    gets tasks of its own."""
    import lm_eval.tasks

    built = []

    class Counted(lm_eval.tasks.TaskManager):
        def __init__(self, **kwargs):
            built.append(kwargs["include_defaults"])
            super().__init__(**kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Counted)
    monkeypatch.setattr(harness, "MANAGERS", {})
    first, second = harness.prepare(["wikitext"], DATA), harness.prepare(["wikitext"], DATA)
    assert built == [False] and first.manager is second.manager
    task = first.manager.load(["wikitext"])["tasks"]["wikitext"]
    assert task is not second.manager.load(["wikitext"])["tasks"]["wikitext"]


def test_the_scores_of_each_filter_are_kept_apart():
    """A task scored through two filters (gsm8k: strict-match, flexible-extract) keeps both scores,
    each with its own standard error; the filter "none" is left out of the names."""
    got = harness.metrics({"alias": "gsm8k", "exact_match,strict-match": 0.1, "exact_match_stderr,strict-match": 0.01,
                           "exact_match,flexible-extract": 0.3, "exact_match_stderr,flexible-extract": 0.02,
                           "acc,none": 0.5, "sample_len": 8})
    assert got == {"exact_match[strict-match]": 0.1, "exact_match[strict-match]_stderr": 0.01,
                   "exact_match[flexible-extract]": 0.3, "exact_match[flexible-extract]_stderr": 0.02,
                   "acc": 0.5, "sample_len": 8}


def test_log_likelihoods_that_are_nan_stop_the_run(tiny_dir, tmp_path, capsys, monkeypatch):
    """A model overflowing float16 scored NaN on every document, and lm-eval reported its accuracy."""
    hot = make_hot(tiny_dir, tmp_path / "hot")
    refused(["lm-eval", hot, "--tasks", "dolly_mc", "--limit", 2, "--dtype", "float16"], capsys, monkeypatch,
            "the model's log-likelihoods are not finite: it overflows float16: run it in float32 or bfloat16 "
            "(--dtype float32)")
    m = quantkit.load(hot)  # a layer at a time, stopped by it at its first batch: nothing of the model is left,
    with pytest.raises(QuantkitError, match="the model's log-likelihoods are not finite: it overflows float16") as e:
        quantkit.lm_eval(m, ["wikitext"], limit=1, max_length=64, dtype="float16", layerwise=True)
    assert all(t.is_meta for t in m.module.state_dict(keep_vars=True).values())
    assert e.value  # also while the traceback is kept (a notebook's last error)


def scored(monkeypatch, tasks: list[str], **kw):
    """A run of lm_eval on a model giving its results and the log-likelihoods lm-eval scored, by kind of
    request (each kind's last call: a model run a layer at a time calls twice, the first on stand-ins)."""
    from lm_eval.models.huggingface import HFLM

    scores = []
    for name in ("loglikelihood", "loglikelihood_rolling"):
        def kept(self, requests, disable_tqdm=False, real=getattr(HFLM, name), name=name):
            scores.append((name, real(self, requests, disable_tqdm=disable_tqdm)))
            return scores[-1][1]
        monkeypatch.setattr(HFLM, name, kept)

    def run(model, **more):
        scores.clear()
        return quantkit.lm_eval(model, tasks, **kw, **more), dict(scores)

    return run


def test_a_model_run_a_layer_at_a_time_gets_the_scores_of_the_whole_model(tmp_path, capsys, monkeypatch):
    """lm-eval's requests run through a model read a layer at a time (every request of a kind together,
    each layer read once; in parts, each reading the model again, where their hidden states do not fit
    half the free memory): each log-likelihood is the whole model's, rolling (wikitext) and not (dolly_mc),
    and the model is left unread. A model that does not fit is run so unless told otherwise."""
    from quantkit import api, pipeline

    from .conftest import make_tiny

    model = make_tiny(tmp_path / "m", layers=3)
    run = scored(monkeypatch, ["wikitext", "dolly_mc"], limit=3, batch_size=2, max_length=128, seed=0)

    whole = run(model, layerwise=False)
    assert "scoring a layer at a time" not in capsys.readouterr().err
    assert run(model, layerwise=True) == whole
    assert capsys.readouterr().err.count("scoring a layer at a time:   0%") == 2  # once a kind of request
    monkeypatch.setattr(pipeline, "free_bytes", lambda dev: 2 * 256 * 64 * 4)  # half of it: 256 tokens' states
    m = quantkit.load(model)
    monkeypatch.setattr(api, "free_bytes", lambda dev: 2**16)  # 64 KiB free: the model does not fit
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run(m) == whole
    assert any(issubclass(w.category, Note) and "scored a layer at a time" in str(w.message) for w in caught)
    assert "(part 2/" in capsys.readouterr().err
    assert all(t.is_meta for t in m.module.state_dict(keep_vars=True).values())


def test_tasks_that_generate_text_run_the_model_whole(tiny_dir, capsys, monkeypatch):
    """A model a layer at a time generates no text: asked for, refused before the model loads; chosen
    because the model does not fit, the model runs whole instead, with a note saying why."""
    from quantkit import api

    real = harness.prepare

    def generating(names, data_dir=None):  # dolly_mc as if it generated its answers
        tasks = real(names, data_dir)
        tasks.generating = ["dolly_mc"]
        return tasks

    monkeypatch.setattr(harness, "prepare", generating)
    refused(["lm-eval", tiny_dir, "--tasks", "dolly_mc", "--layerwise"], capsys, monkeypatch,
            "dolly_mc generates text a token at a time, which a model run a layer at a time cannot: drop --layerwise, "
            "or score the other tasks alone")
    monkeypatch.setattr(api, "free_bytes", lambda dev: 2**16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantkit.lm_eval(tiny_dir, ["dolly_mc"], limit=1, max_length=128, device="cpu")
    assert any("it runs whole because dolly_mc generates text, and may run out of memory" in str(w.message)
               for w in caught)
    assert "scoring a layer at a time" not in capsys.readouterr().err
    monkeypatch.setattr(harness, "prepare", real)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantkit.lm_eval(tiny_dir, ["dolly_mc"], limit=1, max_length=128, device="cpu", layerwise=False)
    assert any("it runs whole as asked, and may run out of memory" in str(w.message) for w in caught)


def test_a_gguf_file_gets_the_same_scores_a_layer_at_a_time(tiny256, tmp_path, monkeypatch):
    """Each layer dequantized from the file as lm-eval's requests reach it, under llama.cpp's arithmetic."""
    f = tmp_path / "q.gguf"
    quantkit.api.export_gguf(quantkit.load(tiny256), f, "Q4_K_M", progress=False)
    run = scored(monkeypatch, ["dolly_mc"], limit=2, max_length=128, seed=0)
    whole = run(f, layerwise=False)
    assert whole[1]["loglikelihood"] and run(f, layerwise=True) == whole
