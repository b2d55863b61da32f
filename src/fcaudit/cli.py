"""Command line: ``fcaudit {train,audit,compare,demo,bench,sites,reproduce}``.

User errors print one line and exit with status 2; ``--debug`` shows tracebacks. This
module imports nothing heavy at the top, so ``--help`` and argument errors are instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fcaudit.core.errors import FcauditError, render
from fcaudit.io.runtime import measured_minutes

DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def user_path(text: str) -> Path:
    """A path option as the shell would have expanded it: ``~`` is the home folder (a
    quoted '~' must not create a folder named ``~``)."""
    return Path(text).expanduser()


def user_file(text: str) -> str:
    return str(user_path(text)) if text.startswith("~") else text

EPILOG_AUDIT = """\
model SPEC is one of:
  RUN_FOLDER                 a folder written by `fcaudit train`
  CHECKPOINT_FOLDER          a local Hugging Face folder (config.json + safetensors): MUDDPythia /
                             MUDDFormer (fcaudit's own code) or any causal LM transformers knows
                             (pip install "fcaudit[hf]"; Mixture-of-Experts routers are found
                             automatically; never remote code)
  package.module:factory     a zero-argument callable returning a torch.nn.Module, imported from
                             the current folder; name its controllers with --sites 'blocks.*.gate'

data (default: the built-in Shakespeare evaluation and calibration plays):
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
finds, e.g. Mixture-of-Experts routers of Hugging Face models). A model that declares
none is probed with one small forward pass, and the modules that behave like controllers
are listed: those whose output (or its sigmoid, softmax, SiLU...) multiplies another
branch, such as `mlp.act_fn` of a gated MLP, not the linear `mlp.gate_proj` before it.
It suggests the `fcaudit audit --sites GLOB` that names them. --all lists every module
with its output type and shape. The pass feeds two random token windows; a model of
other inputs is probed with two rows of --inputs X.npy (a vision run folder: two of its
own digits images).
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


def _add_audit_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("audit settings")
    g.add_argument("--repeats", type=int, default=3,
                   help="seeds per random condition (reassign, shuffle), 1 to 100 (default 3)")
    g.add_argument("--seed", type=int, default=0, help="master seed, 0 to 2**32-1 (default 0)")
    g.add_argument("--bootstrap", type=int, default=1000,
                   help="bootstrap resamples for 95%% intervals, 10 to 100000 (default 1000)")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per batch (default 8)")
    g.add_argument("--no-per-layer", action="store_true",
                   help="skip the per-layer variants (reassign@layer, static-layer@layer)")
    g.add_argument("--no-execution", action="store_true",
                   help="skip the execution audit (blocks, FLOPs, speed)")
    g.add_argument("--expert-ablation", action=argparse.BooleanOptionalAction, default=None,
                   help="expert importance: one replay per routed layer and expert with that "
                        "expert never picked (costs layers x experts replays, each "
                        "recomputing only the blocks after its layer); default: on when "
                        "every routed layer has at most 64 experts")
    g.add_argument("--frontier", action="store_true",
                   help="the savings frontier: NLL penalty against FLOPs that could be skipped, "
                        "a dynamic rule on the recorded gates or routing weights against static "
                        "rules (costs --frontier-points replays per rule; needs the execution "
                        "audit)")
    g.add_argument("--frontier-points", type=int, default=6,
                   help="points per frontier curve, 2 to 20 (default 6)")
    g.add_argument("--timing-pairs", type=int, default=10,
                   help="interleaved model/dense timing pairs, 10 to 1000; 0 disables timing "
                        "(default 10)")
    g.add_argument("--schedule", choices=["prefix", "naive"], default="prefix",
                   help="prefix (default): a per-layer run recomputes only the blocks after "
                        "its site, reusing the correct replay's outputs before it (checked "
                        "bitwise per site and batch, else full passes); naive: every run is "
                        "a full pass. Both give the same audit.json")
    g.add_argument("--allow-nonexact-identity", action="store_true",
                   help="continue when replaying the recorded coefficients does not reproduce "
                        "the original pass bit for bit (every verdict is then flagged)")
    g.add_argument("--target-ci", default=None, metavar="NATS",
                   help="precision-driven stopping: add evaluation batches in rounds until "
                        "every main penalty's 95%% interval reaches at most NATS on each side "
                        "of its estimate, or the --max-eval pool runs out; the numbers equal a "
                        "fixed audit of the sequences used (audit.json `stopping`)")
    g.add_argument("--min-sequences", type=int, default=None, metavar="N",
                   help="with --target-ci: sequences of the first round (default 16, or the "
                        "whole pool when smaller)")
    g.add_argument("--quiet", action="store_true", help="no progress output")


