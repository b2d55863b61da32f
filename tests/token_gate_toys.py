"""A classifier over token ids whose audit answers are computed by hand with numpy
(tests/test_example_token_ids.py, tests/test_accuracy_retention.py; importable as
``token_gate_toys:FACTORY``).

Two gate sites ``gates.0`` and ``gates.1`` give one value per token, ``table_l[id] +
position_l[t]`` ([B, T, 1]); the logits ``[B, 2]`` are ``[sum_t (g0 - g1), BIAS]``, so the
class is 0 exactly when that sum exceeds ``BIAS``. Given the feed of each condition, every
example's class (and hit) follows in numpy without running the model.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

V = 4  # token ids 0..3: the gates' tables are embeddings, so the model states V
BIAS = 0.25
# gate 0 is the token id itself, gate 1 a constant 1.5: the class is 0 iff sum(ids) >= 7
TABLES = (np.arange(V, dtype=np.float32), np.full(V, 1.5, dtype=np.float32))


class TokenGate(nn.Module):
    """``table[id] + position[t]``: an embedding of one value plus a position term."""

    def __init__(self, table: np.ndarray, position: np.ndarray | None) -> None:
        super().__init__()
        self.table = nn.Embedding(V, 1)
        with torch.no_grad():
            self.table.weight.copy_(torch.from_numpy(table).view(V, 1))
        self.register_buffer("position", torch.from_numpy(
            np.zeros(64, np.float32) if position is None else position))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids) + self.position[:ids.shape[1]].view(1, -1, 1)


class Pool(nn.Module):
    """One value per example: a site with no token axis."""

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return g.sum(1)  # [B, 1]


class TokenGateClassifier(nn.Module):
    def __init__(self, positions: tuple[np.ndarray, np.ndarray] | None = None,
                 float_ids: bool = False) -> None:
        super().__init__()
        self.gates = nn.ModuleList(TokenGate(t, None if positions is None else p)
                                   for t, p in zip(TABLES, positions or (None, None),
                                                   strict=True))
        self.pool, self.float_ids = Pool(), float_ids

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.long() if self.float_ids else ids  # float inputs: the same ids as floats
        score = self.pool(self.gates[0](ids) - self.gates[1](ids))[:, 0]
        return torch.stack([score, torch.full_like(score, BIAS)], 1)


def classifier() -> nn.Module:
    return TokenGateClassifier()


# position terms for the token-id share: gate 0 also rises along the sequence
POSITIONS = (np.array([0.0, 0.5, 1.0, 1.5], np.float32), np.array([0.25, 0.0, 0.25, 0.0],
                                                                  np.float32))


def positional_classifier() -> nn.Module:
    return TokenGateClassifier(POSITIONS)


def gates(ids: np.ndarray, positions: bool = False) -> list[np.ndarray]:
    """Each gate's values ``[N, T]`` on ``ids``, by hand (float64)."""
    out = []
    for table, pos in zip(TABLES, POSITIONS, strict=True):
        extra = pos[:ids.shape[1]].astype(np.float64) if positions else 0.0
        out.append(table.astype(np.float64)[ids] + extra)
    return out


def classes(g0: np.ndarray, g1: np.ndarray) -> np.ndarray:
    """The predicted class of each example from the gate values fed ([N, T] each)."""
    return np.where((g0 - g1).sum(1) > BIAS, 0, 1)


def sequences(n: int, seed: int, length: int = 4) -> np.ndarray:
    """``n`` distinct random sequences of ids (int64)."""
    rng = np.random.default_rng(seed)
    rows = dict.fromkeys(tuple(r) for r in rng.integers(0, V, size=(4 * n, length)).tolist())
    return np.array(list(rows)[:n], dtype=np.int64)  # first occurrences, in drawn order


# calibration: every id seen, mean id 2.25 (so the static profiles predict class 0)
CALIBRATION = np.array([[0, 3, 3, 3], [1, 2, 3, 3], [3, 3, 2, 1], [3, 0, 3, 3]], np.int64)


def evaluation(n: int, seed: int) -> np.ndarray:
    """``n`` evaluation sequences, none of them a calibration sequence."""
    calib = {tuple(r) for r in CALIBRATION.tolist()}
    rows = [r for r in sequences(n + len(calib), seed).tolist() if tuple(r) not in calib]
    return np.array(rows[:n], dtype=np.int64)


def float_classifier() -> nn.Module:
    """The same classifier fed its ids as float32: inputs that are not token ids."""
    return TokenGateClassifier(float_ids=True)
