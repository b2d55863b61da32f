"""Gated linear attention and gated recurrences in ``transformers``: their selection sites.

A selection site (SPEC section 11) holds the tensors, computed from the current input,
that set a recurrence's decay, write strength or input gate; everything else in the
block (the convolution, the values, the output gate, the scan) stays live. The space a
site's values are in is named on the site (``Selection.space``): always before the
range-keeping activation (sigmoid, softplus, exp), so that a static profile averaged
there is a time-invariant recurrence with valid parameters.

Where a coefficient is a module's output (or channels of it) the site is that module.
Where it is computed inside a forward with no module boundary (RG-LRU's gates are
``baddbmm`` with a parameter, Zamba's ``dt``, ``B``, ``C`` are matmuls with
``x_proj_weight`` and ``dt_proj_weight``), :class:`WeightTapAdapter` intercepts the
projections that take those parameters, as :class:`~fcaudit.core.routers.RouterAdapter`
intercepts a router's one projection: observed at extract, substituted at rebuild, the
rest of the forward live; recording checks the rebuild bit for bit on every call.

:func:`gated_recurrence_sites` finds the blocks by their children and parameters; see
docs/ssm.md, section "Gated linear attention and gated recurrences", for each family.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from fcaudit.core.adapters import (
    ADAPTER_API,
    TENSOR,
    SliceAdapter,
    describe,
    join_path,
    same_bits,
)
from fcaudit.core.contract import ControllerAdapter, Selection, Site, SiteCall
from fcaudit.core.errors import FcauditError, ModelError
from fcaudit.core.layout import TOKEN_AXES, TOKEN_LAYOUT
from fcaudit.core.routers import PROJECTIONS, _device, _meta

# the projections a tap may be computed with (RG-LRU's gates use baddbmm)
TAP_OPS = PROJECTIONS | {torch.baddbmm, Tensor.baddbmm}
# arguments of a site's forward that carry a generation cache (state between calls): left
# out when the adapter re-runs the forward, which the live call already advanced
CACHE_ARGUMENTS = ("cache", "cache_params", "past_key_values", "past_key_value")

# ---- where a tap's output keeps tokens, heads and channels ----

# [heads, batch*positions, channels]: a batched matmul over heads (RG-LRU)
HEADS_TOKENS = "heads,tokens,channels"
# [heads, batch, channels, positions]: per-head weights applied to channels-first states (Zamba)
HEADS_BATCH_CHANNELS_TIME = "heads,batch,channels,positions"


def _as_tokens(out: Tensor, layout: str, batch: int, seq_len: int) -> Tensor:
    """A view of a tap's output as ``[batch, positions, heads, channels]``."""
    if layout == HEADS_TOKENS:
        fits = out.dim() == 3 and out.shape[1] == batch * seq_len
    else:
        fits = out.dim() == 4 and (out.shape[1], out.shape[3]) == (batch, seq_len)
    if not fits:
        raise FcauditError(f"a projection gives {list(out.shape)}, not [{layout}] for "
                           f"{batch} examples of {seq_len} positions: feed coefficients "
                           "recorded from this site (same batch and positions)")
    if layout == HEADS_TOKENS:
        return out.view(out.shape[0], batch, seq_len, out.shape[-1]).permute(1, 2, 0, 3)
    return out.permute(1, 3, 0, 2)


@dataclass(frozen=True)
class Tap:
    """One projection inside a site's forward: the op call that takes the site module's
    parameter ``weight``. Its output (in ``layout``) holds, per head, the channels
    ``spans`` as coefficients (None: all of them); ``width`` is their count over all
    heads, the tap's share of the site's coefficient tensor."""

    weight: str
    layout: str
    width: int
    spans: tuple[tuple[int, int], ...] | None = None


def _uses(value: Any, weight: Tensor) -> bool:
    """True when ``value`` is ``weight`` or a view of it (``w[:, None]``)."""
    return isinstance(value, Tensor) and (value is weight or value._base is weight)


