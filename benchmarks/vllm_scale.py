"""The audit of a 100B+ MoE served by vLLM, on paper: what it records per token and how
many forward passes it makes, computed by fcaudit's own code for the published shapes of
DeepSeek-V3, Mixtral-8x7B and Qwen3-235B-A22B (docs/vllm.md, "At scale, on paper").

No such model is loaded. Two things are computed, both by the code an audit runs:

* **Storage per token.** An evaluation shard (``EvaluationShard.build``, written by
  ``CoefficientCache.write`` as every audit writes it) of a model's MoE layers, each
  router's logits ``[1, T, experts]`` in bfloat16 and in float32, is written for two
  window lengths; its tensor bytes' growth per token (the header aside) is what the
  audit keeps per evaluation token (the router logits of every MoE layer and the
  per-token NLL). A calibration shard (``batch_sums``, ``token_sums``,
  ``CalibrationShard.build``) of a batch whose tokens all have distinct ids gives the
  most a calibration token can take. Beside them, the size of
  a routing trace, from the dtypes its writer uses: vLLM's ``enable_return_routed_experts``
  (``RoutedExpertsCapturer`` in vllm/model_executor/layers/fused_moe/
  routed_experts_capturer.py of the vLLM release fcaudit's extra pins: ids only, one row
  per hidden layer, uint8 up to 256 experts, else uint16), and a trace that keeps the
  routing weights too (int32 ids and float32 weights per MoE layer, as a trainer's
  routing replay might).
* **Forward passes.** A stand-in with the model's router sites (one per MoE layer, the
  adapter vLLM's routers get, :class:`fcaudit.io.vllm.EngineRouter`; the engine's flat
  ``[B*T]`` tokens; no execution blocks and an execution note, as a served model) is
  audited with the default options and the command line's default data sizes; every
  forward pass is counted and set beside the plan the audit printed before its work
  (``runtime.plan``), and likewise for the main conditions alone (no per-layer runs, no
  expert ablation). On the engine, each pass is one scheduled step of a batch's windows.

    python benchmarks/vllm_scale.py [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from resultfile import ResultFile, add_json_option
from safetensors import safe_open
from torch import Tensor, nn

from fcaudit.api import audit
from fcaudit.core.contract import Site
from fcaudit.core.interventions import batch_sums, token_sums
from fcaudit.core.layout import TOKEN_AXES, TOKEN_LAYOUT
from fcaudit.core.routers import ROUTER_FAMILY
from fcaudit.engine.analyses.expert_importance import AUTO_ABLATION_MAX_EXPERTS
from fcaudit.engine.cache import CalibrationShard, CoefficientCache, EvaluationShard
from fcaudit.engine.inputs import DEFAULT_WINDOW
from fcaudit.engine.options import AuditOptions
from fcaudit.io.data import AuditData, DataSpec
from fcaudit.io.vllm import NOT_EXECUTED_HERE, EngineRouter


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's routing shape, as its published config.json gives it."""

    name: str
    config: str  # where the values come from
    layers: int  # num_hidden_layers
    moe_layers: int  # the layers with a router
    experts: int  # routed experts per MoE layer
    top_k: int  # num_experts_per_tok
    why: str  # how moe_layers follows from the config


SHAPES = (
    Shape("DeepSeek-V3", "deepseek-ai/DeepSeek-V3 config.json", 61, 58, 256, 8,
          "num_hidden_layers 61, first_k_dense_replace 3 (dense), n_routed_experts 256, "
          "num_experts_per_tok 8"),
    Shape("Mixtral-8x7B", "mistralai/Mixtral-8x7B-v0.1 config.json", 32, 32, 8, 2,
          "num_hidden_layers 32, every one MoE, num_local_experts 8, num_experts_per_tok 2"),
    Shape("Qwen3-235B-A22B", "Qwen/Qwen3-235B-A22B config.json", 94, 94, 128, 8,
          "num_hidden_layers 94, decoder_sparse_step 1 and no mlp_only_layers (every one "
          "MoE), num_experts 128, num_experts_per_tok 8"),
)
MILLION = 1_000_000
LENGTHS = (16, 48)  # window lengths of the two shards whose difference is measured
CALIB_BATCH = AuditOptions().batch_size  # a calibration batch: the default batch size
# a routing trace's dtypes (see the module docstring): vLLM's ids are uint8 up to this
# many experts, else uint16; a trace with weights keeps int32 ids and float32 weights
VLLM_UINT8_EXPERTS = 256
TRACE_ID, TRACE_WEIGHT = torch.int32, torch.float32