def _options(args: argparse.Namespace) -> Any:
    from fcaudit.engine.run import AuditOptions
    return AuditOptions(repeats=args.repeats, seed=args.seed, bootstrap=args.bootstrap,
                        batch_size=args.batch_size, per_layer=not args.no_per_layer,
                        execution=not args.no_execution, timing_pairs=args.timing_pairs,
                        progress=not args.quiet, schedule=args.schedule,
                        allow_nonexact_identity=args.allow_nonexact_identity,
                        expert_ablation=args.expert_ablation, frontier=args.frontier,
                        frontier_points=args.frontier_points,
                        target_ci=_nats(args.target_ci, "--target-ci"),
                        min_sequences=args.min_sequences, device_map=args.device_map,
                        max_memory=args.max_memory, offload_folder=args.offload_folder)


def _nats(value: str | None, flag: str) -> float | str | None:
    """A number of nats as given on the command line; anything else is kept as given, so
    AuditOptions.validate refuses it in the one line every bad value gets."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return value


def _add_train(sub: Any) -> None:
    t = sub.add_parser("train", help="train a model on the built-in corpus",
                       description="Train FeatureGate, its Dense twin, SkipGate, MUDD or MoE on "
                                   "the built-in Shakespeare corpus (seeded, deterministic on "
                                   "CPU).")
    t.add_argument("--arch", required=True, choices=["featuregate", "dense", "skipgate", "mudd",
                                                      "moe", "vit-moe", "tokenprune", "condconv",
                                                      "dense-vit", "dense-cnn"],
                   help="vit-moe, tokenprune, condconv and their dense twins dense-vit and "
                        "dense-cnn train on scikit-learn's bundled digits (fcaudit[vision])")
    t.add_argument("--preset", default="tiny",
                   help="tiny, mid, small, 76m or 504m (default tiny)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", required=True, type=user_path, help="run folder to create")
    t.add_argument("--steps", type=int, default=None, help="override the preset's step count")
    t.add_argument("--force", action="store_true",
                   help="replace an existing run folder written by fcaudit (nothing else)")
    t.add_argument("--quiet", action="store_true", help="no progress output")
    t.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    t.add_argument("--data", type=user_file, default=None, metavar="FILE_OR_DIR",
                   help="train on your own text (a file or a folder of .txt) instead of the "
                        "built-in corpus; its last 5%% of tokens are held out for eval NLL")


def _add_audit(sub: Any) -> None:
    a = sub.add_parser("audit", help="run the full audit on a model",
                       description="Record every controller's coefficients, replay the frozen "
                                   "model under each condition, measure execution, and write "
                                   "OUT/audit.json, OUT/report.md, OUT/report.html and figures.",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG_AUDIT)
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
    a.add_argument("--data", type=user_file, default=None,
                   help="evaluation text file or folder of .txt")
    a.add_argument("--calib-data", type=user_file, default=None,
                   help="calibration text (default: first half of --data's windows)")
    a.add_argument("--tokens", type=user_file, default=None,
                   help="evaluation token ids, integer .npy [N, T]")
    a.add_argument("--calib-tokens", type=user_file, default=None,
                   help="calibration token ids .npy [N, T]")
    a.add_argument("--inputs", type=user_file, default=None,
                   help="evaluation inputs that are not token ids, a numeric .npy [N, ...] "
                        "fed as model(x) (e.g. images [N, 1, 8, 8]); every row is used")
    a.add_argument("--targets", type=user_file, default=None,
                   help="evaluation targets .npy [N] (with --inputs; classification: ints)")
    a.add_argument("--calib-inputs", type=user_file, default=None,
                   help="calibration inputs .npy [N, ...] (with --inputs)")
    a.add_argument("--calib-targets", type=user_file, default=None,
                   help="calibration targets .npy [N] (optional; checked like --targets)")
    a.add_argument("--objective", choices=["token-nll", "classification"], default=None,
                   help="per-unit loss: token-nll (token ids, the default) or classification "
                        "(cross-entropy and accuracy of [N, C] logits; the default with "
                        "--inputs)")
    a.add_argument("--seq-len", type=int, default=None,
                   help="tokens per scored window (default: a run folder's training length; "
                        "a Hugging Face folder or other model: min(256, its context), which "
                        "may exceed the length it was trained at; token arrays: their width). "
                        "The length used and its source are printed and kept in audit.json")
    a.add_argument("--max-eval", type=int, default=None,
                   help="evaluation sequences, spread evenly over what the data holds "
                        "(default 64; with --inputs, every example unless given)")
    a.add_argument("--max-calib", type=int, default=None,
                   help="calibration sequences, likewise (default 64; with --calib-inputs, "
                        "every example unless given)")
    a.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                   help="load the model (and --dense) in this dtype (default: as stored)")
    a.add_argument("--device", default="cpu",
                   help="cpu or cuda (default cpu, where identity replay is bitwise exact)")
    big = a.add_argument_group("models bigger than memory (a Hugging Face folder; needs "
                               "accelerate, in fcaudit[hf])")
    big.add_argument("--device-map", default=None, choices=["auto", "balanced",
                                                            "balanced_low_0", "sequential"],
                     help="place the weights across GPUs, CPU memory and disk with "
                          "accelerate (instead of --device)")
    big.add_argument("--max-memory", default=None, metavar="DEV=SIZE,...",
                     help="budget per device for the weights, e.g. cpu=8GiB,cuda:0=70GiB "
                          "(the process needs some memory beyond the cpu budget: torch, "
                          "activations, the layer being read in from disk)")
    big.add_argument("--offload-folder", default=None, type=user_path, metavar="DIR",
                     help="folder for the weights placed on disk (new or empty; what fcaudit "
                          "writes there is removed afterwards)")
    _add_audit_options(a)


def _add_compare(sub: Any) -> None:
    c = sub.add_parser("compare", help="several audits side by side (tables and figures)",
                       description="Compare finished audits side by side: the three answers "
                                   "per model, every penalty and retention with its 95%% CI, "
                                   "per-layer profiles overlaid, routing and execution.",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=EPILOG_COMPARE)
    c.add_argument("audits", nargs="+", type=user_path, metavar="AUDIT",
                   help="audit folders written by `fcaudit audit` (at least two)")
    c.add_argument("--out", required=True, type=user_path, help="output folder")
    c.add_argument("--label", action="append", default=None, dest="labels", metavar="NAME",
                   help="name of each model, once per AUDIT in order (default: folder names)")
    c.add_argument("--allow-different-data", action="store_true",
                   help="compare audits measured on different data (reported as not paired)")


def _add_bench(sub: Any) -> None:
    b = sub.add_parser("bench", help="execution audit only: model vs dense counterpart",
                       description="Blocks executed, FLOPs per token and interleaved timing of "
                                   "--model against --dense on one batch of built-in evaluation "
                                   "text (random token ids when the model has no tokenizer).")
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


def _add_reproduce(sub: Any) -> None:
    r = sub.add_parser("reproduce", help="the paper's study: multi-seed train + audit + tables",
                       description="Train every seed of FeatureGate/Dense (and the tiny MUDD "
                                   "and SkipGate), audit each, aggregate across seeds and write "
                                   "OUT/reproduction.md, OUT/report.html and figures. Finished "
                                   "runs and audits are reused, so an interrupted study resumes.")
    r.add_argument("--preset", choices=["tiny", "paper", "trend", "vision"], default="tiny",
                   help=f"tiny: CPU scale (about {measured_minutes('reproduce_tiny')} minutes "
                        "for 3 seeds on 2 cores); paper: 76m x7 and 504m x3 seeds (GPU); "
                        "trend: FeatureGate and Dense at a ladder of sizes and training lengths, "
                        "MUDD at the tiny points (about "
                        f"{measured_minutes('reproduce_trend')} minutes for 2 seeds on 2 "
                        "cores), with OUT/points/*.json and OUT/trend.md; vision: ViT-MoE, "
                        "TokenPrune and CondConv with their dense twins on scikit-learn's "
                        "digits, audited by classification (fcaudit[vision])")
    r.add_argument("--seeds", type=int, default=None,
                   help="seeds per group (default: tiny 3; paper 7 for 76m and 3 for 504m; "
                        "trend 2)")
    r.add_argument("--out", type=user_path, default=Path("fcaudit-reproduction"))
    r.add_argument("--mudd-checkpoint", type=user_file, default=None, metavar="PATH",
                   help="also audit a local MUDDPythia-1.4B checkpoint folder")
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--bootstrap", type=int, default=1000)
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
                        "built-in evaluation and calibration plays")
    r.add_argument("--quiet", action="store_true", help="no progress output")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fcaudit",
        description="Frozen Controller Audit: do a model's controller coefficients vary, does "
                    "the frozen model depend on them staying matched to their input and token, "
                    "and does the mechanism change execution?",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Start with `fcaudit demo`; see `fcaudit COMMAND --help`.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_audit(sub)
    _add_compare(sub)
    d = sub.add_parser("demo", help=f"audit the shipped tiny FeatureGate against its Dense "
                                    f"twin (about {measured_minutes('demo')} minutes on 2 cores)",
                       description="The built-in default end to end: audit the tiny FeatureGate "
                                   "shipped with fcaudit against its Dense twin (the README's "
                                   "numbers on any machine), print a summary and write the "
                                   "reports. --train trains the pair afresh first.")
    d.add_argument("--out", type=user_path, default=Path("fcaudit-demo"))
    d.add_argument("--train", action="store_true",
                   help=f"train the two models afresh (about {measured_minutes('demo_train')} "
                        "minutes on 2 cores; another CPU or thread count trains slightly "
                        "different models, so the numbers differ from the README's)")
    d.add_argument("--seed", type=int, default=0,
                   help="the audit's seed, and with --train the training seed (the shipped "
                        "models were trained with seed 0)")
    d.add_argument("--quiet", action="store_true", help="no progress output")
    _add_bench(sub)
    _add_reproduce(sub)
    s = sub.add_parser("sites", help="list a model's controller sites (and, with --all, every "
                                     "module's output)",
                       description="List the controller sites of a model, to choose --sites.",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=EPILOG_SITES)
    s.add_argument("--model", required=True, type=user_file,
                   help="model SPEC (as for `fcaudit audit`)")
    s.add_argument("--all", action="store_true",
                   help="run one small forward pass and list every module with its output "
                        "type and shape, marking likely controllers")
    s.add_argument("--inputs", type=user_file, default=None, metavar="NPY",
                   help="probe with the first two rows of these inputs (.npy [N, ...]) for a "
                        "model that does not take token ids (default: two random token "
                        "windows; a vision run folder: two of its digits images)")
    for command in sub.choices.values():  # `--debug` also works after the command name
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show tracebacks on errors")
    return parser


def cmd_train(args: argparse.Namespace) -> None:
    from fcaudit.study.train import describe_run, train
    folder = train(args.arch, args.preset, args.seed, args.out, force=args.force,
                   steps=args.steps, progress=not args.quiet, device=args.device,
                   data=args.data)
    info = describe_run(folder)
    score = (f"eval accuracy {info['eval_accuracy']:.4f}" if "eval_accuracy" in info else
             f"eval NLL {info['eval_nll']:.4f} (unigram {info['unigram_nll']:.4f})")
    print(f"wrote {folder}: {info['arch']}/{info['preset']} seed {info['seed']}, "
          f"{info['n_params']:,} parameters, {score}, {info['train_wall_s']:.0f} s")


def _data_spec(args: argparse.Namespace) -> Any:
    from fcaudit.io.data import DataSpec
    if args.inputs is not None or args.calib_inputs is not None:
        return _array_data(args)
    for flag in ("targets", "calib_targets"):
        if getattr(args, flag) is not None:
            raise FcauditError(f"--{flag.replace('_', '-')} needs --inputs and --calib-inputs")
    counts = {k: getattr(args, k) for k in ("max_eval", "max_calib")
              if getattr(args, k) is not None}  # else DataSpec's defaults
    return DataSpec(text=args.data, calib_text=args.calib_data, tokens=args.tokens,
                    calib_tokens=args.calib_tokens, seq_len=args.seq_len, **counts)


def _array_data(args: argparse.Namespace) -> Any:
    """``--inputs`` and friends as AuditData; token options beside them are refused."""
    from fcaudit.io.data import AuditData, DataSpec, pick_rows
    from fcaudit.io.examples import load_npy
    mixed = [f for f in ("data", "calib_data", "tokens", "calib_tokens", "seq_len")
             if getattr(args, f) is not None]
    if mixed:
        raise FcauditError(f"--inputs and --{mixed[0].replace('_', '-')} both given: choose "
                           "one source (arrays of inputs, or token ids / text)")
    if args.inputs is None or args.calib_inputs is None:
        raise FcauditError("pass both --inputs (evaluation) and --calib-inputs (calibration) "
                           ".npy arrays")
    if args.objective == "token-nll":
        raise FcauditError("--objective token-nll scores token ids: give them with --tokens, "
                           "or use --objective classification with --inputs")
    DataSpec(max_eval=args.max_eval, max_calib=args.max_calib).validate()  # their bounds
    arrays = {f: load_npy(getattr(args, f), f"--{f.replace('_', '-')}")
              if getattr(args, f) is not None else None
              for f in ("inputs", "targets", "calib_inputs", "calib_targets")}
    sources: dict[str, object] = {"source": "arrays", "eval_path": str(args.inputs),
                                  "calib_path": str(args.calib_inputs)}
    for prefix, count in (("", args.max_eval), ("calib_", args.max_calib)):
        x, y = arrays[f"{prefix}inputs"], arrays[f"{prefix}targets"]
        if count is None or x.ndim == 0 or \
                (y is not None and (y.ndim == 0 or len(y) != len(x))):
            continue  # all of them; rows that disagree are refused by the examples' check
        rows, said = pick_rows(len(x), count, prefix or "eval_")
        sources.update(said)
        if len(rows) < len(x):
            arrays[f"{prefix}inputs"] = x[rows]
            if y is not None:
                arrays[f"{prefix}targets"] = y[rows]
    return AuditData(**arrays, sources=sources)


def cmd_audit(args: argparse.Namespace, argv: Sequence[str]) -> None:
    from fcaudit.engine import distributed
    from fcaudit.engine.run import as_loaded
    from fcaudit.io.placement import offload_space
    from fcaudit.io.runtime import resolve_device, resolve_dtype
    spec = _data_spec(args)
    options = _options(args)
    if args.objective is not None or args.inputs is not None:
        options = dataclasses.replace(options, objective=args.objective or "classification")
    options.validate()
    from fcaudit.io.data import DataSpec
    if isinstance(spec, DataSpec):
        spec.validate()
    place = options.placement()
    if place is not None and args.device != "cpu":
        raise FcauditError("--device-map places the weights itself: drop --device "
                           f"{args.device} (the budget --max-memory names the GPUs)")
    ranks = distributed.init(args.device)  # a no-op outside torchrun
    try:
        device = resolve_device(distributed.device_for(args.device, ranks))
        with offload_space(place, args.out):
            loaded = as_loaded(args.model, resolve_dtype(args.dtype), place)
            if place is None:
                loaded.model.to(device)
            result = _audit_loaded(loaded, args, options, spec, ranks, argv)
    finally:
        distributed.finish()
    if result is not None:
        print_summary(result, args.out)


def _audit_loaded(loaded: Any, args: argparse.Namespace, options: Any, spec: Any, ranks: Any,
                  argv: Sequence[str]) -> Any:
    from fcaudit.api import audit
    from fcaudit.report.progress import ProgressReporter
    with ProgressReporter(options.progress and ranks.main) as progress:
        return audit(loaded, args.out, sites=args.sites, data=spec, dense=args.dense,
                     blocks=args.blocks, options=options, progress=progress,
                     command=shlex.join(["fcaudit", *argv]), site_axes=args.site_axes)


def print_summary(result: Any, out: Path) -> None:
    """The audit's summary on the console. Every text in it is printed literally (no rich
    markup: site names, axes, conditions and paths may hold ``[bold]`` or ``[/]``), the
    styles set as styles."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text
    console = Console(markup=False)
    if result.identity is not None and not result.identity.exact:
        console.print(Text.assemble(("WARNING", "bold red"), f": {result.identity.note}"),
                      soft_wrap=True)
    table = Table(title=f"Frozen Controller Audit: {result.model.spec}")
    table.add_column("condition")
    objective = result.settings.get("objective", "token-nll")
    table.add_column("NLL" if objective == "token-nll" else f"loss ({objective})",
                     justify="right")
    table.add_column("delta vs correct [95% CI]", justify="right")
    from fcaudit.engine.result import condition_rows
    for row in condition_rows(result):
        accuracy = "" if row.get("accuracy") is None else f", accuracy {100 * row['accuracy']:.1f}%"
        table.add_row(row["condition"], f"{row['nll']:.4f}", f"{row['delta']:+.4f} "
                      f"[{row['ci_low']:+.4f}, {row['ci_high']:+.4f}]{accuracy}")
    for name, why in (result.not_applicable or {}).items():
        table.add_row(name, "not applicable", why)
    console.print(table)
    from fcaudit.engine.run import window_line
    console.print(render(window_line(result.data), cli=True), soft_wrap=True)
    for name, r in result.retention.items():
        value = (f"{r.value:.2f}% [{r.ci95[0]:.2f}, {r.ci95[1]:.2f}]"
                 if r.value is not None else "undefined")
        console.print(f"retention {name}: {value}")
    for key in ("variation", "dependence", "execution"):
        console.print(Text.assemble((key, "bold"), f": {getattr(result.verdict, key)}"),
                      soft_wrap=True)
    if result.stopping is not None:
        console.print(f"--target-ci: {result.stopping.reason}", soft_wrap=True)
    console.print(f"wrote {out / 'audit.json'}, {out / 'report.md'}, {out / 'report.html'}")


