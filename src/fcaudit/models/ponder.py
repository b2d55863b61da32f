"""Ponder: adaptive depth over ONE shared-weight block (PonderNet halting, ACT's family).

The embeddings feed a single transformer block (FeatureGate's, weights shared by every
step) applied up to ``max_steps`` times. After step ``n`` a halting unit (shared too)
gives each token ``lambda_n = sigmoid(w . LN(h) + b)``, ``[B, T, 1]``: PonderNet's
probability of halting at step ``n`` given that it has not halted before. Depth then
varies per token without separate layers.

Training (PonderNet): every token runs every step; the step-``n`` prediction (the shared
final norm and LM head) is weighted by ``p_n = lambda_n prod_{j<n} (1 - lambda_j)`` (the
last step takes the rest) in the expected next-token loss, plus ``kl_weight`` times the
KL divergence from a geometric prior with ``prior_halt``, which keeps the halting spread
over steps; the trainer adds the last step's loss.

Inference (eval mode) is PonderNet's deterministic rule: a token halts after the first
step whose cumulative halting probability ``1 - prod_{j<=n} (1 - lambda_j)`` reaches
``halt_threshold`` (``steps.{n}.halt``), and its prediction is that step's. Later steps
run on the running tokens only (gathered, as in :mod:`fcaudit.models.earlyexit`, whose
routed block and CALM key/value propagation this reuses). Each step is a parameterless
module ``steps.{n}`` around the shared weights, so that hooks count per step: its
``body`` (the block, packed running tokens), ``score`` (the site) and ``halt`` (the rule).
Feeding ``lambda = 1`` halts a token at that step; feeding 0 at every step before keeps
it running, whatever the threshold.

The Dense twin (``halting=False``) is the same shared block run ``max_steps`` times on
every token, with no halting unit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fcaudit.core.errors import FcauditError, check_sizes
from fcaudit.core.exits import ExitHead
from fcaudit.models.earlyexit import LayerExits, RoutedKVUpdate, fixed_exit_depth
from fcaudit.models.featuregate import GPT, Gate, GPTConfig, Update
from fcaudit.models.skipgate import Route


@dataclass(frozen=True)
class PonderConfig(GPTConfig):
    # ``n_layer`` and ``gated`` are inherited and ignored: depth is ``max_steps`` of one block
    max_steps: int = 4
    halting: bool = True  # the halting model (True) or its Dense twin (False)
    halt_threshold: float = 0.5  # halt where the cumulative halting probability reaches this
    prior_halt: float = 0.3  # the geometric prior's per-step halting probability
    kl_weight: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        check_sizes(self, ("max_steps",))
        if not 0.0 < self.halt_threshold <= 1.0 or not 0.0 < self.prior_halt < 1.0:
            raise FcauditError(f"halt_threshold={self.halt_threshold} must be in (0, 1] and "
                               f"prior_halt={self.prior_halt} in (0, 1)")


PRESETS: dict[str, PonderConfig] = {
    "tiny": PonderConfig(vocab_size=2048, block_size=128, n_layer=1, n_head=4, n_embd=128,
                         max_steps=4),
    "small": PonderConfig(vocab_size=4096, block_size=256, n_layer=1, n_head=6, n_embd=384,
                          max_steps=6),
}


class Call(nn.Module):
    """A parameterless stand-in that calls shared weights, so hooks see each step apart."""

    def forward(self, *args: Any, fn: Callable[..., torch.Tensor]) -> Any:
        return fn(*args)


class CumulativeHalt(nn.Module):
    """PonderNet's rule, ``[B, T]`` bool: the token has halted by this step."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.threshold = threshold

    def forward(self, lam: torch.Tensor, survive: torch.Tensor) -> torch.Tensor:
        return 1 - survive * (1 - lam) >= self.threshold


class PonderStep(nn.Module):
    def __init__(self, cfg: PonderConfig, decides: bool) -> None:
        super().__init__()
        self.body = Call()
        self.score = Call() if decides else None
        self.halt = CumulativeHalt(cfg.halt_threshold) if decides else None


