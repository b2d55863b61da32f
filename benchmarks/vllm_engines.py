"""The audit inside vLLM against the eager audit, per MoE family, measured side by side.

For each family (tiny random float32 folders, built with transformers, nothing
downloaded) on the same evaluation and calibration tokens, both engines audit the same
router sites and this prints:

* routers found in the engine, and whether its identity replay was exact;
* the largest difference of any condition's NLL between the two audits;
* route agreement: the share of (token, layer) expert sets equal as each engine selects
  them (HF's router returns its choice; vLLM's MoE runner is asked), split by the margin
  of the routing rule (the k-th against the (k+1)-th logit; for GLM-4-MoE's
  bias-corrected group-limited rule, the smaller of its group and expert margins):
  near-ties are where kernels may disagree;
* cross-fed: each engine replaying the other's recorded logits, the largest per-token
  NLL difference from the other's own pass (the same routing, two engines' arithmetic);
* seconds per audit in each engine (vLLM's includes starting the engine);
* in the engine, the vLLM audit's own execution answer (``execution.controller_cost``):
  prompt tokens per second with the model's own routing and with its recorded router
  logits supplied (the router's matmul skipped, as a static token-id table such as the
  ``static-layer-token`` profile would feed them), in interleaved pairs, and their
  latency ratio with its interval (on a CPU, only the ratio means anything).

Needs vLLM (its own venv: .ci/run, README):

    python benchmarks/vllm_engines.py [family ...] [--repeats N] [--tensor-parallel-size N]

With ``--tensor-parallel-size 2`` the engine runs two tensor-parallel ranks (on a CPU, one
share of the cores each): its kernels reduce in another order, so near-tie routes may flip
against the eager model's; routes at a clear margin may not.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import fcaudit
from fcaudit.engine.actions.routes import MARGIN_EDGES  # fcaudit routes' buckets
from fcaudit.engine.options import AuditOptions
from fcaudit.io.data import AuditData

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_vllm import _chosen, _config, _folder, _margin, _nll  # noqa: E402  the tests' families

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe")
OPTIONS = AuditOptions(repeats=2, bootstrap=200, progress=False, execution=False)
VOCAB = 128


def _data(n: int, length: int) -> AuditData:
    rng = np.random.default_rng(0)
    return AuditData(eval_ids=rng.integers(3, VOCAB, (n, length)).astype(np.int64),
                     calib_ids=rng.integers(3, VOCAB, (n, length)).astype(np.int64))


def _agreement(eager: dict[str, torch.Tensor], engine: dict[str, torch.Tensor],
               margins: list[torch.Tensor]) -> list[str]:
    """Share of equal expert sets (as each engine selects them) per margin bucket, as
    'equal/total'."""
    same = torch.cat([(a == b).all(-1).reshape(-1)
                      for a, b in zip(eager.values(), engine.values(), strict=True)])
    m = torch.cat([x.reshape(-1) for x in margins])
    edges = (0.0, *MARGIN_EDGES, float("inf"))
    return [f"{int(same[(m >= lo) & (m < hi)].sum())}/{int(((m >= lo) & (m < hi)).sum())}"
            for lo, hi in zip(edges, edges[1:], strict=False)]


def family_row(family: str, folder: Path, data: AuditData, repeats: int,
               tensor_parallel: int = 1) -> list[str]:
    from fcaudit.core.routers import ROUTER_FAMILY, moe_router_sites
    from fcaudit.io.hf import load_hf_folder
    from fcaudit.io.vllm import Serving, load_served
    folder = _folder(folder, family)
    x = torch.from_numpy(data.eval_ids)
    start = time.perf_counter()
    served = fcaudit.audit(str(folder), None, data=data, options=AuditOptions(
        **{**OPTIONS.__dict__, "engine": "vllm", "execution": True, "timing_pairs": repeats,
           "tensor_parallel_size": tensor_parallel}),
        report=False)
    vllm_s = time.perf_counter() - start
    model = load_hf_folder(folder)[0]
    eager_sites = [s for s in moe_router_sites(model) if s.family == ROUTER_FAMILY]
    eager_names = [s.name for s in eager_sites]
    names = [s.name for s in served.sites]
    start = time.perf_counter()
    eager = fcaudit.audit(str(folder), None, data=data, options=OPTIONS, sites=eager_names,
                          report=False)
    eager_s = time.perf_counter() - start
    ours, eager_chosen = fcaudit.record(model, x, eager_names), _chosen(model, eager_sites, x)
    loaded = load_served(str(folder), None, Serving(len(x), 0.1,
                                                    tensor_parallel=tensor_parallel))
    try:
        theirs = fcaudit.record(loaded.model, x)
        engine_chosen = _chosen(loaded.model, loaded.model.controller_sites(), x)
        engine_own = _nll(loaded.model, x)
        with fcaudit.replay(loaded.model, dict(zip(names, ours.values(), strict=True))):
            engine_fed = _nll(loaded.model, x)
    finally:
        loaded.model.close()
    with fcaudit.replay(model, dict(zip(eager_names, theirs.values(), strict=True))):
        eager_fed = _nll(model, x)
    k = int(_config(family).num_experts_per_tok)
    margins = [_margin(ours[n], k, folder, n) for n in eager_names]
    cost = served.execution.controller_cost
    nll_diff = max(abs(c.nll - eager.conditions[n].nll) for n, c in served.conditions.items())
    # each engine fed the other's routing, against the other's own pass
    cross = max(float((engine_fed - _nll(model, x)).abs().max()),
                float((eager_fed - engine_own).abs().max()))
    return [family, str(len(names)), "yes" if served.identity_replay_max_abs_diff == 0 else
            "NO", f"{nll_diff:.1e}", *_agreement(eager_chosen, engine_chosen, margins),
            f"{cross:.1e}", f"{eager_s:.1f}", f"{vllm_s:.1f}", f"{cost.own.tokens_per_s:.0f}",
            f"{cost.supplied.tokens_per_s:.0f}",
            f"{cost.ratio.value:.3f} ({cost.ratio.ci95[0]:.3f} to {cost.ratio.ci95[1]:.3f})"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help=f"any of {', '.join(FAMILIES)} (all)")
    parser.add_argument("--repeats", type=int, default=20,
                        help="timed pairs (own routing, logits supplied), at least 10")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="the engine's tensor-parallel ranks (default 1)")
    args = parser.parse_args()
    if unknown := sorted(set(args.families) - set(FAMILIES)):
        parser.error(f"unknown families {unknown}: choose from {', '.join(FAMILIES)}")
    data = _data(args.sequences, args.length)
    header = ["family", "routers", "identity exact", "max condition NLL diff",
              "routes equal, margin < 1e-4", "1e-4 to 1e-2", "> 1e-2", "cross-fed max diff",
              "eager audit s", "vLLM audit s (with timing)", "own routing tok/s",
              "logits supplied tok/s", "latency own / supplied"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families or FAMILIES:
            row = family_row(family, Path(tmp), data, args.repeats,
                             args.tensor_parallel_size)
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