def cmd_compare(args: argparse.Namespace, argv: Sequence[str]) -> None:
    from fcaudit.report.compare import compare
    result = compare(args.audits, args.out, labels=args.labels,
                     allow_different_data=args.allow_different_data,
                     command=shlex.join(["fcaudit", *argv]))
    if not result.data["identical"]:
        print("fcaudit: warning: these audits were measured on different data; their numbers "
              "are not paired (the report says so first)", file=sys.stderr)
    print(f"compared {', '.join(result.labels)}: wrote {args.out / 'compare.md'}, "
          f"{args.out / 'compare.html'} and {args.out / 'compare.json'}")


def cmd_demo(args: argparse.Namespace, argv: Sequence[str]) -> None:
    from fcaudit.api import audit
    from fcaudit.engine.run import AuditOptions
    from fcaudit.io.outdir import DEMO_PARTS, check_output, hold_output
    from fcaudit.report.progress import ProgressReporter
    from fcaudit.study.demo import demo_runs
    out: Path = args.out
    check_output(out, "demo")  # refuse before minutes of training, not after
    for name, kind in DEMO_PARTS.items():
        check_output(out / name, kind)
    options = AuditOptions(seed=args.seed, progress=not args.quiet)
    options.validate()
    with hold_output(out, "demo", shlex.join(["fcaudit", *argv])):
        runs = demo_runs(out, train_afresh=args.train, seed=args.seed, progress=not args.quiet)
        with ProgressReporter(options.progress) as progress:
            result = audit(str(runs["featuregate"]), out / "audit", dense=str(runs["dense"]),
                           options=options, progress=progress,
                           command=shlex.join(["fcaudit", *argv]))
    print_summary(result, out / "audit")


