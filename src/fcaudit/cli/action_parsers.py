"""The command lines of actions on an audit folder: ``fcaudit fold`` (with its healing)
and ``fcaudit tasks``; both take the audit's data options again."""

from __future__ import annotations

import argparse
from typing import Any

from fcaudit.cli.parser import AUDIT_DATA, general_options, user_file, user_path
from fcaudit.engine.options import MAX_TIMING_PAIRS, MIN_TIMING_PAIRS, AuditOptions
from fcaudit.io.arches import foldable


def _add_heal_options(parser: argparse.ArgumentParser) -> None:
    h = parser.add_argument_group("heal (fine-tune the folded model; the original alike as "
                                  "the control)")
    h.add_argument("--heal-steps", type=int, default=None, metavar="N",
                   help="fine-tune the folded model and, as the control, the original for N "
                        "steps on the same batches, scored on the audit's evaluation data")
    h.add_argument("--heal-data", type=user_file, default=None, metavar="TEXT",
                   help="text to heal on, tokenized with the run's tokenizer (default: the "
                        "built-in training plays, where the run was trained on them)")
    h.add_argument("--heal-params", action="append", default=None, metavar="GLOB",
                   help="train only the weights whose names match this glob (repeatable, e.g. "
                        "'blocks.*.mlp.*'), in both models; one naming no weight of the "
                        "folded model is refused before anything is written (default: all)")
    h.add_argument("--heal-out", type=user_path, default=None, metavar="RUN",
                   help="write the healed model as a run folder here (default: measure only)")


def _on_audit(sub: Any, name: str, summary: str, description: str, example: str
              ) -> tuple[argparse.ArgumentParser, Any]:
    """A command acting on an audit folder: its parser and its own group, which starts
    with ``--audit``."""
    parser = sub.add_parser(name, add_help=False, help=summary, description=description,
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=f"example:\n  {example}")
    group = parser.add_argument_group(name)
    group.add_argument("--audit", required=True, type=user_file, metavar="DIR",
                       help="a folder written by fcaudit audit (its audit.json)")
    return parser, group


def _model_argument(group: Any) -> None:
    group.add_argument("--model", default=None, type=user_file, metavar="SPEC",
                       help="the audited model (default: the one audit.json names)")


def add_fold(sub: Any) -> None:
    parser, f = _on_audit(
        sub, "fold", "write the model with a static profile in place of its controllers",
        "Fold a static profile an audit measured into the audited model: write a "
                    "run folder whose model has no controller computation, only the "
                    "profile's fixed values (a FeatureGate becomes its Dense twin with one "
                    "scale per block, position or token id; an MoE reads its router logits "
                    "from a table, or merges its experts into one MLP at one value per "
                    "layer; a Mamba becomes its time-invariant twin run as a convolution; a "
                    "MUDD model gets static dense connections; "
                    "under fixed exit an early-exit or ponder model is its twin cut at "
                    "that depth). "
                    "The calibration profiles are "
                    "recomputed from the audit's data, the condition is replayed and must "
                    "give the NLL audit.json reports, and the folded model's per-token "
                    "losses must equal the replay's (1e-5 relative) or nothing is written; "
                    "it is then timed against the original and the dense twin.",
        "fcaudit fold --audit audits/featuregate --profile static-layer --out "
        "runs/featuregate-folded")
    f.add_argument("--profile", required=True, metavar="CONDITION",
                   help=f"the condition to fold (a static profile, or fixed exit; the audit "
                        f"must have computed it); folds exist for {foldable()}")
    f.add_argument("--out", required=True, type=user_path, metavar="RUN",
                   help="the run folder to write (new, or a run folder fcaudit wrote, with "
                        "--force)")
    f.add_argument("--force", action="store_true",
                   help="replace a run folder fcaudit wrote at --out")
    _model_argument(f)
    pairs = AuditOptions().timing_pairs
    f.add_argument("--timing-pairs", type=int, default=pairs, metavar="N",
                   help="interleaved timing pairs against the original and the dense twin, "
                        f"{MIN_TIMING_PAIRS} to {MAX_TIMING_PAIRS}; 0 disables timing "
                        f"(default {pairs})")
    f.add_argument("--json", type=user_path, default=None, metavar="FILE",
                   help="also write what the fold (and the healing) measured as JSON")
    _add_heal_options(parser)
    _add_audit_data(parser)


def _add_audit_data(parser: argparse.ArgumentParser) -> None:
    """An action on an audit folder: the audit's data again (checked by SHA-256)."""
    data = parser.add_argument_group(
        "data (the audit's: default the built-in plays, as fcaudit audit; checked by SHA-256)")
    for name in ("data", "calib_data", "tokens", "calib_tokens"):
        data.add_argument("--" + name.replace("_", "-"), type=user_file, default=None,
                          help=AUDIT_DATA[name])
    for flag, what in (("--seq-len", "tokens per scored window"),
                       ("--max-eval", "evaluation sequences"),
                       ("--max-calib", "calibration sequences")):
        data.add_argument(flag, type=int, default=None, help=f"{what}, as the audit's")
    general_options(parser, quiet=True)


def add_tasks(sub: Any) -> None:
    parser, t = _on_audit(
        sub, "tasks", "score benchmark tasks (lm-evaluation-harness) under the audit's "
        "conditions",
        "Score lm-evaluation-harness tasks with the audited model under each "
                    "condition of the audit: the task's requests recorded and replayed with "
                    "the coefficients the condition gives each (its own for correct, which "
                    "must reproduce the unperturbed scores bit for bit; the calibration "
                    "profiles for the static conditions). Per task and metric: the value "
                    "under each condition with a paired bootstrap interval over the task's "
                    "examples, the penalty against correct and each static profile's "
                    "retention. Log-likelihood, multiple-choice and rolling tasks; nothing "
                    "downloads (tasks with local data, or data already in the datasets "
                    "cache). Needs the lm-eval extra.",
        "fcaudit tasks --audit audits/featuregate --tasks my_cloze --include-path my_tasks/")
    t.add_argument("--tasks", required=True, metavar="TASK[,TASK...]",
                   help="lm-evaluation-harness task names (its own, or those --include-path "
                        "defines; a group stands for its tasks)")
    t.add_argument("--include-path", type=user_file, default=None, metavar="DIR",
                   help="a folder of task YAML files (lm-eval's --include_path)")
    t.add_argument("--limit", type=int, default=None, metavar="N",
                   help="score the first N examples of each task (default: all)")
    _model_argument(t)
    t.add_argument("--json", type=user_path, default=None, metavar="FILE",
                   help="also write what was measured as JSON")
    _add_audit_data(parser)
