"""The Frozen Controller Audit end to end: data -> record -> cache -> replay -> measure.

``run_audit`` records every site's coefficients along unperturbed passes (into the
on-disk cache), estimates static profiles from calibration data only, replays the
frozen model under every SPEC condition with the controllers replaced by stubs,
and returns the ``audit.json`` content (also written to ``out``, with the report).
"""

from __future__ import annotations

import dataclasses
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import __version__
from .cache import CoefficientCache
from .contract import Site
from .data import (
    AuditData,
    builtin_documents,
    builtin_split_record,
    cut_windows,
    encode_documents,
    load_token_array,
    spread_pick,
    text_documents,
)
from .errors import FcauditError
from .fileio import write_json
from .interventions import (
    MAIN_CONDITIONS,
    RANDOM_CONDITIONS,
    STATIC_CONDITIONS,
    RandomDraw,
    StaticProfiles,
    draw,
    shuffle_positions,
    static_tensor,
)
from .loading import LoadedModel, load
from .metrics import (
    VarianceAccumulator,
    bootstrap_indices,
    interaction,
    penalty,
    retention,
)
from .progress import progress_bar
from .record import recording
from .replay import replaying
from .sites import find_sites as resolve_sites
from .sites import match_modules

SCHEMA = "fcaudit.audit/1"
# ``runtime`` holds host facts and wall times; ``command`` names the output folder; the
# timing part of ``execution`` is measured wall-clock time (``verdict.execution`` quotes it
# when measured).
NONDETERMINISTIC_KEYS = ["runtime", "command", "execution.timing",
                         "execution.speed_ratio_vs_dense"]


@dataclass(frozen=True)
class AuditOptions:
    """Knobs of one audit; every one is recorded in ``audit.json``."""

    repeats: int = 3  # K seeds per random condition
    seed: int = 0
    bootstrap: int = 1000
    batch_size: int = 8
    per_layer: bool = True
    execution: bool = True
    timing_pairs: int = 10
    progress: bool = True


# ----------------------------------------------------------------------------- data

def model_limits(model: nn.Module) -> tuple[int | None, int | None]:
    """(vocabulary size, maximum context) when the model states them."""
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    ctx = getattr(cfg, "block_size", None)
    if vocab is None:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        vocab = emb.num_embeddings if emb is not None else None
    return vocab, ctx


@torch.no_grad()
def probe_vocab(model: nn.Module, seq_len: int) -> int | None:
    """The vocabulary size read off the logits of one all-zero sequence, for a model that
    states none (token ids at or above it cannot be scored); None if the probe fails."""
    try:
        x = torch.zeros(1, seq_len, dtype=torch.long, device=device_of(model))
        return int(logits_of(model(x)).shape[-1])
    except Exception:  # the real pass reports its own error
        return None


def default_seq_len(loaded: LoadedModel) -> int:
    train_cfg = (loaded.run_config or {}).get("train")
    if isinstance(train_cfg, dict) and isinstance(train_cfg.get("seq_len"), int):
        return int(train_cfg["seq_len"])
    _, ctx = model_limits(loaded.model)
    return min(256, ctx) if ctx else 256