class _Taps(TorchFunctionMode):
    """During one call of a site's forward: counts the projections that take each tap's
    weight; the first of each is observed (a copy of its output kept) or, with
    ``supplied`` (one ``[B, T, width]`` chunk per tap), answered with those coefficients
    written over its channels (computed on the meta device when every channel is
    supplied, else live and overwritten)."""

    def __init__(self, module: nn.Module, taps: Sequence[Tap], call: SiteCall,
                 supplied: list[Tensor] | None) -> None:
        super().__init__()
        self.taps, self.call, self.supplied = taps, call, supplied
        self.weights = [getattr(module, tap.weight, None) for tap in taps]
        missing = [t.weight for t, w in zip(taps, self.weights, strict=True)
                   if not isinstance(w, Tensor)]
        if missing:
            raise FcauditError(f"{type(module).__name__} has no parameter {missing[0]} for the "
                               f"adapter to intercept; {ADAPTER_API}")
        self.calls = [0] * len(taps)
        self.outputs: list[Tensor | None] = [None] * len(taps)

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        values = (*args, *kwargs.values())
        k = next((k for k, w in enumerate(self.weights)
                  if func in TAP_OPS and any(_uses(v, w) for v in values)), None)
        if k is None:
            return func(*args, **kwargs)
        self.calls[k] += 1
        if self.calls[k] > 1:  # refused by the count once the forward returns
            return func(*args, **kwargs)
        if self.supplied is None:
            output = func(*args, **kwargs)
            self.outputs[k] = output.detach().clone()
            return output
        return self._substitute(k, func, args, kwargs)

    def _substitute(self, k: int, func: Any, args: Sequence[Any],
                    kwargs: dict[str, Any]) -> Tensor:
        tap, chunk = self.taps[k], self.supplied[k]  # type: ignore[index]
        like = func(*_meta(tuple(args)), **{n: _meta(v) for n, v in kwargs.items()})
        if tap.spans is None:  # every channel supplied: the projection is not computed
            out = torch.empty(like.shape, dtype=like.dtype, device=_device([*args]))
        else:
            out = func(*args, **kwargs).clone()
        view = _as_tokens(out, tap.layout, self.call.batch, int(self.call.seq_len or 0))
        heads, at = view.shape[2], 0
        for a, b in _spans(tap, view):
            view[..., a:b] = chunk[..., at:at + heads * (b - a)].reshape(
                *view.shape[:3], b - a).to(device=out.device, dtype=out.dtype)
            at += heads * (b - a)
        return out


def _spans(tap: Tap, view: Tensor) -> tuple[tuple[int, int], ...]:
    """The tap's coefficient channels per head, checked against its output ``view``
    ``[B, T, heads, channels]``."""
    spans = tap.spans if tap.spans is not None else ((0, view.shape[-1]),)
    if view.shape[2] * sum(b - a for a, b in spans) != tap.width:
        raise FcauditError(f"the projection with {tap.weight} gives {view.shape[2]} heads of "
                           f"{view.shape[-1]} channels, which do not hold {tap.width} "
                           f"coefficients; {ADAPTER_API}")
    return spans


def _uncached(call: SiteCall) -> tuple[dict[str, Any], str | None]:
    """The call's keyword arguments with any generation cache left out, and the name of
    the one left out. A re-run must not read or write the cache: the live call already
    advanced it. A cache passed by position cannot be left out: refused."""
    positional = [type(v).__name__ for v in call.args if type(v).__name__.endswith("Cache")]
    if positional:
        raise FcauditError(f"{type(call.module).__name__} was given a generation cache "
                           f"({positional[0]}) by position; run the model with "
                           "use_cache=False")
    held = next((n for n in CACHE_ARGUMENTS if call.kwargs.get(n) is not None), None)
    return {k: None if k in CACHE_ARGUMENTS else v for k, v in call.kwargs.items()}, held


