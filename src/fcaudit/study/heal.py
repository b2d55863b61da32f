"""Heal a folded model (``fcaudit fold --heal-steps N``): fine-tune it briefly, with the
same steps spent fine-tuning the original as the control.

The question a fold leaves: is the dynamic controller needed, or did the rest of the
network merely adapt to it? Fine-tuning the folded model says how much of its penalty a
little training recovers; the control says whether that is the fold healing or just more
training (the original, fine-tuned on the same batches with the same schedule, improves
too). Both are scored on the audit's evaluation windows along the way; the penalty of the
folded model against the original, per sequence, with a paired bootstrap interval,
before healing and after (healed against the fine-tuned original), and the share of the
penalty recovered where the penalty before is clearly above zero.

Healing continues at a tenth of the run's own peak learning rate, decaying on the run's
cosine schedule, on random windows of the run's training length: of the built-in
training plays (where the run's tokenizer is the built-in corpus's) or of the user's text
(tokenized with the run's own tokenizer). A run trained on a synthetic task (selective
copying) heals on fresh sequences of its task, drawn as its training drew them (never one
of the audit's), scored by the task's objective, with the task's accuracy (every answer
of an example right) beside the loss at every point: whether healing makes a fold pass
the task is the question there. All weights are trained, or those whose names match the
given globs (``params``), in both models alike.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fcaudit.core.errors import DataError, UsageError, arg
from fcaudit.core.nll import device_of, logits_of, token_nll
from fcaudit.engine.metrics import Bootstrap, interval
from fcaudit.engine.objectives import Objective, run_task
from fcaudit.engine.result_parts import Estimate
from fcaudit.io.data import encode_documents, folder_tokenizer, text_documents
from fcaudit.io.fileio import write_text
from fcaudit.io.loading import load_run
from fcaudit.study.train import TrainPreset, builtin_tokenizer, fit_tokens, training_data

SCHEMA = "fcaudit.heal/1"
LR_FACTOR = 0.1  # of the run's peak learning rate
POINTS = 4  # evaluations along the way, besides step 0
RESAMPLES = 1000


@dataclass
class HealPoint:
    step: int
    folded_nll: float  # a task run: the task's loss
    original_nll: float  # the control: the original fine-tuned alike
    folded_accuracy: float | None = None  # a task run: share of examples all right
    original_accuracy: float | None = None


@dataclass
class HealResult:
    """The folded model healed for ``steps`` steps, against the original fine-tuned alike."""

    steps: int
    lr: float
    batch_size: int
    seq_len: int
    seed: int
    data: str  # what it trained on
    curve: list[HealPoint]
    penalty_before: Estimate  # folded minus original, per sequence (nats)
    penalty_after: Estimate  # healed minus the fine-tuned original
    recovered: Estimate | None  # share of the penalty before recovered (None: not clear)
    out: str | None
    params: list[str] | None  # the globs naming the weights trained (None: all)
    trained: dict[str, int]  # numbers trained: in the folded model, in the control (original)
    schema: str = SCHEMA

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


Score = tuple[np.ndarray, float | None]  # per-unit losses, and the task's accuracy


@dataclass
class _Healing:
    """What healing trains on and how a model is scored: text windows or a task's
    sequences. ``train(model, tp, seed, progress, label, before)``; ``score(model)``."""

    said: str
    train: Callable[..., Any]
    score: Callable[[nn.Module], Score]


def _per_sequence(model: nn.Module, windows: np.ndarray, batch_size: int = 16) -> Score:
    was = model.training
    model.eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            ids = torch.from_numpy(windows[i:i + batch_size]).to(device_of(model))
            out.append(token_nll(logits_of(model(ids)), ids).double().mean(-1).cpu().numpy())
    model.train(was)
    return np.concatenate(out), None


def _text(run: Path, config: dict[str, Any], data: str | Path | None, tp: TrainPreset,
          eval_ids: np.ndarray) -> _Healing:
    """Healing on token windows, scored per evaluation window."""
    stream, said = _tokens(run, config, data)
    if len(stream) < tp.seq_len + 2:
        raise DataError(f"the heal data hold {len(stream)} tokens, fewer than one window of "
                        f"{tp.seq_len + 1}")
    return _Healing(said, lambda model, tp, seed, progress, label, before: fit_tokens(
        model, stream, tp, np.random.default_rng(seed), progress, label, before),
        lambda model: _per_sequence(model, eval_ids))


def _task(run: Path, config: dict[str, Any], data: str | Path | None, eval_ids: np.ndarray,
          eval_targets: np.ndarray | None) -> _Healing:
    """Healing on fresh sequences of the run's task, scored per evaluation example."""
    from fcaudit.study import tasks
    entry = _task_entry(run, config, data)
    if eval_targets is None or len(eval_targets) != len(eval_ids):
        raise UsageError(f"{run} trained on the task {entry.name}: give the answers of the "
                         "evaluation examples (eval_targets: FoldResult.eval_targets)")
    module, objective = importlib.import_module(entry.task), Objective(entry.name)
    task = module.from_record(config.get("data"), str(run))

    def score(model: nn.Module) -> Score:
        was = model.training
        losses, hits, _ = tasks.per_example(model, objective, eval_ids, eval_targets)
        model.train(was)
        return losses, float(hits.mean())
    return _Healing(f"fresh {entry.name} sequences (the run's task)",
                    lambda model, tp, seed, progress, label, before: tasks.fit(
                        model, module, task, objective, tp, seed, progress, label, before),
                    score)