def _study_rows(given: int | None, preset: str) -> int | None:
    """``--max-eval`` / ``--max-calib``: as given; else 64, or every image for vision."""
    return given if given is not None else None if preset == "vision" else 64


def cmd_reproduce(args: argparse.Namespace, argv: Sequence[str]) -> None:
    from fcaudit.study.reproduce import StudySettings, reproduce, study_options
    if args.seeds is not None and args.seeds < 1:
        raise FcauditError(f"--seeds {args.seeds}: must be at least 1")
    if args.steps is not None and args.steps < 1:
        raise FcauditError(f"--steps {args.steps}: must be at least 1")
    options = study_options(repeats=args.repeats, bootstrap=args.bootstrap,
                            progress=not args.quiet)
    options.validate()
    result = reproduce(args.preset, args.out, seeds=args.seeds,
                       mudd_checkpoint=args.mudd_checkpoint,
                       settings=StudySettings(options, steps=args.steps,
                                              max_eval=_study_rows(args.max_eval, args.preset),
                                              max_calib=_study_rows(args.max_calib, args.preset),
                                              train_data=args.train_data),
                       command=shlex.join(["fcaudit", *argv]))
    for finding, verdict in result["findings"]:
        print(f"- {finding}: {verdict}")
    print(f"wrote {args.out / 'reproduction.md'} and {args.out / 'report.html'}")
    if args.preset == "trend":
        from fcaudit.study.trend import POINTS
        print(f"wrote {args.out / 'trend.md'} from the point summaries in {args.out / POINTS}")