@dataclass(frozen=True)
class WeightTapAdapter:
    """Coefficients computed inside a forward by projections with the site module's own
    parameters (:class:`Tap`), side by side in ``taps`` order: the forward runs with
    those projections observed (extract) or answered with supplied coefficients
    (rebuild); each weight must enter exactly one projection per call. The re-runs leave
    a generation cache out; a cache whose earlier state changed the output is refused."""

    taps: tuple[Tap, ...]
    name: str = field(default="weight-taps", init=False)

    def _run(self, call: SiteCall, supplied: Tensor | None) -> tuple[Any, _Taps, str | None]:
        kwargs, cache = _uncached(call)
        if call.seq_len is None:
            raise FcauditError(f"{type(call.module).__name__}: its coefficients are per token, "
                               "and these inputs do not say how many tokens each example "
                               "has: give the token ids [N, T] as the inputs")
        chunks = None if supplied is None else list(
            supplied.split([tap.width for tap in self.taps], dim=-1))
        mode = _Taps(call.module, self.taps, call, chunks)
        with mode:
            # forward, not __call__: hooks on the module (the recorder's own) must not fire
            output = call.module.forward(*call.args, **kwargs)
        for tap, count in zip(self.taps, mode.calls, strict=True):
            if count != 1:
                raise FcauditError(
                    f"{type(call.module).__name__}: its parameter {tap.weight} entered {count} "
                    "projections in one call, expected 1; a fused kernel that takes the weight "
                    "itself hides the coefficients: run the PyTorch path (no use_kernels=True)")
        return output, mode, cache

    def extract(self, output: Any, call: SiteCall) -> Tensor:
        rerun, mode, cache = self._run(call, None)
        if cache is not None and not same_bits(rerun, output):
            raise FcauditError(
                f"{type(call.module).__name__} was called with a generation cache ({cache}) "
                "holding state from earlier calls: its output depends on them, and a replay "
                "cannot carry that state; run the model on whole windows with "
                "use_cache=False and no past_key_values")
        parts = []
        for tap, out in zip(self.taps, mode.outputs, strict=True):
            assert out is not None  # every tap ran once: _run checked
            view = _as_tokens(out, tap.layout, call.batch, int(call.seq_len or 0))
            parts += [view[..., a:b].reshape(call.batch, call.seq_len, -1)
                      for a, b in _spans(tap, view)]
        return torch.cat(parts, dim=-1)

    def rebuild(self, coefficients: Tensor, call: SiteCall) -> Any:
        width = sum(tap.width for tap in self.taps)
        if coefficients.shape[-1] != width:
            raise FcauditError(f"{type(call.module).__name__}: coefficients "
                               f"{describe(coefficients)} do not have its {width} channels: "
                               "feed coefficients recorded from this site")
        output, _, _ = self._run(call, coefficients)
        return output


# ---- the discovery rule ----

GATED_DELTANET = "gated_deltanet"
GATED_DELTANET_SPACE = ("beta: write strength before sigmoid; decay: a before softplus "
                        "(g = -exp(A_log) softplus(a + dt_bias))")
# the two projections of a Gated DeltaNet that computes them apart: (beta, decay)
GDN_SPLIT = (("in_proj_b", "in_proj_a"), ("b_proj", "a_proj"))
GDN_BETA, GDN_BETA_SPACE = "gated_deltanet_beta", "write strength before sigmoid"
GDN_DECAY, GDN_DECAY_SPACE = "gated_deltanet_decay", (
    "decay input a before softplus (g = -exp(A_log) softplus(a + dt_bias))")
KDA_DECAY, KDA_DECAY_SPACE = "kda_decay", ("per-channel decay before dt_bias and softplus "
                                           "(g = -exp(A_log) softplus(f + dt_bias))")
KDA_BETA, KDA_BETA_SPACE = "kda_beta", "write strength before sigmoid"
RGLRU, RGLRU_SPACE = "rglru", "input and recurrence gates before sigmoid"
MLSTM_GATES_SPACE = ("gate pre-activation before soft cap (input gate: exp; forget gate: "
                     "log-sigmoid)")
RWKV_RECEPTANCE, RWKV_RECEPTANCE_SPACE = "rwkv_receptance", (
    "receptance (read gate) before sigmoid; the decay time_decay is a static parameter")
RWKV_KEY, RWKV_KEY_SPACE = "rwkv_key", (
    "key before exp: each token's write weight in the WKV state (decay is static)")
SHORT_CONV, SHORT_CONV_SPACE = "short_conv", ("input gate B and output gate C, used as they "
                                              "are (products, no activation)")
MAMBA, MAMBA_SPACE = "mamba_selection", "dt before bias and softplus; B and C as they are"


@dataclass(frozen=True)
class _Found:
    """A site before its layer number (its order within the family) is known."""

    path: str
    family: str
    adapter: ControllerAdapter
    selection: str
    parts: tuple[tuple[str, int], ...] = ()


