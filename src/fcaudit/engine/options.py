"""What an audit is run with: its options, and the validated inputs every stage reads.

:class:`AuditOptions` are the user's knobs (recorded in ``audit.json``); :class:`Prepared`
is the plain, frozen data that validation produces and every later stage takes.

``AuditOptions`` stays one flat frozen dataclass, so every caller's flat keywords,
attribute reads, ``dataclasses.replace`` and ``AuditOptions(**other.__dict__)`` keep
working; each field carries an :class:`OptionSpec` in its metadata (its part, help,
integer bounds, command-line form, the option it is read with and where ``audit.json``
records it). Validation (an option asked for without what it needs is refused, never
dropped), the ``fcaudit audit`` flags and the result's ``settings`` are read off that
metadata.

This module imports neither torch nor numpy: ``fcaudit --help`` builds its flags from it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fcaudit.core.conditions import FRONTIER, OPT_IN_CONDITIONS
from fcaudit.core.errors import UsageError, arg
from fcaudit.core.option_checks import (
    check_conditions,
    check_early_exit,
    check_int,
    check_target,
    check_tasks,
    option_name,
)
from fcaudit.core.registry import refusal
from fcaudit.engine.analyses.expert_importance import AUTO_ABLATION_MAX_EXPERTS
from fcaudit.engine.objectives import OBJECTIVES, Objective, resolve
from fcaudit.io.engines import EAGER, ENGINES, VLLM
from fcaudit.io.placement import DEVICE_MAPS

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

    from fcaudit.core.contract import Site
    from fcaudit.core.interventions import Intervention
    from fcaudit.engine.passes import Executor
    from fcaudit.io.data import AuditData
    from fcaudit.io.inputs import ExampleData, TokenData
    from fcaudit.io.loading import LoadedModel
    from fcaudit.io.placement import Placement
    from fcaudit.io.vllm import Serving

# progress(stage, done, total, info): an optional callback, never threaded through compute
Progress = Callable[[str, int, int, str], None]

MAX_BOOTSTRAP = 100_000
# Each repeat replays every random condition over every sequence once more; the intervals
# come from the sequences, so beyond this more repeats only cost hours.
MAX_REPEATS = 100
MAX_TIMING_PAIRS = 1000  # each pair times a full pass of model and dense
MAX_SEED = 2**32 - 1  # torch and numpy generators; every seed derives from it (engine/seeds.py)
MAX_FRONTIER_POINTS = 20  # each point of each rule is one more replay
MIN_FRONTIER_POINTS = 2  # a curve needs two points
MIN_TIMING_PAIRS = 10  # fewer give no meaningful interval (0: no timing)


SCHEDULES = ("prefix", "naive")
VERIFY_MODES = ("sample", "all")  # engine/replay_proof.py: which reused replays are proven
DEFAULT_EXIT_THRESHOLD = 0.9  # --early-exit's confidence (maximum softmax probability)


def silent(stage: str, done: int, total: int, info: str = "") -> None:
    """The default progress callback: report nothing."""


@dataclass(frozen=True)
class Needs:
    """The option another one is read with: asked for while ``on`` says the prerequisite
    is off, the dependent would change nothing, so it is refused (never silently dropped).
    ``said`` names the prerequisite for the message, ``why`` says what it is read for, and
    ``enable`` how to turn the prerequisite on (default: add it)."""

    option: str
    on: Callable[[Any], bool]  # the AuditOptions -> whether the prerequisite holds
    said: str
    why: str = ""
    enable: str = "add it"
    # the sites -> whether the model meets it otherwise (an exit model's threshold sweep
    # reads frontier_points): such a need is checked again once the model is known
    by_model: Callable[[Any], bool] | None = None


def _execution(why: str) -> Needs:
    """The execution audit as a prerequisite: on unless the caller turned it off."""
    return Needs("execution", lambda o: o.execution is True, "the execution audit", why,
                 "drop " + arg("execution", py="AuditOptions(execution=False)",
                               cli="--no-execution"))


@dataclass(frozen=True)
class OptionSpec:
    """What one :class:`AuditOptions` field is: its part, its meaning, its integer bounds,
    its command-line form, what it needs and where ``audit.json`` records it. Validation,
    the ``fcaudit audit`` flags and the result's ``settings`` read this."""

    # "statistics", "scope", "schedule", "stopping", "placement", "engine" or "tasks"
    part: str
    help: str  # one sentence; options named through ``arg`` (rendered for each reader)
    bounds: tuple[int, int | None] | None = None  # an integer, lo..hi (None: no ceiling)
    span: str = ""  # how the help says the bounds, where "lo to hi" does not
    flag: str = ""  # the CLI flag ("" : --name); "-": none
    # the flag's action: "value"; "on" (--frontier sets True); "off" (--quiet sets False);
    # "either" (--expert-ablation / --no-expert-ablation, unset: None); "append" (repeatable:
    # --condition A --condition B gives a tuple)
    action: str = "value"
    kind: str = "text"  # how the flag's text is read: "int", "nats", "number", "path" or "text"
    choices: tuple[str, ...] = ()
    metavar: str = ""
    needs: Needs | None = None  # the option it is read with (None: read in every audit)
    # its values that ask nothing of ``needs`` (0 timing pairs: none; frontier None: only
    # where the audit can), accepted without the prerequisite
    inert: tuple[Any, ...] = ()
    # where audit.json records its effective value: "settings", "stopping" (a --target-ci
    # audit that stopped at N has the settings of the fixed audit of those N sequences),
    # "runtime.schedule", "runtime.reuse" or "runtime.placement" (how the work ran, what
    # proved the cache: no number depends on it), or "console" (what is shown while it
    # runs, nothing in audit.json)
    recorded: str = "settings"


