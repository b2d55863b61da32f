"""Training the vision families (``vit-moe``, ``tokenprune``, ``condconv`` and their dense
twins ``dense-vit``, ``dense-cnn``) on scikit-learn's digits.

Classification cross-entropy on the train split of :mod:`fcaudit.io.digits`, AdamW
(the language runs' optimiser and learning-rate schedule), batches drawn with the
seed's generator; a model's own training term (the MoE's load balancing) is added as
for the language MoE. The run folder is the language runs' (``config.json``,
``model.safetensors``, ``train_log.jsonl``; no tokenizer), written atomically, and
its ``results`` hold the evaluation split's accuracy and mean cross-entropy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fcaudit.core.registry import refusal
from fcaudit.io import digits
from fcaudit.io.loading import Arch
from fcaudit.io.runs import building, write_run
from fcaudit.study import train


@dataclass(frozen=True)
class VisionSchedule:
    """Optimisation settings of a vision run (the model sizes are the arch's presets)."""

    batch_size: int
    steps: int
    lr: float
    warmup: int
    weight_decay: float = 0.05


SCHEDULES: dict[str, VisionSchedule] = {
    "tiny": VisionSchedule(batch_size=128, steps=300, lr=1e-2, warmup=30),
}


def schedule(preset: str, steps: int | None = None) -> VisionSchedule:
    """The preset's settings, ``steps`` overriding the length (warm-up capped at a tenth)."""
    if preset not in SCHEDULES:
        raise refusal(f"unknown preset {preset!r} for a vision arch", preset, list(SCHEDULES))
    return train.with_steps(SCHEDULES[preset], steps)


@torch.no_grad()
def evaluate(model: nn.Module, images: np.ndarray, targets: np.ndarray,
             batch_size: int = 256) -> dict[str, float]:
    """Accuracy and mean cross-entropy (nats) of ``model`` in eval mode."""
    model.eval()
    device = next(model.parameters()).device
    losses, hits = [], []
    for start in range(0, len(images), batch_size):
        x = torch.from_numpy(images[start:start + batch_size]).to(device)
        y = torch.from_numpy(targets[start:start + batch_size]).to(device)
        logits = model(x).float()
        losses.append(F.cross_entropy(logits, y, reduction="none").cpu())
        hits.append((logits.argmax(dim=-1) == y).cpu())
    return {"eval_accuracy": float(torch.cat(hits).double().mean()),
            "eval_loss": float(torch.cat(losses).double().mean())}


def fit(model: nn.Module, images: np.ndarray, targets: np.ndarray, tp: VisionSchedule,
        rng: np.random.Generator, progress: bool, label: str) -> tuple[list[dict], float]:
    """:func:`~fcaudit.study.train.fit` on batches drawn without replacement."""
    device = next(model.parameters()).device
    x_all, y_all = torch.from_numpy(images).to(device), torch.from_numpy(targets).to(device)

    def step(_: int) -> tuple[torch.Tensor, dict[str, Any], str]:
        rows = torch.from_numpy(rng.choice(len(images), size=tp.batch_size, replace=False))
        return F.cross_entropy(model(x_all[rows]), y_all[rows]), {}, ""

    return train.fit(model, tp, step, progress, label)


def train_vision(arch: Arch, preset: str, seed: int, out: Path, tp: VisionSchedule, cfg: Any,
                 device: str, progress: bool) -> Path:
    """Train one vision model and swap its run folder in for ``out`` (held by the caller)."""
    train_x, train_y = digits.digits("train")
    eval_x, eval_y = digits.digits("eval")
    torch.manual_seed(seed)
    model = arch.build(cfg).to(device)
    with building(out) as work:
        log, wall = fit(model, train_x, train_y, tp, np.random.default_rng(seed), progress,
                        f"train {arch.name}/{preset} seed {seed}")
        scores = evaluate(model, eval_x, eval_y)
        log.append({"event": "eval", **scores, "train_wall_s": round(wall, 2)})
        write_run(work, model, log, {
            "arch": arch.name, "preset": preset, "seed": seed,
            "model_config": dataclasses.asdict(cfg), "train": dataclasses.asdict(tp),
            "data": {**digits.split_record(), "train_images": len(train_x),
                     "eval_images": len(eval_x)},
            "results": {**scores, "n_params": sum(p.numel() for p in model.parameters()),
                        "train_wall_s": round(wall, 2), "device": device}})
    return out
