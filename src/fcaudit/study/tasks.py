"""Training a language arch on a synthetic task (``fcaudit train --task``): fresh batches.

A task is an objective of :data:`fcaudit.engine.objectives.TASKS` together with the
module generating its sequences (selective copying: :mod:`fcaudit.io.selective_copy`).
Every step draws a new batch from the run seed's generator, leaving out every sequence
the audit sets can hold, and minimises the task's own objective (the loss the audit
scores), so "infinite data": no example is seen twice except by chance. The run folder
is the language runs' (``config.json`` with ``task`` and the task's settings under
``data``, ``model.safetensors``, ``train_log.jsonl``; no tokenizer), written
atomically; ``results`` hold the evaluation set's accuracy (every answer of an example
right), per-answer accuracy and mean loss. An audit of the folder reads the same task's
sets and objective without being told (:func:`fcaudit.engine.objectives.run_task`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import nn

from fcaudit.core.errors import UsageError, arg
from fcaudit.core.registry import refusal
from fcaudit.engine.objectives import TASKS, BuiltinObjective, Objective
from fcaudit.io.examples import ExampleBatch
from fcaudit.io.loading import Arch
from fcaudit.io.runs import building, write_run
from fcaudit.study import train
from fcaudit.study.train import TrainPreset

# optimisation per preset; the sequence length is the task's (seq_len is set from it)
SCHEDULES: dict[str, TrainPreset] = {
    "tiny": TrainPreset(seq_len=0, batch_size=32, steps=2000, lr=3e-3, warmup=100,
                        eval_sequences=256, weight_decay=0.0),
}
# model sizes per preset, replacing the arch preset's where its config has the field: the
# Mamba paper's two layers at width 64, whose scan trains in minutes on a CPU core
MODEL_SIZES: dict[str, dict[str, int]] = {"tiny": {"n_layer": 2, "n_embd": 64}}


def task_entry(name: str, arch: Arch) -> BuiltinObjective:
    """The registry entry of ``--task NAME``, for a language arch; else one line."""
    entry = TASKS.lookup(name)
    if arch.task != "lm":
        raise UsageError(f"{arg('task', name)} trains a language arch (token ids to token "
                         f"logits); {arg('arch', arch.name)} takes images: choose another "
                         f"{arg('arch')} or drop {arg('task')}", option="task")
    return entry


def schedule(preset: str, steps: int | None, length: int) -> TrainPreset:
    """The preset's settings at the task's sequence length, ``steps`` overriding the
    length of training (warm-up capped at a tenth)."""
    if preset not in SCHEDULES:
        raise refusal(f"unknown preset {preset!r} for a task", preset, list(SCHEDULES),
                      option="preset")
    return train.with_steps(dataclasses.replace(SCHEDULES[preset], seq_len=length), steps)


def model_config(arch: Arch, preset: str, vocab_size: int) -> Any:
    """The arch's preset at the task's vocabulary and the task preset's sizes."""
    cfg = arch.config(preset, vocab_size=vocab_size)
    names = {f.name for f in dataclasses.fields(cfg)}
    return dataclasses.replace(cfg, **{k: v for k, v in MODEL_SIZES[preset].items()
                                       if k in names})


def batch(x: np.ndarray, y: np.ndarray, device: str | torch.device) -> ExampleBatch:
    return ExampleBatch(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))