def resolve_data(loaded: LoadedModel, *, data: str | Path | None = None,
                 calib_data: str | Path | None = None, tokens: str | Path | None = None,
                 calib_tokens: str | Path | None = None, seq_len: int | None = None,
                 max_eval: int | None = 64, max_calib: int | None = 64) -> AuditData:
    """Evaluation and calibration windows from token arrays, user text or the built-in corpus.

    Without ``calib_data``, user text is split into two contiguous halves of its
    windows: the first half calibrates, the second is evaluated.
    """
    if max_eval is not None and max_eval < 2 or max_calib is not None and max_calib < 1:
        raise FcauditError(f"--max-eval {max_eval} / --max-calib {max_calib}: the audit needs "
                           "at least 2 evaluation and 1 calibration sequence")
    if tokens is not None or calib_tokens is not None:
        if tokens is None or calib_tokens is None:
            raise FcauditError("pass both --tokens (evaluation) and --calib-tokens "
                               "(calibration) integer .npy arrays")
        ev = load_token_array(tokens, "evaluation tokens")
        ca = load_token_array(calib_tokens, "calibration tokens")
        if seq_len is not None and seq_len != ev.shape[1]:
            raise FcauditError(f"--seq-len {seq_len} does not match the {ev.shape[1]}-token "
                               f"sequences of {tokens}; drop --seq-len (token arrays set it) "
                               "or re-cut the arrays")
        ev, ca = ev[spread_pick(len(ev), max_eval)], ca[spread_pick(len(ca), max_calib)]
        return AuditData(ev, ca, {"source": "tokens", "eval_path": str(tokens),
                                  "calib_path": str(calib_tokens)})
    if loaded.tokenizer is None:
        raise FcauditError(f"{loaded.spec} has no tokenizer.json; pass pre-tokenized integer "
                           "arrays with --tokens and --calib-tokens")
    T = seq_len or default_seq_len(loaded)
    if data is not None:
        windows = cut_windows(encode_documents(loaded.tokenizer, text_documents(data)), T)
        if calib_data is not None:
            ev = windows
            ca = cut_windows(encode_documents(loaded.tokenizer, text_documents(calib_data)), T)
            sources = {"source": "text", "eval_path": str(data), "calib_path": str(calib_data)}
        else:
            half = (len(windows) + 1) // 2
            ca, ev = windows[:half], windows[half:]
            sources = {"source": "text", "eval_path": str(data), "calib_path": str(data),
                       "split": "contiguous halves of --data windows: first half calibrates"}
    else:
        ev = cut_windows(encode_documents(loaded.tokenizer, builtin_documents("eval")), T)
        ca = cut_windows(encode_documents(loaded.tokenizer, builtin_documents("calib")), T)
        sources = {"source": "builtin", **builtin_split_record()}
    ev, ca = ev[spread_pick(len(ev), max_eval)], ca[spread_pick(len(ca), max_calib)]
    return AuditData(ev, ca, sources)


# --------------------------------------------------------------------------- passes

def logits_of(output: Any) -> torch.Tensor:
    """Models return logits or an object with ``.logits`` (e.g. Hugging Face outputs)."""
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise FcauditError("the model must map input_ids [B, T] to logits [B, T, V] (or an "
                           f"object with .logits); got {type(output).__name__}")
    return logits


