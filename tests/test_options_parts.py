"""AuditOptions in parts: one flat frozen dataclass whose fields carry their part, help,
bounds and command-line form; the ``fcaudit audit`` flags are generated from the fields,
and validation refuses before the model is read."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import run_inprocess

from fcaudit.cli import build_parser
from fcaudit.cli.parser import audit_options
from fcaudit.core.errors import UsageError
from fcaudit.engine.options import AuditOptions, option_specs


def _subparser(name: str) -> object:
    return build_parser()._subparsers._group_actions[0].choices[name]


def test_every_field_declares_its_part() -> None:
    """Each of the 30 fields in exactly one of the seven parts (the ``fcaudit audit`` help
    groups placement, the engine and benchmark tasks apart by it)."""
    parts = {"statistics": ["repeats", "seed", "bootstrap", "objective"],
             "scope": ["per_layer", "execution", "timing_pairs", "allow_nonexact_identity",
                       "expert_ablation", "frontier", "frontier_points", "early_exit",
                       "exit_threshold", "conditions"],
             "schedule": ["batch_size", "progress", "schedule", "verify_reuse"],
             "stopping": ["target_ci", "min_sequences"],
             "placement": ["device_map", "max_memory", "offload_folder"],
             "engine": ["engine", "engine_memory_share", "tensor_parallel_size",
                        "pipeline_parallel_size"],
             "tasks": ["lm_eval_tasks", "lm_eval_include_path", "lm_eval_limit"]}
    declared: dict[str, list[str]] = {}
    for f, spec in option_specs():
        declared.setdefault(spec.part, []).append(f.name)
    assert {part: sorted(names) for part, names in declared.items()} == \
        {part: sorted(names) for part, names in parts.items()}
    assert len(dataclasses.fields(AuditOptions)) == 30


def test_every_existing_way_of_building_options_still_works() -> None:
    base = AuditOptions(3, 0, 1000, 8)  # positional, in the original field order
    assert base == AuditOptions()
    options = AuditOptions(repeats=2, bootstrap=200, per_layer=False)
    assert (options.repeats, options.bootstrap, options.per_layer) == (2, 200, False)
    moved = dataclasses.replace(options, seed=7)
    assert (moved.seed, moved.repeats) == (7, 2)
    copied = AuditOptions(**{**options.__dict__, "frontier_points": 3})
    assert copied == dataclasses.replace(options, frontier_points=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.repeats = 5  # type: ignore[misc]


def test_the_cli_defaults_are_the_fields_defaults() -> None:
    args = build_parser().parse_args(["audit", "--model", "m", "--out", "o"])
    assert audit_options(args) == AuditOptions()


@pytest.mark.parametrize("argv, field, value", [
    (["--no-per-layer"], "per_layer", False),
    (["--no-execution"], "execution", False),
    (["--quiet"], "progress", False),
    (["--frontier"], "frontier", True),
    (["--expert-ablation"], "expert_ablation", True),
    (["--no-expert-ablation"], "expert_ablation", False),
    (["--allow-nonexact-identity"], "allow_nonexact_identity", True),
    (["--schedule", "naive"], "schedule", "naive"),
    (["--repeats", "5"], "repeats", 5),
    (["--frontier-points", "4"], "frontier_points", 4),
    (["--target-ci", "0.02"], "target_ci", 0.02),
    (["--target-ci", "small"], "target_ci", "small"),  # kept, so validate names it
    (["--min-sequences", "8"], "min_sequences", 8),
    (["--device-map", "auto"], "device_map", "auto"),
    (["--max-memory", "cpu=8GiB"], "max_memory", "cpu=8GiB"),
    (["--offload-folder", "~/weights"], "offload_folder", Path.home() / "weights"),
    (["--objective", "classification"], "objective", "classification"),
])
def test_each_flag_sets_its_field(argv: list[str], field: str, value: object) -> None:
    args = build_parser().parse_args(["audit", "--model", "m", "--out", "o", *argv])
    assert getattr(audit_options(args), field) == value


def test_the_help_states_the_bounds_and_defaults_validation_enforces() -> None:
    text = " ".join(_subparser("audit").format_help().split())  # type: ignore[attr-defined]
    for said in ("seeds per random condition (reassign, shuffle), 1 to 100 (default 3)",
                 "master seed, 0 to 2**32-1 (default 0)",
                 "bootstrap resamples for 95% intervals, 10 to 100000 (default 1000)",
                 "points per frontier curve, 2 to 20 (default 6)",
                 "timing pairs, 10 to 1000; 0 disables timing (default 10)",
                 "sequences per batch, at least 1 (default 8)"):
        assert said in text, said
    for bad, message in ((dict(repeats=101), "between 1 and 100"),
                         (dict(seed=2**32), "between 0 and 4294967295"),
                         (dict(bootstrap=9), "between 10 and 100000"),
                         (dict(frontier_points=21), "between 2 and 20"),
                         (dict(batch_size=0), "at least 1")):
        with pytest.raises(UsageError, match=message):
            AuditOptions(**bad).validate()


def test_arch_choices_are_the_model_registry() -> None:
    train = _subparser("train")
    arch = next(a for a in train._actions if "--arch" in a.option_strings)  # type: ignore
    assert sorted(arch.choices) == sorted([
        "featuregate", "dense", "skipgate", "earlyexit", "ponder", "mudd", "moe", "vit-moe",
        "tokenprune", "dense-vit", "condconv", "branchy", "dense-cnn", "mamba", "s4d",
        "dense-ponder", "mixtral"])


def test_the_cli_refuses_an_option_before_it_reads_the_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model that cannot be found is not read yet when an option is refused: the
    option's own line, exit 2."""
    res = run_inprocess(["audit", "--model", tmp_path / "no-such-model", "--repeats", "0",
                         "--out", tmp_path / "out"], capsys)
    assert res.returncode == 2
    assert res.stderr.strip() == \
        "fcaudit: error: --repeats 0: must be an integer between 1 and 100"
    assert not (tmp_path / "out").exists()
