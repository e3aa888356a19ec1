"""EleutherAI's lm-evaluation-harness on a model quantkit has loaded, through lm-eval's HFLM wrapper
around our module and tokenizer: no checkpoint is loaded again. The tasks in tasks/ read local
files under data_dir (wikitext: lm-eval's wikitext task on the local WikiText-2 raw test file;
dolly_mc: four-way response choice built from the Dolly slice); hub tasks need the network."""
from __future__ import annotations

import difflib
import logging
import math
import os
import random
import sys
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from quantkit import hub
from quantkit.errors import Note, QuantkitError, option
from quantkit.modelio import check_context

from .perplexity import Forward, overflow

TASKS = Path(__file__).parent / "tasks"
LOCAL = tuple(sorted(p.stem for p in TASKS.glob("*.yaml")))


@dataclass
class Tasks:
    """Tasks checked and their data read, ready to run."""
    names: list[str]
    manager: object  # lm-eval's TaskManager, with the local tasks
    plain: list[str]  # those that score rolling windows of plain text (wikitext): no prompt to shape
    generating: list[str]  # those that generate text (gsm8k), a token at a time: only a model run whole can


MANAGERS: dict[tuple[bool, str], object] = {}  # lm-eval's TaskManager by (with its own tasks, data_dir)


def default_data_dir() -> Path:
    """$QUANTKIT_DATA, else ../shared/data from the working directory (the README's layout), else the
    shared data beside this checkout (an editable install run from elsewhere)."""
    if os.environ.get("QUANTKIT_DATA"):
        return Path(os.environ["QUANTKIT_DATA"])
    here, checkout = Path.cwd().parent / "shared" / "data", Path(__file__).resolve().parents[2] / "shared" / "data"
    return here if here.is_dir() or not checkout.is_dir() else checkout


def documents(limit: object, said: str) -> int | float | None:
    """limit as lm-eval reads it (documents per task, or below 1 a fraction of each), refused unless it
    is one of those; said is how the caller spelled it (--limit 1.5)."""
    if limit is None:
        return None
    if (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not math.isfinite(limit) or limit <= 0
            or limit >= 1 and limit != int(limit)):
        raise QuantkitError(f"{said}: pass a whole number of documents per task, or a fraction of each below 1")
    if limit >= sys.maxsize:  # more than lm-eval's islice takes, and than any task holds: every document
        return None
    return int(limit) if limit >= 1 else limit  # lm-eval reads a float as a fraction


def documents_said(limit: int | float) -> str:
    """A limit (documents) in words: a count per task, or a share of each task's documents."""
    return f"{limit:g} documents per task" if limit >= 1 else f"{limit:.0%} of each task's documents"


