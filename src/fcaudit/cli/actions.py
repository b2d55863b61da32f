"""The commands that act on an audit or a model beyond auditing it: ``fcaudit routes``
(a serving engine's routing trace against the model's own), ``fcaudit fold`` (a static
profile folded into the model, healed and timed) and ``fcaudit tasks`` (benchmark tasks
under the audit's conditions)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from fcaudit.core.errors import DataError, UsageError

ROUTES_SCHEMA = "fcaudit.routes/1"


def _own_json(path: Path | None, schema: str) -> None:
    """``path`` (``--json``, None when not given) may be written: absent, or a file this
    command wrote before (its schema); anything else is the user's, never overwritten."""
    import json
    if path is None or not path.exists():
        return
    try:
        ours = json.loads(path.read_text(encoding="utf-8")).get("schema") == schema
    except (OSError, ValueError, AttributeError):
        ours = False
    if not ours:
        raise UsageError(f"--json {path} exists and fcaudit did not write it there: choose "
                         "another file (fcaudit never overwrites what it did not write)",
                         option="json")


def cmd_routes(args: argparse.Namespace) -> None:
    import torch

    from fcaudit.core.sites import find_sites
    from fcaudit.engine.actions.routes import IDS_FIXED, route_agreement
    from fcaudit.engine.inputs import as_loaded
    from fcaudit.io.engines import VLLM
    from fcaudit.io.examples import load_npy
    from fcaudit.io.fileio import write_json
    from fcaudit.io.loading import release
    from fcaudit.io.traces import read_trace
    from fcaudit.io.vllm import Serving
    if args.batch_size < 1 or args.prompt_start < 0:
        raise UsageError("--batch-size must be at least 1 and --prompt-start at least 0",
                         option="batch_size" if args.batch_size < 1 else "prompt_start")
    if args.tensor_parallel_size < 1 or (args.tensor_parallel_size > 1
                                         and args.engine != VLLM):
        raise UsageError("--tensor-parallel-size: at least 1, and above 1 only with --engine "
                         "vllm (the eager pass runs in this process)",
                         option="tensor_parallel_size")
    _own_json(args.json, ROUTES_SCHEMA)
    ids = load_npy(args.tokens, "--tokens")
    if ids.ndim != 2 or ids.dtype.kind not in "iu" or ids.size == 0:
        raise DataError(f"--tokens {args.tokens}: {ids.dtype} {list(ids.shape)}; give the "
                        "prompts' token ids as integers [requests, tokens]",
                        path=str(args.tokens))
    trace = read_trace(Path(args.trace))  # before the model: a bad trace costs nothing
    loaded = as_loaded(args.model, serving=Serving(
        args.batch_size, tensor_parallel=args.tensor_parallel_size)
        if args.engine == VLLM else None)
    try:
        found = route_agreement(loaded.model, find_sites(loaded.model),
                                torch.from_numpy(ids.astype("int64")), trace,
                                args.batch_size, args.prompt_start)
    finally:
        release(loaded.model)
    print(f"{found.equal:,} of {found.compared:,} (token, layer) expert sets agree "
          f"({found.equal / max(found.compared, 1):.2%}); {found.missing:,} rows the trace "
          f"left unfilled; top-{found.top_k} over {len(found.layers)} routers")
    print("| top-k margin | compared | agree |\n|---|---:|---:|")
    for b in found.by_margin:
        span = f"[{b.low:g}, {b.high:g})" if b.high is not None else f">= {b.low:g}"
        share = f"{b.equal / b.compared:.2%}" if b.compared else "n/a"
        print(f"| {span} | {b.compared:,} | {b.equal:,} ({share}) |")
    print(f"margin: {found.margin_definition}")
    fixed = found.ids_fixed
    if fixed is None:
        print(f"{IDS_FIXED}: not run ({found.ids_fixed_not_run})")
    else:
        lo, hi = fixed.delta_ci
        print(f"{IDS_FIXED}: NLL {fixed.nll_ids_fixed:.4f} against {fixed.nll_own:.4f} on the "
              f"model's own routes, {fixed.delta:+.4f} [{lo:+.4f}, {hi:+.4f}] over "
              f"{fixed.windows} windows; {fixed.contract}")
    if args.json is not None:
        write_json(args.json, {"schema": ROUTES_SCHEMA, **dataclasses.asdict(found)})


