"""The ``fcaudit`` commands and :func:`main`, which runs one and turns its errors into a
line and an exit status. Nothing heavy is imported at the top, so ``--help`` and argument
errors are instant."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fcaudit.cli.actions import cmd_fold, cmd_routes, cmd_tasks, data_spec
from fcaudit.cli.parser import audit_options, build_parser, given_options
from fcaudit.core.errors import DataError, FcauditError, ModelError, UsageError, render
from fcaudit.engine.objectives import CLASSIFICATION, OBJECTIVES


def cmd_train(args: argparse.Namespace) -> None:
    from fcaudit.study.train import describe_run, train
    folder = train(args.arch, args.preset, args.seed, args.out, force=args.force,
                   steps=args.steps, progress=not args.quiet, device=args.device,
                   data=args.data, task=args.task)
    info = describe_run(folder)
    print(f"wrote {folder}: {run_words(info)}, {info['train_wall_s']:.0f} s")


def run_words(info: dict[str, Any]) -> str:
    """A trained run as `train` and `demo` print it: what it is, its size and its held-out
    score (beside the unigram floor for a language model)."""
    score = (f"eval accuracy {info['eval_accuracy']:.4f}" if "eval_accuracy" in info else
             f"eval NLL {info['eval_nll']:.4f} vs unigram {info['unigram_nll']:.4f}")
    return (f"{info['arch']}/{info['preset']} seed {info['seed']}, "
            f"{info['n_params']:,} parameters, {score}")


def _data_spec(args: argparse.Namespace) -> Any:
    if args.inputs is not None or args.calib_inputs is not None:
        return _array_data(args)
    for flag in ("targets", "calib_targets"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} needs --inputs and --calib-inputs",
                             option=flag)
    return data_spec(args)


def _array_data(args: argparse.Namespace) -> Any:
    """``--inputs`` and friends as AuditData; token options beside them are refused."""
    from fcaudit.io.data import AuditData, DataSpec, pick_rows
    from fcaudit.io.examples import load_npy
    mixed = [f for f in ("data", "calib_data", "tokens", "calib_tokens", "seq_len")
             if getattr(args, f) is not None]
    if mixed:
        raise UsageError(f"--inputs and --{mixed[0].replace('_', '-')} both given: choose "
                         "one source (arrays of inputs, or token ids / text)", option=mixed[0])
    if args.inputs is None or args.calib_inputs is None:
        raise UsageError("pass both --inputs (evaluation) and --calib-inputs (calibration) "
                         ".npy arrays",
                         option="calib_inputs" if args.inputs is not None else "inputs")
    if args.objective is not None and OBJECTIVES[args.objective].tokens:
        raise UsageError(f"--objective {args.objective} scores token ids: give them with "
                         f"--tokens, or use --objective {CLASSIFICATION} with --inputs",
                         option="objective")
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
    from fcaudit.engine import passes
    from fcaudit.engine.inputs import as_loaded, check_dense
    from fcaudit.io.loading import release
    from fcaudit.io.placement import offload_space
    from fcaudit.io.runtime import resolve_device, resolve_dtype
    options = audit_options(args)  # --objective unset: the data decide (engine/inputs.py)
    options.validate(given_options(args))  # every option before any file is read
    check_dense(args.dense, options)
    spec = _data_spec(args)  # its counts and sources checked
    place, serving = options.placement(), options.serving()
    if place is not None and args.device != "cpu":
        raise UsageError("--device-map places the weights itself: drop --device "
                         f"{args.device} (the budget --max-memory names the GPUs)",
                         option="device")
    if serving is not None and args.device != "cpu":
        raise UsageError(f"--engine {options.engine} places the model itself: drop --device "
                         f"{args.device}", option="device")
    ranks = passes.init(args.device)  # a no-op outside torchrun
    try:
        device = resolve_device(passes.device_for(args.device, ranks))
        with offload_space(place, args.out):
            loaded = as_loaded(args.model, resolve_dtype(args.dtype), place, serving)
            if place is None and serving is None:
                loaded.model.to(device)
            try:
                result = _audit_loaded(loaded, args, options, spec, ranks, argv)
            finally:  # an engine serving the model: its memory and threads
                release(loaded.model)
    finally:
        passes.finish()
    if result is not None:
        print_summary(result, args.out)


def _audit_loaded(loaded: Any, args: argparse.Namespace, options: Any, spec: Any, ranks: Any,
                  argv: Sequence[str]) -> Any:
    from fcaudit.api import ProgressReporter, audit
    from fcaudit.core.sites import find_sites
    from fcaudit.engine.options import check_needs
    try:  # the needs a model may meet (an exit model's sweep), with the flags as typed
        sites = None if options.early_exit else find_sites(loaded.model, args.sites)
    except FcauditError:
        sites = None  # the audit says what is wrong with them
    if sites is not None:
        check_needs(options, given_options(args), sites)
    with ProgressReporter(options.progress and ranks.main) as progress:
        return audit(loaded, args.out, sites=args.sites, data=spec, dense=args.dense,
                     blocks=args.blocks, options=options, progress=progress,
                     command=shlex.join(["fcaudit", *argv]), site_axes=args.site_axes)


def _share(r: Any) -> str:
    """A retention as the summary prints it: percent and interval, or undefined and why."""
    if r.value is not None:
        return f"{r.value:.2f}% [{r.ci95[0]:.2f}, {r.ci95[1]:.2f}]"
    return f"undefined ({r.reason})" if r.reason else "undefined"


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
    table.add_column(result.loss_name(), justify="right")
    table.add_column("delta vs correct [95% CI]", justify="right")
    from fcaudit.engine.result import condition_rows
    for row in condition_rows(result):
        accuracy = "" if row.get("accuracy") is None else f", accuracy {100 * row['accuracy']:.1f}%"
        table.add_row(row["condition"], f"{row['nll']:.4f}", f"{row['delta']:+.4f} "
                      f"[{row['ci_low']:+.4f}, {row['ci_high']:+.4f}]{accuracy}")
    for name, why in (result.not_applicable or {}).items():
        table.add_row(name, "not applicable", why)
    console.print(table)
    from fcaudit.api import identity_words
    console.print(f"identity replay: {identity_words(result, str, str)}", soft_wrap=True)
    from fcaudit.engine.inputs import window_line
    console.print(render(window_line(result.data), cli=True), soft_wrap=True)
    for name, r in result.retention.items():
        accuracy = "" if r.accuracy is None else f"; on accuracy {_share(r.accuracy)}"
        console.print(f"retention {name}: {_share(r)}{accuracy}", soft_wrap=True)
    for key, part in result.verdict_parts().items():  # an exit model's exits first
        console.print(Text.assemble((key, "bold"), f": {part.sentence}"), soft_wrap=True)
    if result.stopping is not None:
        console.print(f"--target-ci: {result.stopping.reason}", soft_wrap=True)
    console.print(f"wrote {out / 'audit.json'}, {out / 'report.md'}, {out / 'report.html'}")


def cmd_compare(args: argparse.Namespace, argv: Sequence[str]) -> None:
    from fcaudit.api import compare
    result = compare(args.audits, args.out, labels=args.labels,
                     allow_different_data=args.allow_different_data,
                     command=shlex.join(["fcaudit", *argv]))
    if not result.data["identical"]:
        print("fcaudit: warning: these audits were measured on different data; their numbers "
              "are not paired (the report says so first)", file=sys.stderr)
    print(f"compared {', '.join(result.labels)}: wrote {args.out / 'compare.md'}, "
          f"{args.out / 'compare.html'} and {args.out / 'compare.json'}")


def cmd_demo(args: argparse.Namespace, argv: Sequence[str]) -> None:
    from fcaudit.api import ProgressReporter, audit
    from fcaudit.engine.run import AuditOptions
    from fcaudit.io.outdir import DEMO_PARTS, check_output, hold_output
    from fcaudit.study.demo import demo_runs
    out: Path = args.out
    check_output(out, "demo")  # refuse before minutes of training, not after
    for name, kind in DEMO_PARTS.items():
        check_output(out / name, kind)
    options = AuditOptions(seed=args.seed, progress=not args.quiet)
    options.validate()
    with hold_output(out, "demo", shlex.join(["fcaudit", *argv])):
        runs = demo_runs(out, train_afresh=args.train, seed=args.seed, progress=not args.quiet)
        from fcaudit.study.train import describe_run
        for folder in runs.values():  # the models' own scores, on their held-out text
            print(f"{folder}: {run_words(describe_run(folder))}")
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
    for name in ("seeds", "steps"):
        if (value := getattr(args, name)) is not None and value < 1:
            raise UsageError(f"--{name} {value}: must be at least 1", option=name)
    given = {k: v for k in ("repeats", "bootstrap") if (v := getattr(args, k)) is not None}
    options = study_options(**given, progress=not args.quiet)
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
            raise DataError(f"the built-in text gives {len(ids)} windows of --seq-len "
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
            raise UsageError(f"{option} {value}: must be {bound}",
                             option=option[2:].replace("-", "_"))
    if args.json is not None:
        check_output_file(args.json, BENCH_SCHEMA, "json")


def _bench_models(args: argparse.Namespace, device: Any) -> tuple[Any, Any, Any]:
    """The loaded model and its dense counterpart, both able to run ``--seq-len`` tokens."""
    from fcaudit.core.contract import dense_twin
    from fcaudit.core.nll import model_limits
    from fcaudit.engine.inputs import as_loaded
    loaded = as_loaded(args.model)
    model = loaded.model.to(device)
    dense = as_loaded(args.dense).model if args.dense else dense_twin(model, args.seed)
    if dense is None:
        raise ModelError(f"{args.model} has no built-in dense counterpart; pass --dense SPEC")
    contexts = {name: model_limits(net)[1] for name, net in (("the model", model),
                                                            ("--dense", dense))}
    if args.seq_len is None:
        args.seq_len = min([128, *(c for c in contexts.values() if c is not None)])
    for name, ctx in contexts.items():
        if ctx is not None and args.seq_len > ctx:
            raise UsageError(f"--seq-len {args.seq_len} exceeds the context of {name} "
                             f"({ctx} tokens); use --seq-len {ctx} or less", option="seq_len")
    return loaded, model, dense.to(device).eval()


def cmd_bench(args: argparse.Namespace) -> None:
    import json

    from fcaudit.engine.execution import check_comparable, measure_execution, refuse_idle_blocks
    from fcaudit.engine.inputs import resolve_block_paths
    from fcaudit.engine.verdicts import verdict_execution
    from fcaudit.io.fileio import write_json
    from fcaudit.io.runtime import resolve_device
    _check_bench_args(args)
    device = resolve_device(args.device)
    loaded, model, dense = _bench_models(args, device)
    blocks = resolve_block_paths(model, args.blocks)
    dense_blocks = resolve_block_paths(dense, args.blocks, "the dense counterpart " + (
        f"--dense {args.dense}" if args.dense else "its dense_counterpart() built"))
    if blocks is None or dense_blocks is None:
        raise ModelError("the model (or --dense) declares no blocks; pass --blocks GLOB "
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
            raise DataError(f"--inputs {path} holds no rows (shape {list(rows.shape)}); "
                            "give examples on the first axis, [N, ...]", path=str(path))
        return rows[:2]
    if loaded.run_config and get_arch(loaded.run_config["arch"]).task == "vision":
        from fcaudit.io.digits import audit_data
        return torch.from_numpy(audit_data(2, 1).inputs)
    return None


def _site_fields(s: Any, kind: Any) -> list[str]:
    """A site's line: what every site has, then what only some declare (axes, the parts
    side by side in its output, a selection parameter's space, exit scores), so the
    listing shows what the audit will read, and its kind as the audit judges it."""
    fields = [s.name, f"family={s.family}", f"layer={s.layer}",
              f"adapter={getattr(s.adapter, 'name', type(s.adapter).__name__)}"]
    if kind is not None:
        fields.append(f"kind={kind.name}")
    if s.axes:
        fields.append(f"axes={','.join(s.axes)}")
    if s.selection is not None and s.selection.parts:
        fields.append("parts=" + ",".join(f"{n}:{w}" for n, w in s.selection.parts))
    if s.selection is not None:
        fields.append(f"selection={s.selection.space}")
    if s.exit is not None:
        fields.append(f"exit=continue {s.exit.go:g}, exit {s.exit.stop:g}")
    return fields


def _declared_kinds(model: Any, sites: Sequence[Any], probe: Any) -> dict[str, Any]:
    """The declared sites' kinds as the audit judges them, on the probe's inputs (two
    random token windows when none are given)."""
    import torch

    from fcaudit.core.nll import device_of, model_limits
    from fcaudit.core.sites import PROBE_TOKENS
    from fcaudit.engine.prepare import site_kinds
    from fcaudit.io.examples import ExampleBatch
    if probe is None:
        vocab, _ = model_limits(model)
        probe = torch.randint(0, vocab or 2, (2, PROBE_TOKENS), device=device_of(model))
    else:
        probe = ExampleBatch(probe, None)
    return site_kinds(model, sites, probe)


def _say_kinds(kinds: Iterable[Any]) -> None:
    """One line per kind listed: what it is and what a dense counterpart would be."""
    for k in dict.fromkeys(kinds):
        print(f"kind {k.line()}; dense counterpart: {k.twin or 'none, ' + k.no_twin}")


def cmd_sites(args: argparse.Namespace) -> None:
    from fcaudit.core.sites import (
        describe_modules,
        find_sites,
        glob_hits,
        probe_failure,
        suggested_globs,
    )
    from fcaudit.engine.inputs import as_loaded
    from fcaudit.io.runtime import untested_versions
    loaded = as_loaded(args.model)
    for line in loaded.notes:
        _say(f"fcaudit: note: {line}")
    for line in untested_versions():
        _say(f"fcaudit: warning: {line}")
    model = loaded.model
    try:
        sites = find_sites(model)
    except FcauditError:
        sites = []
    probe = _probe_inputs(args.inputs, loaded)
    kinds = _declared_kinds(model, sites, probe) if sites else {}
    for s in sites:
        print("\t".join(_site_fields(s, kinds.get(s.name))))
    if not sites:
        print("no declared controller sites; name them with --sites GLOB")
    if sites and not args.all and args.inputs is None:  # --inputs feeds the probe: it runs
        _say_kinds(kinds.values())
        return
    rows = describe_modules(model, {s.path for s in sites}, probe)
    shown = rows if args.all else [r for r in rows if r.hint.startswith("likely")]
    for r in shown:
        kind = f"; kind: {r.kind.name}" if r.kind is not None else ""
        print(f"  {r.path}\t{r.cls}\t{r.output}{f'  <- {r.hint}{kind}' if r.hint else ''}")
    candidates = {r.path: r.kind for r in rows if r.hint.startswith("likely controller")}
    for glob in suggested_globs(list(candidates), [r.path for r in rows]):
        said = next(k for p, k in candidates.items() if glob_hits([p], glob))
        print(f"suggested: fcaudit audit --sites {shlex.quote(glob)} ..." +
              (f"  ({said.name})" if said is not None else ""))
    if not args.all:
        print(f"{len(shown)} likely controllers of {len(rows)} modules; --all lists every "
              "module with its output")
    _say_kinds([*kinds.values(), *(r.kind for r in shown if r.kind)])
    if (failure := probe_failure(rows)) is not None:
        print(failure)


COMMANDS = {"train": cmd_train, "bench": cmd_bench, "sites": cmd_sites, "routes": cmd_routes,
            "fold": cmd_fold, "tasks": cmd_tasks}
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
    except (Exception, KeyboardInterrupt) as exc:
        if args.debug:
            raise
        if isinstance(exc, FcauditError):
            _say(f"fcaudit: error: {_one_line(exc.for_cli())}")
            return 2
        if isinstance(exc, KeyboardInterrupt):
            _say(f"fcaudit: interrupted; {INTERRUPTED.get(args.command, 'nothing was lost')}")
            return 130
        # not a known user error: still one line, traceback on --debug
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
    "fold": "no run folder was written; rerun the command to fold again",
    "tasks": "nothing was written; rerun the command to score the tasks again",
}


def _one_line(exc: BaseException | str) -> str:
    """The exception's message collapsed onto one line (messages quoting other errors may
    hold newlines)."""
    return " ".join(str(exc).split()) or type(exc).__name__

