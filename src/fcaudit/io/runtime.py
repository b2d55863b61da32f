"""Facts about the running environment: package versions, host, devices."""

from __future__ import annotations

import functools
import platform
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fcaudit._version import __version__
from fcaudit.core.errors import UsageError, arg


def versions() -> dict[str, str]:
    """Versions of everything that can change a number (recorded in every result; the
    packages a model's classes come from are in its ``model.packages``)."""
    import numpy
    import safetensors
    import tokenizers
    import torch
    return {"fcaudit": __version__, "torch": torch.__version__, "numpy": numpy.__version__,
            "safetensors": safetensors.__version__, "tokenizers": tokenizers.__version__,
            "python": platform.python_version()}


# the extras whose packages fcaudit reads the internals of (pyproject.toml's ranges)
INTERNALS_EXTRAS = ("hf", "gguf")


def _extras_in_use() -> dict[str, tuple[str, str]]:
    """Package -> (installed version, tested specifier) for each package of
    :data:`INTERNALS_EXTRAS` that this process imported; empty when fcaudit's metadata is
    not installed (a source tree on ``PYTHONPATH``) or ``packaging`` is missing."""
    from importlib import metadata
    try:
        from packaging.requirements import Requirement
        required = metadata.requires("fcaudit") or []
    except (ImportError, metadata.PackageNotFoundError):
        return {}
    found = {}
    for line in required:
        req = Requirement(line)
        module = req.name.replace("-", "_")
        if req.marker is None or module not in sys.modules or not any(
                req.marker.evaluate({"extra": extra}) for extra in INTERNALS_EXTRAS):
            continue
        try:
            found[req.name] = (metadata.version(req.name), str(req.specifier))
        except metadata.PackageNotFoundError:
            continue
    return found


def untested_versions() -> list[str]:
    """One line per imported package of fcaudit's internals-reading extras whose installed
    version lies outside the range the test suite passed on (pyproject.toml declares it;
    ``.ci/dependency_ceiling.py`` raises the ceiling once the suite passes on a newer
    release)."""
    in_use = _extras_in_use()
    if not in_use:
        return []
    from packaging.specifiers import SpecifierSet
    return [f"{name} {version} is outside the versions fcaudit's tests passed on ({spec}): "
            "fcaudit reads its internals, which may have moved; check the site list and the "
            f"identity replay, or install a tested one (pip install '{name}{spec}')"
            for name, (version, spec) in in_use.items()
            if version not in SpecifierSet(spec, prereleases=True)]


def package_versions(modules: Iterable[str]) -> dict[str, str]:
    """Installed distribution -> version for every module name given (by its top-level
    package): code from an installed package enters an identity by name, so its version
    must too (a package upgraded under the same names computes other numbers). The
    standard library and modules no distribution installed (the user's own) are left out:
    the standard library goes with Python's version, the user's code by content."""
    from importlib import metadata
    owners = _distributions()
    found: dict[str, str] = {}
    for top in sorted({m.partition(".")[0] for m in modules} - set(sys.stdlib_module_names)):
        for dist in owners.get(top, ()):
            try:
                found[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:  # metadata removed under a live import
                found[dist] = "unknown"
    return found


@functools.lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    from importlib import metadata
    return {k: sorted(set(v)) for k, v in metadata.packages_distributions().items()}


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (the platform's name elsewhere): a
    trained model's numbers depend on it, since CPUs' kernels round differently."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host() -> dict[str, Any]:
    import torch
    return {"platform": platform.platform(), "python": sys.version.split()[0],
            "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
            "cpu": cpu_model()}


def thread_note(threads: int, cores: int, load: float, chosen: bool) -> str | None:
    """One line of advice when torch's CPU threads outnumber the cores other jobs leave free
    (``cores`` less the 1-minute ``load`` average, with half a core of slack for background
    noise), unless the user ``chosen`` the count: such threads wait for each other, and on a
    shared machine one thread trains several times faster. fcaudit does not pick the count
    itself: it is part of what fixes a trained model's weights, so it must not follow the
    load of the moment."""
    if chosen or threads <= 1 or load <= cores - threads + 0.5:
        return None
    return (f"the load average is {load:.2f} on {cores} cores, so torch's {threads} threads "
            "will wait for each other; on a busy machine OMP_NUM_THREADS=1 usually runs "
            "faster (the count also changes a trained model's last bits: config.json "
            "records it)")


def threads_advice() -> str | None:
    """:func:`thread_note` for this process and machine now."""
    import os

    import torch
    return thread_note(torch.get_num_threads(), os.cpu_count() or 1, os.getloadavg()[0],
                       "OMP_NUM_THREADS" in os.environ)


def resolve_device(name: str | None) -> Any:
    """A usable ``torch.device`` (default: CUDA when available), or one clear error."""
    import torch
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise UsageError(f"{arg('device', name)} is not a device; use cpu, cuda or "
                         "cuda:N", option="device") from exc
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise UsageError(f"{arg('device', name)}: fcaudit runs on cpu or cuda", option="device")
    if not torch.cuda.is_available():
        raise UsageError(f"{arg('device', name)}: no CUDA device is available here; use "
                         f"{arg('device', 'cpu')}", option="device")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"{arg('device', name)}: this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s)", option="device")
    return device


def resolve_dtype(name: str | None) -> Any:
    import torch
    return None if name is None else getattr(torch, name)


def measured_minutes(key: str) -> str:
    """A wall time measured by ``benchmarks/timings.py`` (``demo``, ``tests``,
    ``reproduce_tiny``), as the README and ``--help`` quote it."""
    import json
    from importlib import resources
    minutes = json.loads(resources.files("fcaudit").joinpath("timings.json").read_text())
    return f"{minutes[key]:.1f}"
