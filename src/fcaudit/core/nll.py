"""Next-token NLL: the one loss every pass of the audit (and training's evaluation) uses."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fcaudit.core.errors import ModelError


def logits_of(output: Any) -> Tensor:
    """Models return logits or an object with ``.logits`` (e.g. Hugging Face outputs)."""
    logits = getattr(output, "logits", output)
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise ModelError("the model must map input_ids [B, T] to logits [B, T, V] (or an "
                         f"object with .logits); got {type(output).__name__}")
    return logits


# Elements of one chunk of rows [tokens, V] scored at once (4 MiB of float32 on a CPU).
# Every chunk is scored into one buffer allocated once per call: allocating and filling a
# fresh logits-sized float32 tensor alone cost ~20% of the tiny preset's forward pass on
# a 2-core CPU, while the reused buffer stays in cache. Chunks are not smaller because
# each is a parallel region, and many small ones were slow on a loaded machine. On an
# accelerator they are larger, as kernel launches dominate small ones.
CHUNK_ELEMENTS_CPU = 1 << 20
CHUNK_ELEMENTS_ACCELERATOR = 1 << 24


def token_nll(logits: Tensor, ids: Tensor) -> Tensor:
    """Per-token next-token NLL ``[B, T-1]`` in float32 (positions 1..T-1).

    Chunks of rows of the contiguous ``[B*T, V]`` view get a float32 log-softmax in a
    reused buffer (no copy of all logits); a row's value does not depend on the chunking,
    and equals ``F.cross_entropy`` to float32 rounding (tests/test_nll.py). Not
    differentiable: it measures, and training computes its own loss.
    """
    batch, seq_len, vocab = logits.shape
    rows = logits.reshape(batch * seq_len, vocab)  # a view when the logits are contiguous
    targets = F.pad(ids[:, 1:].long(), (0, 1)).reshape(-1, 1)
    budget = CHUNK_ELEMENTS_CPU if logits.device.type == "cpu" else CHUNK_ELEMENTS_ACCELERATOR
    step = max(1, min(len(rows), budget // vocab))
    log_probs = torch.empty(step, vocab, dtype=torch.float32, device=logits.device)
    upcast = None if logits.dtype == torch.float32 else torch.empty_like(log_probs)
    picked = torch.empty(len(rows), 1, dtype=torch.float32, device=logits.device)
    for start in range(0, len(rows), step):
        chunk, where = rows[start:start + step], slice(start, start + step)
        if upcast is not None:
            chunk = upcast[:len(chunk)].copy_(chunk)
        out = log_probs[:len(chunk)]
        torch.log_softmax(chunk, -1, out=out)
        torch.gather(out, 1, targets[where], out=picked[where])
    return picked.view(batch, seq_len)[:, :-1].neg()


def device_of(model: nn.Module) -> torch.device:
    """Where the model's inputs go. A model dispatched by accelerate (``device_map``) keeps
    offloaded weights on the meta device and states its own execution device; otherwise
    the first parameter's device (cpu for a model without any)."""
    stated = getattr(getattr(model, "_hf_hook", None), "execution_device", None)
    if stated is not None:
        return torch.device(stated)
    param = next((p for p in model.parameters() if p.device.type != "meta"), None)
    return param.device if param is not None else torch.device("cpu")


@torch.no_grad()
def mean_nll(model: nn.Module, windows: np.ndarray, batch_size: int = 32) -> float:
    """Mean next-token NLL (nats) over positions 1..T-1 of every window."""
    model.eval()
    device = device_of(model)
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        ids = torch.from_numpy(windows[i:i + batch_size]).to(device)
        nll = token_nll(logits_of(model(ids)), ids)
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
