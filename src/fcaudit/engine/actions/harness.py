"""Benchmark tasks under an audit's conditions (:func:`evaluate_tasks`): the audited model
scored by lm-evaluation-harness (the ``lm-eval`` extra: its task definitions, metrics and
per-sample logs) with each condition applied, beside the audit's NLL answers.

The harness asks its model for log-likelihoods of request strings, batched and reordered
as it likes. :class:`ConditionedLM` is that model for one condition: each request is
tokenized with the audited model's tokenizer, recorded (the controllers live, their
outputs kept) and replayed with the coefficients the condition defines for that request:

* ``correct``: its own recorded ones; the replay must give the recorded logits bit for
  bit, or the evaluation stops (the audit's identity rule, per request);
* a static profile (``static-layer``, ``-position``, ``-token``, ``global-mean``): the
  audit's calibration profiles, recomputed from the audit's calibration data (never read
  from a cache); positions past the calibration windows take the site's static-layer
  value, as ``fcaudit fold`` writes them;
* ``original``: the unperturbed pass itself.

The random conditions (``reassign``, ``shuffle``) need a donor request and are not run
yet: they are listed as not applicable with that reason. Generation tasks are refused.
Per task and metric: the value under each condition with a paired bootstrap interval
over the task's examples (the same resamples for every condition), the penalty against
``correct`` and each static profile's retention of the Correct-to-GlobalMean gap
(undefined where the gap's interval does not clear zero).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fcaudit.core.conditions import (
    CONDITIONS,
    CORRECT,
    GLOBAL_MEAN,
    ORIGINAL,
    REASSIGN,
    STATIC_LAYER,
)
from fcaudit.core.errors import DataError, IdentityError, UsageError, arg, install_extra
from fcaudit.core.interventions import StaticProfiles, static_tensor
from fcaudit.core.nll import device_of, logits_of, model_limits
from fcaudit.engine.actions.reopen import Progress, read_audit, recomputed_profiles, reopened
from fcaudit.engine.metrics import Bootstrap, interval
from fcaudit.engine.result_parts import Estimate
from fcaudit.io.data import AuditData, DataSpec

SCHEMA = "fcaudit.tasks/1"
RESAMPLES = 1000
# per-sample values the harness logs as (log-likelihood, count) pairs: the aggregate of
# each from the summed pairs
_WEIGHTED: dict[str, Callable[[float, float], float]] = {
    "word_perplexity": lambda ll, n: math.exp(-ll / n),
    "byte_perplexity": lambda ll, n: math.exp(-ll / n),
    "bits_per_byte": lambda ll, n: -ll / n / math.log(2),
}


def require_lm_eval() -> Any:
    """lm-evaluation-harness, with the datasets and hub libraries offline: nothing
    downloads at run time (set before they are imported, and on their settings where
    another import came first)."""
    import os
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets.config
        import huggingface_hub.constants
        import lm_eval.evaluator
    except ImportError as exc:
        raise UsageError(f"benchmark tasks run through lm-evaluation-harness: "
                         f"{install_extra('lm-eval')}", option="tasks") from exc
    datasets.config.HF_DATASETS_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    return lm_eval


def runnable(condition: str) -> str | None:
    """Why a condition is not run on task requests (None: it is)."""
    entry = CONDITIONS[condition]
    if entry.kind == "reference" or entry.kind == "static" and entry.profile in (
            "layer", "layer_position", "layer_token", "global_mean"):
        return None
    if condition == REASSIGN:
        return None
    if entry.kind == "random":
        return "shuffles positions within a request; not run on task requests yet"
    return f"a {entry.kind} condition; not run on task requests"


class _Scorer:
    """Requests scored by the audited model with one condition applied."""

    def __init__(self, setup: Any, profiles: StaticProfiles, tokenizer: Any,
                 condition: str, seed: int = 0) -> None:
        self.setup, self.profiles, self.tokenizer = setup, profiles, tokenizer
        self.condition, self.seed = condition, seed
        self.context = model_limits(setup.model)[1]
        self.requests = 0
        self.undonored: dict[str, int] = {}  # reassign: requests without a donor, by task

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _feed(self, site: Any, like: Tensor, ids: Tensor) -> Tensor:
        """The condition's coefficients for ``site`` on one request (``like``: its recorded
        ones); per-position rows past the calibration windows: static-layer's."""
        if CONDITIONS[self.condition].profile != "layer_position":
            return static_tensor(self.condition, site, self.profiles, like, ids)
        covered = self.profiles.shape(site)[0]
        rows = static_tensor(self.condition, site, self.profiles,
                             like.new_zeros(like.shape[0], covered, *like.shape[2:]))
        if like.shape[1] <= covered:
            return rows[:, :like.shape[1]]
        return torch.cat([rows, static_tensor(STATIC_LAYER, site, self.profiles,
                                              like[:, covered:], ids[:, covered:])], dim=1)

    def _inputs(self, ids: list[int]) -> Tensor:
        if self.context is not None and len(ids) - 1 > self.context:
            raise DataError(f"a task request of {len(ids)} tokens exceeds the model's context "
                            f"of {self.context}: choose tasks whose requests fit, or a model "
                            "with a longer context")
        return torch.tensor([ids[:-1]], device=device_of(self.setup.model))

    def logprobs(self, ids: list[int], donor: dict[str, Tensor] | None = None) -> Tensor:
        """Log-probabilities ``[T - 1, V]`` of the model on ``ids`` under the condition
        (``donor``: reassign's, another request's recorded coefficients)."""
        x = self._inputs(ids)
        self.requests += 1
        if donor is not None:  # nothing of its own is read: no record pass
            replayed = self.setup.executor.replay(x, {s: donor[s.name] for s in self.setup.sites})
            return torch.log_softmax(logits_of(replayed.logits)[0].double(), -1)
        logits, coefficients, _ = self.setup.executor.record(x, None)
        if self.condition == ORIGINAL:
            return torch.log_softmax(logits_of(logits)[0].double(), -1)
        fed = {s: coefficients[s.name] if self.condition == CORRECT else
               self._feed(s, coefficients[s.name], x) for s in self.setup.sites}
        replayed = logits_of(self.setup.executor.replay(x, fed).logits)
        if self.condition == CORRECT and not torch.equal(replayed, logits_of(logits)):
            raise IdentityError("identity replay is not exact on a task request: the replay "
                                "with its recorded coefficients does not give the recorded "
                                "logits bit for bit, so no condition can be scored on it")
        return torch.log_softmax(replayed[0].double(), -1)

    def split(self, context: str, continuation: str) -> tuple[list[int], int]:
        """The request's token ids and how many are context, the harness's way of
        splitting the two (trailing spaces of the context go with the continuation)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, head = self.encode(context + continuation), self.encode(context)
        if not head or len(whole) <= len(head):
            raise DataError(f"a task request has an empty context or continuation once "
                            f"tokenized ({context[-30:]!r} / {continuation[:30]!r}); "
                            "fcaudit scores a continuation given at least one context token")
        return whole, len(head)

    def continuation(self, whole: list[int], head: int,
                     donor: dict[str, Tensor] | None = None) -> tuple[float, bool]:
        """log P(continuation | context) and whether it is the greedy one."""
        lp = self.logprobs(whole, donor)[head - 1:]
        want = torch.tensor(whole[head:], device=lp.device)
        return float(lp.gather(-1, want[:, None]).sum()), bool(lp.argmax(-1).eq(want).all())

    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        """Every request's score; under reassign each is fed the coefficients of a request
        of the same token length from another document (:func:`donors`)."""
        split = [self.split(*r.args) for r in requests]
        if self.condition != REASSIGN:
            return [self.continuation(*s) for s in split]
        out: list[tuple[float, bool]] = [(math.nan, False)] * len(split)
        by_length: dict[int, list[int]] = {}
        for i, (whole, _) in enumerate(split):
            by_length.setdefault(len(whole), []).append(i)
        rng = np.random.default_rng(self.seed)
        for members in by_length.values():
            given = donors([(requests[i].task_name, requests[i].doc_id) for i in members], rng)
            if given is None:  # no request of another document this long: not scored
                for i in members:
                    self.undonored[requests[i].task_name] = \
                        self.undonored.get(requests[i].task_name, 0) + 1
                continue
            recorded = {i: self.setup.executor.record(self._inputs(split[i][0]), None)[1]
                        for i in members}
            for k, i in enumerate(members):
                out[i] = self.continuation(*split[i], recorded[members[given[k]]])
        return out

    def rolling(self, text: str, task: str | None = None) -> float:
        """log P of every token of ``text`` after its first, in windows of the model's
        context (one token of context across a window's edge, as the harness does).
        Reassign has no donor for a document's windows: not scored."""
        if self.condition == REASSIGN:
            self.undonored[str(task)] = self.undonored.get(str(task), 0) + 1
            return math.nan
        ids = self.encode(text)
        size, total, start = self.context or len(ids), 0.0, 1
        while start < len(ids):
            stop = min(start + size, len(ids))
            lp = self.logprobs(ids[start - 1:stop])
            want = torch.tensor(ids[start:stop], device=lp.device)
            total += float(lp.gather(-1, want[:, None]).sum())
            start = stop
        return total


def donors(documents: Sequence[tuple[Any, Any]], rng: np.random.Generator
           ) -> list[int] | None:
    """For requests of one token length (``documents``: each one's task and document),
    the index of each one's donor: a request of another document, every request a donor
    once (the documents in random order, each request given the one a largest
    document's count further on); None when no such assignment exists (some document
    holds more than half of them)."""
    blocks: dict[Any, list[int]] = {}
    for i, doc in enumerate(documents):
        blocks.setdefault(doc, []).append(i)
    largest, n = max(len(b) for b in blocks.values()), len(documents)
    if n < 2 * largest:
        return None
    order = [i for k in rng.permutation(len(blocks)) for i in list(blocks.values())[k]]
    given = [0] * n
    for k, i in enumerate(order):
        given[i] = order[(k + largest) % n]
    return given


def conditioned_lm(scorer: _Scorer) -> Any:
    """The harness model (an ``lm_eval.api.model.LM``) scoring with ``scorer``."""
    from lm_eval.api.model import LM

    class ConditionedLM(LM):  # the harness's model protocol, one condition applied
        def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
            return scorer.loglikelihood(requests)

        def loglikelihood_rolling(self, requests: Sequence[Any]) -> list[float]:
            return [scorer.rolling(r.args[0], r.task_name) for r in requests]

        def generate_until(self, requests: Sequence[Any]) -> list[str]:
            raise UsageError("generation tasks are not supported yet: choose log-likelihood "
                             "or multiple-choice tasks", option="tasks")
    return ConditionedLM()


@dataclass
class MetricScores:
    """One metric of one task: its value under each condition (with a paired bootstrap
    interval over the task's examples), penalties against correct, retentions."""

    higher_is_better: bool
    values: dict[str, Estimate]
    penalty: dict[str, Estimate]  # the condition's value minus correct's
    retention: dict[str, Estimate | None]  # static profiles (None: no clear gap)


@dataclass
class TaskScores:
    task: str
    examples: int
    metrics: dict[str, MetricScores]
    requests: dict[str, int]  # per condition
    not_applicable: dict[str, str]  # conditions not scored on this task, and why


@dataclass
class TasksResult:
    """What :func:`evaluate_tasks` measured (``tasks.json`` with ``--json``)."""

    audit: str
    conditions: list[str]
    not_applicable: dict[str, str]
    tasks: dict[str, TaskScores]
    wall_s: dict[str, float]
    lm_eval_version: str
    schema: str = SCHEMA
    samples: dict[str, Any] = field(default_factory=dict, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "samples"}

    def markdown(self) -> str:
        """A table per task and metric: each condition's value, its penalty against correct
        and a static profile's retention, with 95% intervals."""
        def est(e: Estimate | None, spec: str) -> str:
            return "undefined (no clear gap)" if e is None else \
                f"{e.value:{spec}} [{e.ci95[0]:{spec}}, {e.ci95[1]:{spec}}]"
        lines = []
        for task, scores in self.tasks.items():
            for metric, m in scores.metrics.items():
                lines += [f"\n{task} ({scores.examples} examples): {metric} "
                          f"({'higher' if m.higher_is_better else 'lower'} is better)\n",
                          "| condition | value | minus correct | retention |",
                          "|---|---:|---:|---:|"]
                lines += [f"| {c} | {est(v, '.4f')} | "
                          f"{est(m.penalty[c], '+.4f') if c in m.penalty else ''} | "
                          f"{est(m.retention[c], '.1%') if c in m.retention else ''} |"
                          for c, v in m.values.items()]
        lines += [f"\nnot run: {c} ({why})" for c, why in self.not_applicable.items()]
        lines += [f"\nnot scored on {t}: {c} ({why})" for t, scores in self.tasks.items()
                  for c, why in scores.not_applicable.items()]
        return "\n".join(lines).lstrip("\n")


def _per_sample(samples: list[dict[str, Any]], metric: str) -> tuple[np.ndarray, ...]:
    """A metric's per-example values in document order: one array, or (log-likelihood,
    count) for a weighted metric."""
    rows = sorted(samples, key=lambda s: s["doc_id"])
    values = [s[metric] for s in rows]
    if metric in _WEIGHTED:
        return (np.array([float(v[0]) for v in values]), np.array([float(v[1]) for v in values]))
    if not all(isinstance(v, (int, float, bool)) for v in values):
        raise UsageError(f"metric {metric} has per-example values fcaudit cannot aggregate "
                         "yet; choose tasks scored by accuracy or perplexity",
                         option="tasks")
    return (np.array(values, dtype=float),)


def _aggregate(metric: str, parts: tuple[np.ndarray, ...], boot: Bootstrap
               ) -> tuple[float, np.ndarray]:
    """The metric over all examples and under each resample (the same resamples for
    every condition: paired)."""
    if metric in _WEIGHTED:
        ll, n = parts
        f = np.vectorize(_WEIGHTED[metric])
        return float(f(ll.sum(), n.sum())), f(boot.means(ll), boot.means(n))
    return float(parts[0].mean()), boot.means(parts[0])


def _scores(metric: str, higher: bool, per: dict[str, tuple[np.ndarray, ...]], seed: int
            ) -> MetricScores:
    n = len(next(iter(per.values()))[0])
    boot = Bootstrap(n, RESAMPLES, seed)
    agg = {c: _aggregate(metric, parts, boot) for c, parts in per.items()}
    values = {c: Estimate(v, interval(s, v)) for c, (v, s) in agg.items()}
    base, base_s = agg[CORRECT]
    penalty = {c: Estimate(v - base, interval(s - base_s, v - base))
               for c, (v, s) in agg.items() if c != CORRECT}
    retention: dict[str, Estimate | None] = {}
    if GLOBAL_MEAN in agg:
        gm, gm_s = agg[GLOBAL_MEAN]
        sign = 1.0 if higher else -1.0
        gap, gap_s = sign * (base - gm), sign * (base_s - gm_s)
        clear = interval(gap_s, gap)[0] > 0
        for c, (v, s) in agg.items():
            if CONDITIONS[c].profile is not None:
                with np.errstate(divide="ignore", invalid="ignore"):
                    share = sign * (s - gm_s) / gap_s
                retention[c] = Estimate(sign * (v - gm) / gap, interval(
                    share[np.isfinite(share)], sign * (v - gm) / gap)) if clear else None
    return MetricScores(higher, values, penalty, retention)


def load_tasks(tasks: Sequence[str], include_path: str | Path | None, seed: int) -> Any:
    """The harness's tasks, loaded once (their data read offline) and checked before any
    audit work: names it knows, log-likelihood kinds, no few-shot examples unless the
    task sets them."""
    from lm_eval.tasks import TaskManager
    manager = None
    if include_path is not None:  # indexing the harness's own thousands of tasks is slow
        manager = TaskManager(include_path=str(include_path), include_defaults=False)
        if not set(tasks) <= set(manager.all_tasks):
            manager = None
    manager = manager or TaskManager(
        include_path=None if include_path is None else str(include_path))
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        raise UsageError(f"{arg('tasks', ','.join(unknown))}: lm-evaluation-harness "
                         "knows no such task (give a task's YAML folder with "
                         f"{arg('include_path')})", option="tasks")
    try:
        loaded = manager.load(list(tasks))
    except (OSError, ConnectionError, ValueError) as exc:
        raise DataError(f"lm-evaluation-harness could not load {', '.join(tasks)} offline "
                        f"({type(exc).__name__}: {str(exc)[:200]}): give tasks whose data "
                        "lie in a local folder or in the datasets cache") from exc
    for name, task in loaded["tasks"].items():
        kind = task.get_config("output_type")
        if kind not in ("loglikelihood", "multiple_choice", "loglikelihood_rolling"):
            raise UsageError(f"{arg('tasks', name)} is a {kind} task; fcaudit runs "
                             "log-likelihood, multiple-choice and rolling log-likelihood "
                             "tasks (generation is not supported yet)", option="tasks")
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=seed)
    return loaded