def token_nll(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Per-token next-token NLL ``[B, T-1]`` in float32 (positions 1..T-1)."""
    logits = logits_of(model(ids))[:, :-1].float()
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")


def batches(ids: np.ndarray, batch_size: int,
            device: torch.device | str = "cpu") -> Iterator[tuple[int, torch.Tensor]]:
    for b, start in enumerate(range(0, len(ids), batch_size)):
        yield b, torch.from_numpy(np.ascontiguousarray(ids[start:start + batch_size])).to(device)


def device_of(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _finite_check(site_values: dict[str, torch.Tensor], where: str) -> None:
    bad = {k: int((~torch.isfinite(v)).sum()) for k, v in site_values.items()
           if not torch.isfinite(v).all()}
    if bad:
        listing = ", ".join(f"{k} ({n} values)" for k, n in bad.items())
        raise FcauditError(f"non-finite (NaN or inf) coefficients recorded on {where} at "
                           f"{listing}; no dependence metric is computed on them: fix the "
                           "model or its weights (try float32)")


def _finite_nll(nll: torch.Tensor, where: str, b: int) -> None:
    if not torch.isfinite(nll).all():
        raise FcauditError(f"the model's NLL is not finite (NaN or inf) in {where}, batch {b} "
                           f"({int((~torch.isfinite(nll)).sum())} tokens); no metric can be "
                           "computed: check the model's weights and dtype (try float32)")


@torch.no_grad()
def record_calibration(model: nn.Module, sites: Sequence[Site], ids: np.ndarray,
                       batch_size: int, cache: CoefficientCache, bar: Any) -> StaticProfiles:
    """Static profiles from calibration data, cached so a rerun reuses them."""
    state = cache.read_extra("static.safetensors")
    if state is not None:
        return StaticProfiles.from_state(sites, state)
    profiles = StaticProfiles(sites)
    task = bar.add_task("record calibration", total=-(-len(ids) // batch_size), info="")
    for _, x in batches(ids, batch_size, device_of(model)):
        with recording(model, sites, *x.shape) as captured:
            model(x)
        _finite_check(captured, "calibration data")
        profiles.add({k: v.cpu() for k, v in captured.items()})
        bar.update(task, advance=1)
    cache.write_extra("static.safetensors", profiles.state())
    return profiles


@torch.no_grad()
def record_evaluation(model: nn.Module, sites: Sequence[Site], ids: np.ndarray,
                      cache: CoefficientCache, bar: Any) -> None:
    """One unperturbed pass per batch; resumes at the first shard not yet on disk."""
    todo = [b for b in range(cache.n_batches) if not cache.has_shard(b)]
    task = bar.add_task("record evaluation", total=cache.n_batches,
                        completed=cache.n_batches - len(todo), info="")
    for b, x in batches(ids, cache.batch_size, device_of(model)):
        if b not in todo:
            continue
        with recording(model, sites, *x.shape) as captured:
            nll = token_nll(model, x)
        _finite_check(captured, "evaluation data")
        _finite_nll(nll, "the unperturbed record pass", b)
        cache.write_shard(b, nll.cpu(), {s.name: captured[s.name].cpu() for s in sites})
        bar.update(task, advance=1)


@dataclass(frozen=True)
class Run:
    """One replay pass over the evaluation set."""

    condition: str  # main condition name
    repeat: int = 0
    site: Site | None = None  # per-layer variant: only this site is intervened

    @property
    def key(self) -> str:
        return self.condition if self.site is None else f"{self.condition}@{self.site.name}"


def feed(run: Run, b: int, rows: range, cache: CoefficientCache, sites: Sequence[Site],
         profiles: StaticProfiles, rand: RandomDraw | None) -> dict[Site, torch.Tensor]:
    """The coefficient tensors every site receives for batch ``b`` under ``run``."""
    correct = {s: cache.batch(b, f"site::{s.name}") for s in sites}
    targets = [run.site] if run.site is not None else list(sites)
    fed = dict(correct)
    for site in targets:
        x = correct[site]
        if run.condition in ("reassign", "reassign+shuffle"):
            assert rand is not None
            x = cache.rows(f"site::{site.name}", rand.donor[rows.start:rows.stop])
        if run.condition in ("shuffle", "reassign+shuffle"):
            assert rand is not None
            x = shuffle_positions(x, rand.positions[rows.start:rows.stop])
        if run.condition in STATIC_CONDITIONS:
            x = static_tensor(run.condition, site, profiles, len(rows), x)
        fed[site] = x
    return fed


@torch.no_grad()
def replay(model: nn.Module, run: Run, ids: np.ndarray, cache: CoefficientCache,
           sites: Sequence[Site], profiles: StaticProfiles, rand: RandomDraw | None,
           bar: Any, task: Any) -> tuple[np.ndarray, float]:
    """Per-sequence mean NLL under ``run``, and the max |NLL - original| per token."""
    seq_nll = np.empty(len(ids), dtype=np.float64)
    max_diff = 0.0
    device = device_of(model)
    for b, x in batches(ids, cache.batch_size, device):
        rows = cache.batch_range(b)
        fed = {s: t.to(device) for s, t in feed(run, b, rows, cache, sites, profiles,
                                                 rand).items()}
        with replaying(model, fed):
            nll = token_nll(model, x).cpu()
        _finite_nll(nll, f"replay under {run.key}", b)
        seq_nll[rows.start:rows.stop] = nll.double().mean(1).numpy()
        if run.condition == "correct":
            max_diff = max(max_diff, float((nll - cache.batch(b, "nll")).abs().max()))
        bar.update(task, advance=1)
    return seq_nll, max_diff


def plan_runs(sites: Sequence[Site], repeats: int, per_layer: bool) -> list[Run]:
    runs = [Run("correct")]
    runs += [Run(c, k) for k in range(repeats) for c in RANDOM_CONDITIONS]
    runs += [Run(c) for c in STATIC_CONDITIONS]
    if per_layer:
        for site in sites:
            runs += [Run("reassign", k, site) for k in range(repeats)]
            runs.append(Run("static-layer", 0, site))
    return runs


# -------------------------------------------------------------------------- verdicts

def variation_verdict(variance: dict[str, Any], variation: dict[str, Any]) -> str:
    parts = []
    for family, v in variation.items():
        eta = variance[family]
        varies = v["mean_sd_across_inputs"] > 1e-6 or v["mean_sd_across_positions"] > 1e-6
        parts.append(
            f"{family}: coefficients {'vary' if varies else 'do not vary'} (sd across inputs "
            f"{v['mean_sd_across_inputs']:.3g}, across positions "
            f"{v['mean_sd_across_positions']:.3g}, across layers {v['across_layer_sd']:.3g}); "
            f"layer identity explains "
            f"{100 * eta['eta2_layer']:.1f}% of their variance, input and token content "
            f"{100 * eta['eta2_residual']:.1f}%")
    return "; ".join(parts) + "."


def dependence_verdict(conditions: dict[str, Any], ret: dict[str, Any]) -> str:
    """Strong if reassign/shuffle clearly cost > 0.1 nats or a static profile keeps < 50%;
    weak if the static per-layer profile keeps >= 90% and both penalties stay < 0.05 nats."""
    r, s = conditions["reassign"], conditions["shuffle"]
    sl = ret["static-layer"]
    worst_lo = max(r["ci95"][0], s["ci95"][0])
    worst = max(r["delta"], s["delta"])
    kept = sl["value"]
    if worst_lo > 0.1 or (kept is not None and kept < 50):
        label = "Strong dependence on the coefficient assignment"
    elif kept is not None and kept >= 90 and worst < 0.05:
        label = "Weak dependence on the coefficient assignment"
    else:
        label = "Partial dependence on the coefficient assignment"
    kept_txt = (f"a static per-layer profile keeps {kept:.2f}% [{sl['ci95'][0]:.2f}, "
                f"{sl['ci95'][1]:.2f}] of the Correct-to-GlobalMean gap" if kept is not None
                else "static-profile retention is undefined (no clear Correct-to-GlobalMean gap)")
    return (f"{label}: reassigning coefficients across inputs costs {r['delta']:+.4f} nats "
            f"[{r['ci95'][0]:+.4f}, {r['ci95'][1]:+.4f}], shuffling them across tokens "
            f"{s['delta']:+.4f} [{s['ci95'][0]:+.4f}, {s['ci95'][1]:+.4f}]; {kept_txt}.")


# ----------------------------------------------------------------------------- audit

def _as_loaded(model: str | nn.Module | LoadedModel) -> LoadedModel:
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, nn.Module):
        model.eval()
        return LoadedModel(model, type(model).__name__, "module")
    return load(str(model))


def _versions() -> dict[str, str]:
    import safetensors
    import tokenizers
    return {"fcaudit": __version__, "torch": torch.__version__, "numpy": np.__version__,
            "safetensors": safetensors.__version__, "tokenizers": tokenizers.__version__,
            "python": platform.python_version()}


def _block_paths(model: nn.Module, pattern: str | None) -> list[str] | None:
    if pattern is not None:
        return match_modules(model, pattern, "--blocks", "blocks.*")
    declared = getattr(model, "execution_blocks", None)
    return list(declared()) if callable(declared) else None


def _execution(loaded: LoadedModel, dense: str | nn.Module | None, ids: np.ndarray,
               opts: AuditOptions, blocks: str | None) -> dict[str, Any]:
    from .execution import measure_execution, verdict_execution
    model = loaded.model
    if dense is None:
        make = getattr(model, "dense_counterpart", None)
        if not callable(make):
            return {"measured": False, "reason": "no dense counterpart: pass --dense SPEC"}
        torch.manual_seed(opts.seed)
        dense_model = make()
        dense_source = "built from the model's architecture (dense_counterpart, fresh weights)"
    else:
        dense_model = _as_loaded(dense).model
        dense_source = str(dense)
    model_blocks = _block_paths(model, blocks)
    dense_blocks = _block_paths(dense_model, blocks)
    if model_blocks is None or dense_blocks is None:
        return {"measured": False, "reason": "the model does not declare its blocks: pass "
                                             "--blocks GLOB (e.g. 'layers.*')"}
    param = next(model.parameters(), None)
    if param is not None:
        dense_model = dense_model.to(dtype=param.dtype, device=param.device)
    dense_model.eval()
    x = torch.from_numpy(np.ascontiguousarray(ids)).to(device_of(model))
    result = measure_execution(
        model, dense_model, x, batch_size=opts.batch_size, block_paths=model_blocks,
        dense_block_paths=dense_blocks, pairs=opts.timing_pairs, seed=opts.seed,
        timing=opts.timing_pairs > 0)
    result = {"measured": True, "dense": dense_source, **result}
    result["verdict"] = verdict_execution(result)
    return result


def run_audit(model: str | nn.Module | LoadedModel, out: str | Path, *,
              sites: Sequence[str] | None = None, dense: str | nn.Module | None = None,
              data: AuditData | None = None, text: str | Path | None = None,
              calib_text: str | Path | None = None, tokens: str | Path | None = None,
              calib_tokens: str | Path | None = None, seq_len: int | None = None,
              max_eval: int | None = 64, max_calib: int | None = 64,
              options: AuditOptions | None = None, command: str | None = None,
              blocks: str | None = None, write_report: bool = True) -> dict[str, Any]:
    """Run the whole audit; write ``out/audit.json`` (and the report); return its content."""
    opts = options or AuditOptions()
    if opts.repeats < 1 or opts.bootstrap < 10 or opts.batch_size < 1:
        raise FcauditError("--repeats and --batch-size must be >= 1 and --bootstrap >= 10")
    if 0 < opts.timing_pairs < 10:
        raise FcauditError(f"--timing-pairs {opts.timing_pairs}: use 0 (no timing) or at "
                           "least 10 pairs for a meaningful interval")
    started = time.perf_counter()
    loaded = _as_loaded(model)
    net = loaded.model
    site_list = resolve_sites(net, sites)
    if blocks is not None and opts.execution:
        _block_paths(net, blocks)  # a wrong --blocks glob fails now, not after the replays
    if data is None:
        data = resolve_data(loaded, data=text, calib_data=calib_text, tokens=tokens,
                            calib_tokens=calib_tokens, seq_len=seq_len, max_eval=max_eval,
                            max_calib=max_calib)
    vocab, ctx = model_limits(net)
    if vocab is None:
        vocab = probe_vocab(net, data.eval_ids.shape[1])
    data.validate(vocab, ctx)
    out = Path(out)
    param = next(net.parameters(), None)
    dtype = str(param.dtype) if param is not None else "unknown"
    identity = {"model": loaded.weights_fingerprint or loaded.spec, "model_class":
                type(net).__name__, "eval_data": data.summary()["eval_fingerprint"],
                "calib_data": data.summary()["calib_fingerprint"], "dtype": dtype,
                "sites": [s.name for s in site_list], "fcaudit": __version__,
                "torch": torch.__version__}
    if loaded.kind == "factory":  # the code, not only the weights, defines the model
        identity["model_spec"] = loaded.spec
    cache = CoefficientCache(out / "cache", identity, opts.batch_size, len(data.eval_ids))

    timings: dict[str, float] = {}
    with progress_bar(opts.progress) as bar:
        profiles = record_calibration(net, site_list, data.calib_ids, opts.batch_size, cache, bar)
        record_evaluation(net, site_list, data.eval_ids, cache, bar)
        cache.verify_all()
        timings["record_s"] = time.perf_counter() - started

        families = sorted({s.family for s in site_list}, key=[s.family for s in site_list].index)
        acc = {f: VarianceAccumulator([s for s in site_list if s.family == f]) for f in families}
        original = np.empty(len(data.eval_ids))
        for b in range(cache.n_batches):
            coeffs = {s.name: cache.batch(b, f"site::{s.name}") for s in site_list}
            for f in families:
                acc[f].add(coeffs)
            rows = cache.batch_range(b)
            original[rows.start:rows.stop] = cache.batch(b, "nll").double().mean(1).numpy()

        N, T = data.eval_ids.shape
        seeds = [opts.seed * 1000 + 17 + k for k in range(opts.repeats)]
        draws = [draw(s, N, T) for s in seeds]
        runs = plan_runs(site_list, opts.repeats, opts.per_layer)
        task = bar.add_task("replay", total=len(runs) * cache.n_batches, info="")
        results: dict[str, list[np.ndarray]] = {}
        max_diff = 0.0
        replay_start = time.perf_counter()
        for run in runs:
            bar.update(task, info=run.key)
            rand = draws[run.repeat] if run.condition in RANDOM_CONDITIONS else None
            seq_nll, diff = replay(net, run, data.eval_ids, cache, site_list, profiles, rand,
                                   bar, task)
            results.setdefault(run.key, []).append(seq_nll)
            max_diff = max(max_diff, diff)
        timings["replay_s"] = time.perf_counter() - replay_start

    boot_seed = opts.seed * 1000 + 7
    idx = bootstrap_indices(N, opts.bootstrap, boot_seed)
    per_seq = {k: np.mean(v, axis=0) for k, v in results.items()}
    per_seq["original"] = original
    results["original"] = [original]
    correct = per_seq["correct"]

    def summarize(key: str) -> dict[str, Any]:
        return {"nll": float(per_seq[key].mean()), **penalty(per_seq[key], correct, idx),
                "repeats": [float(r.mean()) for r in results[key]],
                "repeat_deltas": [float((r - correct).mean()) for r in results[key]]}

    conditions = {c: summarize(c) for c in MAIN_CONDITIONS}
    per_layer = {c: [{"layer": s.layer, "site": s.name, "family": s.family,
                      **summarize(f"{c}@{s.name}")} for s in site_list]
                 for c in ("reassign", "static-layer")} if opts.per_layer else {}
    ret = {p: retention(per_seq[p], correct, per_seq["global-mean"], idx)
           for p in ("static-layer", "static-layer-position")}
    inter = interaction(per_seq["reassign+shuffle"], per_seq["reassign"], per_seq["shuffle"],
                        correct, idx)
    variance = {f: a.decompose() for f, a in acc.items()}
    variation = {f: a.variation() for f, a in acc.items()}
    profiles_out = {f: a.profile() for f, a in acc.items()}

    execution: dict[str, Any]
    exec_start = time.perf_counter()
    if opts.execution:
        execution = _execution(loaded, dense, data.eval_ids, opts, blocks)
    else:
        execution = {"measured": False, "reason": "disabled (--no-execution)"}
    timings["execution_s"] = time.perf_counter() - exec_start
    execution_verdict = execution.pop("verdict", None) or \
        f"Execution not measured: {execution['reason']}."

    audit: dict[str, Any] = {
        "schema": SCHEMA,
        "fcaudit_version": __version__,
        "model": {"spec": loaded.spec, "kind": loaded.kind, "class": type(net).__name__,
                  "arch": (loaded.run_config or {}).get("arch"),
                  "n_params": sum(p.numel() for p in net.parameters()),
                  "fingerprint": loaded.weights_fingerprint, "dtype": dtype},
        "data": data.summary(),
        "sites": [{"name": s.name, "family": s.family, "layer": s.layer,
                   "trailing_shape": list(cache.batch(0, f"site::{s.name}").shape[2:])}
                  for s in site_list],
        "identity_replay_max_abs_diff": max_diff,
        "conditions": conditions,
        "per_layer": per_layer,
        "retention": ret,
        "interaction": inter,
        "variance": variance,
        "variation": variation,
        "profiles": profiles_out,
        "execution": execution,
        "verdict": {"variation": variation_verdict(variance, variation),
                    "dependence": dependence_verdict(conditions, ret),
                    "execution": execution_verdict},
        "seeds": {"master": opts.seed, "reassign": seeds, "shuffle": seeds,
                  "bootstrap": boot_seed},
        "settings": {**dataclasses.asdict(opts), "bootstrap_resamples": opts.bootstrap,
                     "calibration_sequences_used_for_static": profiles.count,
                     "layer_index": "a site's index within its family"},
        "versions": _versions(),
        "command": command,
        # keys (dotted paths) that may differ between two runs of the same model, data,
        # seeds and settings; everything else is byte-identical (see docs/reliability.md)
        "nondeterministic_keys": NONDETERMINISTIC_KEYS + (
            ["verdict.execution"] if execution.get("timing") else []),
        "runtime": {
            "host": {"platform": platform.platform(), "python": sys.version.split()[0],
                     "torch_threads": torch.get_num_threads(), "machine": platform.machine()},
            "timings": {k: round(v, 3) for k, v in
                        {**timings, "total_s": time.perf_counter() - started}.items()},
        },
    }
    if write_report:
        from .report import write_report as render
        from .result import AuditResult
        render(AuditResult.from_json(audit), out)
    write_json(out / "audit.json", audit)  # last: an audit.json means the audit is complete
    return audit


__all__ = ["AuditOptions", "resolve_data", "run_audit"]