def _bench_ids(loaded: Any, args: argparse.Namespace) -> Any:
    """One batch of built-in evaluation text (routing models route as in use), or random ids
    for a model without a tokenizer."""
    import torch

    from fcaudit.core.nll import model_limits
    from fcaudit.io.data import DataSpec, resolve_data
    if loaded.tokenizer is not None:
        spec = DataSpec(seq_len=args.seq_len, max_eval=args.batch_size, max_calib=1)
        ids = resolve_data(loaded.tokenizer, spec, args.seq_len, args.model).eval_ids
        if len(ids) < args.batch_size:
            raise FcauditError(f"the built-in text gives {len(ids)} windows of --seq-len "
                               f"{args.seq_len}; lower --batch-size or --seq-len")
        return torch.from_numpy(ids)
    vocab, _ = model_limits(loaded.model)
    return torch.randint(0, vocab or 2, (args.batch_size, args.seq_len),
                         generator=torch.Generator().manual_seed(args.seed))


BENCH_SCHEMA = "fcaudit.bench/1"


def _check_bench_args(args: argparse.Namespace) -> None:
    """Counts in range and a ``--json`` that names a new file or fcaudit's own bench JSON."""
    from fcaudit.engine.options import MAX_SEED, MAX_TIMING_PAIRS
    from fcaudit.io.outdir import check_output_file
    for option, value, least, most in (("--batch-size", args.batch_size, 1, None),
                                       ("--seq-len", args.seq_len or 2, 2, None),
                                       ("--pairs", args.pairs, 10, MAX_TIMING_PAIRS),
                                       ("--seed", args.seed, 0, MAX_SEED)):
        if value < least or (most is not None and value > most):
            bound = f"between {least} and {most}" if most is not None else f"at least {least}"
            raise FcauditError(f"{option} {value}: must be {bound}")
    if args.json is not None:
        check_output_file(args.json, BENCH_SCHEMA, "json")


