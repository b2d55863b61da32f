"""Selection parameters of selective state-space mixers: Mamba, Mamba-2 and the hybrids
built on them, found by their structure (see docs/ssm.md for the per-family table).

A selective SSM makes its step Δ and its projections B, C functions of the current
input; those are the coefficients. Everything else in the block stays live: the input
path x, the causal convolution, the output gate z, A, D and the state itself.

**Mamba-1 mixers** (a module with ``x_proj`` and ``dt_proj`` linear children, its
``time_step_rank`` R and ``ssm_state_size`` N: Mamba, FalconMamba, Jamba). ``x_proj``'s
whole output ``[B, T, R + 2N]`` is the coefficient tensor, parts ``dt`` (R), ``B``, ``C``
(N each). Δ has no module boundary of its own: transformers multiplies the low-rank dt by
``dt_proj.weight`` (the module is not called) and adds the bias inside the scan, so the
low-rank dt is where Δ can be fed. That map is linear: a mean, a donor's value or a
shuffle of the low-rank dt is the same operation on Δ before its bias and softplus.
Jamba and FalconMamba put RMS norms on dt, B and C after the split; the coefficient is
still ``x_proj``'s output, before them: a calibration mean of normalised vectors has a
smaller norm than any vector the scan ever reads, while the mean taken before the norms
is normalised by the model's own norm like every real input (the LTI profile stays in
the range the model was trained on, as a decay profile is taken before its sigmoid).

**Mamba-2 mixers** (``in_proj`` linear and ``conv1d`` children, ``A_log`` and ``dt_bias``
parameters, and the widths ``intermediate_size`` I, ``conv_dim``, ``num_heads`` H,
``n_groups`` G, ``ssm_state_size`` N: Mamba-2, Bamba, Falcon-H1, Nemotron-H,
Granite-MoE-Hybrid, Zamba2). ``in_proj``'s output is laid out ``[z (I) | x (I) | B (GN) |
C (GN) | dt (H)]``; the coefficients are its dt, B and C slices (:class:`SliceAdapter`,
parts ``dt``, ``B``, ``C``), z and x stay live. dt is before ``dt_bias`` and softplus; B
and C are before the depthwise causal convolution and its activation, which act on each
channel alone, so a donor's slices give the scan exactly the donor's B and C. Falcon-H1
scales ``in_proj``'s output by fixed µP multipliers afterwards; the slices are before them.

**Fused kernels.** transformers picks each mixer's scan, convolution and fused
training path when the modeling module is imported (the ``mamba_ssm`` and
``causal_conv1d`` packages when installed, hub kernels with ``use_kernels=True``, else
its PyTorch code). In eval mode every path still calls ``x_proj`` and ``in_proj`` as
modules and feeds their output to the kernel, so recording and replay hold. A Mamba-1
mixer in training mode with a fused ``mamba_inner_fn`` does not: it reads ``x_proj``'s
weight and never calls it. :func:`selection_sites` refuses that case in one line
(:func:`fused_bypass`) rather than let a recording come back without the mixer.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from fcaudit.core.adapters import TENSOR, SliceAdapter, join_path
from fcaudit.core.contract import Selection, Site
from fcaudit.core.errors import ModelError
from fcaudit.core.layout import TOKEN_AXES, TOKEN_LAYOUT

MAMBA_FAMILY = "mamba_selection"  # Mamba-1: x_proj's low-rank dt, B, C
MAMBA2_FAMILY = "mamba2_selection"  # Mamba-2: in_proj's dt, B, C slices
MAMBA_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")
FUSED_TRAINING_PATH = "mamba_inner_fn"  # Mamba-1's training kernel: x_proj is not called


def _width(module: nn.Module, name: str) -> int | None:
    value = getattr(module, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _linear(module: nn.Module, name: str) -> nn.Linear | None:
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Linear) else None


def mamba_site(path: str, mixer: nn.Module) -> Site | None:
    """The selection site of a Mamba-1 mixer (``x_proj``'s output), or None when
    ``mixer`` is not one or its widths do not add up."""
    x_proj, dt_proj = _linear(mixer, "x_proj"), _linear(mixer, "dt_proj")
    rank, state = _width(mixer, "time_step_rank"), _width(mixer, "ssm_state_size")
    if x_proj is None or dt_proj is None or rank is None or state is None or \
            x_proj.out_features != rank + 2 * state or dt_proj.in_features != rank:
        return None
    normed = all(isinstance(getattr(mixer, n, None), nn.Module) for n in MAMBA_NORMS)
    space = ("dt (low rank), B and C before their RMS norms; dt then through dt_proj's "
             "weight, its bias and softplus") if normed else \
        "dt low rank, before dt_proj's weight, its bias and softplus; B, C as the scan reads them"
    site_path = join_path(path, "x_proj")
    return Site(site_path, site_path, MAMBA_FAMILY, 0, TENSOR, TOKEN_AXES, TOKEN_LAYOUT,
                Selection(space, (("dt", rank), ("B", state), ("C", state))))


def mamba2_site(path: str, mixer: nn.Module) -> Site | None:
    """The selection site of a Mamba-2 mixer (``in_proj``'s dt, B, C slices), or None
    when ``mixer`` is not one or its widths do not add up."""
    in_proj = _linear(mixer, "in_proj")
    widths = [_width(mixer, n) for n in ("intermediate_size", "conv_dim", "num_heads",
                                          "n_groups", "ssm_state_size")]
    if in_proj is None or not isinstance(getattr(mixer, "conv1d", None), nn.Conv1d) or \
            not all(isinstance(getattr(mixer, n, None), nn.Parameter)
                    for n in ("A_log", "dt_bias")) or None in widths:
        return None
    inner, conv_dim, heads, groups, state = (int(w or 0) for w in widths)
    bc = groups * state
    if conv_dim != inner + 2 * bc or in_proj.out_features != inner + conv_dim + heads:
        return None
    b_at, dt_at = 2 * inner, inner + conv_dim  # after z and x; after z, x, B and C
    space = ("dt before dt_bias and softplus; B, C before the causal convolution and "
             f"{getattr(mixer, 'activation', None) or 'its activation'}")
    if hasattr(mixer, "mup_vector"):  # Falcon-H1 scales in_proj's output per channel
        space += "; all three before the µP multipliers"
    site_path = join_path(path, "in_proj")
    return Site(site_path, site_path, MAMBA2_FAMILY, 0,
                SliceAdapter(((dt_at, dt_at + heads), (b_at, b_at + bc),
                              (b_at + bc, b_at + 2 * bc))),
                axes=TOKEN_AXES, positions=TOKEN_LAYOUT,
                role=Selection(space, (("dt", heads), ("B", bc), ("C", bc))))


MIXER_RULES: tuple[Callable[[str, nn.Module], Site | None], ...] = (mamba_site, mamba2_site)


def fused_implementation(function: Any) -> str | None:
    """The fused kernel a transformers function runs (``module.name``), or None when it
    runs transformers' own PyTorch code. transformers decorates such a function with
    ``use_kernel_func_from_hub_with_fallback``, which keeps its choice in the closure
    variable ``implementation`` (the installed package's kernel, else the PyTorch
    stand-in); with the ``kernels`` package installed (transformers >= 5.25) the decorated
    function is further wrapped in a module whose ``forward`` closes over it (``func``).
    A function imported straight from a kernel package is its own implementation."""
    seen = function
    for _ in range(_MAX_WRAPPERS):
        if not callable(seen):
            break
        cells = _closure(seen)
        if callable(cells.get("implementation")):
            function = cells["implementation"]
            break
        seen = getattr(seen, "__wrapped__", None) or cells.get("func")
    module = getattr(function, "__module__", None) or ""
    if not callable(function) or module.startswith("transformers."):
        return None
    return f"{module}.{getattr(function, '__name__', type(function).__name__)}"


_MAX_WRAPPERS = 8  # decorators between a transformers function and its implementation


def _closure(obj: Any) -> dict[str, Any]:
    """The closure variables of a function, or of a callable object's ``forward``."""
    target = obj if inspect.isfunction(obj) else getattr(type(obj), "forward", None)
    try:
        return dict(inspect.getclosurevars(target).nonlocals) if target else {}
    except (TypeError, ValueError):  # a builtin (no closure) or an empty cell
        return {}


def fused_bypass(model: nn.Module, path: str, mixer: nn.Module) -> str | None:
    """Why a Mamba-1 mixer would skip its ``x_proj`` call on the next forward pass (one
    line, naming the kernel and what to do), or None. Only a mixer whose forward calls
    ``mamba_inner_fn`` (Mamba, FalconMamba; not Jamba) has that path, transformers takes
    it only in training mode, and only a kernel short-circuits there (the PyTorch
    stand-in returns None and the module path runs)."""
    forward = inspect.unwrap(type(mixer).forward)
    code = getattr(forward, "__code__", None)
    if not mixer.training or code is None or FUSED_TRAINING_PATH not in code.co_names:
        return None
    kernel = fused_implementation(forward.__globals__.get(FUSED_TRAINING_PATH))
    if kernel is not None:
        runs = f"the fused kernel {kernel}"
    elif getattr(model, "use_kernels", False) is True:
        runs = f"a hub kernel for {FUSED_TRAINING_PATH} (use_kernels=True)"
    else:
        return None
    return (f"Mamba mixer {path or type(mixer).__name__} is in training mode, where "
            f"transformers runs {runs}, which reads x_proj's weight without calling x_proj: "
            "its selection coefficients (dt, B, C) could be neither recorded nor replayed; "
            "call model.eval() before the audit (fcaudit audit does)")


def selection_sites(model: nn.Module) -> list[Site]:
    """One selection site per Mamba-1 or Mamba-2 mixer, named by module path, layer =
    order within its family; empty for a model without such mixers. Refuses (one line) a
    mixer whose fused kernel would bypass the site's module call."""
    found: list[Site] = []
    for path, module in model.named_modules():
        for rule in MIXER_RULES:
            site = rule(path, module)
            if site is None:
                continue
            if rule is mamba_site:
                reason = fused_bypass(model, path, module)
                if reason is not None:
                    raise ModelError(reason, site=site.name)
            layer = sum(s.family == site.family for s in found)
            found.append(dataclasses.replace(site, layer=layer))
            break
    return found