@contextmanager
def kept_state() -> Iterator[None]:
    """Within: lm-eval may seed the caller's random number generators (it seeds them even when no seed
    is given) and quiet its logger; after, they are as they were."""
    import numpy as np

    log = logging.getLogger("lm_eval")
    level, states = log.level, (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        log.setLevel(level)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def prepare(names: list[str], data_dir: str | os.PathLike | None = None) -> Tasks:
    """Check the task names and read the tasks' data (before any model loads)."""
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise QuantkitError("lm-eval is not installed: pip install 'quantkit[eval]' (or pip install lm-eval)") from None
    if not names:
        raise QuantkitError(f"no task given: pass {option('tasks')}, e.g. {','.join(LOCAL)}")
    # lm-eval's own index takes some 20 s to build: only when a task is not one of ours, and once a process
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes (our tasks override its own) are not errors
    key = (not set(names) <= set(LOCAL), str(data_dir))
    if key not in MANAGERS:  # a manager holds the index alone: load() builds new tasks from it every time
        MANAGERS[key] = TaskManager(include_path=str(TASKS), include_defaults=key[0], metadata={"data_dir": key[1]})
    manager = MANAGERS[key]
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
            hint = f"close names: {', '.join(close)}" if close else f"the local tasks are {', '.join(LOCAL)}"
            raise QuantkitError(f"lm-eval knows no task {name!r} ({hint}): pass {option('tasks')} with task names "
                                "(lm-eval ls tasks lists them)")
    if any(name in LOCAL for name in names) and not data_dir.is_dir():
        raise QuantkitError(f"{data_dir}: no such directory, where the local tasks read their data: pass "
                            f"{option('data_dir')} or set QUANTKIT_DATA")
    try:  # read here first (run() reads again, from datasets' cache): a hub task without the network fails here
        with hub.reached():
            loaded = manager.load(names)["tasks"]
    except QuantkitError:  # a local task's own
        raise
    except Exception as e:
        raise QuantkitError(f"lm-eval could not load the data of {', '.join(names)} ({type(e).__name__}: "
                            f"{str(e)[:300]}): hub tasks need the network; the local tasks ({', '.join(LOCAL)}) "
                            f"read {data_dir}") from None
    kinds = {n: t.OUTPUT_TYPE for n, t in loaded.items()}
    return Tasks(names, manager, [n for n, k in kinds.items() if k == "loglikelihood_rolling"],
                 [n for n, k in kinds.items() if k == "generate_until"])


def check_prompts(tasks: Tasks, num_fewshot: int | None, chat: bool) -> None:
    """Few-shot examples and the chat template shape prompts, and a rolling task (wikitext) scores plain
    text with none, so lm-eval drops them there without a word: refused where every task is such, a
    note naming those tasks where some are."""
    shaped = [option("num_fewshot")] * (num_fewshot is not None) + [option("chat")] * chat
    if not shaped or not tasks.plain:
        return
    said = f"{', '.join(tasks.plain)} {'scores' if len(tasks.plain) == 1 else 'score'} rolling windows of plain text"
    if set(tasks.plain) >= set(tasks.names):
        raise QuantkitError(f"{said}, with no prompt for {' or '.join(shaped)} to shape: drop {' and '.join(shaped)}")
    others = [n for n in tasks.names if n not in tasks.plain]
    warnings.warn(f"{said}: {' and '.join(shaped)} appl{'y' if len(shaped) > 1 else 'ies'} to {', '.join(others)} "
                  "only", Note)


def check_settings(config, tokenizer, max_length: int | None, chat: bool) -> None:
    """Refuse windows past the model's context (lm-eval would run them without a word), and chat
    prompts for a tokenizer without a template."""
    if max_length is not None:
        check_context(config, max_length, "max_length")
    if chat and not getattr(tokenizer, "chat_template", None):
        raise QuantkitError(f"the model's tokenizer has no chat template: drop {option('chat')}")


def generating(tasks: Tasks) -> str:
    """The tasks that generate text, said so ("gsm8k generates text")."""
    return f"{', '.join(tasks.generating)} generate{'s' if len(tasks.generating) == 1 else ''} text"


def check_layerwise(tasks: Tasks) -> None:
    """Refuse tasks a model run a layer at a time cannot score."""
    if tasks.generating:
        raise QuantkitError(f"{generating(tasks)} a token at a time, which a model run a layer at a time cannot: "
                            f"drop {option('layerwise', True)}, or score the other tasks alone")


def run(tasks: Tasks, module: torch.nn.Module, tokenizer, limit: int | float | None = None,
        num_fewshot: int | None = None, batch_size: int = 4, max_length: int | None = None,
        seed: int | None = None, chat: bool = False, forward: Forward | None = None) -> dict[str, dict[str, float]]:
    """lm-eval's results by task ({"wikitext": {"word_perplexity": ..., ...}}), each metric's
    standard error beside it as METRIC_stderr where lm-eval gives one. seed None takes lm-eval's own
    seeds (its few-shot examples are then those `lm_eval` picks); chat renders each prompt with the
    tokenizer's chat template (lm-eval's --apply_chat_template). forward: how the model runs (a
    pipeline.Layerwise, its module lazy), where not whole."""
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM

    check_settings(module.config, tokenizer, max_length, chat)
    kind = rolling_in_one_bar(HFLM)
    if forward is not None:
        check_layerwise(tasks)
        kind = replayed(kind)
    lm = kind(pretrained=module, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    if forward is not None:
        lm.forward, lm._device = forward, forward.device  # HFLM took the lazy module's: meta
    seeds = {} if seed is None else {k: seed for k in ("random_seed", "numpy_random_seed", "torch_random_seed",
                                                       "fewshot_random_seed")}
    # lm-eval asks git for the working directory's commit, which prints "fatal: not a git repository"
    # outside one; the results here do not hold it
    try:
        with mock.patch.object(evaluator, "get_git_commit_hash", lambda: None):
            results = evaluator.simple_evaluate(model=lm, tasks=tasks.names, num_fewshot=num_fewshot, limit=limit,
                                                task_manager=tasks.manager, log_samples=False, bootstrap_iters=1000,
                                                apply_chat_template=chat, **seeds)
    except AssertionError as e:  # lm-eval's check that an answer fits the window
        if "max_length" not in (traceback.extract_tb(e.__traceback__)[-1].line or ""):
            raise
        raise QuantkitError(f"an answer of {', '.join(tasks.names)} is longer than "
                            f"{option('max_length', lm.max_length)} tokens: raise {option('max_length')}") from None
    except ValueError as e:  # its few-shot sampler's random.sample
        if num_fewshot is None or "larger than population" not in str(e):
            raise
        raise QuantkitError(f"{option('num_fewshot', num_fewshot)} asks for more examples than a task of "
                            f"{', '.join(tasks.names)} has to draw them from: pass fewer") from None
    return {task: metrics(values) for task, values in results["results"].items()}


def rolling_in_one_bar(hflm: type) -> type:
    """HFLM whose rolling log-likelihood (wikitext's perplexities) shows one bar of windows scored:
    lm-eval's draws a bar per batch (hundreds for a whole text) after one over documents that only
    cuts them into windows."""
    from tqdm import tqdm

    class OneBar(hflm):
        bar = None
        forward: Forward | None = None  # how the model runs, where not whole (replayed)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            self.bar = tqdm(desc="scoring windows", unit="window", disable=disable_tqdm or self.rank != 0)
            try:
                return super().loglikelihood_rolling(requests, disable_tqdm=True)
            finally:
                self.bar.close()
                self.bar = None

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
            scores = super()._loglikelihood_tokens(requests, disable_tqdm or self.bar is not None, override_bs)
            if not all(math.isfinite(logprob) for logprob, _ in scores):  # every score after would be NaN or inf
                computed = (self.forward or self.model).dtype
                raise QuantkitError(f"the model's log-likelihoods are not finite: {overflow(computed)}")
            if self.bar is not None:
                self.bar.update(len(requests))
            return scores

    return OneBar


def replayed(hflm: type) -> type:
    """HFLM scoring its requests through a model run a layer at a time (its forward): lm-eval's loop is
    run once with stand-in logits to learn the batches it makes, every batch then goes through the model
    together, each layer read once, and the loop runs again on their logits, in the same order. The
    results are those of the model run whole."""
    from lm_eval.api.model import CacheHook

    class Replayed(hflm):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return self.replay(super().loglikelihood, requests, disable_tqdm)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return self.replay(super().loglikelihood_rolling, requests, disable_tqdm)

        def replay(self, score, requests, disable_tqdm: bool):
            batches, vocab = [], self.model.config.vocab_size

            def record(inps: torch.Tensor, **kwargs) -> torch.Tensor:
                batches.append(inps.cpu())
                return torch.zeros((), dtype=self.forward.dtype, device=inps.device).expand(*inps.shape, vocab)

            def made(inps: torch.Tensor, **kwargs) -> torch.Tensor:
                if not batches or not torch.equal(inps.cpu(), batches.pop(0)):  # lm-eval's batching is deterministic
                    raise RuntimeError("lm-eval made other batches when its requests were scored again")
                return next(logits)

            hook, self.cache_hook = self.cache_hook, CacheHook(None)  # the stand-in scores are cached nowhere
            self._model_call, logits = record, None
            try:
                score(requests, disable_tqdm=True)
                logits = self.forward(list(batches), 0)
                self._model_call, self.cache_hook = made, hook
                return score(requests, disable_tqdm=disable_tqdm)
            finally:
                if logits is not None:  # stopped midway: the head and the hidden states left are let go now
                    logits.close()
                del self._model_call
                self.cache_hook = hook

    return Replayed


def metrics(values: dict) -> dict[str, float]:
    """lm-eval's 'metric,filter' keys as metric names, with the filter as metric[filter] where there is
    one (a task scored through two, gsm8k's strict-match and flexible-extract, keeps both);
    aliases and non-numbers dropped."""
    out = {}
    for key, value in values.items():
        name, _, filtered = key.partition(",")
        if filtered not in ("", "none"):
            stem = name.removesuffix("_stderr")
            name = f"{stem}[{filtered}]{name[len(stem):]}"
        if isinstance(value, (int, float)) and not isinstance(value, bool) and name != "alias":
            out[name] = value if name == "sample_len" else float(value)  # a count stays a count
    return out