_SERVED = Needs("engine", lambda o: o.engine == VLLM, arg("engine", VLLM))
_RANKS = dict(bounds=(1, None), kind="int", metavar="N", recorded="runtime.placement",
              needs=_SERVED)
_TASKS = Needs("lm_eval_tasks", lambda o: bool(o.lm_eval_tasks), arg("lm_eval_tasks"),
               why="the benchmark tasks it reads")
_PLACED = Needs("device_map", lambda o: o.device_map is not None, arg("device_map", "auto"))


def option(default: Any, part: str, help: str, **spec: Any) -> Any:
    """A field of :class:`AuditOptions` with its :class:`OptionSpec`."""
    return field(default=default, metadata={"option": OptionSpec(part, help, **spec)})


@dataclass(frozen=True)
class AuditOptions:
    """Knobs of one audit; every one is recorded in ``audit.json`` (``settings``) except
    how it is scheduled, shown, stopped and placed (these change no number)."""

    # statistics: how many random draws, which seeds, how intervals are drawn, what loss
    repeats: int = option(3, "statistics", "seeds per random condition (reassign, shuffle)",
                          bounds=(1, MAX_REPEATS), kind="int")
    seed: int = option(0, "statistics", "master seed", bounds=(0, MAX_SEED), span="0 to 2**32-1",
                       kind="int")
    bootstrap: int = option(1000, "statistics", "bootstrap resamples for 95% intervals",
                            bounds=(10, MAX_BOOTSTRAP), kind="int")
    # schedule: how the work is cut and run (the numbers do not depend on it)
    batch_size: int = option(8, "schedule", "sequences per batch", bounds=(1, None), kind="int")
    # scope: what is measured
    per_layer: bool = option(True, "scope", "skip the per-layer variants (reassign@layer, "
                             "static-layer@layer)", flag="--no-per-layer", action="off")
    execution: bool = option(True, "scope", "skip the execution audit (blocks, FLOPs, speed)",
                             flag="--no-execution", action="off")
    timing_pairs: int = option(
        10, "scope", "interleaved model/dense (a served model: routers computing/logits "
        "supplied) timing pairs", kind="int",
        bounds=(0, MAX_TIMING_PAIRS), span=f"{MIN_TIMING_PAIRS} to {MAX_TIMING_PAIRS}; 0 "
        "disables timing", inert=(0,),
        needs=_execution("it times the model against its dense counterpart"))
    # the CLI's bars and notes (the engine takes a callback)
    progress: bool = option(True, "schedule", "no progress output", flag="--quiet",
                            action="off", recorded="console")
    allow_nonexact_identity: bool = option(
        False, "scope", "continue when replaying the recorded coefficients does not reproduce "
        "the original pass bit for bit (every verdict is then flagged)", action="on")
    schedule: str = option(
        "prefix", "schedule", "prefix (default): a per-layer run recomputes only the blocks "
        "after its site, reusing the correct replay's outputs before it (checked bitwise per "
        "site and batch, else full passes); naive: every run is a full pass. Both give the "
        "same audit.json", choices=SCHEDULES, recorded="runtime.schedule")
    # a rerun into the same folder: which cached replay runs are replayed again and must
    # equal their cached rows bit for bit before the cache is used (engine/replay_proof.py)
    verify_reuse: str = option(
        "sample", "schedule", "on a rerun into the same output folder, which cached replay "
        "results are replayed again and must equal the cache bit for bit before it is used: "
        "sample (default): every run of the plan on one cached batch drawn afresh; all: every "
        "run of every cached batch (as costly as replaying them)", choices=VERIFY_MODES,
        recorded="runtime.reuse")
    # one replay per routed layer and expert, that expert never picked; None: on when every
    # routed layer has at most AUTO_ABLATION_MAX_EXPERTS experts
    expert_ablation: bool | None = option(
        None, "scope", "expert importance: one replay per routed layer and expert with that "
        "expert never picked (costs layers x experts replays, each recomputing only the blocks "
        "after its layer); default: on when every routed layer has at most "
        f"{AUTO_ABLATION_MAX_EXPERTS} experts", action="either")
    # the savings frontier: NLL penalty vs FLOPs skippable, dynamic vs static rules, with
    # frontier_points replays per rule (needs the execution audit for the FLOPs); None:
    # on for the families it covers when the execution audit runs (the study's setting)
    frontier: bool | None = option(
        False, "scope", "the savings frontier: NLL penalty against FLOPs that could be "
        "skipped, a dynamic rule on the recorded gates or routing weights against static "
        f"rules (costs {arg('frontier_points')} replays per rule; needs the execution audit)",
        action="on", inert=(None,),
        needs=_execution("its x axis is the FLOPs it counts"))
    frontier_points: int = option(
        6, "scope", f"with {arg(FRONTIER)}: points per frontier curve", kind="int",
        bounds=(MIN_FRONTIER_POINTS, MAX_FRONTIER_POINTS),
        needs=Needs(FRONTIER, lambda o: o.frontier is True or o.early_exit is True or (
            o.frontier is None and o.execution is True),
                    arg(FRONTIER, py="AuditOptions(frontier=True)") + " or an exit model "
                    "(its threshold sweep)", by_model=lambda sites: any(s.exit is not None
                                                                   for s in sites)))
    # stopping (engine/run.py): evaluation batches are added in rounds until every
    # counted penalty's 95% interval reaches at most target_ci nats on each side of its
    # estimate, or the evaluation pool runs out; min_sequences is the first round's size
    # (None: DEFAULT_MIN_SEQUENCES, or the whole pool when smaller)
    target_ci: float | None = option(
        None, "stopping", "precision-driven stopping: add evaluation batches in rounds until "
        "every main penalty's 95% interval reaches at most NATS on each side of its estimate, "
        f"or the {arg('max_eval', owner='DataSpec')} pool runs out; the numbers equal a fixed "
        "audit of the sequences used (audit.json `stopping`)", kind="nats", metavar="NATS",
        recorded="stopping")
    min_sequences: int | None = option(
        None, "stopping", f"with {arg('target_ci')}: sequences of the first round (default 16, "
        "or the whole pool when smaller)", kind="int", metavar="N", recorded="stopping",
        needs=Needs("target_ci", lambda o: o.target_ci is not None,
                    arg("target_ci", owner="AuditOptions"), why="the size of its first round"))
    # early exit on a Hugging Face causal LM (io/hf_exit.py): every decoder layer read
    # through the model's own final norm and LM head, a token stopping where that head's
    # maximum softmax probability reaches exit_threshold
    early_exit: bool = option(
        False, "scope", "make a Hugging Face causal LM an early-exit model (LayerSkip style): "
        "each layer's exit head is the model's own final norm and LM head, a token exits "
        f"where its maximum softmax probability reaches {arg('exit_threshold')} (updates "
        "masked: FLOPs saved are counted, not realised)", action="on")
    exit_threshold: float = option(
        DEFAULT_EXIT_THRESHOLD, "scope", f"with {arg('early_exit')}: the confidence (maximum "
        "softmax probability, in (0, 1]) at which a token exits (default "
        f"{DEFAULT_EXIT_THRESHOLD})", kind="number", metavar="P",
        needs=Needs("early_exit", lambda o: o.early_exit is True,
                    arg("early_exit", py="AuditOptions(early_exit=True)")))
    # placement, for models bigger than memory (a Hugging Face folder given by path):
    # accelerate's device map ("auto"), its budget ("cpu=8GiB,cuda:0=70GiB" or a dict) and
    # the folder for the weights it puts on disk; where weights sit changes no number
    device_map: str | None = option(
        None, "placement", "place the weights across GPUs, CPU memory and disk with accelerate "
        "(instead of --device)", choices=DEVICE_MAPS, recorded="runtime.placement")
    max_memory: str | dict[str, str | int] | None = option(
        None, "placement", "budget per device for the weights, e.g. cpu=8GiB,cuda:0=70GiB (the "
        "process needs some memory beyond the cpu budget: torch, activations, the layer being "
        "read in from disk)", metavar="DEV=SIZE,...", recorded="runtime.placement",
        needs=_PLACED)
    offload_folder: str | Path | None = option(
        None, "placement", "folder for the weights placed on disk (new or empty; what fcaudit "
        "writes there is removed afterwards)", kind="path", metavar="DIR",
        recorded="runtime.placement", needs=_PLACED)
    # where the passes run: PyTorch here, or vLLM's workers (io/vllm.py), and how it serves
    engine: str = option(
        EAGER, "engine", f"where the passes run: {EAGER} (PyTorch, the default) or "
        f"{VLLM} (a Hugging Face MoE folder served by vLLM, its workers hooked: eager "
        "execution, no prefix caching, one scheduled step per batch)", choices=ENGINES,
        recorded="runtime.placement")
    engine_memory_share: float | None = option(
        None, "engine", f"with {arg('engine', VLLM)}: the share of the GPU's memory vLLM may "
        "take (on a CPU, of the machine's memory; default: vLLM's own on a GPU, 0.1 on a "
        "CPU)", kind="number", metavar="SHARE", recorded="runtime.placement", needs=_SERVED)
    tensor_parallel_size: int = option(
        1, "engine", f"with {arg('engine', VLLM)}: ranks each layer's weights are split over "
        "(vLLM's tensor parallelism; routers are replicated: every rank is fed, one recorded)",
        **_RANKS)
    pipeline_parallel_size: int = option(
        1, "engine", f"with {arg('engine', VLLM)}: stages the layers are split over (vLLM's "
        "pipeline parallelism; each stage's routers recorded where they run)", **_RANKS)
    # the per-unit loss: a built-in objective's name (engine/objectives.py's registry), or
    # a callable (model_output, batch) -> per-unit losses [B] or [B, T]; None: the data
    # decide (token ids: token-nll; other inputs and vision runs: classification; a
    # synthetic task's run: its task's objective). One given is used as given, or refused
    # where it cannot score the data, never replaced
    objective: Any = option(
        None, "statistics",
        "per-unit loss: " + " or ".join(o.help for o in OBJECTIVES.values()),
        choices=tuple(OBJECTIVES))
    # opt-in built-in conditions (core/conditions.py, default=False), run as main conditions
    # and reported beside the default ones; () leaves the audit as it was
    conditions: tuple[str, ...] = option(
        (), "scope", "an opt-in condition to run besides the default ones (repeatable); its "
        "calibration sums are collected only when asked", flag="--condition", action="append",
        choices=OPT_IN_CONDITIONS, metavar="NAME")
    # benchmark tasks (engine/analyses/tasks.py): lm-evaluation-harness tasks scored under
    # each condition once the audit is measured (loaded and checked before the model)
    lm_eval_tasks: tuple[str, ...] = option(
        (), "tasks", "lm-evaluation-harness tasks to score under each condition once the "
        "audit is measured, comma-separated: the harness's own task names, or those whose "
        f"YAML lies under {arg('lm_eval_include_path')}; a group stands for its tasks "
        "(log-likelihood, multiple-choice and rolling log-likelihood tasks; their data read "
        "offline, never downloaded)",
        kind="names", metavar="TASK[,TASK...]")
    lm_eval_include_path: str | Path | None = option(
        None, "tasks", "a folder of task YAMLs with local data (lm-evaluation-harness's "
        "--include_path)", kind="path", metavar="DIR", needs=_TASKS)
    lm_eval_limit: int | None = option(
        None, "tasks", "examples per task (default: all; the first N, as lm-evaluation-harness "
        "takes them)", kind="int", metavar="N", needs=_TASKS)

    def validate(self, given: Collection[str] = ()) -> None:
        """Refuse option values no audit can run with, and options asked for without the
        option they are read with (:class:`Needs`), naming the option in the caller's
        words (the ``AuditOptions`` field, or the CLI flag). An option is asked for when
        its value is not its default, or in ``given`` (a command line's flags, at their
        default or not). A pure check: the CLI runs it before loading a model."""
        for f, spec in option_specs():
            if spec.bounds is not None:
                check_int(f.name, getattr(self, f.name), *spec.bounds)
        for name, choices in (("schedule", SCHEDULES), ("verify_reuse", VERIFY_MODES),
                              ("engine", ENGINES)):
            if getattr(self, name) not in choices:
                raise refusal(option_name(name, getattr(self, name)), getattr(self, name),
                              list(choices), option=name)
        for name, unset in (("expert_ablation", f"on for at most {AUTO_ABLATION_MAX_EXPERTS} "
                             "experts per routed layer"),
                            (FRONTIER, "on where a family is covered and execution measured")):
            if (value := getattr(self, name)) is not None and not isinstance(value, bool):
                raise UsageError(f"{option_name(name, value)}: must be True, False or None "
                                 f"({unset})", option=name)
        check_target(self.target_ci, self.min_sequences)
        check_conditions(self.conditions)
        check_early_exit(self.early_exit, self.exit_threshold)
        check_tasks(self.lm_eval_tasks, self.lm_eval_limit, "lm_eval_tasks" in given)
        if self.lm_eval_tasks and self.engine != EAGER:
            raise UsageError(f"{option_name('lm_eval_tasks', ','.join(self.lm_eval_tasks))}: "
                             f"benchmark tasks are scored in PyTorch; with "
                             f"{arg('engine', self.engine)} drop them, or audit the folder "
                             f"with {arg('engine', EAGER)} to score them",
                             option="lm_eval_tasks")
        if 0 < self.timing_pairs < MIN_TIMING_PAIRS:
            raise UsageError(f"{option_name('timing_pairs', self.timing_pairs)}: use 0 (no "
                             f"timing) or at least {MIN_TIMING_PAIRS} pairs for a meaningful "
                             "interval", option="timing_pairs")
        share = self.engine_memory_share
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0 < share <= 1):
            raise UsageError(f"{option_name('engine_memory_share', share)}: a share in (0, 1]",
                             option="engine_memory_share")
        check_needs(self, given)  # before placement(), whose own check says less
        if self.engine != EAGER and self.device_map is not None:
            raise UsageError(f"{option_name('engine', self.engine)} places the weights itself: "
                             f"drop {arg('device_map')}", option="device_map")
        self.placement()  # the device map, budget syntax and offload folder
        if self.objective is not None:  # None: the data decide (engine/inputs.py)
            resolve(self.objective)

    def serving(self) -> Serving | None:
        """The engine to serve the model with (None: eager PyTorch in this process)."""
        if self.engine == EAGER:
            return None
        from fcaudit.io.vllm import Serving  # vLLM: imported only when served
        return Serving(self.batch_size, self.engine_memory_share, self.tensor_parallel_size,
                       self.pipeline_parallel_size)

    def placement(self) -> Placement | None:
        """Where accelerate may put the weights (None: the model loads whole)."""
        from fcaudit.io.placement import placement
        return placement(self.device_map, self.max_memory, self.offload_folder)


