"""Mixture-of-Experts routers: a generic adapter, routing metrics and expert execution counts.

**The adapter.** A router reads hidden states and computes its logits with one
linear projection (``F.linear``, an ``nn.Linear`` child, or a matmul with its
weight); everything after that (softmax or sigmoid, bias correction, group-limited
top-k, renormalisation, scaling, dtype casts) is a fixed function of the logits and
the router's buffers. :class:`RouterAdapter` takes the projection's output as the
coefficient tensor and rebuilds the router's output by running the router's *own*
forward with that one projection intercepted (a ``TorchFunctionMode`` active only
during the call): the projection returns the supplied logits without being
computed, and the rest runs exactly as the family wrote it. So a reassigned,
shuffled or static condition selects experts exactly as the donor's logits would,
and identity replay is bitwise exact. Supplied logits are cast to the dtype the
projection would have produced (a no-op for recorded ones).

The coefficient is the projection's output, not an element of the router's
output: some routers return probabilities (Gemma 4), soft-capped or scaled logits
(Laguna, Muse Spark) or a slice of them (Inkling). Recording therefore runs the
router's forward once more with the projection observed (one small matmul per
router and pass).

**Metrics** are pure functions of top-k index tensors ``[..., k]``: expert load and
its entropy, and how many top-k expert sets two routings disagree on.

**Execution counts** come from hooks on the experts: tokens entering each expert
module, or, for a fused module that runs every expert, the int64 ``[tokens, k]``
index tensor among its inputs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (torch's own convention)
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from fcaudit.core.adapters import ADAPTER_API, FLAT, TENSOR, describe, join_path
from fcaudit.core.contract import ExpertLayer, Gate, Site, SiteCall
from fcaudit.core.errors import FcauditError
from fcaudit.core.hooks import hooks
from fcaudit.core.layout import TOKEN_AXES, TOKEN_LAYOUT

# every way a router may compute its projection: intercepted, and counted
PROJECTIONS = frozenset({
    F.linear, torch.matmul, Tensor.matmul, Tensor.__matmul__, Tensor.__rmatmul__,
    torch.mm, Tensor.mm, torch.addmm, Tensor.addmm, torch.bmm, Tensor.bmm, torch.einsum,
})


def _meta(value: Any) -> Any:
    """``value`` with its tensors (also inside a list, as ``einsum`` takes them) on meta."""
    if isinstance(value, Tensor):
        return torch.empty_like(value, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(v) for v in value)
    return value


def _device(values: Sequence[Any]) -> torch.device:
    for value in values:
        if isinstance(value, Tensor):
            return value.device
        if isinstance(value, (list, tuple)) and value:
            return _device(value)
    return torch.device("cpu")


class _Projection(TorchFunctionMode):
    """Counts the projections of one router call. The first returns ``supplied`` in its
    place (its shape and dtype worked out on the meta device, nothing computed), or,
    with ``supplied`` None, runs and a copy of its output is kept (taken at once, so a
    later in-place edit by the router cannot change it). Any further projection runs
    as written, for the caller to refuse the router by the count."""

    def __init__(self, supplied: Tensor | None) -> None:
        super().__init__()
        self.supplied = supplied
        self.calls = 0
        self.output: Tensor | None = None

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in PROJECTIONS:
            return func(*args, **kwargs)
        self.calls += 1
        if self.supplied is not None and self.calls == 1:
            return self._substitute(func, args, kwargs, self.supplied)
        output = func(*args, **kwargs)
        if self.calls == 1:
            self.output = output.detach().clone()
        return output

    @staticmethod
    def _substitute(func: Any, args: Sequence[Any], kwargs: dict[str, Any],
                    supplied: Tensor) -> Tensor:
        like = func(*_meta(tuple(args)), **{k: _meta(v) for k, v in kwargs.items()})
        if like.numel() != supplied.numel():
            raise FcauditError(
                f"the router's projection gives {list(like.shape)}, which does not hold the "
                f"supplied logits {list(supplied.shape)}: feed coefficients recorded from this "
                "router (same batch, positions and experts)")
        device = _device([*args, *kwargs.values()])
        return supplied.reshape(like.shape).to(device=device, dtype=like.dtype)


def routing_of(router: nn.Module, logits: Tensor) -> tuple[Tensor, Tensor]:
    """The experts ``[k]`` (int64) and their weights ``[k]`` that ``router`` gives a token
    whose logits are ``logits`` ``[E]``: the router's own forward on one token, its
    projection returning the logits (what a fold of a static profile fixes). The router
    must return one top-k index tensor and one weight tensor of its shape (transformers'
    5.x routers: logits, top-k weights, top-k indices)."""
    weight = next(router.parameters())
    mode = _Projection(logits.reshape(1, -1))
    with mode, torch.no_grad():
        output = router.forward(torch.zeros(1, weight.shape[-1], dtype=weight.dtype,
                                            device=weight.device))
    items = output if isinstance(output, (tuple, list)) else (output,)
    ids = [t for t in items if isinstance(t, Tensor) and not t.is_floating_point()]
    weights = [t for t in items if isinstance(t, Tensor) and t.is_floating_point()
               and len(ids) == 1 and t.shape == ids[0].shape]
    if mode.calls != 1 or len(ids) != 1 or len(weights) != 1:
        raise FcauditError(f"router {type(router).__name__} returned {describe(output)}, not "
                           "one top-k index tensor with its weights from one projection: its "
                           "experts cannot be merged at a fixed choice")
    return ids[0].reshape(-1).long(), weights[0].reshape(-1)


TOPKS = frozenset({torch.topk, Tensor.topk})


class FixedTopK(TorchFunctionMode):
    """Experts fixed, weights recomputed (the trainers' replay contract, R3's): while a
    pass runs in this mode, each top-k of ``k`` over ``experts`` scores is the selection of
    the router named :attr:`current` (set as each router starts), and returns the ids
    :attr:`fixed` gives for it (``[tokens, k]``; negative ids: the live choice kept) with
    the scores at them. The router's own code then weights the fixed experts from its live
    scores: its softmax or sigmoid, renormalisation and scaling run as the family wrote
    them. Top-ks of another width (a group-limited router's group selection) run as
    written; :attr:`calls` counts the fixed ones per router, for the caller to check."""

    def __init__(self, experts: int, k: int) -> None:
        super().__init__()
        self.experts, self.k = experts, k
        self.current: str | None = None
        self.fixed: dict[str, Tensor] = {}
        self.calls: dict[str, int] = {}

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in TOPKS or self.current not in self.fixed:
            return out
        scores = args[0]
        k = args[1] if len(args) > 1 else kwargs.get("k")
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        if k != self.k or scores.shape[-1] != self.experts or dim not in (-1, scores.dim() - 1):
            return out
        self.calls[self.current] = self.calls.get(self.current, 0) + 1
        ids = self.fixed[self.current]
        if ids.numel() != out.indices.numel():
            raise FcauditError(f"router {self.current} selected experts for "
                               f"{out.indices.numel() // k} tokens, and the fixed ids cover "
                               f"{ids.numel() // k}")
        ids = ids.reshape(out.indices.shape).to(out.indices.device)
        ids = torch.where(ids >= 0, ids, out.indices)
        return torch.return_types.topk((scores.gather(-1, ids), ids))


@dataclass(frozen=True)
class RouterAdapter:
    """:class:`~fcaudit.core.contract.RoutingAdapter` for a router whose logits come from
    exactly one linear projection (see the module docstring).

    ``selected_experts`` reads the router's top-k index tensor: the one integer tensor
    in its output tuple. A router without one (DBRX, Llama 4 return logits or scores
    and leave the top-k to the caller) is read as the top-``top_k`` of output element
    ``logits_index`` (the output itself when it is a tensor), since softmax and sigmoid
    keep the order; ``top_k`` defaults to the router's own ``top_k`` attribute.
    """

    top_k: int | None = None
    logits_index: int = 0
    name: str = field(default="router", init=False)

    def _run(self, call: SiteCall, supplied: Tensor | None) -> tuple[Any, _Projection]:
        mode = _Projection(supplied)
        with mode:
            # forward, not __call__: hooks on the router (the recorder's own) must not fire
            output = call.module.forward(*call.args, **call.kwargs)
        if mode.calls != 1:
            raise FcauditError(
                f"router {type(call.module).__name__} ran {mode.calls} linear projections "
                "(F.linear, matmul, mm, einsum) in one call; fcaudit's RouterAdapter needs "
                f"exactly one, the logits: {ADAPTER_API}")
        return output, mode

    def extract(self, output: Any, call: SiteCall) -> Tensor:
        """The projection's output (the router logits) as ``[B, T, E]``."""
        _, mode = self._run(call, None)
        logits = mode.output
        assert logits is not None  # set by the single projection _run checked for
        if call.seq_len is None:
            raise FcauditError(
                f"router {type(call.module).__name__}: its logits {describe(logits)} hold one "
                f"row per token, and these inputs do not say how many tokens each of the "
                f"{call.batch} examples has: give the token ids [N, T] as the inputs, or in "
                "a dict of inputs as 'input_ids' (or token vectors [N, T, C] as "
                "'inputs_embeds')")
        tokens = call.batch * call.seq_len
        if logits.dim() < 1 or logits.numel() % tokens:
            raise FcauditError(
                f"router {type(call.module).__name__}: its projection gives "
                f"{describe(logits)}, not one row of logits per token ({tokens} tokens); "
                f"{ADAPTER_API}")
        return logits.reshape(call.batch, call.seq_len, -1)

    def rebuild(self, coefficients: Tensor, call: SiteCall) -> Any:
        """The router's output for ``coefficients`` as logits: its own forward, with the
        projection returning them instead of being computed."""
        output, _ = self._run(call, coefficients)
        return output

    def selected_experts(self, output: Any, call: SiteCall) -> Tensor:
        """The top-k expert indices ``[B, T, k]`` (int64) that ``output`` routes to."""
        items = output if isinstance(output, (tuple, list)) else (output,)
        indices = [t for t in items if isinstance(t, Tensor) and not t.is_floating_point()]
        if len(indices) == 1:
            return indices[0].long().reshape(call.batch, call.seq_len, -1)
        if indices:
            raise FcauditError(
                f"router {type(call.module).__name__} returned {describe(output)}: several "
                "integer tensors, so which holds the top-k experts is ambiguous; count expert "
                "execution on the experts module instead")
        scores = items[self.logits_index] if isinstance(output, (tuple, list)) else output
        k = self.top_k if self.top_k is not None else getattr(call.module, "top_k", None)
        if not isinstance(k, int) or not isinstance(scores, Tensor):
            raise FcauditError(
                f"router {type(call.module).__name__} returned {describe(output)} with no "
                "top-k index tensor and has no top_k: give RouterAdapter(top_k=...)")
        return scores.reshape(call.batch * call.seq_len, -1).topk(k, dim=-1).indices.reshape(
            call.batch, call.seq_len, k)


@dataclass(frozen=True)
class TopKLogits:
    """:class:`~fcaudit.core.contract.RoutingAdapter` for a router module that returns its logits
    ``[B, T, E]`` and leaves the selection (the top-``top_k`` logits) to the block: the
    output is the coefficient, as with the plain tensor adapter, and the selected experts
    are its top-k."""

    top_k: int
    name: str = field(default="topk-logits", init=False)

    def extract(self, output: Any, call: SiteCall) -> Tensor:
        return TENSOR.extract(output, call)

    def rebuild(self, coefficients: Tensor, call: SiteCall) -> Tensor:
        return coefficients

    def selected_experts(self, output: Any, call: SiteCall) -> Tensor:
        return output.topk(self.top_k, dim=-1).indices


# ---- expert ablation: logits whose routing rule never picks one expert ----

ABLATION_MARGIN = 1e4  # below every other logit of the token: exp(-1e4) and sigmoid(-1e4) are 0
ABLATION_FRACTION = 2**-4  # ... or by this share of the lowest logit's magnitude, if larger


def ablate_expert(logits: Tensor, expert: int) -> Tensor:
    """``logits [..., E]`` with expert ``expert``'s column set below the token's lowest other
    logit by ``ABLATION_MARGIN`` or 1/16 of that logit's magnitude, whichever is larger,
    never under the dtype's most negative finite value.

    A value relative to the other logits, not ``-inf`` or the dtype's minimum: ``-inf``
    turns rules that subtract or average logits into NaN, and the minimum swamps a
    row's mean or sum in float rounding; a finite gap of 10^4 gives the expert exactly 0
    probability under softmax (over all experts or over the top-k) and sigmoid alike,
    and leaves the other logits as they were. Whether the family's rule then never picks
    the expert (a score bias can still favour it) is checked on the rule's own output.
    """
    others = torch.cat([logits[..., :expert], logits[..., expert + 1:]], dim=-1)
    lowest = torch.finfo(logits.dtype).min
    if others.shape[-1]:  # a gap of at least the margin and the lowest logit's own size,
        low = others.double().amin(dim=-1)  # so rounding cannot absorb it
        floor = low - (low.abs() * ABLATION_FRACTION).clamp_min(ABLATION_MARGIN)
    else:
        floor = torch.full(logits.shape[:-1], lowest, dtype=torch.float64, device=logits.device)
    out = logits.clone()
    out[..., expert] = floor.clamp_min(lowest).to(logits.dtype)
    return out


def topk_mass(logits: Tensor, k: int) -> Tensor:
    """Cumulative routing weight ``[..., k]`` of each token's top-``k`` experts, largest
    first: a softmax over the token's top-``k`` logits (Mixtral's and the tiny MoE's
    renormalised weights; for any family, each chosen expert's share of the routed mass)."""
    top = logits.double().topk(k, dim=-1).values
    return top.softmax(dim=-1).cumsum(dim=-1)


def top_p_keep(logits: Tensor, k: int, mass: float) -> Tensor:
    """Experts each token keeps under top-p routing (int64 ``[...]``, 1 to ``k``): the fewest
    of its top-``k`` experts whose routing weight (:func:`topk_mass`) reaches ``mass``."""
    cum = topk_mass(logits, k)
    return ((cum < mass).sum(dim=-1) + 1).clamp(max=k)


def drop_experts(logits: Tensor, keep: Tensor) -> Tensor:
    """``logits [..., E]`` with every expert outside each token's top-``keep`` (by logit) set
    below the token's lowest kept logit, as :func:`ablate_expert` sets one expert: the
    family's rule renormalises over the kept experts, and an expert it must still pick to
    fill its ``k`` slots gets routing weight exactly 0 (``exp(-1e4)`` underflows)."""
    rank = logits.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    dropped = rank >= keep.to(logits.device).unsqueeze(-1)
    kept = logits.double().masked_fill(dropped, float("inf"))
    low = kept.amin(dim=-1, keepdim=True)
    floor = (low - (low.abs() * 2**-4).clamp_min(ABLATION_MARGIN)).clamp_min(
        torch.finfo(logits.dtype).min)
    return torch.where(dropped, floor.to(logits.dtype), logits)


# ---- routing metrics (pure functions of top-k index tensors [..., k]) ----

def load_entropy(load: Tensor) -> tuple[float, float]:
    """Entropy of an expert load distribution in nats, and divided by ``log E`` (1 is a
    perfectly balanced load, 0 a single expert; 0 log 0 counts as 0)."""
    p = load.double()
    nats = float(-(p[p > 0] * p[p > 0].log()).sum())
    return nats, (nats / math.log(p.numel()) if p.numel() > 1 else 0.0)


def expert_counts(indices: Tensor, num_experts: int) -> Tensor:
    """Token-slots routed to each of ``num_experts`` experts (int64 ``[E]``); indices outside
    ``0..E-1`` (experts that compute nothing, e.g. LongCat's) are not counted."""
    flat = indices.reshape(-1).long()
    return torch.bincount(flat[(flat >= 0) & (flat < num_experts)], minlength=num_experts)


def changed_rows(a: Tensor, b: Tensor) -> int:
    """How many rows (e.g. (layer, token) pairs) of two index tensors ``[..., k]`` of the
    same shape select different top-k expert *sets* (order within a set ignored)."""
    if a.shape != b.shape:
        raise FcauditError(f"index tensors have shapes {list(a.shape)} and {list(b.shape)}; "
                           "compare routings of the same tokens and layers")
    rows_a = a.reshape(-1, a.shape[-1]).sort(dim=-1).values
    rows_b = b.reshape(-1, b.shape[-1]).sort(dim=-1).values
    return int((rows_a != rows_b).any(dim=-1).sum())


def selection_change(a: Tensor, b: Tensor) -> float:
    """Fraction of rows whose top-k expert sets differ (see :func:`changed_rows`)."""
    rows = a.numel() // max(a.shape[-1], 1) if a.dim() else 0
    return changed_rows(a, b) / rows if rows else 0.0


# ---- execution counts ----

@dataclass
class ExpertCount:
    """What ran in one routed layer while counting.

    ``per_expert[e]``: token-slots that entered expert ``e``. ``rows``: for a fused
    experts module, the ``[tokens, k]`` index tensors it was given, in call order (per
    expert modules have no per-token record).
    """

    layer: ExpertLayer
    per_expert: Tensor
    rows: list[Tensor] = field(default_factory=list)

    def experts_per_token(self, tokens: int) -> float:
        """Mean experts executed per token, over ``tokens`` tokens routed in the layer."""
        return float(self.per_expert.sum()) / tokens

    def executed(self) -> Tensor:
        """Experts executed per token ``[tokens]`` (fused modules only): distinct valid
        experts in each index row."""
        if not self.rows:
            raise FcauditError(f"{self.layer.name}: per-token expert counts need a fused experts "
                               "module (its index input); per-expert modules give loads only")
        rows = torch.cat(self.rows)
        valid = (rows >= 0) & (rows < self.layer.num_experts)
        marks = torch.zeros(rows.shape[0], self.layer.num_experts + 1, dtype=torch.bool)
        marks.scatter_(1, torch.where(valid, rows, self.layer.num_experts), True)
        return marks[:, :-1].sum(dim=1)

    def matches(self, selected: Tensor) -> bool:
        """True when the experts that ran are exactly the router's ``selected`` top-k
        indices ``[..., k]`` (indices outside ``0..E-1``, e.g. LongCat's zero-computation
        experts, run nothing): the same load per expert and, for a fused module, the same
        expert set for every token."""
        experts = self.layer.num_experts
        chosen = selected.reshape(-1, selected.shape[-1]).long()
        valid = chosen[(chosen >= 0) & (chosen < experts)]
        if not torch.equal(torch.bincount(valid, minlength=experts), self.per_expert):
            return False
        if not self.rows:
            return True
        rows = torch.cat(self.rows)
        return rows.shape == chosen.shape and selection_change(rows, chosen) == 0.0


def _index_input(values: Sequence[Any]) -> Tensor | None:
    """The 2-D int64 tensor among a fused experts module's inputs (the top-k indices)."""
    found = [v for v in values if isinstance(v, Tensor) and v.dtype == torch.int64
             and v.dim() == 2]
    return found[0] if len(found) == 1 else None


def _tokens_in(values: Sequence[Any]) -> int:
    tensor = next((v for v in values if isinstance(v, Tensor) and v.dim() > 0), None)
    return 0 if tensor is None else tensor.numel() // tensor.shape[-1]


@contextlib.contextmanager
def counting_experts(model: nn.Module,
                     layers: Sequence[ExpertLayer]) -> Iterator[dict[str, ExpertCount]]:
    """Count expert executions while the block runs; yields layer name -> ExpertCount.

    One module per expert: a pre-hook counts the tokens entering each. A single fused
    module: a pre-hook reads the int64 ``[tokens, k]`` index tensor among its inputs
    (values outside ``0..E-1``, e.g. an expert-parallel sentinel or LongCat's
    zero-computation experts, are not counted). A fused module given no index tensor
    runs every expert densely (Llama 4 stacks one copy of the tokens per expert): each
    expert is counted for its share, rows / E, of what enters.
    """
    counts = {layer.name: ExpertCount(layer, torch.zeros(layer.num_experts, dtype=torch.int64))
              for layer in layers}
    pre_hooks: dict[str | nn.Module, Callable[..., None]] = {}
    for layer in layers:
        count = counts[layer.name]
        fused = len(layer.experts) == 1
        for expert, path in enumerate(layer.experts):
            def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     count: ExpertCount = count, expert: int = expert, fused: bool = fused,
                     path: str = path) -> None:
                values = [*args, *kwargs.values()]
                if not fused:
                    count.per_expert[expert] += _tokens_in(values)
                    return
                rows = _index_input(values)
                experts = count.layer.num_experts
                if rows is None:  # no routing input: every expert runs on what it is given
                    tokens = _tokens_in(values)
                    if tokens % experts:
                        raise FcauditError(
                            f"fused experts module {path} received {describe(tuple(values))}: "
                            "no int64 [tokens, k] index tensor, and its rows do not split into "
                            f"{experts} experts; name one module per expert instead")
                    count.per_expert += tokens // experts
                    return
                rows = rows.detach().cpu()
                count.rows.append(rows)
                valid = rows[(rows >= 0) & (rows < experts)]
                count.per_expert += torch.bincount(valid, minlength=experts)
            pre_hooks[path] = hook
    with hooks(model, pre_hooks, kind="pre", with_kwargs=True):
        yield counts


