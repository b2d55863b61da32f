"""A serving engine's routed-expert trace against fcaudit's recording (``fcaudit routes``,
fcaudit.engine.routes, fcaudit.io.traces). The reference trace is read off the Hugging
Face router's own index output by a hook of this test, then planted with disagreements,
unfilled rows (sentinels) and completion rows; the expected counts, per margin bucket
too, are worked out here from the router's logits."""

from __future__ import annotations

import json
from pathlib import Path

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
    from fcaudit.engine.inputs import as_loaded
    from fcaudit.engine.routes import route_agreement
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
    from fcaudit.engine.inputs import as_loaded
    from fcaudit.engine.routes import decoder_layer, route_agreement
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
    from fcaudit.engine.routes import route_agreement
    from fcaudit.models.featuregate import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(ModelError, match="no router site"):
        route_agreement(model, model.controller_sites(), torch.zeros(1, 8, dtype=torch.long),
                        np.zeros((1, 8, 1, 2), dtype=np.int64))
    with pytest.raises(DataError, match="expected an existing"):
        from fcaudit.io.traces import read_trace
        read_trace(tmp_path / "missing.pt")
