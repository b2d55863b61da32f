"""Benchmark tasks scored under an audit's conditions: the audited model read by
lm-evaluation-harness (the ``lm-eval`` extra: its task definitions, metrics and per-sample
logs) with each condition applied. Used by an audit with ``--lm-eval-tasks`` (the
analysis :mod:`fcaudit.engine.analyses.tasks`) and by ``fcaudit tasks`` on a finished
audit (:mod:`fcaudit.engine.actions.tasks`).

The harness asks its model for log-likelihoods of request strings, batched and reordered
as it likes. :class:`ConditionedLM` is that model for one condition: each request is
tokenized with the audited model's tokenizer, recorded (the controllers live, their
outputs kept) and replayed with the coefficients the condition defines for that request:

* ``correct``: its own recorded ones; the replay must give the recorded logits bit for
  bit, or the evaluation stops (the audit's identity rule, per request);
* a static profile (``static-layer``, ``-position``, ``-token``, ``global-mean``): the
  audit's calibration profiles; positions past the calibration windows take the site's
  static-layer value, as ``fcaudit fold`` writes them;
* ``reassign``: the recorded coefficients of a donor, a request of the same token length
  from another document (:func:`donors`); a task with requests that have none is not
  scored under it, and says so;
* ``shuffle``: its own recorded coefficients with their positions permuted (one seeded
  permutation per request, sites of the same length alike); ``reassign+shuffle``: the
  donor's, permuted;
* ``original``: the unperturbed pass itself.

The exit conditions and ``static-layer-token-position`` are listed as not run, with the
reason. Generation tasks are refused. Per task and metric: the value under each condition
(the task's own aggregation of its per-example items: a mean, a weighted perplexity...)
with a paired bootstrap interval over the task's examples (the same resamples for every
condition), the penalty against ``correct`` and each static profile's retention of the
Correct-to-GlobalMean gap (undefined where the gap's interval does not clear zero).
"""

from __future__ import annotations

import contextlib
import io
import math
import numbers
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
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
    REASSIGN_SHUFFLE,
    SHUFFLE,
)
from fcaudit.core.errors import DataError, IdentityError, UsageError, arg, install_extra
from fcaudit.core.interventions import StaticProfiles, shuffle_by_length, static_any_length
from fcaudit.core.nll import device_of, logits_of, model_limits
from fcaudit.engine.analyses.tasks import MetricScores, TaskScores, TasksSection
from fcaudit.engine.metrics import Bootstrap, interval
from fcaudit.engine.result_parts import Estimate

# what reports a stage's progress: (stage, done, total)
Progress = Callable[[str, int, int], None]
RESAMPLES = 1000


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
    datasets.disable_progress_bars()  # a local task's data cached: not the user's concern
    return lm_eval


def runnable(condition: str) -> str | None:
    """Why a condition is not run on task requests (None: it is)."""
    entry = CONDITIONS[condition]
    if entry.kind in ("reference", "random") or entry.kind == "static" and entry.profile in (
            "layer", "layer_position", "layer_token", "global_mean"):
        return None
    return f"a {entry.kind} condition; fcaudit does not feed it to task requests yet"


def draws(condition: str, repeats: int) -> int:
    """How many times a condition scores the requests: a random one (reassign, shuffle)
    once per repeat of the audit (seeds ``seed``, ``seed + 1``, ...), the others once."""
    return repeats if CONDITIONS[condition].kind == "random" else 1


def pass_positions(setup: Any) -> int:
    """The positions a scoring pass may read: the audit's own batches' (what its memory
    was sized for)."""
    ids = setup.inputs.token_ids
    return setup.options.batch_size * (int(ids.shape[1]) if ids is not None else 1)


