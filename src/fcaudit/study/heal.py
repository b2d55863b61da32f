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
(tokenized with the run's own tokenizer). All weights are trained, or those whose names
match the given globs (``params``), in both models alike.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fcaudit.core.errors import DataError, UsageError, arg
from fcaudit.core.nll import device_of, logits_of, token_nll
from fcaudit.engine.metrics import Bootstrap, interval
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
    folded_nll: float
    original_nll: float  # the control: the original fine-tuned alike


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


def _per_sequence(model: nn.Module, windows: np.ndarray, batch_size: int = 16) -> np.ndarray:
    was = model.training
    model.eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            ids = torch.from_numpy(windows[i:i + batch_size]).to(device_of(model))
            out.append(token_nll(logits_of(model(ids)), ids).double().mean(-1).cpu().numpy())
    model.train(was)
    return np.concatenate(out)


def _tokens(run: Path, config: dict[str, Any], data: str | Path | None
            ) -> tuple[np.ndarray, str]:
    """The token stream to heal on, and what it is."""
    tok = folder_tokenizer(run)
    if tok is None:
        raise DataError(f"{run} has no tokenizer.json: healing reads text with the run's own "
                        "tokenizer")
    if data is not None:
        stream = np.concatenate(encode_documents(tok, text_documents(data)))
        return stream, f"text {data} (the run's tokenizer)"
    vocab = int(config["model_config"]["vocab_size"])
    if builtin_tokenizer(vocab).to_str() != tok.to_str():
        raise UsageError(f"{run}'s tokenizer is not the built-in corpus's: give the text to "
                         f"heal on ({arg('heal_data')})", option="heal_data")
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


def _fine_tuned(model: nn.Module, stream: np.ndarray, tp: TrainPreset, eval_ids: np.ndarray,
                seed: int, progress: bool, name: str) -> dict[int, np.ndarray]:
    """``model`` fine-tuned on ``stream`` (the seed draws the batches: the same for every
    model), scored per sequence on ``eval_ids`` at step 0, along the way and at the end."""
    marks = {round(tp.steps * k / POINTS) for k in range(POINTS)}
    if not any(p.requires_grad for p in model.parameters()):  # nothing to train: as it is
        unchanged = _per_sequence(model, eval_ids)
        return {i: unchanged for i in (*marks, tp.steps)}
    scores: dict[int, np.ndarray] = {}

    def before(i: int) -> None:
        if i in marks:
            scores[i] = _per_sequence(model, eval_ids)
    torch.manual_seed(seed)
    fit_tokens(model, stream, tp, np.random.default_rng(seed), progress,
               f"heal: fine-tune the {name} model", before)
    scores[tp.steps] = _per_sequence(model, eval_ids)
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
         data: str | Path | None = None, params: Sequence[str] | None = None,
         out: str | Path | None = None, seed: int = 0, force: bool = False,
         progress: bool = True) -> HealResult:
    """Fine-tune the folded run ``folded`` and, as the control, the ``original`` run for
    ``steps`` steps on the same batches; score both on ``eval_ids`` ``[N, T]`` (the
    audit's evaluation windows) at step 0, along the way and at the end; write the healed
    model as a run folder at ``out`` (None: measure only). ``params``: globs over weight
    names (``blocks.*.mlp.*``): only those train, in both models (None: all)."""
    from fcaudit.io.outdir import hold_output
    from fcaudit.io.runs import building, check_run_out, write_run
    if steps < 1:
        raise UsageError(f"{arg('heal_steps', steps)}: at least 1", option="heal_steps")
    target = Path(out).expanduser() if out is not None else None
    if target is not None:
        check_run_out(target, force)
    source = load_run(Path(original))
    config = source.run_config or {}
    tp = _schedule(config, steps)
    stream, said = _tokens(Path(original), config, data)
    if len(stream) < tp.seq_len + 2:
        raise DataError(f"the heal data hold {len(stream)} tokens, fewer than one window of "
                        f"{tp.seq_len + 1}")
    start = load_run(Path(folded))  # both loaded afresh: trained in place
    healed = start.model.float()
    if params is not None:
        check_params(healed, params)
    models = {"folded": healed, "control": source.model.float()}
    trained = {name: _train_only(model, params) for name, model in models.items()}
    scores = {name: _fine_tuned(model, stream, tp, eval_ids, seed, progress, name)
              for name, model in models.items()}
    curve = [HealPoint(i, float(scores["folded"][i].mean()),
                       float(scores["control"][i].mean())) for i in sorted(scores["folded"])]
    done = HealResult(steps, tp.lr, tp.batch_size, tp.seq_len, seed, said, curve,
                      *_penalties(scores["folded"][0] - scores["control"][0],
                                  scores["folded"][steps] - scores["control"][steps], seed),
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
