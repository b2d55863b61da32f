"""Every causal-LM family of the installed transformers, random-initialised, checked for routing.

For each ``model_type`` that has a causal-LM class, builds a tiny random config generically
(the config class's defaults with the common size fields shrunk, then the few fields of
``OVERRIDES`` where a family needs them to build), builds the model with
``AutoModelForCausalLM.from_config`` (float32, eval, seeded; nothing is downloaded) and
asks fcaudit for its router sites (``fcaudit.core.discovery.declared_sites``) and expert layers
(``declared_experts``). Models without router sites are dense and only counted. For every
MoE family it checks, on a batch of 2 x 8 random tokens:

* identity: the logits under ``fcaudit.replay(model, fcaudit.record(model, ids))`` equal the
  plain forward bit for bit;
* donor: replaying sequence 1's router logits into sequence 0 (``fcaudit.reassign``) makes
  sequence 0 select exactly sequence 1's experts at every router;
* experts = top-k: the experts that ran per token (``fcaudit.core.routers.counting_experts``) are
  the router's top-k selection ("dense" when a fused experts module runs every expert on
  every token, as Llama 4's does; counted as a pass, see docs/moe.md, Execution);
* audit: the audit a user runs, ``fcaudit audit`` with every option at its default
  (expert ablation and execution included) on the model saved with ``save_pretrained``
  (``benchmarks/sweep_audit.py``): ``yes``, or the one line it failed with.

A family whose model cannot be built from the shrunk config is reported as skipped (not an
error of fcaudit). Prints a Markdown table and a summary line.

    python benchmarks/hf_moe_sweep.py [model_type ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any

import torch
import transformers
from resultfile import ResultFile, add_json_option
from sweep_audit import default_audit
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import fcaudit
from fcaudit.core.discovery import declared_experts, declared_sites
from fcaudit.core.replaying import replaying, selecting
from fcaudit.core.routers import counting_experts

VOCAB = 128
BATCH, SEQ_LEN = 2, 8
MAX_PARAMS = 300_000_000  # a shrunk config still bigger than this is skipped (too slow here)

# field -> tiny value, applied to integer fields present in a config (nested configs too)
SIZES = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2,
    "intermediate_size": 64, "ffn_hidden_size": 64, "intermediate_size_mlp": 64,
    "moe_intermediate_size": 32, "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
    "dense_intermediate_size": 64, "expert_ffn_hidden_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 16,
    "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "num_local_experts": 8, "num_experts": 8, "n_routed_experts": 8, "moe_num_experts": 8,
    "num_routed_experts": 8,
    "num_experts_per_tok": 2, "top_k": 2, "moe_topk": 2, "top_k_experts": 2, "moe_top_k": 2,
    "num_experts_per_token": 2,
    "n_group": 2, "topk_group": 1, "first_k_dense_replace": 0, "moe_layer_freq": 1,
    "decoder_sparse_step": 1, "max_position_embeddings": 256,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer")
TOP_K = ("num_experts_per_tok", "top_k", "moe_topk", "top_k_experts", "moe_top_k",
         "num_experts_per_token")
SKIP_KEYS = {"architectures", "id2label", "label2id", "task_specific_params"}

# model_type -> config fields set after the generic shrink, where it leaves a config that
# transformers cannot build or run: fields the defaults leave unset (None), sizes under other
# names than those of SIZES, and sizes that must agree with each other
MLA = {"qk_head_dim": 16, "num_key_value_heads": 4}  # latent attention: qk = nope + rope dims
OVERRIDES: dict[str, dict[str, Any]] = {
    "axk2": MLA, "deepseek_v32": MLA, "glm_moe_dsa": MLA,
    "bailing_hybrid": {**MLA, "num_expert_group": 2, "layer_group_size": 2,
                       "layer_types": ["linear_attention", "full_attention"],
                       "mlp_layer_types": ["sparse", "sparse"]},
    "dbrx": {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 256,
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "dots1": {"n_routed_experts": 8, "n_shared_experts": 1},
    "dots3_note_text": {"num_key_value_heads": 4, "shared_experts_intermediate_size": 32},
    "gemma4_text": {"num_experts": 8, "moe_intermediate_size": 32,  # as tests/test_model_hf.py
                    "per_layer_config": {}},
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16,
                         "mamba_chunk_size": 8, "shared_intermediate_size": 32},
    "hunyuan_v1_moe": {"head_dim": 16},
    "lfm2_moe": {"num_dense_layers": 1, "layer_types": ["conv", "full_attention"]},
    "longcat_flash": {**MLA, "zero_expert_num": 2},
    "qwen4_exp_text": {"hc_lowrank": 16, "indexer_n_heads": 2, "indexer_kv_heads": 1,
                       "indexer_head_dim": 16, "indexer_budget": 4, "indexer_compress_ratio": 2},
}


def kept_layers(values: dict[str, Any], layers: int, count: int) -> list[int]:
    """Which of ``layers`` layers to keep (``count``): the first, then the first of another
    kind in the per-layer lists (a hybrid keeps an attention and a linear-attention layer),
    then the next ones."""
    lists = [v for v in values.values() if isinstance(v, list) and len(v) == layers]
    other = next((i for i in range(1, layers) if any(v[i] != v[0] for v in lists)), None)
    kept = [0] + ([other] if other is not None else [])
    kept += [i for i in range(1, layers) if i not in kept]
    return sorted(kept[:count])


def shrink(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (a config's ``to_dict()``) with its size fields made tiny: integer fields of
    ``SIZES`` replaced, lists and dicts with one entry per layer cut to the kept layers, nested
    configs (``text_config``...) shrunk alike, the cache off."""
    layers = next((values[k] for k in LAYER_COUNTS if isinstance(values.get(k), int)), None)
    count = next((SIZES[k] for k in LAYER_COUNTS if isinstance(values.get(k), int)), None)
    kept = kept_layers(values, layers, count) if layers and count and layers > count else None
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key in SKIP_KEYS:
            out[key] = value
        elif isinstance(value, dict) and ("model_type" in value or
                                          any(k in value for k in SIZES)):
            out[key] = shrink(value)
        elif key in SIZES and isinstance(value, int) and not isinstance(value, bool) or \
                key in TOP_K and value is None:  # a router's k left unset by the defaults
            out[key] = SIZES[key]
        elif kept and isinstance(value, list) and len(value) == layers:
            out[key] = [value[i] for i in kept]
        elif kept and isinstance(value, dict) and value and \
                all(str(k).isdigit() for k in value):  # per-layer overrides by index
            out[key] = {type(k)(kept.index(int(k))): v for k, v in value.items()
                        if int(k) in kept}
        else:
            out[key] = value
    if isinstance(out.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = []
    if isinstance(values.get("qk_rope_head_dim"), int) and "head_dim" in values:
        out["head_dim"] = SIZES["qk_rope_head_dim"]  # multi-head latent attention: rope dim
    if values.get("enable_moe_block") is False:  # Gemma 4: the MoE block is opt-in
        out["enable_moe_block"] = True
    if "use_cache" in values:
        out["use_cache"] = False
    return out


def tiny_config(model_type: str) -> Any:
    config_class = transformers.CONFIG_MAPPING[model_type]
    values = shrink(config_class().to_dict())
    values.update(OVERRIDES.get(model_type, {}))
    values.pop("model_type", None)
    values.pop("transformers_version", None)
    return config_class(**values)


def build(model_type: str) -> torch.nn.Module:
    config = tiny_config(model_type)
    with torch.device("meta"):
        params = sum(p.numel() for p in
                     transformers.AutoModelForCausalLM.from_config(config).parameters())
    if params > MAX_PARAMS:
        raise RuntimeError(f"still {params / 1e6:.0f}M parameters after shrinking")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # routers start near zero; give them spread like a trained router
        for name, param in model.named_parameters():
            if ".gate." in name or ".router." in name:
                param.normal_(0, 0.5)
    model = model.float().eval()
    with torch.no_grad():
        model(torch.randint(3, VOCAB, (BATCH, SEQ_LEN)))  # a model that cannot run is skipped
    return model


def one_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".replace("|", "/").splitlines()
    line = text[0] if text else type(err).__name__
    return line if len(line) <= 140 else line[:137] + "..."


def yes(ok: bool) -> str:
    return "yes" if ok else "no"


def check(model: torch.nn.Module, sites: list[Any]) -> dict[str, str]:
    """The three checks on one MoE model; each cell is yes / no / error: ..."""
    routers = [s for s in sites if s.family == "router"]
    row = {"sites": str(len(routers)),
           "shared": str(sum(s.family == "shared_expert_gate" for s in sites)),
           "identity": "", "donor": "", "experts": "", "audit": "", "note": ""}
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ_LEN))
    try:
        with torch.no_grad():
            plain = model(ids).logits
            cached = fcaudit.record(model, ids, sites)
            with fcaudit.replay(model, cached, sites):
                replayed = model(ids).logits
        row["identity"] = yes(torch.equal(plain, replayed))
    except Exception as err:  # noqa: BLE001 (reported, then the next family)
        row["identity"] = f"error: {one_line(err)}"
        return row

    def routed(coefficients: dict[str, torch.Tensor], layers: list[Any]) -> tuple[Any, Any]:
        fed = {s: coefficients[s.name] for s in sites}
        with torch.no_grad(), counting_experts(model, layers) as counts, \
                replaying(model, fed) as stubs, selecting(stubs) as chosen:
            model(ids)
        return dict(chosen), counts

    try:
        layers = declared_experts(model) or []
        own, counts = routed(cached, layers)
    except Exception as err:  # noqa: BLE001
        row["donor"] = row["experts"] = f"error: {one_line(err)}"
        return row
    try:
        given, _ = routed(fcaudit.reassign(cached, donor=[1, 0]), [])
        missing = [s.name for s in routers if s.name not in given]
        if missing:
            row["donor"] = f"no (no selection at {missing[0]})"
        else:
            row["donor"] = yes(all(torch.equal(given[s.name][0], own[s.name][1])
                                   for s in routers))
            if all(torch.equal(own[s.name][0], own[s.name][1]) for s in routers):
                row["note"] = "both sequences route alike (donor check is vacuous)"
    except Exception as err:  # noqa: BLE001
        row["donor"] = f"error: {one_line(err)}"
    try:
        if not layers:
            row["experts"] = "no (no expert layers found)"
        else:
            results, dense = [], 0
            for layer in layers:
                count = counts[layer.name]
                ok = count.matches(own[layer.name])
                if not ok and not count.rows and \
                        count.experts_per_token(ids.numel()) == layer.num_experts:
                    dense += 1  # a fused module given no indices: every expert ran
                results.append(ok)
            if all(results):
                row["experts"] = "yes"
            elif dense == len(layers):
                row["experts"] = "dense"
                row["note"] = "all experts run on every token (counted as the model computes)"
            else:
                row["experts"] = f"no ({results.count(False)}/{len(layers)} layers differ)"
    except Exception as err:  # noqa: BLE001
        row["experts"] = f"error: {one_line(err)}"
    try:
        audited = default_audit(model, VOCAB, SEQ_LEN)
        row["audit"] = audited["audit"]
        if audited.get("folder", "saved") != "saved":
            row["note"] = "; ".join(filter(None, (row["note"], audited["folder"])))
    except Exception as err:  # noqa: BLE001
        row["audit"] = f"error: {one_line(err)}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", metavar="model_type", help="default: every family")
    add_json_option(parser, "hf_moe_sweep")
    args = parser.parse_args()
    record = ResultFile("hf_moe_sweep.py")
    record.start()
    start = time.perf_counter()
    names = sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t in transformers.CONFIG_MAPPING)
    if args.only:
        names = [t for t in names if t in args.only]
    rows: dict[str, dict[str, str]] = {}
    skipped: dict[str, str] = {}
    dense: list[str] = []
    for model_type in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = build(model_type)
        except BaseException as err:  # noqa: BLE001 (anything that fails to build is skipped)
            if isinstance(err, KeyboardInterrupt):
                raise
            skipped[model_type] = one_line(err)
            continue
        try:
            sites = declared_sites(model) or []
        except Exception as err:  # noqa: BLE001
            rows[model_type] = {"sites": f"error: {one_line(err)}", "shared": "",
                                "identity": "", "donor": "", "experts": "", "audit": "",
                                "note": ""}
            continue
        if not any(s.family == "router" for s in sites):
            dense.append(model_type)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows[model_type] = check(model, sites)
        del model
        print(f"  {model_type}: {rows[model_type]}", file=sys.stderr, flush=True)

    report(rows, skipped, dense, time.perf_counter() - start)
    record.write(args.json, {"transformers": transformers.__version__, "batch": BATCH,
                             "seq_len": SEQ_LEN, "rows": rows, "skipped": skipped,
                             "passed": [t for t, r in rows.items() if passes(r)],
                             "failed": [t for t, r in rows.items() if not passes(r)],
                             "dense": dense, "wall_s": time.perf_counter() - start})