def _bench_models(args: argparse.Namespace, device: Any) -> tuple[Any, Any, Any]:
    """The loaded model and its dense counterpart, both able to run ``--seq-len`` tokens."""
    from fcaudit.core.contract import dense_twin
    from fcaudit.core.nll import model_limits
    from fcaudit.engine.run import as_loaded
    loaded = as_loaded(args.model)
    model = loaded.model.to(device)
    dense = as_loaded(args.dense).model if args.dense else dense_twin(model, args.seed)
    if dense is None:
        raise FcauditError(f"{args.model} has no built-in dense counterpart; pass --dense SPEC")
    contexts = {name: model_limits(net)[1] for name, net in (("the model", model),
                                                            ("--dense", dense))}
    if args.seq_len is None:
        args.seq_len = min([128, *(c for c in contexts.values() if c is not None)])
    for name, ctx in contexts.items():
        if ctx is not None and args.seq_len > ctx:
            raise FcauditError(f"--seq-len {args.seq_len} exceeds the context of {name} "
                               f"({ctx} tokens); use --seq-len {ctx} or less")
    return loaded, model, dense.to(device).eval()


def cmd_bench(args: argparse.Namespace) -> None:
    import dataclasses
    import json

    from fcaudit.engine.execution import check_comparable, measure_execution, refuse_idle_blocks
    from fcaudit.engine.run import resolve_block_paths
    from fcaudit.engine.verdicts import verdict_execution
    from fcaudit.io.fileio import write_json
    from fcaudit.io.runtime import resolve_device
    _check_bench_args(args)
    device = resolve_device(args.device)
    loaded, model, dense = _bench_models(args, device)
    blocks = resolve_block_paths(model, args.blocks)
    dense_blocks = resolve_block_paths(dense, args.blocks)
    if blocks is None or dense_blocks is None:
        raise FcauditError("the model (or --dense) declares no blocks; pass --blocks GLOB "
                           "(e.g. 'layers.*')")
    ids = _bench_ids(loaded, args).to(device)
    source = args.dense or "dense_counterpart (fresh weights)"
    check_comparable(model, dense, ids[:1], source)
    if args.blocks is not None:
        refuse_idle_blocks(args.blocks, ids[:args.batch_size], {
            "the model": (model, blocks), "the dense model": (dense, dense_blocks)})
    result = measure_execution(model, dense, ids, batch_size=args.batch_size, pairs=args.pairs,
                               seed=args.seed, block_paths=blocks, dense_block_paths=dense_blocks,
                               dense_source=source)
    content = {"schema": BENCH_SCHEMA, **dataclasses.asdict(result),
               "verdict": verdict_execution(result)}
    print(json.dumps(content, indent=2))
    if args.json:
        write_json(args.json, content)