def _tokenizer(run: Path, config: dict[str, Any], data: str | Path | None) -> Any:
    """The run's tokenizer, which reads the text to heal on (the built-in training plays
    where no text is given: only for a run of the built-in corpus's tokenizer)."""
    tok = folder_tokenizer(run)
    if tok is None:
        raise DataError(f"{run} has no tokenizer.json: healing reads text with the run's own "
                        "tokenizer")
    vocab = int(config["model_config"]["vocab_size"])
    if data is None and builtin_tokenizer(vocab).to_str() != tok.to_str():
        raise UsageError(f"{run}'s tokenizer is not the built-in corpus's: give the text to "
                         f"heal on ({arg('heal_data', py='data')})", option="heal_data")
    return tok


def _task_entry(run: Path, config: dict[str, Any], data: str | Path | None) -> Any:
    """The task a run trained on, which it heals on (no text)."""
    entry = run_task(config)
    assert entry is not None and entry.task is not None
    if data is not None:
        raise UsageError(f"{run} trained on the task {entry.name}: it heals on fresh "
                         f"sequences of its task; drop {arg('heal_data', py='data')}",
                         option="heal_data")
    return entry


def check_heal(original: str | Path, steps: int, data: str | Path | None) -> None:
    """Refuse what healing the fold of the run ``original`` would refuse, read from that
    run's folder alone (callable before the fold writes anything): the step count, the
    run's training schedule, and what it would heal on."""
    from fcaudit.io.fileio import read_json
    if steps < 1:
        raise UsageError(f"{arg('heal_steps', steps)}: at least 1", option="heal_steps")
    run = Path(original)
    config = read_json(run / "config.json", "run config") \
        if (run / "config.json").is_file() else None
    if not isinstance(config, dict) or "fcaudit_run" not in config:
        raise UsageError(f"{run} is not a run folder of fcaudit train: healing continues a "
                         "run's own training schedule, which a checkpoint does not record; "
                         "fine-tune the folded run with your own trainer",
                         option="heal_steps")
    _schedule(config, steps)
    if run_task(config) is not None:
        _task_entry(run, config, data)
    else:
        _tokenizer(run, config, data)


def _tokens(run: Path, config: dict[str, Any], data: str | Path | None
            ) -> tuple[np.ndarray, str]:
    """The token stream to heal on, and what it is."""
    tok = _tokenizer(run, config, data)
    if data is not None:
        stream = np.concatenate(encode_documents(tok, text_documents(data)))
        return stream, f"text {data} (the run's tokenizer)"
    vocab = int(config["model_config"]["vocab_size"])
    _, stream, _, _ = training_data(vocab, int(config.get("train", {}).get("seq_len", 128)),
                                    None)
    return stream, "the built-in training plays"


def _schedule(config: dict[str, Any], steps: int) -> TrainPreset:
    train = config.get("train") or {}
    if not {"seq_len", "batch_size", "lr"} <= set(train):
        raise DataError("the run's config.json records no training schedule (train: seq_len, "
                        "batch_size, lr): healing continues the run's own")
    return TrainPreset(seq_len=int(train["seq_len"]), batch_size=int(train["batch_size"]),
                       steps=steps, lr=float(train["lr"]) * LR_FACTOR, warmup=0)


def check_params(folded: nn.Module, params: Sequence[str]) -> None:
    """Refuse a glob of ``params`` that names no weight of the folded model (callable
    before the fold is written: nothing is)."""
    names = [n for n, _ in folded.named_parameters()]
    for glob in params:
        if not fnmatch.filter(names, glob):
            raise UsageError(f"{arg('heal_params', glob)} names no weight of the folded model "
                             f"(its weights: {', '.join(names[:6])}, ...); give globs over "
                             "these names", option="heal_params")


