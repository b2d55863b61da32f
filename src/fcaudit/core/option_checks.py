"""The checks :meth:`fcaudit.engine.options.AuditOptions.validate` makes on option values
that need more than bounds and choices: each refuses in one line naming the option in the
caller's words (``AuditOptions(...)`` or its flag). Imports neither torch nor numpy (the
CLI's ``--help`` reads the options)."""

from __future__ import annotations

import math

from fcaudit.core.conditions import MAIN_CONDITIONS, OPT_IN_CONDITIONS
from fcaudit.core.errors import UsageError, arg

# --target-ci below this is never a precision an audit can stop at: intervals shrink as
# 1/sqrt(N), so a penalty whose per-sequence sd is 0.01 nats needs ~4e8 sequences to
# reach 1e-6, and float32 losses of a few nats round at ~1e-7 (a model with no
# dependence reaches 0 at any target; it stops at the first round at this one too)
MIN_TARGET_CI = 1e-6


def option_name(option: str, value: object) -> str:
    return arg(option, value, owner="AuditOptions")


def check_int(option: str, value: object, lo: int, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (
            hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise UsageError(f"{option_name(option, value)}: must be an integer {bound}", option=option)


def check_tasks(tasks: object, limit: object, given: bool) -> None:
    """Task names as a sequence of non-empty strings (a string alone is refused: its
    letters are no task names; a flag given with none too), a limit of at least one
    example."""
    if isinstance(tasks, str) or not isinstance(tasks, (tuple, list)) or not all(
            isinstance(t, str) and t.strip() for t in tasks) or (given and not tasks):
        example = arg("lm_eval_tasks", py="AuditOptions(lm_eval_tasks=('arc_easy', 'piqa'))",
                      cli="--lm-eval-tasks arc_easy,piqa")
        raise UsageError(f"{option_name('lm_eval_tasks', tasks)}: give task names, e.g. {example}",
                         option="lm_eval_tasks")
    if limit is not None:
        check_int("lm_eval_limit", limit, 1, None)


def check_target(target: object, floor: object) -> None:
    """``target_ci`` a finite number of nats of at least :data:`MIN_TARGET_CI`;
    ``min_sequences`` an integer of at least 2 (a derangement needs two sequences)."""
    target_arg = arg("target_ci", target, owner="AuditOptions")
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                               or not math.isfinite(target) or target <= 0):
        raise UsageError(f"{target_arg}: must be a number of nats above 0 (the largest "
                         "half-width of a penalty's 95% interval to stop at, e.g. 0.02)",
                         option="target_ci")
    if target is not None and target < MIN_TARGET_CI:
        raise UsageError(f"{target_arg}: below {MIN_TARGET_CI:g} nats is finer than an "
                         "audit resolves (float32 losses round at about 1e-07 nats, and "
                         "intervals shrink only as 1/sqrt(sequences)): give at least "
                         f"{MIN_TARGET_CI:g} (e.g. 0.02), or drop it to audit every sequence",
                         option="target_ci")
    if floor is not None and (isinstance(floor, bool) or not isinstance(floor, int)
                              or floor < 2):
        raise UsageError(f"{arg('min_sequences', floor, owner='AuditOptions')}: must be an "
                         "integer of at least 2 (reassignment needs two sequences)",
                         option="min_sequences")


def check_early_exit(early_exit: object, threshold: object) -> None:
    """``early_exit`` a bool; ``exit_threshold`` a probability in (0, 1]."""
    if not isinstance(early_exit, bool):
        raise UsageError(f"{option_name('early_exit', early_exit)}: must be True or False",
                         option="early_exit")
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) \
            or not 0.0 < threshold <= 1.0:
        raise UsageError(f"{option_name('exit_threshold', threshold)}: must be a number in (0, 1] "
                         "(a softmax probability; 1.0 exits only tokens the head is certain "
                         "of)", option="exit_threshold")


def check_conditions(names: object) -> None:
    """``conditions`` a tuple (or list) of opt-in condition names: a default one is run by
    every audit already, anything else is not a condition an audit can opt into."""
    what = arg("conditions", names, owner="AuditOptions")
    choices = ", ".join(OPT_IN_CONDITIONS)
    if not isinstance(names, (tuple, list)):
        raise UsageError(f"{what}: must be a tuple of condition names, e.g. "
                         f"conditions=({OPT_IN_CONDITIONS[0]!r},); choose from {choices}",
                         option="conditions")
    for name in names:
        if name in OPT_IN_CONDITIONS:
            continue
        why = "every audit runs it already" if name in MAIN_CONDITIONS else \
            "not an opt-in condition"
        named = arg("conditions", name, owner="AuditOptions", cli="--condition")
        raise UsageError(f"{named}: {why}; choose from {choices}", option="conditions")
