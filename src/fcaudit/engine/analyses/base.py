"""What an analysis is (:mod:`fcaudit.engine.analyses` registers them)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fcaudit.core.conditions import FRONTIER

if TYPE_CHECKING:  # reading an audit.json loads no torch
    from torch import Tensor

    from fcaudit.core.contract import Site
    from fcaudit.core.interventions import Intervention

Section = Any  # an instance of the analysis's section_type, else plain JSON types


@dataclass(frozen=True)
class RunStage:
    """Where the audit's plan counts an analysis's own runs before the work: the stage's
    ``name``, and the option that drops it (``cut``: its field, as Python, as a flag)."""

    name: str
    cut: tuple[str, str, str]


class Target:
    """What a run intervenes on (:mod:`fcaudit.engine.plan` has the audit's own: every
    site, one site, a frontier point, the user's function; an analysis may plan its own,
    such as one router's expert removed). Each says its run's key, its part of the run's
    digest identity and what it feeds (``run``: a :class:`~fcaudit.engine.plan.Run`,
    ``inputs``: its :class:`~fcaudit.engine.plan.ReplayInputs`; typed loosely, as
    :class:`Analysis`, so that reading an audit.json loads no torch)."""

    counts_rerouting = False  # its re-routing rows are kept in the replay shard
    # the replay shard keeps, per batch, the token-slots whose routing still picked what
    # the run removed (:meth:`picks`)
    counts_picks = False
    condition = ""  # an analysis's own target: the condition its runs are named by
    stage: RunStage | None = None  # None: counted with the main conditions' replays

    @property
    def only_site(self) -> Site | None:
        """The one site the run changes (per-layer and ablation runs), else None."""
        return None

    def key(self, condition: str) -> str:
        return condition

    def identity(self) -> tuple[str | None, bool, int | None, str | None]:
        """(the one site's name, a user intervention, the ablated expert, the frontier
        point's key): what, besides the condition and repeat, names the run in digests."""
        return (None, False, None, None)

    def feed(self, run: Any, b: int, inputs: Any,
             correct: dict[Site, Tensor]) -> Mapping[Site, Tensor]:
        """The tensors fed where they differ from the recorded (``correct``) ones."""
        raise NotImplementedError

    def picks(self, chosen: Mapping[str, Tensor]) -> int:
        """Of a target that :attr:`counts_picks`: the token-slots whose routing rule still
        picked what the run removed (``chosen``: each router's selections in the run)."""
        raise NotImplementedError


class PointRun(Target):
    """A frontier point's run (the savings frontier's, the exit frontier's): keyed, and
    named in digests, by its point's ``key``."""

    point: Any
    condition = FRONTIER

    def key(self, condition: str) -> str:
        return str(self.point.key)

    def identity(self) -> tuple[str | None, bool, int | None, str | None]:
        return (None, False, None, str(self.point.key))


def picking_rows(runs: Sequence[Any]) -> list[int]:
    """Plan indices of the runs whose picks the replay shard counts, in row order."""
    return [i for i, r in enumerate(runs) if r.target.counts_picks]


class Later:
    """Runs an analysis can place only once the audit is recorded (their levels are read
    off the recorded coefficients). Returned by its ``plan``, so what it decides from the
    probe (and any refusal) comes before any file; ``resolve`` then runs after recording,
    on every rank, and ``cost`` says its passes before the work."""

    def resolve(self, recorded: Any) -> tuple[Any, Sequence[Target]]:
        """(its state for ``summarise``, its targets, replayed once each) from the
        :class:`~fcaudit.engine.analyses.runs.Recorded` audit."""
        raise NotImplementedError

    def cost(self, setup: Any, first: Any, n_eval: int, n_calib: int) -> Cost:
        """What it adds to the audit's work (``n_eval``, ``n_calib``: the batches), said
        before the work starts."""
        raise NotImplementedError


@dataclass(frozen=True)
class Cost:
    """A :class:`Later`'s work, named in the plan ``<name> references`` (record-like
    passes) and ``<name> points`` (replays of every evaluation batch, at most): the sites
    whose whole calibration coefficients it stores (the cache's size) and the option that
    shrinks it (as Python, as a flag). ``own``: passes it makes itself on inputs of its own
    (not the audit's batches) and their seconds, the plan's stage ``<name>``, at most."""

    name: str
    record_passes: int
    replay_runs: int
    stored_sites: tuple[str, ...]
    cut: tuple[str, str, str]
    own: tuple[int, float] = (0, 0.0)


@dataclass(frozen=True)
class Work(Later):
    """Forward passes an analysis makes itself on inputs of its own as it summarises (the
    benchmark tasks' requests), returned by its ``plan`` so that the plan says them before
    the work: at most ``passes`` passes taking at most ``seconds`` (the analysis's own
    estimate: it knows what one of its passes reads); ``cut``: the option that shrinks
    them (its field, as Python, as a flag)."""

    name: str
    passes: int
    seconds: float
    cut: tuple[str, str, str]

    def resolve(self, recorded: Any) -> tuple[Any, Sequence[Target]]:
        return None, ()

    def cost(self, setup: Any, first: Any, n_eval: int, n_calib: int) -> Cost:
        return Cost(self.name, 0, 0, (), self.cut, (self.passes, self.seconds))


def _no_metrics(section: Section) -> Mapping[str, float | None]:
    return {}


def _no_intervals(section: Section) -> Mapping[str, list[float] | None]:
    return {}


@dataclass(frozen=True)
class Analysis:
    """One analysis: ``plan`` (the :class:`~fcaudit.engine.options.Prepared` audit and its
    :class:`~fcaudit.engine.probe.Probe` -> the functions to replay, each
    ``(coefficients, context) -> tensors to feed``, as user interventions are, its own
    :class:`Target`, replayed once each, or a :class:`Later` placing targets once the audit
    is recorded),
    ``summarise`` (after execution is measured: the
    :class:`~fcaudit.engine.analyses.runs.Measured` runs, found by
    :meth:`run_key`, and the analysis itself -> its section, or None to leave none) and
    ``metrics`` (its section -> named numbers; ``intervals``: the 95% intervals of those
    that have one, by the same names). Optional: ``before`` (the options -> what it loads
    and checks before the model loads, its refusals coming before any audit work; the
    :class:`~fcaudit.engine.options.Prepared` audit holds it as ``before[name]``),
    ``rows`` (its section -> the rows of ``AuditResult.to_frame(name)``) and ``compared``
    (its metrics are rows of ``fcaudit compare``) and ``settings`` (the measured audit and
    every section -> its keys of ``audit.json``'s ``settings``, given whether or not it
    ran) and ``earlier`` (``audit.json`` content -> the content without what files
    written before this analysis held elsewhere, and the section read from there, or
    None: such files read back alike, a wrong value refused at the path the file has).
    Typed loosely here so that the result and the report can read this module without
    the engine's passes."""

    name: str
    plan: Callable[[Any, Any], Sequence[Intervention | Target | Later]]
    summarise: Callable[[Any, Analysis], Section | None]
    metrics: Callable[[Section], Mapping[str, float | None]] = field(default=_no_metrics)
    # the section's dataclass, read back strictly from audit.json (None: plain JSON types)
    section_type: type | None = None
    before: Callable[[Any], Any] | None = None
    intervals: Callable[[Section], Mapping[str, list[float] | None]] = field(
        default=_no_intervals)
    rows: Callable[[Section], list[dict[str, Any]]] | None = None
    compared: bool = False
    settings: Callable[[Any, Mapping[str, Section]], Mapping[str, Any]] | None = None
    earlier: Callable[[dict[str, Any]], tuple[dict[str, Any], Section | None]] | None = None

    def run_key(self, intervention: str) -> str:
        """The run key of this analysis's intervention named ``intervention``."""
        return f"{self.name}:{intervention}"