def passes(row: dict[str, str]) -> bool:
    """Every check of the family passed (all experts running counts, see docs/moe.md),
    the default audit included."""
    return row["identity"] == "yes" and row["donor"] == "yes" and \
        row["experts"] in ("yes", "dense") and row["audit"] == "yes"


def report(rows: dict[str, dict[str, str]], skipped: dict[str, str], dense: list[str],
           wall: float) -> None:
    """The Markdown table and the summary line."""
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"batch {BATCH} x {SEQ_LEN} tokens\n")
    print("| family | router sites | shared gates | identity | donor | experts = top-k | "
          "default audit | note |")
    print("|---|---|---|---|---|---|---|---|")
    passed, failed = [], []
    for model_type, r in rows.items():
        print(f"| {model_type} | {r['sites']} | {r['shared']} | {r['identity']} | "
              f"{r['donor']} | {r['experts']} | {r['audit']} | {r['note']} |")
        (passed if passes(r) else failed).append(model_type)
    for model_type, reason in skipped.items():
        print(f"| {model_type} | | | | | | | skipped: {reason} |")
    print(f"\nPass: {', '.join(passed) or 'none'}")
    print(f"Fail: {', '.join(failed) or 'none'}")
    print(f"Dense ({len(dense)}): {', '.join(dense)}")
    print(f"\n{len(passed)} MoE families pass all checks, {len(failed)} fail, "
          f"{len(skipped)} skipped, {len(dense)} dense ({wall:.0f} s)")


if __name__ == "__main__":
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(2)
    main()