def option_specs() -> Iterator[tuple[dataclasses.Field[Any], OptionSpec]]:
    """Every field of :class:`AuditOptions` with its spec, in declaration order."""
    for f in dataclasses.fields(AuditOptions):
        yield f, f.metadata["option"]


_SPECS: dict[str, tuple[dataclasses.Field[Any], OptionSpec]] = {
    f.name: (f, spec) for f, spec in option_specs()}


def asked(options: AuditOptions, name: str, given: Collection[str] = ()) -> bool:
    """Whether the caller asked for option ``name``: given explicitly (a command line's
    flag, even at its default value), or set to a value other than its default; an
    :attr:`OptionSpec.inert` value asks for nothing."""
    f, spec = _SPECS[name]
    value = getattr(options, name)
    if any(_same(value, v) for v in spec.inert):
        return False
    return name in given or not _same(value, f.default)


def _same(value: object, default: object) -> bool:
    """``value`` is the default itself: equal and of its type (True is not 1)."""
    return value is default or (type(value) is type(default) and value == default)


def check_needs(options: AuditOptions, given: Collection[str] = (),
                sites: Sequence[Site] | None = None) -> None:
    """Refuse every option asked for while the option it is read with (its
    :class:`Needs`) is off: it would change nothing, and an option is done or refused,
    never silently dropped. A need the model may meet otherwise (``by_model``) waits for
    ``sites``: before the model is known it passes, after it is checked on them."""
    for name, (_, spec) in _SPECS.items():
        need = spec.needs
        if need is None or need.on(options) or not asked(options, name, given):
            continue
        if need.by_model is not None and (sites is None or need.by_model(sites)):
            continue
        why = f" ({need.why})" if need.why else ""
        raise UsageError(f"{said_as_given(options, name)} is read only with {need.said}{why}: "
                         f"{need.enable} or drop {said_as_given(options, name, False)}",
                         option=name)