def cmd_fold(args: argparse.Namespace) -> None:
    from fcaudit.engine.actions.fold import SCHEMA, fold
    from fcaudit.engine.actions.reopen import read_audit
    from fcaudit.io.fileio import write_json
    _own_json(args.json, SCHEMA)
    if args.heal_steps is None and (args.heal_data or args.heal_out or args.heal_params):
        raise UsageError("--heal-data, --heal-params and --heal-out are read only with "
                         "--heal-steps N", option="heal_steps")
    if args.heal_out is not None:
        if args.heal_out.resolve() == args.out.resolve():
            raise UsageError("--heal-out must differ from --out (the folded model is kept "
                             "beside the healed one)", option="heal_out")
        from fcaudit.io.runs import check_run_out
        check_run_out(args.heal_out, args.force)  # before the fold writes anything
    spec = data_spec(args)
    from fcaudit.study.heal import check_heal, check_params
    if args.heal_steps is not None:  # what healing would refuse: before the fold writes
        check_heal(args.model or read_audit(args.audit).model.spec, args.heal_steps,
                   args.heal_data)
    globs = args.heal_params
    done = fold(args.audit, args.profile, args.out, model=args.model, data=spec,
                timing_pairs=args.timing_pairs, force=args.force,
                progress=None if args.quiet else _fold_progress,
                accept=None if globs is None else lambda folded: check_params(folded, globs))
    e = done.exactness
    print(f"folded {done.profile} into {done.source}: {args.out} ({done.arch}-shaped "
          "folder" + ("" if done.exit_depth is None else
                      f", every token stopping after {done.exit_depth} layers") + ")")
    print(f"exact: per-token losses within {e.max_abs_diff:.3g} of the replayed condition "
          f"(mean {e.mean_abs_diff:.3g}, bound {e.bound_relative:g} relative) over "
          f"{e.tokens:,} tokens; NLL {e.folded_nll:.4f}, the audit's {e.audit_nll:.4f}")
    for name, speed in (("the original", done.vs_original), ("the dense twin", done.vs_dense)):
        if speed is not None:
            lo, hi = speed.latency_ratio.ci95
            print(f"against {name}: latency {speed.latency_ratio.value:.3f} [{lo:.3f}, "
                  f"{hi:.3f}] (< 1: the folded model is faster), FLOPs "
                  f"{speed.flops_ratio:.4f}")
    healed = _heal(args, done) if args.heal_steps is not None else None
    if args.json is not None:
        write_json(args.json, {**done.to_json(),
                               "heal": None if healed is None else healed.to_json()})


def _heal(args: argparse.Namespace, done: Any) -> Any:
    from fcaudit.study.heal import heal
    healed = heal(args.out, done.source, args.heal_steps, done.eval_ids,
                  eval_targets=done.eval_targets, data=args.heal_data,
                  params=args.heal_params, out=args.heal_out, force=args.force,
                  progress=not args.quiet)
    print(f"healing trained {healed.trained['folded']:,} weights of the folded model and "
          f"{healed.trained['control']:,} of the original" +
          ("" if healed.params is None else f" (those named {', '.join(healed.params)})"))
    task = healed.curve[0].folded_accuracy is not None  # a task run: its accuracy beside
    loss = "loss" if task else "NLL"
    print(f"healing on {healed.data}\n| step | folded {loss} | original {loss} (the control, "
          "fine-tuned alike) |" + (" folded accuracy | original accuracy |" if task else "")
          + "\n|---:|---:|---:|" + ("---:|---:|" if task else ""))
    for point in healed.curve:
        print(f"| {point.step} | {point.folded_nll:.4f} | {point.original_nll:.4f} |" +
              (f" {point.folded_accuracy:.3f} | {point.original_accuracy:.3f} |" if task
               else ""))
    before, after = healed.penalty_before, healed.penalty_after
    print(f"penalty against the original: {before.value:+.4f} [{before.ci95[0]:+.4f}, "
          f"{before.ci95[1]:+.4f}] before healing, {after.value:+.4f} [{after.ci95[0]:+.4f}, "
          f"{after.ci95[1]:+.4f}] after {healed.steps} steps (against the original fine-tuned "
          "alike)" + ("" if healed.recovered is None else
                      f"; recovered {healed.recovered.value:.1%} [{healed.recovered.ci95[0]:.1%}"
                      f", {healed.recovered.ci95[1]:.1%}]"))
    return healed


def data_spec(args: argparse.Namespace) -> Any:
    """The text or token-id data options as a checked DataSpec: the audit's own (``fcaudit
    audit``), or the audit's data given again to an action on its folder."""
    from fcaudit.io.data import DataSpec
    counts = {k: getattr(args, k) for k in ("max_eval", "max_calib")
              if getattr(args, k) is not None}  # else DataSpec's defaults
    spec = DataSpec(text=args.data, calib_text=args.calib_data, tokens=args.tokens,
                    calib_tokens=args.calib_tokens, seq_len=args.seq_len, **counts)
    spec.validate()
    return spec


def cmd_tasks(args: argparse.Namespace) -> None:
    from fcaudit.engine.actions.tasks import SCHEMA, evaluate_tasks
    from fcaudit.io.fileio import write_json
    _own_json(args.json, SCHEMA)
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not names:
        raise UsageError("--tasks names no task: give lm-evaluation-harness task names, "
                         "comma-separated", option="tasks")
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit {args.limit}: at least 1 example per task", option="limit")
    done = evaluate_tasks(args.audit, names, model=args.model, data=data_spec(args),
                          include_path=args.include_path, limit=args.limit,
                          progress=None if args.quiet else _fold_progress)
    print(done.markdown())
    if args.json is not None:
        write_json(args.json, done.to_json())


def _fold_progress(stage: str, done: int, total: int) -> None:
    if done == total:
        from fcaudit.cli.commands import _say  # at call time: commands imports this module
        _say(f"fcaudit: {stage}: {total}/{total}")