def _train_only(model: nn.Module, params: Sequence[str] | None) -> int:
    """Freeze every weight of ``model`` but those whose names match a glob of ``params``
    (None: train all); how many numbers are trained. The original may have none of them
    (a fold's new constants, e.g. a folded Mamba's ``layers.*.mixer.dt``): then the
    control is the original untrained."""
    if params is None:
        return sum(p.numel() for p in model.parameters())
    trained = 0
    for n, p in model.named_parameters():
        p.requires_grad_(any(fnmatch.fnmatchcase(n, g) for g in params))
        trained += p.numel() if p.requires_grad else 0
    return trained


def _fine_tuned(model: nn.Module, healing: _Healing, tp: TrainPreset, seed: int,
                progress: bool, name: str) -> dict[int, Score]:
    """``model`` fine-tuned as ``healing`` trains (the seed draws the batches: the same for
    every model), scored at step 0, along the way and at the end."""
    marks = {round(tp.steps * k / POINTS) for k in range(POINTS)}
    if not any(p.requires_grad for p in model.parameters()):  # nothing to train: as it is
        unchanged = healing.score(model)
        return {i: unchanged for i in (*marks, tp.steps)}
    scores: dict[int, Score] = {}

    def before(i: int) -> None:
        if i in marks:
            scores[i] = healing.score(model)
    torch.manual_seed(seed)
    healing.train(model, tp, seed, progress, f"heal: fine-tune the {name} model", before)
    scores[tp.steps] = healing.score(model)
    return scores


def _penalties(before: np.ndarray, after: np.ndarray, seed: int
               ) -> tuple[Estimate, Estimate, Estimate | None]:
    """The penalty per sequence before and after healing (paired bootstrap: the same
    resamples), and the share recovered where the penalty before is clearly above zero."""
    boot = Bootstrap(len(before), RESAMPLES, seed)
    b_s, a_s = boot.means(before), boot.means(after)
    pb = Estimate(float(before.mean()), interval(b_s, float(before.mean())))
    pa = Estimate(float(after.mean()), interval(a_s, float(after.mean())))
    if pb.ci95[0] <= 0:
        return pb, pa, None
    share = 1 - pa.value / pb.value
    return pb, pa, Estimate(share, interval(1 - a_s / b_s, share))


def heal(folded: str | Path, original: str | Path, steps: int, eval_ids: np.ndarray, *,
         eval_targets: np.ndarray | None = None, data: str | Path | None = None,
         params: Sequence[str] | None = None, out: str | Path | None = None, seed: int = 0,
         force: bool = False, progress: bool = True) -> HealResult:
    """Fine-tune the folded run ``folded`` and, as the control, the ``original`` run for
    ``steps`` steps on the same batches; score both on ``eval_ids`` ``[N, T]`` (the
    audit's evaluation windows; a task run's: its evaluation examples, whose answers are
    ``eval_targets``) at step 0, along the way and at the end; write the healed model as a
    run folder at ``out`` (None: measure only). ``params``: globs over weight names
    (``blocks.*.mlp.*``): only those train, in both models (None: all)."""
    from fcaudit.io.outdir import hold_output
    from fcaudit.io.runs import building, check_run_out, write_run
    check_heal(original, steps, data)
    target = Path(out).expanduser() if out is not None else None
    if target is not None:
        check_run_out(target, force)
    source = load_run(Path(original))
    config = source.run_config or {}
    tp = _schedule(config, steps)
    healing = _task(Path(original), config, data, eval_ids, eval_targets) \
        if run_task(config) is not None else _text(Path(original), config, data, tp, eval_ids)
    start = load_run(Path(folded))  # both loaded afresh: trained in place
    healed = start.model.float()
    if params is not None:
        check_params(healed, params)
    models = {"folded": healed, "control": source.model.float()}
    trained = {name: _train_only(model, params) for name, model in models.items()}
    scores = {name: _fine_tuned(model, healing, tp, seed, progress, name)
              for name, model in models.items()}
    ours, control = scores["folded"], scores["control"]
    curve = [HealPoint(i, float(ours[i][0].mean()), float(control[i][0].mean()),
                       ours[i][1], control[i][1]) for i in sorted(ours)]
    done = HealResult(steps, tp.lr, tp.batch_size, tp.seq_len, seed, healing.said, curve,
                      *_penalties(ours[0][0] - control[0][0],
                                  ours[steps][0] - control[steps][0], seed),
                      None if target is None else str(target),
                      None if params is None else list(params), trained)
    if target is not None:
        with hold_output(target, "run"), building(target) as work:
            tokenizer = Path(folded) / "tokenizer.json"
            if tokenizer.is_file():
                write_text(work / "tokenizer.json", tokenizer.read_text(encoding="utf-8"))
            write_run(work, healed, None, {
                **{k: v for k, v in (start.run_config or {}).items()
                   if k not in ("weights_sha256", "versions", "fcaudit_run")},
                "heal": done.to_json()})
    return done