def said_as_given(options: AuditOptions, name: str, with_value: bool = True) -> str:
    """Option ``name`` as its reader set it: ``AuditOptions(frontier=True)`` / ``--frontier``
    for a switch, ``AuditOptions(frontier_points=4)`` / ``--frontier-points 4`` for a
    value (``with_value=False``: ``frontier_points=`` / ``--frontier-points``)."""
    _, spec = _SPECS[name]
    value = getattr(options, name)
    flag = spec.flag or "--" + name.replace("_", "-")
    if spec.action in ("on", "off", "either"):
        flag = "--no-" + flag[2:] if spec.action == "either" and value is False else flag
        return arg(name, py=f"AuditOptions({name}={value!r})", cli=flag)
    if not with_value:
        return arg(name, cli=flag)
    return arg(name, value, owner="AuditOptions", cli=flag)


@dataclass(frozen=True)
class Prepared:
    """Everything validated before the audit's first forward pass (:func:`fcaudit.engine.
    prepare.prepare`): built once, never changed; a ``--target-ci`` round is a copy with a
    prefix of the data."""

    loaded: LoadedModel
    sites: list[Site]
    blocks: list[str] | None
    blocks_glob: str | None
    data: AuditData
    options: AuditOptions  # as validated: never rewritten (what prepare decides is below)
    interventions: list[Intervention]
    # the conditions run: the options' own and those the sites need (an exit model's)
    conditions: tuple[str, ...]
    # the objective scoring the data: the options' own, else the one the data decide
    objective_spec: Any
    # audit.json's ``data`` section: the data's SHA-256s, computed once per audit (a
    # --target-ci round, a copy with a prefix of the data, gives its own)
    data_summary: dict[str, object]
    dense: nn.Module | None = None
    dense_source: str = ""
    out: Path | None = None
    started: float = field(default_factory=time.perf_counter)
    layouts: dict[str, str] = field(default_factory=dict)  # site -> how its layout was found
    kinds: dict[str, str] = field(default_factory=dict)  # site -> its kind (core/kinds.py)
    notes: tuple[str, ...] = ()  # what to tell the user before the audit starts
    # what each analysis loaded and checked before the model (engine.analyses.before_model)
    before: dict[str, Any] = field(default_factory=dict)

    @property
    def seeds(self) -> SeedPlan:
        """The one plan every seed of the audit derives from."""
        return SeedPlan(self.options.seed, self.options.repeats)

    @property
    def model(self) -> nn.Module:
        return self.loaded.model

    @functools.cached_property
    def executor(self) -> Executor:
        """Where every pass of the audit runs (:mod:`fcaudit.engine.passes`)."""
        from fcaudit.engine.passes import Local  # torch: options stay light
        return Local(self.model, self.sites)

    @functools.cached_property
    def objective(self) -> Objective:
        """The audit's objective, resolved once (a callable's state digested once)."""
        return resolve(self.objective_spec)

    @functools.cached_property
    def not_applicable(self) -> dict[str, str]:
        """The conditions (opt-in ones asked for too) that cannot act on these sites or
        inputs, with the reason: not run, and said so (computed once per audit)."""
        from fcaudit.core.layout import not_applicable  # torch: options stay light
        return not_applicable(self.sites, self.inputs.token_ids is not None,
                              self.conditions)

    @functools.cached_property
    def inputs(self) -> TokenData | ExampleData:
        """The engine's one view of the data, whichever kind (a copy of the Prepared with
        other data gets its own)."""
        return self.data.checked()

    @property
    def token_ids(self) -> np.ndarray | None:
        """The evaluation token ids where they key every coefficient (token-keyed profiles,
        the token-id share): the data's, when every site has a token axis; else None."""
        from fcaudit.core.layout import keyed_by_token
        return self.inputs.token_ids if keyed_by_token(self.sites) else None

    @property
    def eval_source(self) -> Any:
        """What evaluation batches are cut from: token ids [N, T] or Examples."""
        return self.inputs.eval_source

    @property
    def calib_source(self) -> Any:
        return self.inputs.calib_source