def data_bytes(path: Path) -> int:
    """A safetensors file's tensor bytes: its size less the header (an 8-byte length, then
    that many bytes of JSON, padded)."""
    with path.open("rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - header


def stored_dtypes(path: Path) -> dict[str, list[str]]:
    """The dtypes an evaluation shard holds, read back from the file: its router logits'
    (the sites') and its losses'."""
    found: dict[str, set[str]] = {"logits": set(), "nll": set()}
    with safe_open(str(path), "pt") as f:
        for key in f.keys():  # noqa: SIM118 - a safetensors handle is not iterable
            kind = "nll" if key == EvaluationShard.NLL else "logits"
            found[kind].add(str(f.get_slice(key).get_dtype()))
    return {k: sorted(v) for k, v in found.items()}


def eval_bytes_per_token(shape: Shape, dtype: torch.dtype, folder: Path) -> dict[str, Any]:
    """What an evaluation shard grows by per token: the shard of one window of each of
    :data:`LENGTHS`, every MoE layer's router logits in ``dtype``, written as the audit
    writes it; the difference over the tokens between them."""
    sizes, kinds = [], {}
    for length in LENGTHS:
        cache = CoefficientCache(folder / f"{shape.name}-{dtype}-{length}", {}, 1, 1)
        logits = {f"layers.{i}.gate": torch.zeros(1, length, shape.experts, dtype=dtype)
                  for i in range(shape.moe_layers)}
        nll = torch.zeros(1, length - 1)  # the objective's per-token losses, as recorded
        cache.write(cache.eval_name(0), EvaluationShard.build(nll, logits))
        path = cache.folder / cache.eval_name(0)
        sizes.append(data_bytes(path))
        kinds = stored_dtypes(path)
    per_token = (sizes[1] - sizes[0]) / (LENGTHS[1] - LENGTHS[0])
    logits_bytes = shape.moe_layers * shape.experts * dtype.itemsize
    return {"bytes_per_token": per_token, "logits_bytes_per_token": logits_bytes,
            "nll_bytes_per_token": per_token - logits_bytes, "stored": kinds}


def calib_bytes_per_token(shape: Shape, folder: Path) -> float:
    """The most a calibration token takes: a batch of :data:`CALIB_BATCH` windows whose
    tokens all have distinct ids (the sums per id then hold one row per token), its
    shard's growth per token between the two window lengths."""
    sizes = []
    for length in LENGTHS:
        cache = CoefficientCache(folder / f"{shape.name}-calib-{length}", {}, CALIB_BATCH, 1)
        logits = {f"layers.{i}.gate": torch.zeros(CALIB_BATCH, length, shape.experts,
                                                  dtype=torch.bfloat16)
                  for i in range(shape.moe_layers)}
        ids = torch.arange(CALIB_BATCH * length).view(CALIB_BATCH, length)
        cache.write(cache.calib_name(0), CalibrationShard.build(batch_sums(logits),
                                                                token_sums(logits, ids)))
        sizes.append(data_bytes(cache.folder / cache.calib_name(0)))
    return (sizes[1] - sizes[0]) / (CALIB_BATCH * (LENGTHS[1] - LENGTHS[0]))


def trace_bytes_per_token(shape: Shape) -> dict[str, int]:
    """A routing trace's bytes per token: vLLM's (ids, every hidden layer) and one that
    keeps the weights too (every MoE layer)."""
    vllm_id = torch.uint8 if shape.experts <= VLLM_UINT8_EXPERTS else torch.uint16
    pair = TRACE_ID.itemsize + TRACE_WEIGHT.itemsize
    return {"vllm_ids": shape.layers * shape.top_k * vllm_id.itemsize,
            "vllm_id_dtype": str(vllm_id).removeprefix("torch."),
            "ids_and_weights": shape.moe_layers * shape.top_k * pair}


# ---------------------------------------------------------------------- passes

class Router(nn.Module):
    """A vLLM router's call: the flat tokens in, ``(logits [B*T, experts], None)`` out."""

    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, experts, bias=False)

    def forward(self, h: Tensor) -> tuple[Tensor, None]:
        return self.proj(h), None


