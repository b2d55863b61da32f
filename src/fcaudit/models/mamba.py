"""Mamba: a selective state-space (S6) language model, and the pieces its LTI twin shares.

Each layer is pre-norm and residual, ``h + Mixer(RMSNorm(h))``. The mixer projects
``h`` to an input path ``x`` and a gate ``z`` (``in_proj``), runs a causal depthwise
convolution and SiLU on ``x``, mixes the sequence with a diagonal state-space
recurrence per channel ``d`` and state ``n``::

    h_t = exp(Δ_t A) * h_{t-1} + Δ_t B_t x_t,     y_t = C_t · h_t + D x_t

and returns ``out_proj(y * silu(z))``. ``A = -exp(A_log)`` is learned per ``(d, n)``
(S4D-real start, ``A_dn = -(n + 1)``), ``D`` per channel.

**Selection.** Mamba computes the step ``Δ`` and the projections ``B``, ``C`` from the
current token's ``x``, each in its own child module so that each is a controller site:
``dt_proj`` (low rank, ``x -> dt_rank -> D``, output ``[B, T, D]``: Δ *before* softplus,
its bias set so that ``softplus`` starts in ``[dt_min, dt_max]``), ``B_proj`` and
``C_proj`` (``x -> [B, T, N]``, no activation). Everything else (the convolution, the gate
``z``, ``A``, ``D``) stays live under an audit. The LTI twin (:mod:`fcaudit.models.s4d`)
is this file's network with the three modules replaced by learned constants.

**Scan** (:func:`selective_scan`, :class:`ChunkedScan`): chunked, exact in float32. The
sequence is cut into chunks of ``chunk`` steps. Per chunk, the decays ``exp(Δ A)`` and
inputs ``Δ B x`` are formed at once (time-major ``[L, b, D, N]``), the recurrence runs
step by step on a ``[b, D, N]`` state that stays in cache, and the state is carried into
the next chunk; only the state entering each chunk is kept. The backward pass, written
out, runs the chunks in reverse, recomputes each chunk's states from its entering state
and runs the adjoint recurrence through them. Autograd over a whole-sequence scan would
keep several ``[b, T, D, N]`` tensors per layer (33 MB each at the tiny preset) and spend
the step moving them; the chunks make a training step over ten times faster on a CPU.
Only decays ``<= 1`` are formed: the parallel form that divides by a cumulative decay
overflows once a trained ``Δ |A|`` passes ~88 within a chunk, and the pairwise form costs
``chunk`` times the memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from fcaudit.core.contract import Selection, Site
from fcaudit.core.errors import FcauditError, check_sizes
from fcaudit.core.layout import TOKEN_AXES, TOKEN_LAYOUT


@dataclass(frozen=True)
class MambaConfig:
    vocab_size: int = 2048
    block_size: int = 128  # longest context trained and audited (the scan has no limit)
    n_layer: int = 4
    n_embd: int = 128  # model width (d_model)
    d_state: int = 16  # N, states per channel
    expand: int = 2  # inner channels D = expand * n_embd
    d_conv: int = 4  # causal depthwise convolution width
    dt_rank: int = 8  # rank of the Δ projection (Mamba: ceil(n_embd / 16))
    chunk: int = 16  # scan chunk length (speed only: every length gives the same bits)
    dt_min: float = 1e-3  # Δ starts log-uniform in [dt_min, dt_max]
    dt_max: float = 0.1

    def __post_init__(self) -> None:
        check_sizes(self, ("vocab_size", "block_size", "n_layer", "n_embd", "d_state",
                           "expand", "d_conv", "dt_rank", "chunk"))
        if not 0 < self.dt_min <= self.dt_max:
            raise FcauditError(f"dt_min={self.dt_min} and dt_max={self.dt_max} must satisfy "
                               "0 < dt_min <= dt_max")

    @property
    def d_inner(self) -> int:
        return self.expand * self.n_embd


PRESETS: dict[str, MambaConfig] = {
    # FeatureGate tiny's width, vocabulary and context at four layers of ~116k parameters
    # (1.0M in all against its 1.3M): the scan costs most of a training step on a CPU, and
    # four layers train in minutes on 2 cores
    "tiny": MambaConfig(vocab_size=2048, block_size=128, n_layer=4, n_embd=128),
    # the trend study's mid: tiny's depth at twice its width
    "mid": MambaConfig(vocab_size=2048, block_size=128, n_layer=4, n_embd=256, dt_rank=16),
    # twice FeatureGate small's depth at its width: about its parameters (a Mamba layer
    # holds about half a transformer block's)
    "small": MambaConfig(vocab_size=4096, block_size=256, n_layer=12, n_embd=384,
                         dt_rank=24),
}


def selective_scan(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, chunk: int) -> torch.Tensor:
    """``y_t = C_t · h_t``, ``h_t = exp(dt_t A) * h_{t-1} + dt_t B_t u_t``, ``h_0 = 0``.

    ``u``, ``dt``: ``[b, T, D]``; ``A``: ``[D, N]``; ``B``, ``C``: ``[b, T, N]``; returns
    ``[b, T, D]``, differentiable in all five (:class:`ChunkedScan`).
    """
    return ChunkedScan.apply(u, dt, A, B, C, chunk)


def chunk_terms(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                span: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's decays ``exp(dt A)``, inputs ``dt u B`` (time-major ``[L, b, D, N]``) and
    ``dt u`` (``[L, b, D]``)."""
    dt_c = dt[:, span].transpose(0, 1).contiguous()
    dtu = dt_c * u[:, span].transpose(0, 1)
    decay = torch.exp(dt_c.unsqueeze(-1) * A)
    return decay, dtu.unsqueeze(-1) * B[:, span].transpose(0, 1).unsqueeze(-2), dtu