def _probe_inputs(path: Path | None, loaded: Any) -> Any:
    """Two inputs for `sites --all`: from --inputs, a vision run's own digits, or None
    (token ids)."""
    import torch

    from fcaudit.io.loading import get_arch
    if path is not None:  # the audit's rules for --inputs (core/arrays.py), then two rows
        from fcaudit.core.arrays import example_tensor
        from fcaudit.io.examples import load_npy
        rows = example_tensor(load_npy(path, "--inputs"), "--inputs")
        if len(rows) == 0:
            raise FcauditError(f"--inputs {path} holds no rows (shape {list(rows.shape)}); "
                               "give examples on the first axis, [N, ...]")
        return rows[:2]
    if loaded.run_config and get_arch(loaded.run_config["arch"]).task == "vision":
        from fcaudit.io.digits import audit_data
        return torch.from_numpy(audit_data(2, 1).inputs)
    return None


def cmd_sites(args: argparse.Namespace) -> None:
    from fcaudit.core.sites import describe_modules, find_sites, probe_failure, suggested_globs
    from fcaudit.engine.run import as_loaded
    loaded = as_loaded(args.model)
    model = loaded.model
    try:
        sites = find_sites(model)
    except FcauditError:
        sites = []
    for s in sites:
        adapter = getattr(s.adapter, "name", type(s.adapter).__name__)
        print(f"{s.name}\tfamily={s.family}\tlayer={s.layer}\tadapter={adapter}")
    if not sites:
        print("no declared controller sites; name them with --sites GLOB")
    if not (args.all or not sites):
        return
    rows = describe_modules(model, {s.path for s in sites}, _probe_inputs(args.inputs, loaded))
    shown = rows if args.all else [r for r in rows if r[3].startswith("likely")]
    for path, kind, output, hint in shown:
        print(f"  {path}\t{kind}\t{output}{f'  <- {hint}' if hint else ''}")
    candidates = [path for path, _, _, hint in rows if hint.startswith("likely controller")]
    for glob in suggested_globs(candidates, [path for path, *_ in rows]):
        print(f"suggested: fcaudit audit --sites {shlex.quote(glob)} ...")
    if not args.all:
        print(f"{len(shown)} likely controllers of {len(rows)} modules; --all lists every "
              "module with its output")
    if (failure := probe_failure(rows)) is not None:
        print(failure)


