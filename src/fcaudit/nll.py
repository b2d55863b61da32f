"""Next-token NLL: the one loss every pass of the audit (and training's evaluation) uses."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import FcauditError


def logits_of(output: Any) -> Tensor:
    """Models return logits or an object with ``.logits`` (e.g. Hugging Face outputs)."""
    logits = getattr(output, "logits", output)
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise FcauditError("the model must map input_ids [B, T] to logits [B, T, V] (or an "
                           f"object with .logits); got {type(output).__name__}")
    return logits


def token_nll(logits: Tensor, ids: Tensor) -> Tensor:
    """Per-token next-token NLL ``[B, T-1]`` in float32 (positions 1..T-1)."""
    return F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")


def model_nll(model: nn.Module, ids: Tensor) -> Tensor:
    """``token_nll`` of one forward pass of ``model`` on ``ids``."""
    return token_nll(logits_of(model(ids)), ids)


def device_of(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


@torch.no_grad()
def mean_nll(model: nn.Module, windows: np.ndarray, batch_size: int = 32) -> float:
    """Mean next-token NLL (nats) over positions 1..T-1 of every window."""
    model.eval()
    device = device_of(model)
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        ids = torch.from_numpy(windows[i:i + batch_size]).to(device)
        nll = model_nll(model, ids)
        total += float(nll.double().sum())
        count += nll.numel()
    return total / count


def model_limits(model: nn.Module) -> tuple[int | None, int | None]:
    """(vocabulary size, maximum context) when the model states them."""
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    ctx = getattr(cfg, "block_size", None) or getattr(cfg, "max_position_embeddings", None)
    if vocab is None:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        vocab = emb.num_embeddings if emb is not None else None
    return vocab, ctx


@torch.no_grad()
def probe_vocab(model: nn.Module, seq_len: int) -> int | None:
    """The vocabulary read off the logits of one all-zero sequence, for a model that states
    none (token ids at or above it cannot be scored); None if the probe fails."""
    try:
        x = torch.zeros(1, seq_len, dtype=torch.long, device=device_of(model))
        return int(logits_of(model(x)).shape[-1])
    except Exception:  # the real pass reports its own error
        return None
