"""Prepare: every check that needs no pass of the audit itself, once, into a frozen
:class:`~fcaudit.engine.options.Prepared`.

Arguments and options, the model and its sites, the user's interventions, the data, the
dense counterpart, the output folder, the process group, then the layout of every site
no one declared (read off the first batch); nothing is written before this passes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fcaudit.core.errors import UsageError, arg
from fcaudit.core.interventions import Intervention
from fcaudit.core.layout import SiteAxes, declare_axes
from fcaudit.core.sites import SiteSpec, find_sites
from fcaudit.engine.distributed import Ranks, current
from fcaudit.engine.exits import check_twin, with_exit_conditions
from fcaudit.engine.inputs import (
    as_loaded,
    check_arguments,
    check_dense,
    custom_interventions,
    resolve_block_paths,
    resolve_inputs,
    window_line,
)
from fcaudit.engine.layouts import resolve_layouts
from fcaudit.engine.options import AuditOptions, Prepared, SeedPlan, asked, check_needs
from fcaudit.engine.probe import first_batch
from fcaudit.engine.twin import dense_counterpart
from fcaudit.io.data import AuditData, DataSpec
from fcaudit.io.hf_exit import HEADS_NOTE, KIND, with_early_exit
from fcaudit.io.runtime import untested_versions


@dataclass(frozen=True)
class AuditRequest:
    """What one audit is asked for: :func:`fcaudit.audit`'s arguments as its caller gave
    them (that function says what each means), so the engine takes one value instead of
    spelling the signature again; :func:`prepare` checks every one."""

    model: Any
    out: str | Path | None = None
    sites: SiteSpec = None
    data: DataSpec | AuditData = field(default_factory=DataSpec)
    dense: Any = None
    blocks: str | None = None
    options: AuditOptions = field(default_factory=AuditOptions)
    interventions: Mapping[str, Any] | Sequence[Intervention] | None = None
    command: str | None = None  # the command line that asked (None: a Python call)
    site_axes: SiteAxes = None


def prepare(request: AuditRequest, ranks: Ranks | None = None) -> Prepared:
    """Every check that does not need a forward pass of the audit itself; the notes say
    how long the scored windows are and how undeclared layouts were found."""
    dense, blocks, options = request.dense, request.blocks, request.options
    sites = check_arguments(request.sites, request.data, blocks, options)
    options.validate()
    check_dense(dense, options)
    loaded = as_loaded(request.model, placement=options.placement())
    if options.early_exit:
        loaded = with_early_exit(loaded, options.exit_threshold)
    net = loaded.model.eval()
    site_list = declare_axes(find_sites(net, sites), request.site_axes)
    check_needs(options, sites=site_list)  # the needs a model may meet (exit models' sweep)
    conditions = with_exit_conditions(options.conditions, site_list, net)
    # before the first forward pass
    custom = custom_interventions(request.interventions, site_list, conditions)
    block_paths = resolve_block_paths(net, blocks)  # for execution and prefix reuse
    audit_data, objective = resolve_inputs(loaded, request.data, options, site_list)
    twin, twin_source = dense_counterpart(net, audit_data, SeedPlan(options.seed), dense,
                                          blocks) if options.execution else (None, "")
    if twin is None and options.execution and asked(options, "timing_pairs"):
        raise UsageError(f"{arg('timing_pairs', options.timing_pairs, owner='AuditOptions')}"
                         " times the model against its dense counterpart, and it has none: "
                         f"give one ({arg('dense')}) or drop {arg('timing_pairs')}",
                         option="timing_pairs")
    setup = Prepared(loaded, site_list, block_paths, blocks, audit_data, options, custom,
                     conditions, objective, audit_data.checked().summary(), twin, twin_source,
                     out=Path(request.out) if request.out is not None else None)
    if setup.out is not None:
        from fcaudit.io.outdir import check_output
        check_output(setup.out, "audit")
    _check_ranks(setup, ranks or current())
    check_twin(setup)
    layouts = resolve_layouts(setup, first_batch(setup))
    return dataclasses.replace(setup, sites=layouts.sites, layouts=layouts.notes,
                               kinds=layouts.kinds,
                               notes=(window_line(setup.data_summary), *layouts.lines,
                                      *(f"note: {line}" for line in loaded.notes),
                                      *([f"note: {HEADS_NOTE}"] if loaded.kind == KIND else []),
                                      *(f"warning: {line}" for line in untested_versions())))


def _check_ranks(setup: Prepared, ranks: Ranks) -> None:
    """An audit over several processes shares its cache through a folder, and a
    ``target_ci`` audit runs in one process."""
    if setup.out is None and ranks.world > 1:
        raise UsageError(f"an audit over several processes needs {arg('out')}, a folder "
                         "every process sees")
    if setup.options.target_ci is not None and ranks.world > 1:
        raise UsageError(f"{arg('target_ci', owner='AuditOptions')} runs in one process: "
                         "start it without torchrun, or give a fixed number of sequences")
