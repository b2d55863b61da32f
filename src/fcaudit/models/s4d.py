"""S4D: Mamba's LTI twin, the same network with the selection replaced by learned constants.

Everything but the selection is :mod:`fcaudit.models.mamba`'s (embedding, RMSNorm
layers, ``in_proj``, the causal convolution, ``A = -exp(A_log)`` per ``(d, n)``, ``D``, the
gate ``silu(z)``, ``out_proj``, the head). Per layer, ``dt`` (``[D]``, Δ before softplus,
started as Mamba's ``dt_proj`` bias is), ``B`` and ``C`` (``[N]`` each, shared by the
channels) are parameters. ``[N]`` rather than S4D's ``[D, N]`` on purpose: a Mamba whose
``dt_proj``, ``B_proj`` and ``C_proj`` outputs are held at constants (the audit's
``static-layer`` profile, its LTI profile) is exactly this model, so the trained twin
is the best that profile's family reaches when it is trained for itself.

Time-invariant, the recurrence is a causal convolution per channel with the kernel
``K_k[d] = sum_n C_n exp(k Δ_d A_dn) Δ_d B_n`` (``k = 0 .. T - 1``), built once per forward.
``mode`` says how it runs: ``"fft"`` (the kernel applied by real FFTs of length ``2T``,
the fastest on CPU at the tiny preset and the default, so the mode an execution audit
times unless a config says otherwise), ``"conv"`` (a depthwise causal ``conv1d`` with
kernel length ``T``) or ``"scan"`` (Mamba's chunked scan with the constants, the
reference the other modes are tested against). ``fft`` is causal up to float rounding
only (each output is a sum over every frequency: a later token moves an earlier output by
~1e-7), ``conv`` and ``scan`` bit for bit. The mode enters the model's
fingerprint (a plain module attribute), so an audit records which was timed.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fcaudit.core.contract import Site
from fcaudit.core.errors import FcauditError
from fcaudit.models.mamba import PRESETS as MAMBA_PRESETS
from fcaudit.models.mamba import MambaConfig, Mixer, SSMNet, inverse_softplus_dt, selective_scan

MODE_WORDS = {"fft": "causal convolution by FFT", "conv": "direct causal convolution",
              "scan": "sequential scan"}  # each mode, as the execution audit names it
MODES = tuple(MODE_WORDS)


@dataclass(frozen=True)
class S4DConfig(MambaConfig):
    mode: str = "fft"  # how the time-invariant recurrence runs (module docstring)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in MODES:
            raise FcauditError(f"mode={self.mode!r} must be one of {', '.join(MODES)}")


PRESETS: dict[str, S4DConfig] = {
    name: S4DConfig(**dataclasses.asdict(cfg)) for name, cfg in MAMBA_PRESETS.items()}


def causal_fft_conv(u: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """``y_t = sum_{k <= t} K_k u_{t-k}`` per channel; ``u [b, T, D]``, ``kernel [D, T]``;
    zero-padded to ``2T`` so the circular convolution never wraps."""
    T = u.shape[1]
    spectrum = torch.fft.rfft(u.transpose(1, 2), n=2 * T) * torch.fft.rfft(kernel, n=2 * T)
    return torch.fft.irfft(spectrum, n=2 * T)[..., :T].transpose(1, 2)


def causal_direct_conv(u: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """:func:`causal_fft_conv` by a depthwise ``conv1d`` (``conv1d`` correlates: the kernel
    is flipped, the input padded on the left)."""
    T = u.shape[1]
    x = F.pad(u.transpose(1, 2), (T - 1, 0))
    return F.conv1d(x, kernel.flip(-1).unsqueeze(1), groups=u.shape[2]).transpose(1, 2)


# each mixer's last inference kernel, its length and copies of the weights it came from
# (LTIMixer.kernel): held beside the module, not on it, so no attribute enters the model's
# fingerprint
_KERNELS: weakref.WeakKeyDictionary[nn.Module, tuple[int, list[torch.Tensor], torch.Tensor]] \
    = weakref.WeakKeyDictionary()


class LTIMixer(Mixer):
    """Mamba's mixer with ``Δ``, ``B``, ``C`` learned as constants (no sites)."""

    def __init__(self, cfg: S4DConfig) -> None:
        super().__init__(cfg)
        self.mode = cfg.mode
        self.dt = nn.Parameter(inverse_softplus_dt(cfg, cfg.d_inner))  # Δ before softplus
        self.B = nn.Parameter(torch.ones(cfg.d_state))
        self.C = nn.Parameter(torch.randn(cfg.d_state) * cfg.d_state ** -0.5)

    def kernel(self, T: int) -> torch.Tensor:
        """``K [D, T]``: ``K[d, k] = sum_n C_n exp(k Δ_d A_dn) Δ_d B_n``. A function of the
        weights alone, so inference (no gradients) reuses the last one computed for this
        length while the weights it came from are bitwise the same (compared with copies
        kept beside it: a few thousand numbers). A folded Mamba's kernel is then computed
        once per length: its ``D * N * T`` exponentials cost more than the convolution."""
        if torch.is_grad_enabled():
            return self._kernel(T)
        weights = [p.detach() for p in (self.dt, self.A_log, self.B, self.C)]
        held = _KERNELS.get(self)
        if held is None or held[0] != T or not all(
                a.shape == b.shape and a.device == b.device and a.dtype == b.dtype and
                torch.equal(a, b) for a, b in zip(held[1], weights, strict=True)):
            held = _KERNELS[self] = (T, [w.clone() for w in weights], self._kernel(T))
        return held[2]

    def _kernel(self, T: int) -> torch.Tensor:
        dt = F.softplus(self.dt)  # [D]
        steps = torch.arange(T, device=dt.device, dtype=dt.dtype)
        powers = torch.exp((dt.unsqueeze(-1) * self.A).unsqueeze(-1) * steps)  # [D, N, T]
        return torch.einsum("dnk,n->dk", powers, self.C * self.B) * dt.unsqueeze(-1)

    def ssm(self, x: torch.Tensor) -> torch.Tensor:
        b, T, D = x.shape
        if self.mode == "scan":
            dt = F.softplus(self.dt).expand(b, T, D)
            B, C = (p.expand(b, T, p.shape[0]) for p in (self.B, self.C))
            y = selective_scan(x, dt, self.A, B, C, self.chunk)
        else:
            convolve = causal_fft_conv if self.mode == "fft" else causal_direct_conv
            y = convolve(x, self.kernel(T))
        return y + x * self.D


class S4D(SSMNet):
    """Mamba's LTI twin; ``input_ids [B, T] -> logits [B, T, V]``. No controller sites."""

    mixer_class = LTIMixer

    @property
    def execution_mode(self) -> str:
        """What the execution audit timed: time invariance allows a convolution, which the
        selective model cannot use, so the report names the mode beside the timing."""
        return MODE_WORDS[self.config.mode]

    def controller_sites(self) -> list[Site]:
        return []