class PonderGPT(LayerExits, nn.Module):
    """``input_ids [B, T] -> logits [B, T, V]``; each token's logits from its halting step."""

    LAYERS, FAMILY = "steps", "halting"

    def __init__(self, cfg: PonderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.full_depth = False
        self.aux_loss: torch.Tensor | float = 0.0
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.block = RoutedKVUpdate(cfg)
        self.unit = Gate(cfg) if cfg.halting else None
        N = cfg.max_steps
        self.steps = nn.ModuleList(PonderStep(cfg, cfg.halting and n < N - 1) for n in range(N))
        self.heads = nn.ModuleList(ExitHead() for _ in range(N))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(GPT._init_weights)
        for name, p in self.block.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * N))

    def _lambda(self, step: PonderStep, h: torch.Tensor) -> torch.Tensor:
        assert step.score is not None and self.unit is not None
        return step.score(h, fn=self.unit)[..., 0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        h = self.wte(input_ids) + self.wpe(torch.arange(T, device=input_ids.device))
        if self.training or self.full_depth or self.unit is None:
            return self._full_depth(h, input_ids)
        running = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)
        survive = torch.ones(h.shape[:2], dtype=h.dtype, device=h.device)
        for step in self.steps:
            if running.any():
                route = Route.from_mask(running)
                update = step.body(route.gather(h), route, h, fn=self.block)
                h = route.scatter_add(h, update)
            if step.halt is None:
                break
            lam = self._lambda(step, h)
            running = running & ~step.halt(lam, survive)
            survive = survive * (1 - lam)
        return self._logits(h)

    def _full_depth(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Every step and every head on every token; in training, PonderNet's loss goes to
        ``aux_loss``."""
        heads = self.training or self.full_depth  # the Dense twin reads the last state only
        logits, lams = [], []
        for step, head in zip(self.steps, self.heads, strict=True):
            h = h + step.body(h, fn=lambda x: Update.forward(self.block, x))
            if heads:
                logits.append(head(h, self._logits))
            if step.score is not None:
                lams.append(self._lambda(step, h))
        if self.training and lams:
            self.aux_loss = self._ponder_loss(logits, lams, input_ids)
        return logits[-1] if heads else self._logits(h)

    def _ponder_loss(self, logits: list[torch.Tensor], lams: list[torch.Tensor],
                     input_ids: torch.Tensor) -> torch.Tensor:
        """Expected next-token loss under the halting distribution (positions whose next
        token is in the input) plus ``kl_weight`` KL(p || geometric prior)."""
        cfg, target = self.config, input_ids[:, 1:]
        survive, probs = torch.ones_like(lams[0]), []
        for lam in lams:
            probs.append(survive * lam)
            survive = survive * (1 - lam)
        probs.append(survive)  # the last step takes the rest
        p = torch.stack(probs, -1)[:, :-1]  # [B, T-1, N]
        ce = torch.stack([F.cross_entropy(z[:, :-1].transpose(1, 2), target, reduction="none")
                          for z in logits], -1)
        n = torch.arange(len(probs), device=p.device, dtype=p.dtype)
        prior = cfg.prior_halt * (1 - cfg.prior_halt) ** n
        prior = prior / prior.sum()
        kl = (p * (p.clamp_min(1e-8).log() - prior.log())).sum(-1)
        return (p * ce).sum(-1).mean() + cfg.kl_weight * kl.mean()

    def folded(self, key: str, values: list[torch.Tensor]) -> PonderGPT:
        """Every token halted after step ``values[0]`` (``key`` ``"exit_depth"``, the
        fixed-exit condition): the Dense twin (no halting unit) run that many steps."""
        depth = fixed_exit_depth(key, values, len(self.steps))
        with torch.device("meta"):
            twin = PonderGPT(dataclasses.replace(self.config, halting=False, max_steps=depth))
        twin.load_state_dict({k: v.clone() for k, v in self.state_dict().items()
                              if not k.startswith("unit.")}, assign=True)
        return twin.eval()

    def dense_counterpart(self) -> PonderGPT:
        """The same shared block run ``max_steps`` times on every token, no halting unit."""
        return PonderGPT(dataclasses.replace(self.config, halting=False))