@torch.no_grad()
def per_example(model: nn.Module, objective: Objective, x: np.ndarray, y: np.ndarray,
                batch_size: int = 256) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per example of ``model`` in eval mode, scored by the task's objective: the mean
    loss over its answers, whether every answer is right (1.0 or 0.0), and the share of
    its answers that are right."""
    model.eval()
    device = next(model.parameters()).device
    losses, hits, answers = [], [], []
    for start in range(0, len(x), batch_size):
        b = batch(x[start:start + batch_size], y[start:start + batch_size], device)
        output = model(b.inputs)
        losses.append(objective.units(output, b).double().mean(-1).cpu())
        hits.append(objective.hits(output, b).double().cpu())
        answers.append(output[:, -b.targets.shape[1]:].argmax(-1).eq(b.targets).double()
                       .mean(-1).cpu())
    loss, hit, answer = (torch.cat(v).numpy() for v in (losses, hits, answers))
    return loss, hit, answer


def evaluate(model: nn.Module, objective: Objective, x: np.ndarray, y: np.ndarray
             ) -> dict[str, float]:
    """Accuracy (every answer of an example right), per-answer accuracy and mean loss of
    ``model`` in eval mode, scored by the task's objective."""
    losses, hits, answers = per_example(model, objective, x, y)
    return {"eval_accuracy": float(hits.mean()), "eval_answer_accuracy": float(answers.mean()),
            "eval_loss": float(losses.mean())}


def fit(model: nn.Module, data: ModuleType, task: Any, objective: Objective, tp: TrainPreset,
        seed: int, progress: bool, label: str, before: Callable[[int], None] | None = None
        ) -> tuple[list[dict[str, Any]], float]:
    """:func:`~fcaudit.study.train.fit`, each step on a fresh batch of the task (the seed
    draws them: the same seed, the same batches); ``before(i)`` runs before step ``i``
    (an evaluation along the way)."""
    device = next(model.parameters()).device
    rng, exclude = np.random.default_rng(seed), data.held_out(task)

    def step(i: int) -> tuple[torch.Tensor, dict[str, Any], str]:
        if before is not None:
            before(i)
        b = batch(*data.draw(task, rng, tp.batch_size, exclude, tp.batch_size), device)
        output = model(b.inputs)
        accuracy = float(objective.hits(output.detach(), b).mean())
        return (objective.units(output, b).mean(), {"accuracy": round(accuracy, 4)},
                f"  accuracy {accuracy:.2f}")

    return train.fit(model, tp, step, progress, label)


def task_setup(name: str, arch: Arch, preset: str, steps: int | None
               ) -> tuple[BuiltinObjective, Any, TrainPreset]:
    """The task's entry, its settings (the task module's preset) and the schedule, all
    checked before anything is written."""
    entry = task_entry(name, arch)
    assert entry.task is not None
    task = importlib.import_module(entry.task).preset(preset)
    return entry, task, schedule(preset, steps, task.length)


def train_task(arch: Arch, entry: BuiltinObjective, preset: str, seed: int, out: Path,
               tp: TrainPreset, task: Any, device: str, progress: bool) -> Path:
    """Train one model on the task and swap its run folder in for ``out`` (held by the
    caller)."""
    assert entry.task is not None
    data, objective = importlib.import_module(entry.task), Objective(entry.name)
    cfg = model_config(arch, preset, task.vocab_size)
    torch.manual_seed(seed)
    model = arch.build(cfg).to(device)
    with building(out) as work:
        log, wall = fit(model, data, task, objective, tp, seed, progress,
                        f"train {arch.name}/{preset} on {entry.name} seed {seed}")
        eval_x, eval_y, _, _ = data.audit_sets(task, tp.eval_sequences, data.DEFAULT_EXAMPLES)
        scores = evaluate(model, objective, eval_x, eval_y)
        log.append({"event": "eval", **scores, "train_wall_s": round(wall, 2)})
        write_run(work, model, log, {
            "arch": arch.name, "preset": preset, "seed": seed, "task": entry.name,
            "model_config": dataclasses.asdict(cfg), "train": dataclasses.asdict(tp),
            "data": {**task.record(), "eval_sequences": len(eval_x),
                     "train_sequences": tp.steps * tp.batch_size},
            "results": {**scores, "n_params": sum(p.numel() for p in model.parameters()),
                        "train_wall_s": round(wall, 2), "device": device,
                        "cpu_threads": torch.get_num_threads()}})
    return out
