"""What ``--target-ci`` costs and saves: sequences used and wall time against fixed audits.

For each trained tiny model and each target it runs, in one process and one after the
other: the ``--target-ci`` audit of the evaluation pool (the built-in corpus's first
``--pool`` windows, spread evenly as ``--max-eval`` picks them), the fixed audit of the
N sequences it stopped at (the first N of the pool's seeded order: the numbers must be
equal outside ``runtime``/``stopping``, and the script checks it), and once per model the
fixed audit of the whole pool. Execution (timing) is off: it runs once at the end either
way and would only add noise.

    python benchmarks/target_ci.py --runs /tmp/study-h/runs
    python benchmarks/target_ci.py --runs RUNS --targets featuregate-tiny-s0=0.05,0.015
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from resultfile import ResultFile, add_json_option

from fcaudit.engine.inputs import as_loaded, loaded_seq_len
from fcaudit.engine.result import AuditResult
from fcaudit.engine.run import AuditOptions, AuditRequest, audit, prefix_data, prepare
from fcaudit.io.data import AuditData, DataSpec

STRIPPED = ("stopping",)


def comparable(result: AuditResult) -> dict[str, Any]:
    """audit.json without its nondeterministic keys and the stopping section."""
    out = json.loads(json.dumps(result.to_json()))
    for dotted in [*out["nondeterministic_keys"], *STRIPPED]:
        *parents, leaf = dotted.split(".")
        node = out
        for key in parents:
            node = node.get(key, {})
        node.pop(leaf, None)
    return out


def timed(model: Any, out: Path, data: AuditData, options: AuditOptions
          ) -> tuple[AuditResult, float]:
    started = time.perf_counter()
    result = audit(AuditRequest(model, out, data=data, options=options))
    assert result is not None
    return result, time.perf_counter() - started


def pool_of(model: Any, pool: int, calib: int, options: AuditOptions) -> AuditData:
    """The pool as a fixed audit resolves it (with its sources), before any ordering."""
    setup = prepare(AuditRequest(model, data=DataSpec(max_eval=pool, max_calib=calib),
                                 options=options))
    return setup.data


def measure(folder: Path, targets: list[float], pool: int, calib: int, floor: int,
            options: AuditOptions, work: Path) -> dict[str, Any]:
    model = as_loaded(str(folder))
    data = pool_of(model, pool, calib, options)
    full, full_s = timed(model, work / f"{folder.name}-full", data, options)
    rows = []
    for target in targets:
        ci_opts = dataclasses.replace(options, target_ci=target, min_sequences=floor)
        r, ci_s = timed(model, work / f"{folder.name}-ci-{target}", data, ci_opts)
        s = r.stopping
        assert s is not None
        n = s.sequences_used
        fixed, fixed_s = timed(model, work / f"{folder.name}-fixed-{target}",
                               prefix_data(data, n, options.seed), options)
        rows.append({"target": target, "sequences_used": n, "rounds": len(s.rounds),
                     "round_sizes": [x.sequences for x in s.rounds], "reached": s.reached,
                     "widest": s.rounds[-1].widest,
                     "widest_half_width": s.rounds[-1].half_widths[s.rounds[-1].widest],
                     "replay_passes_total": s.replay_passes_total,
                     "replay_passes_fixed": s.replay_passes_fixed,
                     "runs_reused": sum(c["runs_reused"] for c in r.runtime.rounds or []),
                     "target_ci_s": round(ci_s, 2), "fixed_n_s": round(fixed_s, 2),
                     "equal_to_fixed_n": comparable(r) == comparable(fixed)})
        print(json.dumps(rows[-1]), flush=True)
    widths = {c: max(v.delta - v.ci95[0], v.ci95[1] - v.delta)
              for c, v in full.conditions.items() if c not in ("original", "correct")}
    return {"model": folder.name, "seq_len": loaded_seq_len(model)[0], "pool": len(data.eval_ids),
            "full_pool_s": round(full_s, 2), "full_pool_widest": max(widths.values()),
            "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, required=True, help="folder of trained tiny runs")
    parser.add_argument("--targets", nargs="+", type=model_targets,
                        default=[("featuregate-tiny-s0", [0.05, 0.015]),
                                 ("moe-tiny-s0", [0.1])], metavar="MODEL=T[,T...]",
                        help="run folder names under --runs and their targets in nats")
    parser.add_argument("--pool", type=int, default=32)
    parser.add_argument("--calib", type=int, default=32)
    parser.add_argument("--min-sequences", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--expert-ablation", action=argparse.BooleanOptionalAction,
                        default=False, help="also ablate every expert (layers x experts runs)")
    add_json_option(parser, "target_ci")
    args = parser.parse_args()
    options = AuditOptions(repeats=args.repeats, execution=False, progress=False,
                           expert_ablation=args.expert_ablation)
    record = ResultFile("target_ci.py")
    record.start()
    settings = {"repeats": args.repeats, "bootstrap": options.bootstrap,
                "batch_size": options.batch_size, "min_sequences": args.min_sequences,
                "calib": args.calib, "expert_ablation": args.expert_ablation}
    models: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fcaudit-target-ci-") as tmp:
        for name, targets in args.targets:  # the file is rewritten after every model
            models.append(measure(args.runs / name, targets, args.pool, args.calib,
                                  args.min_sequences, options, Path(tmp)))
            record.write(args.json, {"options": settings, "models": models})


def model_targets(text: str) -> tuple[str, list[float]]:
    name, _, targets = text.partition("=")
    return name, [float(t) for t in targets.split(",")]


if __name__ == "__main__":
    main()
