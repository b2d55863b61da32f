"""An audit opened again for an action on it (``fcaudit fold``, benchmark tasks): its
``audit.json`` read and checked, its model and data loaded again and proven to be the
audit's, its calibration profiles recomputed (never read from a cache).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fcaudit._version import __version__
from fcaudit.core.errors import DataError, ModelError, UsageError, arg
from fcaudit.core.interventions import StaticProfiles
from fcaudit.core.nll import device_of
from fcaudit.engine.options import AuditOptions
from fcaudit.engine.passes import batches
from fcaudit.engine.prepare import AuditRequest, prepare
from fcaudit.engine.result import AuditResult
from fcaudit.engine.stages import add_calibration, calibration_shard
from fcaudit.io.data import AuditData, DataSpec
from fcaudit.io.loading import release

Progress = Callable[[str, int, int], None]


def read_audit(folder: str | Path) -> AuditResult:
    """The audit's result, refused if edited or written by another fcaudit version."""
    path = Path(folder).expanduser()
    file = path / "audit.json"
    if not file.is_file():
        raise UsageError(f"{arg('audit', str(path))} holds no audit.json: give a folder "
                         "written by fcaudit audit", option="audit")
    result = AuditResult.read(file)
    written = result.versions.get("fcaudit")
    if written != __version__:
        raise DataError(f"{file} was written by fcaudit {written}, this is {__version__}: "
                        "rerun the audit with this version first")
    return result


def _reload(result: AuditResult, path: str | Path | None) -> Any:
    """The audited model (``path``, default the one audit.json names) loaded again in the
    dtype the audit ran it in (a bfloat16 checkpoint audited with ``--dtype float32`` is
    reopened in float32)."""
    from fcaudit.engine.inputs import as_loaded
    dtype = getattr(torch, result.model.dtype.removeprefix("torch."), None)
    return as_loaded(path if path is not None else result.model.spec,
                     dtype if isinstance(dtype, torch.dtype) else None)


def _same_audit(setup: Any, result: AuditResult, declared: bool) -> None:
    """The model, data and sites loaded again are the audit's."""
    if setup.loaded.fingerprint != result.model.fingerprint:
        raise ModelError(f"{setup.loaded.spec} is not the model the audit measured (its "
                         "fingerprint differs: other weights, config or code since); give "
                         "the audited model, or audit this one")
    for part in ("eval_fingerprint", "calib_fingerprint"):
        if setup.data_summary.get(part) != result.data.get(part):
            raise DataError(f"the data given is not the audit's ({part.split('_')[0]} data's "
                            "SHA-256 differs): give the same data options as the audit")
    if [s.name for s in setup.sites] != [s.name for s in result.sites]:
        raise ModelError(f"the audit measured the sites {[s.name for s in result.sites]}, not "
                         f"the controllers the model declares ({[s.name for s in setup.sites]}"
                         "): a fold replaces those; audit them (no sites option), then fold"
                         if declared else f"the audit measured the sites "
                         f"{[s.name for s in result.sites]}, and this model has "
                         f"{[s.name for s in setup.sites]}")


@contextmanager
def reopened(result: AuditResult, model: Any = None, data: DataSpec | AuditData | None = None,
             declared: bool = True) -> Iterator[Any]:
    """The audit's model and data prepared again (the audit's batch size, seed and repeats:
    what task scoring draws its random conditions with), proven
    the audit's: its fingerprint, the data's SHA-256s and its sites (``declared``: those
    the model declares, which a fold replaces; else the audit's own site list). ``model``
    (default: the one audit.json names) and ``data`` (default: the built-in corpus) as
    :func:`fcaudit.audit` takes them; a model loaded here is released on leaving."""
    options = AuditOptions(batch_size=int(result.settings["batch_size"]),
                           seed=int(result.settings["seed"]),
                           repeats=int(result.settings["repeats"]), progress=False,
                           execution=False, per_layer=False)
    loads = model is None or isinstance(model, (str, Path))
    spec = _reload(result, model) if loads else model
    setup = prepare(AuditRequest(model=spec, data=data if data is not None else DataSpec(),
                                 sites=None if declared else [s.name for s in result.sites],
                                 options=options))
    try:
        _same_audit(setup, result, declared)
        yield setup
    finally:
        if loads:
            release(setup.model)


def recomputed_profiles(setup: Any, say: Progress, stage: str
                         ) -> tuple[StaticProfiles, dict[str, torch.dtype]]:
    """The audit's calibration profiles, recomputed: one record pass a calibration batch,
    its sums added in batch order as the audit added them; and each site's coefficient
    dtype (what a static condition feeds). ``stage`` names the work in progress lines."""
    profiles, dtypes = StaticProfiles(setup.sites), {}
    size, net = setup.options.batch_size, setup.model
    n = -(-setup.inputs.n_calib // size)
    for done, (b, x) in enumerate(batches(setup.calib_source, size, device_of(net)), start=1):
        _, coefficients, _ = setup.executor.record(x, None)
        add_calibration(setup, profiles, calibration_shard(setup, coefficients, x), b)
        dtypes = {k: v.dtype for k, v in coefficients.items()}
        say(f"{stage}: record calibration", done, n)
    return profiles, dtypes


__all__ = ["recomputed_profiles", "read_audit", "reopened"]