def run_chunk(decay: torch.Tensor, inputs: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The states ``[L, b, D, N]`` of one chunk entered with state ``h``: the sequential
    recurrence on a ``[b, D, N]`` slice that stays in cache."""
    states = torch.empty_like(inputs)
    for t in range(len(inputs)):
        h = torch.addcmul(inputs[t], decay[t], h, out=states[t])
    return states


class ChunkedScan(torch.autograd.Function):
    """The scan chunk by chunk, forward and backward by hand.

    Forward keeps only the state entering each chunk; backward runs the chunks in reverse,
    recomputes each chunk's states from its entering state and runs the adjoint recurrence
    ``g_t = gy_t C_t + exp(dt_{t+1} A) g_{t+1}`` through it. Every ``[b, T, D, N]`` tensor
    autograd would keep (decays, inputs, states: 33 MB each at the tiny preset) is then a
    chunk's ``[L, b, D, N]``, which is what makes training fast on a CPU. Exact: the same
    float32 recurrence as a plain loop; ``torch.autograd.gradcheck`` checks the gradients.
    """

    @staticmethod
    def forward(ctx: Any, u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                B: torch.Tensor, C: torch.Tensor, chunk: int) -> torch.Tensor:
        b, T, D = u.shape
        h = u.new_zeros(b, D, A.shape[1])
        entering, ys = [], []
        for s in range(0, T, chunk):
            span = slice(s, s + chunk)
            entering.append(h)
            decay, inputs, _ = chunk_terms(u, dt, A, B, span)
            states = run_chunk(decay, inputs, h)
            h = states[-1]
            ys.append((states * C[:, span].transpose(0, 1).unsqueeze(-2)).sum(-1))
        ctx.save_for_backward(u, dt, A, B, C, torch.stack(entering))
        ctx.chunk = chunk
        return torch.cat(ys).transpose(0, 1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        u, dt, A, B, C, entering = ctx.saved_tensors
        gu, gdt, gB, gC = (torch.zeros_like(t) for t in (u, dt, B, C))
        gA = torch.zeros_like(A)
        later = torch.zeros_like(entering[0])  # exp(dt_{t+1} A) g_{t+1}, flowing back to t
        for c, s in reversed(list(enumerate(range(0, u.shape[1], ctx.chunk)))):
            span = slice(s, s + ctx.chunk)
            decay, inputs, dtu = chunk_terms(u, dt, A, B, span)
            states = run_chunk(decay, inputs, entering[c])
            gy_c = gy[:, span].transpose(0, 1)
            C_c = C[:, span].transpose(0, 1)
            g = torch.empty_like(states)
            for t in reversed(range(len(states))):
                torch.addcmul(later, gy_c[t].unsqueeze(-1), C_c[t].unsqueeze(-2), out=g[t])
                later = decay[t] * g[t]
            g_log_decay = g * (states - inputs)  # g_t * exp(dt_t A) * h_{t-1}
            g_dtu = (g * B[:, span].transpose(0, 1).unsqueeze(-2)).sum(-1).transpose(0, 1)
            gC[:, span] = (states * gy_c.unsqueeze(-1)).sum(-2).transpose(0, 1)
            gB[:, span] = (g * dtu.unsqueeze(-1)).sum(-2).transpose(0, 1)
            gdt[:, span] = (g_log_decay * A).sum(-1).transpose(0, 1) + g_dtu * u[:, span]
            gu[:, span] = g_dtu * dt[:, span]
            gA += (g_log_decay * dt[:, span].transpose(0, 1).unsqueeze(-1)).sum((0, 1))
        return gu, gdt, gA, gB, gC, None


def inverse_softplus_dt(cfg: MambaConfig, size: int) -> torch.Tensor:
    """Pre-softplus values whose softplus is log-uniform in ``[dt_min, dt_max]`` (Mamba's
    Δ start), so that the selective bias and the twin's constant Δ start alike."""
    lo, hi = math.log(cfg.dt_min), math.log(cfg.dt_max)
    dt = torch.exp(torch.rand(size) * (hi - lo) + lo)
    return dt + torch.log(-torch.expm1(-dt))


class Mixer(nn.Module):
    """The block's sequence mixer without its selection: subclasses say where ``Δ`` (before
    softplus), ``B`` and ``C`` come from (:meth:`ssm`)."""

    def __init__(self, cfg: MambaConfig) -> None:
        super().__init__()
        D, N = cfg.d_inner, cfg.d_state
        self.chunk = cfg.chunk
        self.in_proj = nn.Linear(cfg.n_embd, 2 * D, bias=False)
        self.conv = nn.Conv1d(D, D, cfg.d_conv, groups=D, padding=cfg.d_conv - 1)
        self.A_log = nn.Parameter(torch.arange(1, N + 1, dtype=torch.float32).log().repeat(D, 1))
        self.D = nn.Parameter(torch.ones(D))
        self.out_proj = nn.Linear(D, cfg.n_embd, bias=False)

    @property
    def A(self) -> torch.Tensor:
        return -self.A_log.exp()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        T = h.shape[1]
        x, z = self.in_proj(h).chunk(2, dim=-1)
        x = F.silu(self.conv(x.transpose(1, 2))[..., :T].transpose(1, 2))
        return self.out_proj(self.ssm(x) * F.silu(z))

    def ssm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class LowRank(nn.Module):
    """``x -> dt_rank -> D`` (Mamba's ``x_proj`` dt slice, then its ``dt_proj``): Δ before
    softplus, one module so that its output is one site."""

    def __init__(self, cfg: MambaConfig) -> None:
        super().__init__()
        self.down = nn.Linear(cfg.d_inner, cfg.dt_rank, bias=False)
        self.up = nn.Linear(cfg.dt_rank, cfg.d_inner)
        bound = cfg.dt_rank ** -0.5
        nn.init.uniform_(self.up.weight, -bound, bound)
        with torch.no_grad():
            self.up.bias.copy_(inverse_softplus_dt(cfg, cfg.d_inner))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class SelectiveMixer(Mixer):
    """Mamba's mixer: ``Δ``, ``B``, ``C`` computed from the current token (the sites)."""

    def __init__(self, cfg: MambaConfig) -> None:
        super().__init__(cfg)
        self.dt_proj = LowRank(cfg)
        self.B_proj = nn.Linear(cfg.d_inner, cfg.d_state, bias=False)
        self.C_proj = nn.Linear(cfg.d_inner, cfg.d_state, bias=False)

    def ssm(self, x: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(self.dt_proj(x))  # a replay stub may stand in for each projection
        y = selective_scan(x, dt, self.A, self.B_proj(x), self.C_proj(x), self.chunk)
        return y + x * self.D


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` (Mamba's norm; ``nn.RMSNorm`` needs torch 2.4, fcaudit 2.2)."""

    def __init__(self, width: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight


class Layer(nn.Module):
    def __init__(self, cfg: MambaConfig, mixer: type[Mixer]) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.n_embd)
        self.mixer = mixer(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mixer(self.norm(h))


class SSMNet(nn.Module):
    """Embedding, ``n_layer`` residual :class:`Layer` s, RMSNorm, untied head;
    ``input_ids [B, T] -> logits [B, T, V]``. Subclasses choose the mixer."""

    mixer_class: type[Mixer] = Mixer

    def __init__(self, cfg: MambaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Layer(cfg, self.mixer_class) for _ in range(cfg.n_layer))
        self.norm_f = RMSNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.lm_head.weight, std=0.02)
        for layer in self.layers:  # GPT-2 / Mamba residual scaling
            nn.init.normal_(layer.mixer.out_proj.weight, std=0.02 / math.sqrt(cfg.n_layer))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm_f(h))

    def execution_blocks(self) -> list[str]:
        return [f"layers.{i}" for i in range(len(self.layers))]


SELECTION = (("dt", "dt_proj", "Δ before softplus"),
             ("B", "B_proj", "B (input projection, no activation)"),
             ("C", "C_proj", "C (output projection, no activation)"))


class Mamba(SSMNet):
    """The selective model: every layer's ``Δ``, ``B``, ``C`` are controller sites."""

    mixer_class = SelectiveMixer

    @property
    def execution_mode(self) -> str:
        """What the execution audit timed: a selective recurrence has no other mode."""
        return f"chunked selective scan (chunks of {self.config.chunk} steps)"

    def controller_sites(self) -> list[Site]:
        return [Site(name=f"layers.{i}.{family}", path=f"layers.{i}.mixer.{module}",
                     family=family, layer=i, axes=TOKEN_AXES, positions=TOKEN_LAYOUT,
                     role=Selection(space))
                for family, module, space in SELECTION for i in range(len(self.layers))]

    def folded(self, key: str, values: list[torch.Tensor]) -> nn.Module:
        """This model with ``Δ``, ``B``, ``C`` fixed at one row per layer (``key``
        ``"layer"``; ``values`` in :meth:`controller_sites`' order, ``[1, D]`` or ``[1, N]``
        each): a time-invariant model, so it is the LTI twin's network (:class:`S4D`, run
        as a convolution: :attr:`fold_mode`) with these constants and every other weight
        this model's. Only one row per layer folds: a row per position or token id is not
        time-invariant, and the selective scan would still run."""
        from fcaudit.models.s4d import S4D, S4DConfig
        if key != "layer":
            raise FcauditError(f"a Mamba folds one row per layer (static-layer), not {key!r}: "
                               "rows per position or token id are not time-invariant")
        sites = self.controller_sites()
        config = S4DConfig(**{f.name: getattr(self.config, f.name) for f in fields(MambaConfig)},
                           mode=self.fold_mode)
        with torch.device("meta"):
            folded = S4D(config)
        state = {k: v for k, v in self.state_dict().items()
                 if not any(k.startswith(s.path + ".") for s in sites)}
        given = {f"layers.{s.layer}.mixer.{s.family}": v for s, v in
                 zip(sites, values, strict=True)}
        expected = {k: (1, *v.shape) for k, v in folded.state_dict().items() if k not in state}
        if {k: tuple(v.shape) for k, v in given.items()} != expected:
            raise FcauditError(f"fixed Δ, B, C: expected {expected}, got "
                               f"{ {k: tuple(v.shape) for k, v in given.items()} }")
        folded.load_state_dict({**state, **{k: v[0].clone() for k, v in given.items()}},
                               assign=True)
        return folded.eval()

    # how a folded Mamba runs its time-invariant recurrence (S4D's modes): a convolution,
    # which the selective model cannot use, is what the fold buys
    fold_mode: ClassVar[str] = "fft"

    def dense_counterpart(self) -> nn.Module:
        """The LTI twin (:class:`fcaudit.models.s4d.S4D`) of the same width and depth; a
        subclass's extra config fields are dropped."""
        from fcaudit.models.s4d import S4D, S4DConfig
        return S4D(S4DConfig(**{f.name: getattr(self.config, f.name)
                                for f in fields(MambaConfig)}))