class ServedShape(nn.Module):
    """A stand-in for :class:`fcaudit.io.vllm.ServedModel` with a model's router shape:
    ids ``[B, T]`` to logits ``[B, T, V]``, the ``B*T`` tokens flat through every MoE
    layer's router (its top-k experts' weights mixed back in), the same sites and
    adapter, no execution blocks, and the served model's execution note."""

    execution_note = NOT_EXECUTED_HERE

    def __init__(self, shape: Shape, vocab: int = 64, width: int = 8) -> None:
        super().__init__()
        self.top_k = shape.top_k
        self.embed = nn.Embedding(vocab, width)
        self.gates = nn.ModuleList(Router(width, shape.experts)
                                   for _ in range(shape.moe_layers))
        self.experts = nn.ModuleList(nn.Linear(shape.experts, width)
                                     for _ in range(shape.moe_layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        rows, length = ids.shape
        h = self.embed(ids).reshape(rows * length, -1)
        for gate, experts in zip(self.gates, self.experts, strict=True):
            logits, _ = gate(h)
            top = logits.topk(self.top_k, dim=-1)
            weights = torch.zeros_like(logits).scatter(-1, top.indices,
                                                       top.values.softmax(-1))
            h = h + torch.tanh(experts(weights))
        return self.head(h).view(rows, length, -1)

    def controller_sites(self) -> list[Site]:
        return [Site(f"gates.{i}", f"gates.{i}", ROUTER_FAMILY, i,
                     EngineRouter(TopK(self.top_k)), axes=TOKEN_AXES, positions=TOKEN_LAYOUT)
                for i in range(len(self.gates))]


@dataclasses.dataclass(frozen=True)
class TopK:
    """The stand-in's routing rule, read as a served router's selection is (``chosen``: the
    experts taken for the logits routed)."""

    top_k: int

    def chosen(self, logits: Tensor) -> Tensor:
        return logits.topk(self.top_k, dim=-1).indices


def counted_audit(shape: Shape, options: AuditOptions, data: AuditData) -> dict[str, Any]:
    """One audit of the stand-in: its forward passes counted, and its plan."""
    torch.manual_seed(0)
    model = ServedShape(shape).eval()
    passes = [0]
    handle = model.register_forward_pre_hook(lambda *_: passes.__setitem__(0, passes[0] + 1))
    start = time.perf_counter()
    try:
        result = audit(model, data=data, options=options, report=False)
    finally:
        handle.remove()
    assert result is not None
    plan = result.to_json()["runtime"]["plan"]
    return {"counted_passes": passes[0], "plan_passes": plan["passes"],
            "stages": {k: v["passes"] for k, v in plan["stages"].items() if v["passes"]},
            "identity_exact": result.identity_replay_max_abs_diff == 0.0,
            "sites": len(result.sites), "wall_s": round(time.perf_counter() - start, 1)}


def passes(shape: Shape, seq_len: int) -> dict[str, Any]:
    """The default audit, and the one of the main conditions alone (``--no-per-layer
    --no-expert-ablation``), of the command line's default data sizes (DataSpec) in
    windows of ``seq_len`` tokens; each count split into what every evaluation and
    calibration batch costs, which must add up to the count."""
    spec, options = DataSpec(), AuditOptions(progress=False)
    rng = np.random.default_rng(0)
    data = AuditData(rng.integers(0, 64, (spec.max_eval, seq_len)),
                     rng.integers(0, 64, (spec.max_calib, seq_len)), {"source": "random"})
    n_eval, n_calib = (-(-n // options.batch_size) for n in (spec.max_eval, spec.max_calib))
    out: dict[str, Any] = {"eval_sequences": spec.max_eval, "calib_sequences": spec.max_calib,
                           "eval_batches": n_eval, "calib_batches": n_calib,
                           "batch_size": options.batch_size, "repeats": options.repeats,
                           "seq_len": seq_len, "default_window": DEFAULT_WINDOW}
    for name, opts in (("default", options),
                       ("main_only", dataclasses.replace(options, per_layer=False,
                                                         expert_ablation=False))):
        run = counted_audit(shape, opts, data)
        out[name] = {**run, **per_batch(shape, run, n_eval, n_calib)}
    return out


def per_batch(shape: Shape, run: dict[str, Any], n_eval: int, n_calib: int) -> dict[str, int]:
    """The count as a sum: per evaluation batch its record pass, the main replays and, per
    MoE layer, the per-layer and expert-ablation runs; per calibration batch its record
    pass; the probe's passes beyond the plan (the first batch's identity replay)."""
    stages, layers = run["stages"], shape.moe_layers
    split = {"replays_per_eval_batch": stages["replay"] / n_eval,
             "per_layer_runs_per_moe_layer": stages.get("per-layer runs", 0) / (n_eval * layers),
             "ablations_per_moe_layer": stages.get("expert ablation", 0) / (n_eval * layers),
             "record_passes": stages["record"] + 1,  # the probe records the first batch
             "probe_replays": run["counted_passes"] - run["plan_passes"] - 1,
             # the served model's execution answer: one record, then the timed pairs
             "controller_timing": stages.get("controller timing", 0)}
    assert all(float(v).is_integer() for v in split.values()), split
    split = {k: int(v) for k, v in split.items()}
    assert split["record_passes"] == n_eval + n_calib, split
    total = n_eval * (1 + split["replays_per_eval_batch"] + layers * (
        split["per_layer_runs_per_moe_layer"] + split["ablations_per_moe_layer"])) \
        + n_calib + split["probe_replays"] + split["controller_timing"]
    assert total == run["counted_passes"], (total, run)
    return split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=16,
                        help="tokens per window of the stand-in's audit (the pass counts do "
                        "not depend on it)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: the stand-in's passes are small, and "
                        "more threads only wait on each other on a busy machine)")
    add_json_option(parser, "vllm_scale")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    record = ResultFile("vllm_scale.py")
    record.start()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in SHAPES:
            row = {**dataclasses.asdict(shape),
                   "eval": {str(d).removeprefix("torch."): eval_bytes_per_token(
                       shape, d, Path(tmp)) for d in (torch.bfloat16, torch.float32)},
                   "calib_bytes_per_token_at_most": calib_bytes_per_token(shape, Path(tmp)),
                   "trace": trace_bytes_per_token(shape),
                   "passes": passes(shape, args.seq_len)}
            rows.append(row)
            p = row["passes"]
            print(f"{shape.name}: eval {row['eval']['bfloat16']['bytes_per_token']:.0f} B/token "
                  f"(bf16), calib <= {row['calib_bytes_per_token_at_most']:.0f}, trace "
                  f"{row['trace']}; passes {p['default']['counted_passes']} counted / "
                  f"{p['default']['plan_passes']} planned ({p['default']['wall_s']} s), main "
                  f"conditions alone {p['main_only']['counted_passes']} / "
                  f"{p['main_only']['plan_passes']}", flush=True)
    record.write(args.json, {"million": MILLION, "calib_batch": CALIB_BATCH,
                             "lengths": list(LENGTHS),
                             "ablation_max_experts": AUTO_ABLATION_MAX_EXPERTS,
                             "vllm_uint8_experts": VLLM_UINT8_EXPERTS, "shapes": rows})


if __name__ == "__main__":
    main()