# progress(NOTE, 0, 0, line): a line for the person running the audit, not a stage; the
# engine never prints, its caller shows these (fcaudit.report.progress.with_notes)
NOTE = "note"


def say(progress: Progress, line: str) -> None:
    progress(NOTE, 0, 0, line)


# ---------------------------------------------------------------------- seeds
# The seed plan: every seed of an audit derived from the one the user gives.
#
# Each stream has its own offset inside a stride of 1000 per master seed, so two audits
# with different seeds never share a stream and the streams of one audit never collide
# (the values are recorded in ``audit.json``'s ``seeds`` and must not change).

STRIDE = 1000  # master seed -> its block of derived seeds
BOOTSTRAP_OFFSET = 7  # the paired bootstrap's resample stream
DRAW_OFFSET = 17  # + k: the random draws (derangement, permutations) of repeat k
ORDER_OFFSET = 500  # --target-ci: the pool's audit order


@dataclass(frozen=True)
class SeedPlan:
    """The user's ``seed`` and the ``repeats`` of each random condition."""

    master: int
    repeats: int = 1

    def draw(self, repeat: int) -> int:
        """The seed of repeat ``repeat``'s random draws."""
        return self.master * STRIDE + DRAW_OFFSET + repeat

    @property
    def draws(self) -> list[int]:
        return [self.draw(k) for k in range(self.repeats)]

    @property
    def bootstrap(self) -> int:
        return self.master * STRIDE + BOOTSTRAP_OFFSET

    @property
    def order(self) -> int:
        return self.master * STRIDE + ORDER_OFFSET

    @property
    def interventions(self) -> int:
        """The master of user interventions' generators (mixed with name, repeat, batch)."""
        return self.master

    @property
    def dense_twin(self) -> int:
        """The seed of a dense counterpart's fresh weights."""
        return self.master

    @property
    def timing(self) -> int:
        """The seed of the latency ratio's bootstrap."""
        return self.master