def _linear(module: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def _gated_deltanet(path: str, module: nn.Module) -> list[_Found]:
    """Gated DeltaNet. Qwen3-Next's ``in_proj_ba`` holds, per key head, the ``b`` then ``a``
    of its ``num_v_heads / num_k_heads`` value heads: one site, regrouped as beta then
    decay. Later families (Qwen3.5, OLMo-Hybrid, ...) project them apart: two sites."""
    heads, groups = getattr(module, "num_v_heads", None), getattr(module, "num_k_heads", None)
    if _linear(module, "in_proj_ba") and isinstance(heads, int) and groups:
        per = heads // groups
        betas = tuple((g * 2 * per, g * 2 * per + per) for g in range(groups))
        decays = tuple((g * 2 * per + per, (g + 1) * 2 * per) for g in range(groups))
        return [_Found(join_path(path, "in_proj_ba"), GATED_DELTANET, SliceAdapter(betas + decays),
                       GATED_DELTANET_SPACE, (("beta", heads), ("decay", heads)))]
    if not isinstance(getattr(module, "A_log", None), nn.Parameter):
        return []
    for beta, decay in GDN_SPLIT:
        if _linear(module, beta, decay):
            return [_Found(join_path(path, beta), GDN_BETA, TENSOR, GDN_BETA_SPACE),
                    _Found(join_path(path, decay), GDN_DECAY, TENSOR, GDN_DECAY_SPACE)]
    return []


def _kimi_delta(path: str, module: nn.Module) -> list[_Found]:
    """Kimi Delta Attention (and Bailing-Hybrid's): the forget gate's last projection
    (``f_b_proj`` after a low-rank ``f_a_proj``, or one ``f_proj``: per-channel decay)
    and ``b_proj`` (per-head write strength)."""
    gate = getattr(module, "forget_gate", None)
    if not (isinstance(gate, nn.Module) and _linear(module, "b_proj")):
        return []
    decay = next((n for n in ("f_b_proj", "f_proj") if _linear(gate, n)), None)
    if decay is None:
        return []
    return [_Found(join_path(path, "forget_gate", decay), KDA_DECAY, TENSOR, KDA_DECAY_SPACE),
            _Found(join_path(path, "b_proj"), KDA_BETA, TENSOR, KDA_BETA_SPACE)]


def _rglru(path: str, module: nn.Module) -> list[_Found]:
    """RG-LRU: both gates are ``baddbmm`` with per-head block-diagonal weights."""
    names = ("input_gate_weight", "recurrent_gate_weight")
    weights = [getattr(module, n, None) for n in names]
    if not all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights):
        return []
    width = weights[0].shape[0] * weights[0].shape[-1]  # type: ignore[union-attr]
    taps = tuple(Tap(n, HEADS_TOKENS, width) for n in names)
    return [_Found(path, RGLRU, WeightTapAdapter(taps), RGLRU_SPACE,
                   (("input_gate", width), ("recurrent_gate", width)))]


def _mlstm(path: str, module: nn.Module) -> list[_Found]:
    """xLSTM's mLSTM layer: input and forget gate pre-activations, two modules
    (``weight_mode='single'``) or one fused ``ifgate_preact``."""
    if _linear(module, "igate_preact", "fgate_preact"):
        return [_Found(join_path(path, "igate_preact"), "mlstm_input_gate", TENSOR,
                       MLSTM_GATES_SPACE),
                _Found(join_path(path, "fgate_preact"), "mlstm_forget_gate", TENSOR,
                       MLSTM_GATES_SPACE)]
    if _linear(module, "ifgate_preact"):
        heads = module.ifgate_preact.out_features // 2
        return [_Found(join_path(path, "ifgate_preact"), "mlstm_gates", TENSOR, MLSTM_GATES_SPACE,
                       (("input_gate", heads), ("forget_gate", heads)))]
    return []


def _rwkv_time_mix(path: str, module: nn.Module) -> list[_Found]:
    """RWKV-4 time mixing: the receptance and the key; its decay is a parameter."""
    if not (isinstance(getattr(module, "time_decay", None), nn.Parameter)
            and _linear(module, "receptance", "key")):
        return []
    return [_Found(join_path(path, "receptance"), RWKV_RECEPTANCE, TENSOR, RWKV_RECEPTANCE_SPACE),
            _Found(join_path(path, "key"), RWKV_KEY, TENSOR, RWKV_KEY_SPACE)]


