"""The Frozen Controller Audit: an orchestration of typed steps.

    prepare       -> :class:`Prepared`: every option and input validated once, models
                     loaded, sites, layouts and data resolved, the output folder checked
                     (nothing is written before this passes; :mod:`~fcaudit.engine.prepare`)
    probe         -> the first batch recorded and replayed in memory: adapters, call counts
                     and the identity replay checked before any real work
                     (:mod:`~fcaudit.engine.probe`)
    measure       -> :class:`Measurements`: calibration and evaluation recorded into the
                     on-disk cache, the runs planned (:mod:`~fcaudit.engine.plan`, the
                     frontier: :mod:`~fcaudit.engine.frontier_plan`) and replayed batch by
                     batch (resumable), then summarized (:mod:`~fcaudit.engine.measure`;
                     with ``target_ci``, round after round: :mod:`~fcaudit.engine.target_ci`)
    build_result  -> execution against the dense counterpart, verdicts and one
                     :class:`~fcaudit.engine.result.AuditResult` (:mod:`~fcaudit.engine.
                     assemble`)

Progress, and every line a person reads, goes through an optional callback
``progress(stage, done, total, info)`` (lines as stage :data:`~fcaudit.engine.options.
NOTE`): the engine never prints.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fcaudit._version import __version__
from fcaudit.core.errors import FcauditError, arg
from fcaudit.core.errors import render as for_reader
from fcaudit.core.layout import spell_axes
from fcaudit.core.nll import device_of
from fcaudit.engine.assemble import build_result
from fcaudit.engine.budget import AuditPlan, audit_plan, say_plan
from fcaudit.engine.cache import CoefficientCache
from fcaudit.engine.distributed import SINGLE, Ranks, current
from fcaudit.engine.frontier_plan import frontier_plan
from fcaudit.engine.measure import Measurements, measure
from fcaudit.engine.objectives import UNREADABLE
from fcaudit.engine.options import AuditOptions, Prepared, Progress, say, silent
from fcaudit.engine.prepare import AuditRequest, prepare
from fcaudit.engine.probe import Probe, ablation_plan, probe, same_probe_on_every_rank
from fcaudit.engine.result import AuditResult
from fcaudit.engine.stages import adopt_probe
from fcaudit.engine.target_ci import run_to_target
from fcaudit.io.outdir import hold_output
from fcaudit.io.placement import offload_space
from fcaudit.io.results import ResultWriter, replacing_results

__all__ = ["AuditOptions", "AuditRequest", "Audited", "Measurements", "Prepared", "audit",
           "audited", "build_result", "measure", "prepare"]


def audit(request: AuditRequest, progress: Progress | None = None) -> AuditResult | None:
    """Run the whole Frozen Controller Audit and return its :class:`AuditResult`, writing
    only ``audit.json`` (so the engine never imports the report layer), the engine's notes
    going to ``progress`` alone. The public entry is :func:`fcaudit.api.audit`, which
    also writes the report and shows the notes (through :func:`audited`).

    In a ``torchrun`` process group every rank calls this; rank 0 validates and claims
    ``out`` first, the batches are shared out, and rank 0 alone returns the result
    (the other ranks return None).
    """
    with audited(request, progress) as done:
        if done.files is not None:
            done.finish()
        return done.result


@dataclass(frozen=True)
class Audited:
    """A measured audit: its result (None on ranks other than 0) and, with an output
    folder, the writer its results go through while the folder is held."""

    result: AuditResult | None
    out: Path | None = None  # the output folder, as given
    files: ResultWriter | None = None  # None: no output folder (or not rank 0)

    def finish(self) -> None:
        """Write ``audit.json``, the completion file: last, after any other result."""
        assert self.result is not None and self.files is not None and self.out is not None
        self.files.write_json(self.out / "audit.json", self.result.to_json())


@contextlib.contextmanager
def audited(request: AuditRequest, progress: Progress | None = None) -> Iterator[Audited]:
    """Run the audit (:func:`audit`) and hand its result to the block; with ``out``, the
    block runs while the folder is held and its previous results are aside: it writes the
    new ones through ``Audited.files``, ``audit.json`` last (:meth:`Audited.finish`), and
    if it raises, the previous results come back."""
    place = request.options.placement() if isinstance(request.model, (str, Path)) else None
    with offload_space(place, request.out):  # weights on disk stay readable until the end
        yield from _audited(request, progress or silent)


def _audited(request: AuditRequest, progress: Progress) -> Iterator[Audited]:
    ranks, command = current(), request.command
    if not ranks.main:
        ranks.barrier(CLAIMED)
    setup = prepare(request, ranks)
    if ranks.main and request.options.progress:
        for line in setup.notes:
            say(progress, for_reader(line, cli=command is not None))
    first = probe(setup)  # every rank: the same checks, and AUTO adapters learn their layout
    ablation_plan(setup, first)  # an impossible --expert-ablation stops before any file
    covered = frontier_plan(setup, first)  # so does an impossible --frontier
    plan = audit_plan(setup, first, covered)  # every pass and its time, said before the work
    if not ranks.main:
        _run(setup, open_cache(setup, setup.out / "cache", ranks), first, progress, command,
             ranks)
        yield Audited(None)
        return
    if setup.out is None:
        with tempfile.TemporaryDirectory(prefix="fcaudit-") as tmp:
            say_plan(setup, plan, Path(tmp), progress)
            result = _run(setup, open_cache(setup, Path(tmp), ranks, first), first, progress,
                          command, ranks, plan)
        yield Audited(result)
        return
    say_plan(setup, plan, setup.out / "cache", progress)
    with hold_output(setup.out, "audit", command):
        cache = open_cache(setup, setup.out / "cache", ranks, first)
        ranks.barrier(CLAIMED)
        result = _run(setup, cache, first, progress, command, ranks, plan)
        assert result is not None
        with replacing_results(setup.out) as files:
            yield Audited(result, setup.out, files)


CLAIMED = "rank 0 validated the inputs and claimed the output folder"


def open_cache(setup: Prepared, folder: Path, ranks: Ranks,
               first: Probe | None = None) -> CoefficientCache:
    """The cache; rank 0 opens (or creates) it and adopts the probe's batch before the
    other ranks open it."""
    if ranks.main and not setup.objective.provable and any(folder.glob("**/*.sha256")):
        raise FcauditError(
            f"{folder} holds an earlier audit's results, and the objective reads "
            f"{setup.objective.state.removeprefix(UNREADABLE + ': ')}, whose state fcaudit "
            "cannot read as bits, so they cannot be proven to be this objective's: delete "
            f"that folder or choose another {arg('out')} (an objective that reads only "
            "functions, tensors, arrays, numbers and strings resumes from its cache)")
    cache = CoefficientCache(folder, cache_identity(setup), setup.options.batch_size,
                             setup.inputs.n_eval, owner=ranks.main)
    if first is not None:
        adopt_probe(cache, first.coefficients, first.nll, first.hits)
    return cache


def cache_identity(setup: Prepared) -> dict[str, Any]:
    net, data = setup.model, setup.inputs.summary()
    param = next(net.parameters(), None)
    return {"model": setup.loaded.fingerprint or setup.loaded.spec,
            "model_class": type(net).__name__, "eval_data": data["eval_fingerprint"],
            "calib_data": data["calib_fingerprint"],
            "dtype": str(param.dtype) if param is not None else "unknown",
            "device": device_of(net).type, "sites": [s.name for s in setup.sites],
            "adapters": [getattr(s.adapter, "name", type(s.adapter).__name__)
                         for s in setup.sites],
            "layouts": [spell_axes(s.axes or (), s.positions or ()) for s in setup.sites],
            "objective": setup.objective.identity(),
            "exit_threshold": setup.options.exit_threshold if setup.options.early_exit
            else None,
            "fcaudit": __version__, "torch": torch.__version__,
            "package versions": setup.loaded.packages}


def _run(setup: Prepared, cache: CoefficientCache, first: Probe, progress: Progress,
         command: str | None, ranks: Ranks, plan: AuditPlan | None = None
         ) -> AuditResult | None:
    """Record and replay this rank's batches; rank 0 then summarizes every batch (with
    ``target_ci``, round after round: :func:`~fcaudit.engine.target_ci.run_to_target`)
    and builds the result."""
    same_probe_on_every_rank(ranks, first)
    if setup.options.target_ci is not None:
        rounds = run_to_target(setup, cache, first, progress)
        return build_result(rounds.last, cache, command, SINGLE, rounds, plan)  # one process
    measured = measure(setup, cache, first, progress, ranks)
    if measured is None:
        return None
    return build_result(measured, cache, command, ranks, plan=plan)