def evaluate_tasks(audit: str | Path, tasks: Sequence[str], *, model: Any = None,
                   data: DataSpec | AuditData | None = None, tokenizer: Any = None,
                   include_path: str | Path | None = None, limit: int | None = None,
                   seed: int = 0, progress: Progress | None = None) -> TasksResult:
    """Score the lm-evaluation-harness ``tasks`` (names it knows, or task YAMLs under
    ``include_path``) with the audited model under each condition of the audit that runs
    on task requests. ``model`` and ``data``: the audit's (default: the model audit.json
    names, the built-in corpus), checked to be; ``tokenizer``: a ``tokenizers.Tokenizer``
    (default: the model's own); ``limit``: examples per task."""
    lm_eval = require_lm_eval()
    result = read_audit(audit)
    loaded = load_tasks(tasks, include_path, seed)
    run = [c for c in result.conditions if runnable(c) is None]
    skipped = {c: str(runnable(c)) for c in result.conditions if runnable(c) is not None}
    say = progress or (lambda *_: None)
    with reopened(result, model, data, declared=False) as setup:
        tok = tokenizer if tokenizer is not None else setup.loaded.tokenizer
        if tok is None:
            raise UsageError("the audited model has no tokenizer to read the task requests "
                             "with: audit a run or checkpoint folder that holds its "
                             "tokenizer.json, or in Python give tokenizer= (a "
                             "tokenizers.Tokenizer)")
        profiles, _ = recomputed_profiles(setup, say, "tasks")
        outputs, walls, counts, undonored = {}, {}, {}, {}
        for i, condition in enumerate(run, start=1):
            started = time.perf_counter()
            scorer = _Scorer(setup, profiles, tok, condition, seed)
            random.seed(seed)  # the harness's own draws (none for zero-shot tasks)
            np.random.seed(seed)
            outputs[condition] = lm_eval.evaluator.evaluate(
                lm=conditioned_lm(scorer), task_dict=loaded, limit=limit, log_samples=True,
                bootstrap_iters=0, verbosity="ERROR")
            walls[condition], counts[condition] = time.perf_counter() - started, scorer.requests
            undonored.update({(condition, t): n for t, n in scorer.undonored.items()})
            say("tasks: conditions", i, len(run))
    return TasksResult(str(audit), run, skipped, {
        t: _task_scores(t, outputs, counts, undonored, seed) for t in tasks}, walls,
        _version(), samples={c: o["samples"] for c, o in outputs.items()})


def _task_scores(task: str, outputs: dict[str, Any], counts: dict[str, int],
                 undonored: dict[tuple[str, str], int], seed: int) -> TaskScores:
    """One task's metrics under every condition that scored all of its requests."""
    skipped = {c: f"{n} of its requests had no donor (a request of the same token length "
                  "from another document; rolling requests have none)"
               for (c, t), n in undonored.items() if t == task}
    outputs = {c: o for c, o in outputs.items() if c not in skipped}
    first = outputs[CORRECT]
    higher = first["higher_is_better"][task]
    metrics = {}
    for key in first["results"][task]:
        metric, _, _filter = key.partition(",")
        if metric not in higher or key.endswith("_stderr") or "_stderr" in metric:
            continue
        per = {c: _per_sample(o["samples"][task], metric) for c, o in outputs.items()}
        metrics[metric] = _scores(metric, bool(higher[metric]), per, seed)
    return TaskScores(task, len(first["samples"][task]), metrics, counts, skipped)


def _version() -> str:
    from importlib.metadata import version
    return version("lm_eval")


__all__ = ["SCHEMA", "MetricScores", "TaskScores", "TasksResult", "evaluate_tasks"]