def _short_conv(path: str, module: nn.Module) -> list[_Found]:
    """LFM2's short convolution: ``in_proj`` gives B, C, x; y = C * conv(B * x)."""
    conv, proj = getattr(module, "conv", None), getattr(module, "in_proj", None)
    if not (isinstance(conv, nn.Conv1d) and isinstance(proj, nn.Linear)
            and conv.groups == conv.in_channels and proj.out_features == 3 * conv.in_channels):
        return []
    width = conv.in_channels
    adapter = SliceAdapter(((0, width), (width, 2 * width)))
    return [_Found(join_path(path, "in_proj"), SHORT_CONV, adapter, SHORT_CONV_SPACE,
                   (("B", width), ("C", width)))]


def _mamba_heads(path: str, module: nn.Module) -> list[_Found]:
    """Zamba's multi-head Mamba mixer: ``dt`` from matmuls with ``dt_proj_weight``, B and C
    from those with ``x_proj_weight`` (its first ``rank`` channels feed ``dt``)."""
    x_proj = getattr(module, "x_proj_weight", None)
    dt_proj = getattr(module, "dt_proj_weight", None)
    if not (isinstance(x_proj, nn.Parameter) and isinstance(dt_proj, nn.Parameter)
            and x_proj.dim() == dt_proj.dim() == 3):
        return []
    heads, channels, head_dim = x_proj.shape
    rank = dt_proj.shape[-1]
    state = (channels - rank) // 2
    taps = (Tap("dt_proj_weight", HEADS_BATCH_CHANNELS_TIME, heads * head_dim),
            Tap("x_proj_weight", HEADS_BATCH_CHANNELS_TIME, 2 * heads * state,
                ((rank, rank + state), (rank + state, channels))))
    return [_Found(path, MAMBA, WeightTapAdapter(taps), MAMBA_SPACE,
                   (("dt", heads * head_dim), ("B", heads * state), ("C", heads * state)))]


MATCHERS: tuple[Callable[[str, nn.Module], list[_Found]], ...] = (
    _gated_deltanet, _kimi_delta, _rglru, _mlstm, _rwkv_time_mix, _short_conv, _mamba_heads)


def _check_torch_path(path: str, module: nn.Module) -> None:
    """Refuse a ``transformers`` block whose forward was replaced from outside the library
    (a hub kernel through ``use_kernels=True``): a fused forward may compute the
    coefficients inside the kernel, where neither hooks nor interception see them."""
    forward = getattr(module.forward, "__func__", module.forward)
    owner = getattr(forward, "__module__", None) or ""
    if type(module).__module__.startswith("transformers.") and \
            not owner.startswith(("transformers.", "accelerate.")):
        kernel = f"{owner}.{getattr(forward, '__qualname__', type(forward).__name__)}"
        raise ModelError(f"{path or type(module).__name__} ({type(module).__name__}) runs the "
                         f"kernel {kernel} instead of its PyTorch forward, which can compute "
                         "the selection coefficients where fcaudit cannot see them; load the "
                         "model without use_kernels=True to audit them", site=path)


def gated_recurrence_sites(model: nn.Module) -> list[Site]:
    """Selection sites of gated linear attention and gated recurrences (Gated DeltaNet,
    Kimi Delta Attention, RG-LRU, mLSTM, RWKV-4, LFM2's short convolution, Zamba's Mamba;
    docs/ssm.md lists the families),
    named by module path, layer = order within the family. Empty when none is found."""
    found: list[_Found] = []
    for path, module in model.named_modules():
        here = [f for matcher in MATCHERS for f in matcher(path, module)]
        if here:
            _check_torch_path(path, module)
        found += here
    layers: dict[str, int] = {}
    sites = []
    for f in found:
        layers[f.family] = layers.get(f.family, -1) + 1
        sites.append(Site(f.path, f.path, f.family, layers[f.family], f.adapter, TOKEN_AXES,
                          TOKEN_LAYOUT, Selection(f.selection, f.parts)))
    return sites
