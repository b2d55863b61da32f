"""What fcaudit runs inside vLLM's workers: the engine's ``worker_extension_cls``.

vLLM runs its model in one worker per rank (tensor- and pipeline-parallel ranks, each in a
process of its own, or one in this process). fcaudit reaches them only through the
engine's ``collective_rpc``, which calls a method of every worker: :class:`FcauditWorker`
is mixed into vLLM's worker class for that. Before each pass the router sites to feed are
armed (their outputs replaced by the supplied logits, on every rank: a tensor-parallel
router is replicated, so each rank must route the same tokens alike); the pass runs; then
each rank hands back what its routers returned and selected. Only one rank per pipeline
stage (tensor rank 0) sends tensors back; with tensor parallelism every rank sends a
digest of its routers' logits, so replicas that computed different bits are seen, never
assumed equal.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from fcaudit.core.hooks import hooks
from fcaudit.core.replaying import StandIn, swapped


class FedRouter(StandIn):
    """Stands in for a router in a worker: returns the supplied logits, as vLLM's router
    returns its own (``(logits [tokens, experts], None)``)."""

    def __init__(self, original: nn.Module, logits: Tensor) -> None:
        super().__init__(original)
        self.logits = logits

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        return self.logits.clone(), None


@dataclass
class RouterRecord:
    """What one router did in one pass on one rank."""

    calls: int = 0
    digest: str = ""  # SHA-256 of its logits' bytes: replicas must agree
    logits: Tensor | None = None  # sent back by tensor rank 0 only
    chosen: Tensor | None = None  # the experts the engine's own selection took


@dataclass
class _Armed:
    stack: contextlib.ExitStack
    routers: dict[str, RouterRecord] = field(default_factory=dict)
    logits: list[Tensor] = field(default_factory=list)


def _digest(tensor: Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(torch.uint8)
                          .numpy().tobytes()).hexdigest()


def _sends() -> bool:
    """Whether this rank sends tensors back: tensor rank 0 of its pipeline stage."""
    from vllm.distributed.parallel_state import get_tp_group
    return get_tp_group().rank_in_group == 0


class FcauditWorker:
    """Methods vLLM mixes into its worker class (``worker_extension_cls``); named
    ``fcaudit_*`` so that none shadows one of the worker's own."""

    def _fcaudit_model(self) -> nn.Module:
        return self.get_model()  # type: ignore[attr-defined]  # the worker's, mixed in

    def fcaudit_model_class(self) -> str:
        return type(self._fcaudit_model()).__name__

    def fcaudit_routers(self, layers: str, block: str, router: str,
                        experts: str) -> list[tuple[int, str, bool]]:
        """(layer index, router path, whether its MoE runner can be asked which experts it
        selects) of each MoE layer this rank holds (a pipeline stage holds some)."""
        model, found = self._fcaudit_model(), []
        for i, layer in enumerate(model.get_submodule(layers)):
            moe = getattr(layer, block, None)
            if not isinstance(getattr(moe, router, None), nn.Module):
                continue  # a dense layer, or one another stage holds
            selector = getattr(getattr(moe, experts, None), "router", None)
            found.append((i, f"{layers}.{i}.{block}.{router}",
                          callable(getattr(selector, "select_experts", None))))
        return found

    def fcaudit_arm(self, paths: list[str], fed: dict[str, Tensor],
                    selectors: dict[str, str], replicated: bool) -> None:
        """Before a pass: feed the routers in ``fed`` their logits, record every router at
        ``paths`` this rank holds (``selectors``: router path -> its runner's path; with
        ``replicated`` tensor-parallel routers, each one's digest too)."""
        self.fcaudit_take()  # a pass that failed before its take: start clean
        model, sends = self._fcaudit_model(), _sends()
        held = dict(model.named_modules())
        mine = [p for p in paths if p in held]
        stack = contextlib.ExitStack()
        armed = _Armed(stack, {p: RouterRecord() for p in mine})
        try:
            stack.enter_context(swapped(model, {
                p: FedRouter(held[p], t.to(_device(held[p]))) for p, t in fed.items()
                if p in held}))

            def hook_for(path: str) -> Any:
                selector = model.get_submodule(selectors[path]).router

                def hook(_m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
                    record = armed.routers[path]
                    record.calls += 1
                    record.digest = _digest(out[0]) if replicated else ""
                    if sends:
                        _, ids = selector.select_experts(hidden_states=args[0],
                                                         router_logits=out[0])
                        record.logits = out[0].detach().cpu().clone()
                        record.chosen = ids.detach().cpu().long()
                return hook
            watched: dict[str | nn.Module, Any] = {model.get_submodule(p): hook_for(p)
                                                   for p in mine}
            processor = getattr(model, "logits_processor", None)
            if sends and isinstance(processor, nn.Module):
                watched[processor] = lambda _m, _a, out: armed.logits.append(
                    out.detach().cpu().clone()) if isinstance(out, Tensor) else None
            stack.enter_context(hooks(None, watched))
        except BaseException:
            stack.close()
            raise
        self._fcaudit_armed = armed

    def fcaudit_take(self) -> dict[str, Any] | None:
        """After a pass: what this rank's routers did, the hooks and feeds removed."""
        armed: _Armed | None = getattr(self, "_fcaudit_armed", None)
        if armed is None:
            return None
        self._fcaudit_armed = None
        armed.stack.close()
        return {"routers": armed.routers, "logits": armed.logits}


def _device(module: nn.Module) -> torch.device:
    weight = next(iter(module.parameters()), None)
    return weight.device if weight is not None else torch.device("cpu")