class Scorer:
    """Requests scored by the audited model with one condition applied."""

    def __init__(self, setup: Any, profiles: StaticProfiles, tokenizer: Any,
                 condition: str, seed: int = 0) -> None:
        self.setup, self.profiles, self.tokenizer = setup, profiles, tokenizer
        self.condition, self.seed = condition, seed
        self.donated = condition in (REASSIGN, REASSIGN_SHUFFLE)  # fed another's coefficients
        self.rng = np.random.default_rng(seed)  # shuffle's permutations, in request order
        self.context = model_limits(setup.model)[1]
        self.scored: dict[str, int] = {}  # requests scored, by task
        self.undonored: dict[str, int] = {}  # reassign: requests without a donor, by task
        self.positions = pass_positions(setup)

    def encode(self, text: str) -> list[int]:
        return encode(self.tokenizer, text)

    def _count(self, counts: dict[str, int], task: Any) -> None:
        counts[str(task)] = counts.get(str(task), 0) + 1

    def _inputs(self, rows: Sequence[list[int]]) -> Tensor:
        """Requests of one token length as a batch ``[B, T - 1]`` (each request's last token
        is only predicted)."""
        longest = max(len(ids) for ids in rows)
        if self.context is not None and longest - 1 > self.context:  # check_requests says
            raise DataError(f"a task request of {longest} tokens reads {longest - 1} "
                            f"positions, beyond the model's context of {self.context}: "
                            "choose tasks whose requests fit")  # it first, where it runs
        return torch.tensor([ids[:-1] for ids in rows], device=device_of(self.setup.model))

    def _shuffled(self, coefficients: dict[str, Tensor]) -> dict[str, Tensor]:
        """Each request's coefficients with their positions permuted (one permutation per
        request, in request order), sites with the same number of positions alike (as the
        audit's shuffle does per sequence)."""
        rows = int(next(iter(coefficients.values())).shape[0])
        return shuffle_by_length(coefficients, lambda length: np.stack(
            [self.rng.permutation(length) for _ in range(rows)]))

    def logits(self, x: Tensor, donor: dict[str, Tensor] | None = None) -> Tensor:
        """The model's logits ``[B, T, V]`` on ``x`` under the condition (``donor``:
        reassign's, other requests' recorded coefficients, a row each)."""
        if donor is not None:  # nothing of its own is read: no record pass
            if self.condition == REASSIGN_SHUFFLE:
                donor = self._shuffled(donor)
            replayed = self.setup.executor.replay(x, {s: donor[s.name] for s in self.setup.sites})
            return logits_of(replayed.logits)
        logits, coefficients, _ = self.setup.executor.record(x, None)
        if self.condition == ORIGINAL:
            return logits_of(logits)
        if self.condition == SHUFFLE:
            coefficients = self._shuffled(coefficients)
        fed = {s: coefficients[s.name] if self.condition in (CORRECT, SHUFFLE) else
               static_any_length(self.condition, s, self.profiles, coefficients[s.name], x)
               for s in self.setup.sites}
        replayed = logits_of(self.setup.executor.replay(x, fed).logits)
        if self.condition == CORRECT and not torch.equal(replayed, logits_of(logits)):
            raise IdentityError("identity replay is not exact on a task request: the replay "
                                "with its recorded coefficients does not give the recorded "
                                "logits bit for bit, so no condition can be scored on it")
        return replayed

    @staticmethod
    def continuation(logits: Tensor, whole: list[int], head: int) -> tuple[float, bool]:
        """log P(continuation | context) from one request's logits ``[T - 1, V]``, and
        whether it is the greedy one."""
        lp = torch.log_softmax(logits[head - 1:].double(), -1)
        want = torch.tensor(whole[head:], device=lp.device)
        return float(lp.gather(-1, want[:, None]).sum()), bool(lp.argmax(-1).eq(want).all())

    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        """Every request's score, requests of one token length scored together (as many a
        pass as fill the audit's own batches' positions); under reassign each is fed the
        coefficients of a request of the same token length from another document
        (:func:`donors`)."""
        split = [split_request(self.tokenizer, *r.args) for r in requests]
        out: list[tuple[float, bool]] = [(math.nan, False)] * len(split)
        by_length: dict[int, list[int]] = {}
        for i, (whole, _) in enumerate(split):
            by_length.setdefault(len(whole), []).append(i)
        rng = np.random.default_rng(self.seed)
        for members in by_length.values():
            given = donors([(requests[i].task_name, requests[i].doc_id) for i in members],
                           rng) if self.donated else None
            if self.donated and given is None:  # no request of another document this long
                for i in members:
                    self._count(self.undonored, requests[i].task_name)
                continue
            rows = rows_per_pass(self.positions, len(split[members[0]][0]) - 1)
            starts = range(0, len(members), rows)
            recorded = self._recorded([members[k:k + rows] for k in starts], split) \
                if given is not None else {}
            for k in starts:
                chunk = members[k:k + rows]
                donor = None if given is None else {
                    name: torch.cat([recorded[members[given[j]]][name]
                                     for j in range(k, k + len(chunk))])
                    for name in recorded[members[0]]}
                logits = self.logits(self._inputs([split[i][0] for i in chunk]), donor)
                for row, i in enumerate(chunk):
                    self._count(self.scored, requests[i].task_name)
                    out[i] = self.continuation(logits[row], *split[i])
        return out

    def _recorded(self, chunks: list[list[int]], split: list[tuple[list[int], int]]
                  ) -> dict[int, dict[str, Tensor]]:
        """Each request's recorded coefficients (a row each), recorded a chunk a pass."""
        out = {}
        for chunk in chunks:
            _, coefficients, _ = self.setup.executor.record(
                self._inputs([split[i][0] for i in chunk]), None)
            out.update({i: {name: t[row:row + 1] for name, t in coefficients.items()}
                        for row, i in enumerate(chunk)})
        return out

    def rolling(self, text: str, task: str | None = None) -> float:
        """log P of every token of ``text`` after its first, in windows of the model's
        context (one token of context across a window's edge, as the harness does).
        Reassign has no donor for a document's windows: not scored."""
        if self.donated:
            self._count(self.undonored, task)
            return math.nan
        self._count(self.scored, task)
        ids = self.encode(text)
        size, total, start = self.context or len(ids), 0.0, 1
        while start < len(ids):
            stop = min(start + size, len(ids))
            window = ids[start - 1:stop]
            total += self.continuation(self.logits(self._inputs([window]))[0], window, 1)[0]
            start = stop
        return total