# ---- the structural MoE rule: a module with an `experts` child and a `gate` or `router`
# child is an MoE block (every MoE block of transformers 5 follows this layout) ----

ROUTER_NAMES = ("gate", "router")
ROUTER_FAMILY = "router"
SHARED_GATE_FAMILY = "shared_expert_gate"
# the gate is a logit that the block passes through a sigmoid (Qwen2-MoE and its
# successors): the shared expert is switched off at -inf, not at 0 (sigmoid(0) = 0.5);
# the frontier checks on the first batch that this switches off exactly the gated module
SHARED_GATE_OFF = float("-inf")
TOP_K_SETTINGS = ("top_k", "num_experts_per_tok", "top_k_experts", "moe_top_k")
NUM_EXPERTS_SETTINGS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(path, module, router child name) of every module with an ``experts`` child and a
    ``gate`` or ``router`` child, in module order."""
    found = []
    for path, module in model.named_modules():
        children = dict(module.named_children())
        router = next((n for n in ROUTER_NAMES if n in children), None)
        if "experts" in children and router is not None:
            found.append((path, module, router))
    return found


def _setting(model: nn.Module, modules: list[nn.Module], names: tuple[str, ...]) -> int | None:
    """The first integer attribute among ``names`` on the modules, then the model config."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    for owner in (*modules, text):
        for name in names:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def moe_router_sites(model: nn.Module) -> list[Site]:
    """Router sites (family ``router``) and per-token scalar shared-expert gates (family
    ``shared_expert_gate``, ``nn.Linear(hidden, 1)`` children of an MoE block), named by
    module path, layer = order within the family. Empty for a dense model."""
    routers: list[Site] = []
    gates: list[Site] = []
    for path, block, router in _moe_blocks(model):
        top_k = _setting(model, [block.get_submodule(router), block], TOP_K_SETTINGS)
        if top_k is None and isinstance(block.get_submodule(router), nn.Linear):
            continue  # a soft mixture's logits: no top-k for RouterAdapter to read (and no
            # flag to give one), so `fcaudit sites` judges it by its output, as any module
        router_path = join_path(path, router)
        routers.append(Site(router_path, router_path, ROUTER_FAMILY, len(routers),
                            RouterAdapter(top_k=top_k), axes=TOKEN_AXES, positions=TOKEN_LAYOUT))
        children = dict(block.named_children())
        for name, child in children.items():
            if name != router and isinstance(child, nn.Linear) and child.out_features == 1:
                gate_path = join_path(path, name)
                body = name.removesuffix("_gate")
                gates.append(Site(gate_path, gate_path, SHARED_GATE_FAMILY, len(gates), FLAT,
                                  axes=TOKEN_AXES, positions=TOKEN_LAYOUT, role=Gate(
                                      SHARED_GATE_OFF,
                                      join_path(path, body) if body in children else None)))
    return routers + gates


def moe_expert_layers(model: nn.Module) -> list[ExpertLayer]:
    """One :class:`ExpertLayer` per MoE block, named like its router site: the fused
    experts module, or one path per expert when ``experts`` is a ``ModuleList``."""
    layers = []
    for path, block, router in _moe_blocks(model):
        experts_path = join_path(path, "experts")
        experts = block.get_submodule("experts")
        modules = [experts, block.get_submodule(router), block]
        if isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
            paths = tuple(join_path(experts_path, name) for name, _ in experts.named_children())
            num_experts: int | None = len(paths)
        else:
            paths = (experts_path,)
            num_experts = _setting(model, modules, NUM_EXPERTS_SETTINGS)
        top_k = _setting(model, modules[1:], TOP_K_SETTINGS)
        if num_experts is None or top_k is None:
            raise FcauditError(f"MoE block {path or type(block).__name__}: cannot tell its number "
                               "of experts or top-k (no num_experts / top_k attribute or "
                               "config entry); declare expert_layers() on the model")
        layers.append(ExpertLayer(join_path(path, router), paths, num_experts, top_k))
    return layers