COMMANDS = {"train": cmd_train, "bench": cmd_bench, "sites": cmd_sites}
WITH_ARGV = {"audit": cmd_audit, "compare": cmd_compare, "demo": cmd_demo,
             "reproduce": cmd_reproduce}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command in WITH_ARGV:
            WITH_ARGV[args.command](args, argv)
        else:
            COMMANDS[args.command](args)
    except FcauditError as exc:
        if args.debug:
            raise
        _say(f"fcaudit: error: {_one_line(exc.for_cli())}")
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        _say(f"fcaudit: interrupted; {INTERRUPTED.get(args.command, 'nothing was lost')}")
        return 130
    except Exception as exc:  # not a known user error: still one line, traceback on --debug
        if args.debug:
            raise
        _say(f"fcaudit: error: unexpected {type(exc).__name__} ({_one_line(exc)}); this is a "
             "bug in fcaudit or in the model: rerun with --debug for the traceback and report it")
        return 1
    return 0


def _say(line: str) -> None:
    """One line to stderr in a single write: the processes of a torchrun audit share the
    stream, and a line written in two parts (text, then newline) interleaves with theirs."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


INTERRUPTED = {
    "train": "no run folder was written; rerun the command to train again",
    "audit": "finished cache shards are kept: rerun the same command to resume",
    "compare": "the previous comparison, if any, is kept: rerun the same command",
    "demo": "finished runs and cache shards are kept: rerun the same command to resume",
    "reproduce": "finished runs and audits are kept: rerun the same command to resume",
}


def _one_line(exc: BaseException | str) -> str:
    """The exception's message collapsed onto one line (messages quoting other errors may
    hold newlines)."""
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
