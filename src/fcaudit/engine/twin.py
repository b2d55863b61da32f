"""The dense counterpart: loaded and checked before any recording, and the execution
audit that prices the model against it.

A twin is either given (``--dense``) or built from the model's declared architecture
with fresh seeded weights; a given one must take the model's inputs and give outputs of
its shape (and, on token ids, cover their vocabulary).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fcaudit.core.arrays import blamed_on_inputs
from fcaudit.core.discovery import declared_experts
from fcaudit.core.errors import ModelError, arg
from fcaudit.core.kinds import KINDS, twin_note
from fcaudit.core.nll import device_of, model_limits
from fcaudit.engine.inputs import as_loaded, resolve_block_paths
from fcaudit.engine.objectives import output_tensors
from fcaudit.engine.options import Prepared
from fcaudit.engine.plan import routing_sites
from fcaudit.engine.result import Execution
from fcaudit.engine.seeds import SeedPlan
from fcaudit.io.data import AuditData
from fcaudit.io.examples import Examples, call_model


def dense_counterpart(net: nn.Module, data: AuditData, seeds: SeedPlan, dense: Any,
                      blocks: str | None) -> tuple[nn.Module | None, str]:
    """The dense counterpart and where it came from, loaded and probed now (a bad --dense,
    or an ``execution_mode`` that is no string, fails before recording)."""
    from fcaudit.core.contract import dense_twin, execution_mode
    execution_mode(net)
    if dense is None:
        twin = dense_twin(net, seeds.dense_twin)
        execution_mode(twin)
        if twin is None:
            return None, ""
        resolve_block_paths(twin, blocks, f"the dense counterpart that {type(net).__name__}"
                                          ".dense_counterpart() built")
        return twin, "built from the model's architecture (dense_counterpart, fresh weights)"
    twin = as_loaded(dense).model
    param = next(net.parameters(), None)
    if param is not None:
        twin = twin.to(dtype=param.dtype, device=device_of(net))
    twin.eval()
    inputs = data.checked()
    if not inputs.next_token:  # token windows are checked against its vocabulary too
        _comparable_examples(net, inputs.eval_source, twin, str(dense))
    else:
        _comparable_tokens(net, inputs.eval_source[:1], twin, dense)
    resolve_block_paths(twin, blocks, f"the dense counterpart {arg('dense', str(dense))}")
    execution_mode(twin)
    return twin, str(dense)


def _comparable_tokens(net: nn.Module, first: np.ndarray, twin: nn.Module, dense: Any) -> None:
    """A dense counterpart must know every id of the first sequence and give logits of
    the model's shape on it."""
    ids = torch.from_numpy(first).to(device_of(net))
    vocab, _ = model_limits(twin)
    if vocab is not None and int(ids.max()) >= vocab:
        raise ModelError(f"{arg('dense', dense)}: its vocabulary has {vocab} entries but the "
                         f"evaluation token ids reach {int(ids.max())}; give a dense model "
                         "with the same tokenizer")
    from fcaudit.engine.execution import check_comparable
    check_comparable(net, twin, ids, str(dense))


@torch.no_grad()
def _comparable_examples(model: nn.Module, examples: Examples, twin: nn.Module,
                         source: str) -> None:
    """A dense counterpart must give outputs of the model's shape on the same example."""
    x = examples.rows(0, 1).to(device_of(model))
    shapes = []
    for net, what in ((model, "the first evaluation example"),
                      (twin, f"the first evaluation example, as {arg('dense', source)}")):
        with blamed_on_inputs(lambda net=net: call_model(net, x), x, what):
            out = output_tensors(call_model(net, x))
        shapes.append(list(out.shape) if isinstance(out, Tensor) else type(out).__name__)
    if shapes[0] != shapes[1]:
        raise ModelError(f"{arg('dense', source)} is not comparable with the model: on the "
                         f"same example it gives {shapes[1]}, the model {shapes[0]}; give "
                         "a dense model with the model's inputs and outputs")


def missing_twin(setup: Prepared) -> str:
    """What a dense counterpart would be for this model's sites (by their kinds), or why
    none exists (:func:`fcaudit.core.kinds.twin_note`)."""
    return twin_note(KINDS[setup.kinds[s.name]] for s in setup.sites if s.name in setup.kinds)


def not_measured(setup: Prepared) -> str | None:
    """Why this audit measures no execution (None: it does): disabled, or blocks nobody
    declared. Without a dense counterpart the model's own blocks and FLOPs are counted.
    The plan counts the execution passes by it too."""
    if not setup.options.execution:
        return "disabled (--no-execution)"
    dense_blocks = resolve_block_paths(setup.dense, setup.blocks_glob) \
        if setup.dense is not None else []
    if setup.blocks is not None and dense_blocks is not None:
        return None
    if setup.dense is None and not declared_experts(setup.model):
        return (f"{missing_twin(setup)}; and the model's blocks are not known, so none can be "
                "counted on the model itself: pass --blocks GLOB (e.g. 'layers.*')")
    return "the model does not declare its blocks: pass --blocks GLOB (e.g. 'layers.*')"


def execute(setup: Prepared, degenerate: str | None = None) -> Execution:
    """The execution section: counts, FLOPs and (with timing pairs) latency vs dense, or
    without a dense counterpart counts and FLOPs on the model alone, with what a twin
    would be; for a routed model, the experts that ran. ``degenerate``: the exit rule's
    note when it stops every unit at one layer, so that no saving and no conditional
    execution is counted for it."""
    from fcaudit.engine.execution import measure_execution
    opts = setup.options
    reason = not_measured(setup)
    if reason is not None:
        return Execution(measured=False, reason=reason)
    experts = declared_experts(setup.model) or []
    dense_blocks = resolve_block_paths(setup.dense, setup.blocks_glob) \
        if setup.dense is not None else []
    x = setup.inputs.execution_inputs(device_of(setup.model))
    routers = {s.name: s for s in routing_sites(setup.sites)}
    measured = measure_execution(
        setup.model, setup.dense, x, batch_size=opts.batch_size, block_paths=setup.blocks,
        dense_block_paths=dense_blocks or None, pairs=opts.timing_pairs, seed=setup.seeds.timing,
        timing=opts.timing_pairs > 0, dense_source=setup.dense_source or None,
        experts=[e for e in experts if e.name in routers], routers=routers,
        gated=[s.gate.gated for s in setup.sites if s.gate.gated], degenerate=degenerate)
    return dataclasses.replace(measured, unit=setup.inputs.execution_unit,
                               twin_note=missing_twin(setup) if setup.dense is None else None)
