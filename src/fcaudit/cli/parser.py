"""The ``fcaudit`` argument parser. The ``fcaudit audit`` flags of :class:`AuditOptions`
fields (defaults, bounds, choices, help) are generated from the fields' metadata
(:class:`~fcaudit.engine.options.OptionSpec`), and ``--arch`` lists the model registry.
Nothing heavy is imported: ``--help`` and argument errors are instant.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from fcaudit.core.errors import install_extra, render
from fcaudit.engine.objectives import TASKS
from fcaudit.engine.options import (
    AuditOptions,
    OptionSpec,
    option_specs,
)
from fcaudit.io.arches import ARCHES
from fcaudit.io.engines import EAGER, ENGINES
from fcaudit.io.runtime import measured_minutes

DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def user_path(text: str) -> Path:
    """A path option as the shell would have expanded it: ``~`` is the home folder (a
    quoted '~' must not create a folder named ``~``)."""
    return Path(text).expanduser()


def user_file(text: str) -> str:
    return str(user_path(text)) if text.startswith("~") else text

EPILOG_AUDIT = f"""\
model SPEC is one of:
  RUN_FOLDER                 a folder written by `fcaudit train`
  CHECKPOINT_FOLDER          a local Hugging Face folder (config.json + safetensors): MUDDPythia /
                             MUDDFormer (fcaudit's own code) or any causal LM transformers knows
                             ({install_extra("hf")}; Mixture-of-Experts
                             routers are found automatically; never remote code)
  package.module:factory     a zero-argument callable returning a torch.nn.Module, imported from
                             the current folder; name its controllers with --sites 'blocks.*.gate'

data sources, one of (default: the built-in plays):
  --data FILE_OR_DIR [--calib-data FILE_OR_DIR]   text, tokenized with the model's tokenizer
  --tokens eval.npy --calib-tokens calib.npy      integer arrays [N, T]

examples:
  fcaudit audit --model runs/featuregate --out audits/fg
  fcaudit audit --model ./MUDDPythia-1.4B --data essay.txt --seq-len 512 --out audits/mudd
  fcaudit audit --model ./OLMoE-tiny --tokens eval.npy --calib-tokens calib.npy --out audits/moe
  fcaudit audit --model mypkg.models:build --sites 'layers.*.router' \\
      --tokens eval.npy --calib-tokens calib.npy --dense mypkg.models:build_dense --out audits/my
"""

EPILOG_SITES = """\
A site is a module whose output carries the coefficients (a gate, a mixing-weight
generator, a router). `fcaudit sites` lists the sites the model declares (or that fcaudit
finds, e.g. Mixture-of-Experts routers of Hugging Face models), one line each with its
family, layer and adapter, and where the site has them its axes, the named parts side
by side in its output (a selective recurrence's dt, B, C), the space of a selection
parameter and an exit site's continue and exit scores. A model that declares
none (any model, given --inputs) is probed with one small forward pass, and the modules
that behave like controllers are listed: those whose output (or its sigmoid, softmax,
SiLU...) multiplies another branch, such as `mlp.act_fn` of a gated MLP, not the
linear `mlp.gate_proj` before it. It suggests the `fcaudit audit --sites GLOB` that
names them. --all lists every module with its output type and shape. The pass feeds two
random token windows; a model of other inputs is probed with two rows of --inputs X.npy
(a vision run folder: two of its own digits images).
"""


EPILOG_COMPARE = """\
Audits are compared on the same evaluation data: each audit.json records its windows
(count, length and a SHA-256 fingerprint of the token ids) and its calibration windows.
Audits whose data differ are refused, naming the audits and the field, since their
numbers are not paired; --allow-different-data compares them anyway and the report
says so first. Audits of identical data (checkpoints of one run, or families on the
built-in corpus) are reported as paired. Models are named by their folders or --label.

writes OUT/compare.md, OUT/compare.html (self-contained), OUT/figures/ and
OUT/compare.json (every table's rows, raw numbers); OUT is new, empty, or a folder
`fcaudit compare` wrote, where only its own unchanged files are replaced.

examples:
  fcaudit compare audits/fg-seed0 audits/fg-seed1 audits/fg-seed2 --out cmp
  fcaudit compare audits/step1000 audits/step2000 audits/step4000 \\
      --label 1k --label 2k --label 4k --out cmp/steps
"""


def _nats(value: str) -> float | str:
    """A number of nats as given on the command line; anything else is kept as given, so
    AuditOptions.validate refuses it in the one line every bad value gets."""
    try:
        return float(value)
    except ValueError:
        return value


# "number": any other float (a probability), read and refused like nats
def _names(value: str) -> tuple[str, ...]:
    """Comma-separated names as a tuple (empty names dropped; none left: refused by
    AuditOptions.validate)."""
    return tuple(n.strip() for n in value.split(",") if n.strip())


READERS: dict[str, Any] = {"int": int, "nats": _nats, "number": _nats, "path": user_path,
                           "text": None, "names": _names}
PLACEMENT_GROUP = ("models bigger than memory (a Hugging Face folder; needs accelerate: "
                   f"{install_extra('hf')})")
TASKS_GROUP = ("benchmark tasks (lm-evaluation-harness, read offline: docs/tasks.md; "
               f"{install_extra('lm-eval')})")
ENGINE_GROUP = ("where the passes run (a Hugging Face MoE folder served by vLLM: "
                "docs/vllm.md)")


GENERAL = "general options"  # -h, --debug and --quiet of every command, and nothing else
GENERAL_FIELDS = ("progress",)  # the AuditOptions fields whose flags are general (--quiet)


def general_options(parser: argparse.ArgumentParser, quiet: bool = False,
                    top: bool = False) -> Any:
    """The group every command lists its general options in: help, --debug (also valid
    before the command) and, where the command prints progress, --quiet; a parser made
    with ``add_help=False`` gets its -h here."""
    group = parser.add_argument_group(GENERAL)
    group.add_argument("-h", "--help", action="help", help="show this help message and exit")
    # a command's --debug leaves the top level's default (False) unless it is given
    group.add_argument("--debug", action="store_true", help="show tracebacks on errors",
                       **({} if top else {"default": argparse.SUPPRESS}))
    if quiet:
        group.add_argument("--quiet", action="store_true", help="no progress output")
    return group


def add_audit_options(parser: argparse.ArgumentParser) -> None:
    """Every :class:`AuditOptions` field as a flag; placement and the engine in groups of
    their own, the
    progress switch (--quiet) among the general options, which come last."""
    groups = {"placement": parser.add_argument_group(PLACEMENT_GROUP),
              "engine": parser.add_argument_group(ENGINE_GROUP),
              "tasks": parser.add_argument_group(TASKS_GROUP)}
    settings = parser.add_argument_group("audit settings")
    general = general_options(parser)
    for f, spec in option_specs():
        _add_flag(general if f.name in GENERAL_FIELDS else groups.get(spec.part, settings),
                  f, spec)


def add_option(parser: argparse.ArgumentParser | Any, name: str) -> None:
    """The flag of one :class:`AuditOptions` field (``fcaudit reproduce --repeats``)."""
    f, spec = next((f, spec) for f, spec in option_specs() if f.name == name)
    _add_flag(parser, f, spec)


def _add_flag(group: Any, f: dataclasses.Field[Any], spec: OptionSpec) -> None:
    flag = spec.flag or "--" + f.name.replace("_", "-")
    text = _help(f, spec)
    if spec.action in ("on", "off"):
        group.add_argument(flag, dest=f.name, help=text,
                           action="store_true" if spec.action == "on" else "store_false")
    elif spec.action == "either":
        group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                           default=None, help=text)
    elif spec.action == "append":  # repeatable; validate() refuses a bad name in one line
        group.add_argument(flag, dest=f.name, action="append", default=None,
                           metavar=spec.metavar or None,
                           help=f"{text}; one of {', '.join(spec.choices)}")
    else:  # unset: None, so a flag given at its default value is still known as given
        extra = {"choices": spec.choices} if spec.choices else {}
        group.add_argument(flag, dest=f.name, type=READERS[spec.kind], default=None,
                           metavar=spec.metavar or None, help=text, **extra)


def _help(f: dataclasses.Field[Any], spec: OptionSpec) -> str:
    """The field's help for the CLI reader, with its bounds and default where it has them."""
    text = render(spec.help, cli=True)
    if spec.bounds is not None:
        lo, hi = spec.bounds
        span = spec.span or (f"{lo} to {hi}" if hi is not None else f"at least {lo}")
        text = f"{text}, {span} (default {f.default})"
    return text.replace("%", "%%")


def audit_options(args: argparse.Namespace, **given: Any) -> AuditOptions:
    """The parsed flags as :class:`AuditOptions`; a flag left unset (None) leaves the field's
    default (a repeated flag's list: a tuple), and ``given`` overrides."""
    values = {f.name: tuple(value) if spec.action == "append" else value
              for f, spec in option_specs() if (value := getattr(args, f.name)) is not None}
    return AuditOptions(**values, **given)


def given_options(args: argparse.Namespace) -> set[str]:
    """The :class:`AuditOptions` fields whose flags the command line gave (a switch: set;
    a value: given, even at its default), for :meth:`AuditOptions.validate`."""
    return {f.name for f, spec in option_specs()
            if (value := getattr(args, f.name, None)) is not None
            and (spec.action not in ("on", "off") or value != f.default)}


def _add_train(sub: Any) -> None:
    parser = sub.add_parser("train", add_help=False,
                            help="train a model on the built-in corpus or a synthetic task",
                            description="Train one of fcaudit's architectures (--arch) on "
                                        "the built-in Shakespeare corpus, a synthetic task "
                                        "or the digits (seeded, deterministic on CPU).")
    t = parser.add_argument_group("training")
    vision = [name for name, arch in ARCHES.items() if arch.task == "vision"]
    t.add_argument("--arch", required=True, choices=list(ARCHES),
                   help=f"{', '.join(vision)} train on scikit-learn's bundled digits "
                        f"({install_extra('vision')})")
    t.add_argument("--preset", default="tiny",
                   help="tiny, mid, small, 76m or 504m (default tiny)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", required=True, type=user_path, help="run folder to create")
    t.add_argument("--steps", type=int, default=None, help="override the preset's step count")
    t.add_argument("--force", action="store_true",
                   help="replace an existing run folder written by fcaudit (nothing else)")
    t.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    t.add_argument("--data", type=user_file, default=None, metavar="FILE_OR_DIR",
                   help="train on your own text (a file or a folder of .txt) instead of the "
                        "built-in corpus; its last 5%% of tokens are held out for eval NLL")
    t.add_argument("--task", choices=list(TASKS), default=None,
                   help="train a language arch on a synthetic task instead of the corpus, "
                        "on fresh batches, with the task's objective as the loss; an audit "
                        "of the run uses the task's data and objective. "
                        + "; ".join(TASKS[name].help for name in TASKS))
    general_options(parser, quiet=True)


def _add_audit(sub: Any) -> None:
    parser = sub.add_parser("audit", help="run the full audit on a model", add_help=False,
                            description="Record every controller's coefficients, replay the "
                                        "frozen model under each condition, measure execution, "
                                        "and write OUT/audit.json, OUT/report.md, "
                                        "OUT/report.html and figures.",
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=EPILOG_AUDIT)
    a = parser.add_argument_group("model and output")
    a.add_argument("--model", required=True, type=user_file, help="model SPEC (see below)")
    a.add_argument("--out", required=True, type=user_path,
                   help="output folder: new, empty, or one fcaudit wrote (its cache is reused)")
    a.add_argument("--sites", action="append", default=None, metavar="GLOB",
                   help="module-path glob of controller modules (repeatable; one family each)")
    a.add_argument("--site-axes", action="append", default=None, metavar="GLOB=AXES",
                   help="declare the coefficient layout of the sites a --sites GLOB names: "
                        "their axes, the examples axis first, a * after each position axis "
                        "(repeatable). 'blocks.*.gate=example,channel': one value set per "
                        "example (a squeeze-and-excitation gate [B, C]; no shuffle); "
                        "'blocks.*.gate=example,patch*': [B, P, ...] per patch; "
                        "'blocks.*.mask=example,channel,row*,column*': a spatial map. "
                        "Default: read off the first batch, a position axis only where its "
                        "length is the tokens, patches or cells the module reads. Sites the "
                        "model declares keep their own layout")
    a.add_argument("--dense", default=None, type=user_file, metavar="SPEC",
                   help="dense counterpart for the execution audit (default: built from the "
                        "model's architecture when it knows one)")
    a.add_argument("--blocks", default=None, metavar="GLOB",
                   help="module-path glob of the blocks whose executions are counted, in both "
                        "model and dense (default: the model's own declaration)")
    a.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                   help="load the model (and --dense) in this dtype (default: as stored)")
    a.add_argument("--device", default="cpu",
                   help="cpu or cuda (default cpu, where identity replay is bitwise exact)")
    data = parser.add_argument_group(DATA_GROUP)
    for name, text in AUDIT_DATA.items():
        data.add_argument("--" + name.replace("_", "-"), type=user_file, default=None, help=text)
    data.add_argument("--seq-len", type=int, default=None,
                      help="tokens per scored window (default: a run folder's training "
                           "length; a Hugging Face folder or other model: min(256, its "
                           "context), which may exceed the length it was trained at; token "
                           "arrays: their width). The length used and its source are printed "
                           "and kept in audit.json")
    data.add_argument("--max-eval", type=int, default=None,
                      help="evaluation sequences, spread evenly over what the data holds "
                           "(default 64; with --inputs, every example unless given)")
    data.add_argument("--max-calib", type=int, default=None,
                      help="calibration sequences, likewise (default 64; with --calib-inputs, "
                           "every example unless given)")
    add_audit_options(parser)


DATA_GROUP = "data (default: the built-in Shakespeare evaluation and calibration plays)"


# where the evaluation and calibration data come from (text, token ids or arrays)
AUDIT_DATA = {
    "data": "evaluation text file or folder of .txt",
    "calib_data": "calibration text (default: first half of --data's windows)",
    "tokens": "evaluation token ids, integer .npy [N, T]",
    "calib_tokens": "calibration token ids .npy [N, T]",
    "inputs": "evaluation inputs that are not token ids, a numeric .npy [N, ...] fed as "
              "model(x) (e.g. images [N, 1, 8, 8]); every row is used",
    "targets": "evaluation targets .npy [N] (with --inputs; classification: ints)",
    "calib_inputs": "calibration inputs .npy [N, ...] (with --inputs)",
    "calib_targets": "calibration targets .npy [N] (optional; checked like --targets)",
}


def _add_compare(sub: Any) -> None:
    parser = sub.add_parser("compare", add_help=False,
                            help="several audits side by side (tables and figures)",
                            description="Compare finished audits side by side: the three "
                                        "answers per model, every penalty and retention with "
                                        "its 95%% CI, per-layer profiles overlaid, routing and "
                                        "execution.",
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=EPILOG_COMPARE)
    c = parser.add_argument_group("comparison")
    parser.add_argument("audits", nargs="+", type=user_path, metavar="AUDIT",
                   help="audit folders written by `fcaudit audit` (at least two)")
    c.add_argument("--out", required=True, type=user_path, help="output folder")
    c.add_argument("--label", action="append", default=None, dest="labels", metavar="NAME",
                   help="name of each model, once per AUDIT in order (default: folder names)")
    c.add_argument("--allow-different-data", action="store_true",
                   help="compare audits measured on different data (reported as not paired)")
    general_options(parser)


def _add_bench(sub: Any) -> None:
    parser = sub.add_parser("bench", add_help=False,
                            help="execution audit only: model vs dense counterpart",
                            description="Blocks executed, FLOPs per token and interleaved "
                                        "timing of --model against --dense on one batch of "
                                        "built-in evaluation text (random token ids when the "
                                        "model has no tokenizer).")
    b = parser.add_argument_group("benchmark")
    b.add_argument("--model", required=True, type=user_file,
                   help="model SPEC (as for `fcaudit audit`)")
    b.add_argument("--dense", default=None, type=user_file,
                   help="default: the model's own dense counterpart")
    b.add_argument("--blocks", default=None, metavar="GLOB",
                   help="module-path glob of the blocks to count, in model and dense "
                        "(default: the models' own declarations)")
    b.add_argument("--batch-size", type=int, default=8)
    b.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (default 128, or the models' context if shorter)")
    b.add_argument("--pairs", type=int, default=10, help="timing pairs, at least 10")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    b.add_argument("--json", type=user_path, default=None, help="also write the result as JSON")
    general_options(parser)


def _add_reproduce(sub: Any) -> None:
    parser = sub.add_parser("reproduce", add_help=False,
                            help="the paper's study: multi-seed train + audit + tables",
                            description="Train every seed of FeatureGate/Dense (and the tiny "
                                        "MUDD and SkipGate), audit each, aggregate across seeds "
                                        "and write OUT/reproduction.md, OUT/report.html and "
                                        "figures. Finished runs and audits are reused, so an "
                                        "interrupted study resumes.")
    r = parser.add_argument_group("study")
    r.add_argument("--preset", choices=["tiny", "paper", "trend", "vision", "ssm", "exit", "fold",
                                        "tasks"],
                   default="tiny",
                   help=f"tiny: CPU scale (about {measured_minutes('reproduce_tiny')} minutes "
                        "for 3 seeds on 2 cores); paper: 76m x7 and 504m x3 seeds (GPU); "
                        "trend: FeatureGate and Dense at a ladder of sizes and training lengths, "
                        "MUDD at the tiny points (about "
                        f"{measured_minutes('reproduce_trend')} minutes for 2 seeds on 2 "
                        "cores), with OUT/points/*.json and OUT/trend.md; vision: ViT-MoE, "
                        "TokenPrune and CondConv with their dense twins on scikit-learn's "
                        f"digits, audited by classification ({install_extra('vision')}); "
                        "ssm: Mamba "
                        "and its LTI twin S4D on the built-in corpus and on selective "
                        "copying, audited for selection; exit: the early-exit LM, the ponder "
                        "model and the digits early-exit classifier with their full-depth "
                        "twins, audited for where they stop (fixed, learned and oracle "
                        "exit, matched depth); fold: FeatureGate, the MoE, Mamba (corpus and "
                        "selective copying) and the early-exit LM, each seed folded at one "
                        "condition, timed and healed with the control (fcaudit fold); "
                        "tasks: the tiny FeatureGate, MoE and Mamba scored on next-word and "
                        "cloze tasks built from the evaluation plays under each condition "
                        f"(lm-evaluation-harness: {install_extra('lm-eval')})")
    r.add_argument("--seeds", type=int, default=None,
                   help="seeds per group (default: tiny, vision, ssm and exit 3; paper 7 for 76m "
                        "and 3 for 504m; trend 2)")
    r.add_argument("--out", type=user_path, default=Path("fcaudit-reproduction"))
    r.add_argument("--mudd-checkpoint", type=user_file, default=None, metavar="PATH",
                   help="also audit a local MUDDPythia-1.4B checkpoint folder")
    add_option(r, "repeats")
    add_option(r, "bootstrap")
    r.add_argument("--max-eval", type=int, default=None,
                   help="evaluation sequences per audit (default 64; vision: all the "
                        "evaluation images)")
    r.add_argument("--max-calib", type=int, default=None,
                   help="calibration sequences per audit (default 64; vision: all the "
                        "calibration images)")
    r.add_argument("--steps", type=int, default=None,
                   help="override every training run's step count (quick smoke runs)")
    r.add_argument("--train-data", type=user_file, default=None, metavar="FILE_OR_DIR",
                   help="train on this text instead of the built-in corpus (advised for "
                        "--preset paper: Shakespeare is ~2M tokens); audits still use the "
                        "built-in evaluation and calibration plays. Runs of the digits or a "
                        "synthetic task keep their own data; a preset with no run of text "
                        "refuses it")
    general_options(parser, quiet=True)


def _add_demo(sub: Any) -> None:
    parser = sub.add_parser("demo", add_help=False,
                            help=f"audit the shipped tiny FeatureGate against its Dense twin "
                                 f"(about {measured_minutes('demo')} minutes on 2 cores)",
                            description="The built-in default end to end: audit the tiny "
                                        "FeatureGate shipped with fcaudit against its Dense "
                                        "twin (the README's numbers on any machine), print a "
                                        "summary and write the reports. --train trains the "
                                        "pair afresh first.")
    d = parser.add_argument_group("demo")
    d.add_argument("--out", type=user_path, default=Path("fcaudit-demo"))
    d.add_argument("--train", action="store_true",
                   help=f"train the two models afresh (about {measured_minutes('demo_train')} "
                        "minutes on 2 cores; another CPU or thread count trains slightly "
                        "different models, so the numbers differ from the README's)")
    d.add_argument("--seed", type=int, default=0,
                   help="the audit's seed, and with --train the training seed (the shipped "
                        "models were trained with seed 0)")
    general_options(parser, quiet=True)


def _add_sites(sub: Any) -> None:
    parser = sub.add_parser("sites", add_help=False,
                            help="list a model's controller sites (and, with --all, every "
                                 "module's output)",
                            description="List the controller sites of a model, to choose "
                                        "--sites.",
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=EPILOG_SITES)
    s = parser.add_argument_group("listing")
    s.add_argument("--model", required=True, type=user_file,
                   help="model SPEC (as for `fcaudit audit`)")
    s.add_argument("--all", action="store_true",
                   help="run one small forward pass and list every module with its output "
                        "type and shape, marking likely controllers")
    s.add_argument("--inputs", type=user_file, default=None, metavar="NPY",
                   help="probe with the first two rows of these inputs (.npy [N, ...]) for a "
                        "model that does not take token ids (default: two random token "
                        "windows; a vision run folder: two of its digits images); given, "
                        "the probe runs and lists the likely controllers beside the "
                        "declared sites")
    general_options(parser)


def _add_routes(sub: Any) -> None:
    parser = sub.add_parser(
        "routes", add_help=False,
        help="compare a serving engine's routed-expert trace with fcaudit's recording",
        description="Compare the routed-expert ids a serving engine recorded (vLLM's "
                    "enable_return_routed_experts, SGLang's return_routed_experts) with "
                    "fcaudit's own pass over the same tokens: the share of (token, layer) "
                    "expert sets that agree, split by the top-k margin of the router "
                    "logits (near-ties are where two engines' arithmetic may differ); and "
                    "the model's NLL with the trace's expert ids fixed and their weights "
                    "recomputed by its own routers (the trainers' route-replay contract, a "
                    "condition of its own, never the frozen-controller correct).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  fcaudit routes --model ./olmoe --tokens prompts.npy "
               "--trace routed_experts.npy --json agreement.json")
    r = parser.add_argument_group("comparison")
    r.add_argument("--model", required=True, type=user_file,
                   help="a Hugging Face MoE folder (or any model SPEC with router sites)")
    r.add_argument("--tokens", required=True, type=user_file, metavar="NPY",
                   help="the prompts' token ids [requests, tokens] (.npy), as the engine "
                        "was given them")
    r.add_argument("--trace", required=True, type=user_file, metavar="FILE",
                   help="the expert ids the engine took: [tokens, layers, k] or [requests, "
                        "tokens, layers, k] integers (.npy, or .safetensors: its one tensor "
                        "or 'routed_experts'); negative ids are rows it did not fill")
    r.add_argument("--prompt-start", type=int, default=0, metavar="ROW",
                   help="the trace row of each prompt's first token (vLLM's "
                        "routed_experts_prompt_start; default 0); the rows after the "
                        "prompt (its completion) are not compared")
    r.add_argument("--engine", choices=ENGINES, default=EAGER,
                   help="run fcaudit's pass eagerly (default) or in vLLM serving the folder")
    r.add_argument("--batch-size", type=int, default=8, metavar="N",
                   help="prompts per forward pass (default 8)")
    r.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="with --engine vllm: its tensor-parallel ranks (default 1)")
    r.add_argument("--json", type=user_path, default=None, metavar="FILE",
                   help="also write the agreement as JSON")
    general_options(parser)


def build_parser() -> argparse.ArgumentParser:
    from fcaudit.cli.action_parsers import add_fold, add_tasks
    parser = argparse.ArgumentParser(
        prog="fcaudit", add_help=False,
        description="Frozen Controller Audit: do a model's controller coefficients vary, does "
                    "the frozen model depend on them staying matched to their input and token, "
                    "and does the mechanism change execution?",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Start with `fcaudit demo`; see `fcaudit COMMAND --help`.")
    general_options(parser, top=True)  # --debug also works after the command name
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_train, _add_audit, _add_compare, _add_demo, _add_bench, _add_reproduce,
                _add_sites, _add_routes, add_fold, add_tasks):
        add(sub)
    return parser