def _no_bars() -> contextlib.AbstractContextManager[Any]:
    """The harness's own progress bars (one per task and condition, on stderr) kept from
    the user, who sees fcaudit's: one step per condition."""
    return contextlib.redirect_stderr(io.StringIO())


def encode(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids (a ``tokenizers.Tokenizer``; no special tokens added)."""
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def split_request(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], int]:
    """A log-likelihood request's token ids and how many are context, the harness's way of
    splitting the two (trailing spaces of the context go with the continuation)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, head = encode(tokenizer, context + continuation), encode(tokenizer, context)
    if not head or len(whole) <= len(head):
        raise DataError(f"a task request has an empty context or continuation once "
                        f"tokenized ({context[-30:]!r} / {continuation[:30]!r}); "
                        "fcaudit scores a continuation given at least one context token")
    return whole, len(head)


def check_requests(loaded: Any, tokenizer: Any, context: int | None, limit: int | None,
                   flag: str = "tasks", owner: str = "") -> tuple[list[int], list[int]]:
    """Build every task's requests (as the harness will) and refuse, before any scoring, a
    request the tokenizer leaves empty or that exceeds the model's context (rolling
    requests are read in windows of it: they always fit). Returns the positions each
    request reads (scored in batches of one length) and each rolling window reads (a
    pass each)."""
    requests, windows = [], []
    for name, task in loaded["tasks"].items():
        with _no_bars():
            task.build_all_requests(limit=limit, rank=0, world_size=1)
        for instance in task.instances:
            if instance.request_type != "loglikelihood":
                read = len(encode(tokenizer, instance.args[0])) - 1
                size = context or max(read, 1)
                windows += [min(size, read - k) for k in range(0, read, size)]
                continue
            whole, _ = split_request(tokenizer, *instance.args)
            requests.append(len(whole) - 1)
            if context is not None and len(whole) - 1 > context:
                raise DataError(f"{arg(flag, name, owner=owner)}: a request of {len(whole)} "
                                f"tokens reads {len(whole) - 1} positions, beyond the model's "
                                f"context of {context} (fcaudit does not cut a request's "
                                "context): choose tasks whose requests fit, or a model with a "
                                "longer context")
    return requests, windows


def rows_per_pass(positions: int, length: int) -> int:
    """How many requests of ``length`` positions one pass scores, in a pass of at most
    ``positions`` positions (the audit's own batches')."""
    return max(1, positions // max(length, 1))


def passes_for(requests: Sequence[int], windows: Sequence[int], positions: int) -> int:
    """The batches one condition scores (each at most a record and a replay pass): the
    requests of one length in batches (:func:`rows_per_pass`), each rolling window alone."""
    return len(windows) + sum(-(-k // rows_per_pass(positions, n))
                              for n, k in Counter(requests).items())


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


def conditioned_lm(scorer: Scorer) -> Any:
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


def _items(samples: list[dict[str, Any]], metric: str) -> list[Any]:
    """A metric's per-example items, as the harness logged them, in document order."""
    return [s[metric] for s in sorted(samples, key=lambda s: s["doc_id"])]


def _mean_items(draws: list[list[Any]]) -> list[Any]:
    """Each example's item averaged over the draws: a number, or each number of a tuple
    (a weighted perplexity's log-likelihood and weight); one draw as it is."""
    if len(draws) == 1:
        return draws[0]

    def mean(values: tuple[Any, ...]) -> Any:
        if all(isinstance(v, numbers.Number) for v in values):  # numpy's scalars too
            return float(np.mean(values))
        if all(isinstance(v, (tuple, list)) and len(v) == len(values[0]) for v in values):
            return type(values[0])(mean(parts) for parts in zip(*values, strict=True))
        raise DataError(f"a task's per-example items {values[0]!r} cannot be averaged over "
                        f"the audit's repeats: score it with an audit of "
                        f"{arg('repeats', 1, owner='AuditOptions')}")
    return [mean(values) for values in zip(*draws, strict=True)]


def _aggregate(aggregate: Callable[[list[Any]], float], items: list[Any], boot: Bootstrap
               ) -> tuple[float, np.ndarray]:
    """The metric over all examples by the task's own aggregation (a mean, a weighted
    perplexity, bits per byte...) and under each resample of the examples (the same
    resamples for every condition: paired)."""
    from lm_eval.api.metrics import mean
    if aggregate is mean and all(isinstance(v, (int, float, bool)) for v in items):
        values = np.asarray(items, dtype=float)  # the common case, vectorised
        return float(values.mean()), boot.means(values)
    return float(aggregate(items)), np.array([float(aggregate([items[i] for i in row]))
                                              for row in boot.rows()])


def _scores(aggregate: Callable[[list[Any]], float], higher: bool,
            per: dict[str, list[Any]], seed: int) -> MetricScores:
    n = len(next(iter(per.values())))
    boot = Bootstrap(n, RESAMPLES, seed)
    agg = {c: _aggregate(aggregate, items, boot) for c, items in per.items()}
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
            if CONDITIONS[c].profile is None:
                continue
            retention[c] = None
            if clear:  # in percent, as the NLL's retention
                with np.errstate(divide="ignore", invalid="ignore"):
                    share = 100 * sign * (s - gm_s) / gap_s
                kept = 100 * sign * (v - gm) / gap
                retention[c] = Estimate(kept, interval(share[np.isfinite(share)], kept))
    return MetricScores(higher, values, penalty, retention)


def load_tasks(tasks: Sequence[str], include_path: str | Path | None, seed: int,
               flags: tuple[str, str] = ("tasks", "include_path"), owner: str = "") -> Any:
    """The harness's tasks, loaded once (their data read offline) and checked before any
    audit work: names it knows, log-likelihood kinds, no few-shot examples unless the
    task sets them. A group (``mmlu``) stands for its tasks, each scored on its own.
    ``flags``: the caller's names of the two options (``owner``: the object they are
    fields of), for messages."""
    names, folder = flags
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
        raise UsageError(f"{arg(names, ','.join(unknown), owner=owner)}: lm-evaluation-"
                         "harness knows no such task (give a task's YAML folder with "
                         f"{arg(folder, owner=owner)})", option=names)
    try:
        loaded = manager.load(list(tasks))
    except (OSError, ConnectionError, ValueError) as exc:
        raise DataError(f"lm-evaluation-harness could not load {', '.join(tasks)} offline "
                        f"({type(exc).__name__}: {str(exc)[:200]}): give tasks whose data "
                        "lie in a local folder or in the datasets cache") from exc
    for name, task in loaded["tasks"].items():
        kind = task.get_config("output_type")
        if kind not in ("loglikelihood", "multiple_choice", "loglikelihood_rolling"):
            raise UsageError(f"{arg(names, name, owner=owner)} is a {kind} task; fcaudit runs "
                             "log-likelihood, multiple-choice and rolling log-likelihood "
                             "tasks (generation is not supported yet)", option=names)
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=seed)
    return loaded


def score_tasks(setup: Any, profiles: StaticProfiles, tokenizer: Any, loaded: Any,
                conditions: Sequence[str], limit: int | None, seed: int, say: Progress
                ) -> tuple[TasksSection, dict[str, Any]]:
    """The ``loaded`` tasks (:func:`load_tasks`; a group's, each on its own) scored with
    the prepared audit's model under each of ``conditions`` that runs on task requests
    (``profiles``: the audit's calibration profiles; a random condition once per repeat
    of the audit, :func:`draws`), and lm-eval's per-sample logs by condition (a random
    condition's first draw)."""
    import lm_eval.evaluator
    run = [c for c in conditions if runnable(c) is None]
    skipped = {c: str(runnable(c)) for c in conditions if runnable(c) is not None}
    outputs: dict[str, list[Any]] = {}
    walls, counts, undonored = {}, {}, {}
    for i, condition in enumerate(run, start=1):
        started = time.perf_counter()
        for k in range(draws(condition, setup.options.repeats)):
            scorer = Scorer(setup, profiles, tokenizer, condition, seed + k)
            random.seed(seed)  # the harness's own draws (none for zero-shot tasks)
            np.random.seed(seed)
            with _no_bars():
                outputs.setdefault(condition, []).append(lm_eval.evaluator.evaluate(
                    lm=conditioned_lm(scorer), task_dict=loaded, limit=limit,
                    log_samples=True, bootstrap_iters=0, verbosity="ERROR"))
            if not k:  # what each draw scores is alike: the requests, the donors' lack
                counts[condition] = scorer.scored
                undonored.update({(condition, t): n for t, n in scorer.undonored.items()})
        walls[condition] = time.perf_counter() - started
        say("tasks: conditions", i, len(run))
    section = TasksSection(run, skipped, {
        str(t): _task_scores(str(t), task.aggregation(), outputs, counts, undonored, seed)
        for t, task in loaded["tasks"].items()}, walls,
        _version())
    return section, {c: o[0]["samples"] for c, o in outputs.items()}


def _task_scores(task: str, aggregations: dict[str, Callable[[list[Any]], float]],
                 outputs: dict[str, list[Any]], counts: dict[str, dict[str, int]],
                 undonored: dict[tuple[str, str], int], seed: int) -> TaskScores:
    """One task's metrics under every condition that scored all of its requests (a
    random condition's per-example items averaged over its draws, as the audit averages a
    sequence's losses over its repeats)."""
    skipped = {c: f"{n} of its requests had no donor (a request of the same token length "
                  "from another document; rolling requests have none)"
               for (c, t), n in undonored.items() if t == task}
    outputs = {c: o for c, o in outputs.items() if c not in skipped}
    first = outputs[CORRECT][0]
    higher = first["higher_is_better"][task]
    metrics = {}
    for key in first["results"][task]:
        metric, _, _filter = key.partition(",")
        if metric not in higher or key.endswith("_stderr") or "_stderr" in metric:
            continue
        per = {c: _mean_items([_items(o["samples"][task], metric) for o in outs])
               for c, outs in outputs.items()}
        metrics[metric] = _scores(aggregations[metric], bool(higher[metric]), per, seed)
    return TaskScores(task, len(first["samples"][task]), metrics,
                      {c: n.get(task, 0) for c, n in counts.items()}, skipped)


def _version() -> str:
    from importlib.metadata import version
    return version("lm_eval")


__all__ = ["Scorer", "conditioned_lm", "donors", "load_tasks", "require_lm_eval",
           "score_tasks"]
