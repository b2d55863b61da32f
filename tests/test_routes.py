"""A serving engine's routed-expert trace against fcaudit's recording (``fcaudit routes``,
fcaudit.engine.actions.routes, fcaudit.io.traces). The reference trace is read off the Hugging
Face router's own index output by a hook of this test, then planted with disagreements,
unfilled rows (sentinels) and completion rows; the expected counts, per margin bucket
too, are worked out here from the router's logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_inprocess

from fcaudit.core.errors import DataError, ModelError

K = 2  # the Mixtral fixture's top-k
EDGES = (0.0, 1e-4, 1e-2, float("inf"))


def _engine_trace(folder: Path, ids: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """(expert ids [N, T, L, k] from the HF routers' index outputs, their logits
    [N, T, L, E]) on one pass."""
    from fcaudit.io.hf import load_hf_folder
    model = load_hf_folder(folder)[0]
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles = [r.register_forward_hook(lambda _m, _a, out: seen.append((out[0], out[2])))
               for r in routers]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    n, t = ids.shape
    chosen = torch.stack([c.reshape(n, t, -1) for _, c in seen], dim=2)
    logits = torch.stack([lg.reshape(n, t, -1) for lg, _ in seen], dim=2)
    return chosen.numpy().astype(np.int64), logits


def _ids(n: int = 4, t: int = 12) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(0).integers(3, 64, (n, t)))


def _bucket(margin: float) -> int:
    return next(i for i in range(3) if EDGES[i] <= margin < EDGES[i + 1])


def test_agreement_counts_planted_disagreements_and_unfilled_rows(hf_mixtral: Path) -> None:
    from fcaudit.core.sites import find_sites
    from fcaudit.engine.actions.routes import route_agreement
    from fcaudit.engine.inputs import as_loaded
    ids = _ids()
    trace, logits = _engine_trace(hf_mixtral, ids)
    model = as_loaded(str(hf_mixtral)).model
    sites = find_sites(model)
    whole = route_agreement(model, sites, ids, trace, batch_size=3)
    cells = trace.shape[0] * trace.shape[1] * trace.shape[2]
    assert (whole.compared, whole.equal, whole.missing) == (cells, cells, 0)
    assert whole.equal_per_layer == [1.0] * trace.shape[2] and whole.top_k == K
    top = logits.topk(K + 1, dim=-1).values
    margin = top[..., K - 1] - top[..., K]
    planted = trace.copy()
    moved, unfilled = [(0, 0, 0), (1, 5, 1), (3, 11, 0)], [(2, 2, 1), (0, 7, 0)]
    experts = logits.shape[-1]
    for cell in moved:  # another expert set: one expert the router did not take
        other = next(e for e in range(experts) if e not in planted[cell])
        planted[cell][0] = other
    for cell in unfilled:
        planted[cell] = -1
    # completion rows after each prompt and two rows before it: not compared
    padded = np.concatenate([np.full_like(planted[:, :2], 7), planted,
                             np.full_like(planted[:, :3], 5)], axis=1)
    got = route_agreement(model, sites, ids, padded, batch_size=4, prompt_start=2)
    compared = cells - len(unfilled)
    assert (got.compared, got.equal, got.missing) == (compared, compared - len(moved),
                                                      len(unfilled))
    expected = [0, 0, 0]
    expected_equal = [0, 0, 0]
    for cell in np.ndindex(*trace.shape[:3]):
        if cell in unfilled:
            continue
        b = _bucket(float(margin[cell]))
        expected[b] += 1
        expected_equal[b] += cell not in moved
    assert [b.compared for b in got.by_margin] == expected
    assert [b.equal for b in got.by_margin] == expected_equal
    assert [(b.low, b.high) for b in got.by_margin] == [(0.0, 1e-4), (1e-4, 1e-2), (1e-2, None)]
    for layer in range(trace.shape[2]):
        n = sum(1 for c in np.ndindex(*trace.shape[:3]) if c[2] == layer and c not in unfilled)
        wrong = sum(1 for c in moved if c[2] == layer)
        assert got.equal_per_layer[layer] == pytest.approx((n - wrong) / n)


def test_a_trace_of_every_decoder_layer_is_read_at_each_router_s_layer(hf_mixtral: Path
                                                                       ) -> None:
    """vLLM's trace has a row for every decoder layer, dense ones left zero: with more layers
    than routers, each router's own layer (its path's number) is taken."""
    from fcaudit.core.sites import find_sites
    from fcaudit.engine.actions.routes import decoder_layer, route_agreement
    from fcaudit.engine.inputs import as_loaded
    ids = _ids()
    trace, _ = _engine_trace(hf_mixtral, ids)
    model = as_loaded(str(hf_mixtral)).model
    sites = find_sites(model)
    cells = trace[..., 0].size
    extra = np.concatenate([trace, np.zeros_like(trace[:, :, :1])], axis=2)  # a dense layer 2
    got = route_agreement(model, sites, ids, extra)
    assert (got.compared, got.equal) == (cells, cells)
    shifted = np.concatenate([np.zeros_like(trace[:, :, :1]), trace], axis=2)
    wrong = route_agreement(model, sites, ids, shifted)  # layer 0 read from the zero row
    assert wrong.equal < cells
    assert [decoder_layer(p) for p in ("model.layers.3.mlp.gate", "served.model.layers.12.x",
                                       "gate")] == [3, 12, None]


def test_the_command_line_prints_and_writes_the_agreement(hf_mixtral: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    ids = _ids()
    trace, _ = _engine_trace(hf_mixtral, ids)
    np.save(tmp_path / "ids.npy", ids.numpy())
    from safetensors.numpy import save_file
    save_file({"routed_experts": trace[0].astype(np.int32)}, tmp_path / "one.safetensors")
    np.save(tmp_path / "trace.npy", trace.astype(np.int16))
    argv = ["routes", "--model", str(hf_mixtral), "--tokens", str(tmp_path / "ids.npy"),
            "--trace", str(tmp_path / "trace.npy"), "--json", str(tmp_path / "a.json")]
    res = run_inprocess(argv, capsys)
    cells = trace[..., 0].size
    assert res.returncode == 0
    assert f"{cells:,} of {cells:,} (token, layer) expert sets agree" in res.stdout
    written = json.loads((tmp_path / "a.json").read_text())
    assert written["equal"] == written["compared"] == cells and written["missing"] == 0
    fixed = written["ids_fixed"]  # the model's own routes fixed: nothing moves
    assert fixed["condition"] == "ids fixed, weights recomputed" and fixed["delta"] == 0.0
    assert f"ids fixed, weights recomputed: NLL {fixed['nll_ids_fixed']:.4f} against " \
        f"{fixed['nll_own']:.4f}" in res.stdout and "not the frozen-controller" in res.stdout
    assert run_inprocess(argv, capsys).returncode == 0  # its own file: written again
    (tmp_path / "mine.json").write_text('{"my": "notes"}')
    theirs = run_inprocess([*argv[:-1], str(tmp_path / "mine.json")], capsys)
    assert theirs.returncode == 2 and "fcaudit did not write it there" in theirs.stderr
    assert (tmp_path / "mine.json").read_text() == '{"my": "notes"}'

    np.save(tmp_path / "one.npy", ids.numpy()[:1])
    one = run_inprocess(["routes", "--model", str(hf_mixtral), "--tokens",
                         str(tmp_path / "one.npy"), "--trace",
                         str(tmp_path / "one.safetensors")], capsys)
    assert one.returncode == 0 and f"{trace[0, ..., 0].size:,} of" in one.stdout


@pytest.mark.parametrize(("change", "needle"), [
    (lambda t: t[:3], "holds 3 request(s) and the tokens 4"),
    (lambda t: t[:, :5], "fewer than the prompt's 12 tokens"),
    (lambda t: t[:, :, :1], "1 layers and the model 2 routers"),
    (lambda t: t + 40, "names expert"),
    (lambda t: t[..., :1], "differ (tokens, layers, top-k)"),
    (lambda t: t.astype(np.float32), "expected integer expert ids"),
    (lambda t: t[..., 0, 0], "expected integer expert ids"),
])
def test_a_trace_that_does_not_match_is_one_line(hf_mixtral: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture, change,
                                                 needle: str) -> None:
    ids = _ids()
    trace, _ = _engine_trace(hf_mixtral, ids)
    np.save(tmp_path / "ids.npy", ids.numpy())
    np.save(tmp_path / "trace.npy", change(trace))
    res = run_inprocess(["routes", "--model", str(hf_mixtral), "--tokens",
                         str(tmp_path / "ids.npy"), "--trace", str(tmp_path / "trace.npy")],
                        capsys)
    assert res.returncode == 2 and needle in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_a_model_without_routers_is_refused(tmp_path: Path) -> None:
    from fcaudit.engine.actions.routes import route_agreement
    from fcaudit.models.featuregate import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(ModelError, match="no router site"):
        route_agreement(model, model.controller_sites(), torch.zeros(1, 8, dtype=torch.long),
                        np.zeros((1, 8, 1, 2), dtype=np.int64))
    with pytest.raises(DataError, match="expected an existing"):
        from fcaudit.io.traces import read_trace
        read_trace(tmp_path / "missing.pt")


def _rule(family: str, config: Any, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each family's weights of the experts ``ids`` from its router logits, written out here
    (the reference): Mixtral's renormalised softmax, Qwen2-MoE's softmax (not renormalised
    by default), DeepSeek-V3's sigmoid scores (no bias: the bias only selects), renormalised
    and scaled."""
    if family == "mixtral":
        w = torch.softmax(logits.float(), -1).gather(-1, ids)
        return w / w.sum(-1, keepdim=True)
    if family == "qwen2_moe":
        w = torch.softmax(logits, dtype=torch.float, dim=-1).gather(-1, ids)
        return (w / w.sum(-1, keepdim=True) if config.norm_topk_prob else w).to(logits.dtype)
    w = logits.sigmoid().gather(-1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) if config.norm_topk_prob else w
    return w * config.routed_scaling_factor


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_ids_fixed_weights_recomputed_follows_each_family_s_own_rule(
        family: str, tmp_path: Path) -> None:
    """The trace's ids fixed, weights recomputed from the live logits: the NLL equals the
    model run with a hook of this test that swaps each router's output for the planted ids
    and the family's rule (written out here) at them; unfilled rows keep the live choice;
    a trace of the model's own choice changes nothing, bit for bit."""
    from conftest import FAMILIES, save

    from fcaudit.core.nll import logits_of, token_nll
    from fcaudit.core.sites import find_sites
    from fcaudit.engine.actions.routes import IDS_FIXED, route_agreement
    from fcaudit.engine.inputs import as_loaded
    folder = save(FAMILIES[family][0](), tmp_path / family)
    ids = _ids()
    own, _ = _engine_trace(folder, ids)
    rng = np.random.default_rng(1)
    experts = int(_engine_trace(folder, ids)[1].shape[-1])
    planted = own.copy()
    for n, t, layer in zip(*np.nonzero(rng.random(own.shape[:3]) < 0.5), strict=True):
        planted[n, t, layer] = rng.choice(experts, K, replace=False)
    planted[0, 1, 0] = -1  # a row the engine left unfilled: the live choice stays
    loaded = as_loaded(str(folder))
    model, sites = loaded.model, find_sites(loaded.model)
    same = route_agreement(model, sites, ids, own, batch_size=3).ids_fixed
    moved = route_agreement(model, sites, ids, planted, batch_size=3).ids_fixed
    assert same is not None and moved is not None and moved.condition == IDS_FIXED
    assert same.nll_ids_fixed == same.nll_own and same.delta == 0.0

    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    fixed = torch.from_numpy(planted)

    def swap(layer: int) -> Any:
        def hook(_m: Any, _a: Any, out: Any) -> Any:
            logits, _, live = out
            chosen = fixed[:, :, layer].reshape(-1, K)
            chosen = torch.where(chosen >= 0, chosen, live)
            return logits, _rule(family, model.config, logits, chosen), chosen
        return hook
    handles = [r.register_forward_hook(swap(i)) for i, r in enumerate(routers)]
    with torch.no_grad():
        reference = token_nll(logits_of(model(ids)), ids).double().mean()
    for h in handles:
        h.remove()
    assert abs(moved.nll_ids_fixed - float(reference)) <= 1e-6
    assert abs(moved.nll_own - same.nll_own) == 0.0 and abs(moved.delta) > 1e-5
    lo, hi = moved.delta_ci
    assert lo <= moved.delta <= hi and moved.windows == ids.shape[0]


def test_a_router_whose_selection_cannot_be_fixed_is_refused_by_name(hf_mixtral: Path) -> None:
    """No top-k of the trace's width over the router's experts (here: asked for one more
    expert than it has): refused, naming the router, never a pass with live routes."""
    from fcaudit.core.sites import find_sites
    from fcaudit.engine.actions.routes import ids_fixed
    from fcaudit.engine.inputs import as_loaded
    ids = _ids()
    trace, logits = _engine_trace(hf_mixtral, ids)
    model = as_loaded(str(hf_mixtral)).model
    sites = find_sites(model)
    with pytest.raises(ModelError, match=r"router model\.layers\.0\.mlp\.gate took 0 top-k"):
        ids_fixed(model, sites, ids, trace, logits.shape[-1] + 1, 3)
