"""A Hugging Face Mamba handed over in memory with its generation cache on: fcaudit calls
it on whole windows and never feeds a returned cache back, so nothing crosses from the
record pass to a replay (identity bitwise exact), and its ``x_proj`` output, declared as
three named coefficients (Δ's low-rank input, B, C), gets a variance row each.

Reference: the cache really is returned (the model's own output), and each part's
layer share is recomputed with numpy from ``x_proj``'s output taken by our own hook.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import toys
from conftest import FAST, toy_data, transformers

from fcaudit.api import audit
from fcaudit.core.contract import Selection, Site

RANK, STATE, LAYERS = 2, 4, 2


def tiny_mamba() -> torch.nn.Module:
    config = transformers.MambaConfig(vocab_size=toys.V, hidden_size=16, state_size=STATE,
                                      num_hidden_layers=LAYERS, expand=2,
                                      time_step_rank=RANK, conv_kernel=3, use_cache=True)
    torch.manual_seed(0)
    return transformers.MambaForCausalLM(config).eval()


def sites() -> list[Site]:
    return [Site(f"x_proj.{i}", f"backbone.layers.{i}.mixer.x_proj", "x_proj", i,
                 role=Selection("dt before dt_proj and softplus; B, C as used",
                                (("dt", RANK), ("B", STATE), ("C", STATE))))
            for i in range(LAYERS)]


def test_a_cache_returned_by_the_model_is_never_fed_back(tmp_path) -> None:
    model = tiny_mamba()
    ids = torch.from_numpy(toy_data().eval_ids[:2])
    with torch.no_grad():
        assert model(ids).cache_params is not None  # the cache is on and returned
    taken: list[list[np.ndarray]] = [[] for _ in range(LAYERS)]
    hooks = [model.get_submodule(s.path).register_forward_hook(
        lambda _m, _a, y, i=s.layer: taken[i].append(y.double().numpy())) for s in sites()]
    with torch.no_grad():
        model(torch.from_numpy(toy_data().eval_ids))
    for h in hooks:
        h.remove()
    result = audit(model, tmp_path / "out", sites=sites(), data=toy_data(), options=FAST)
    assert result.identity_replay_max_abs_diff == 0.0  # bitwise: no cache crossed over
    assert result.selection_parts is not None
    parts = result.selection_parts["x_proj"]
    assert list(parts) == ["dt", "B", "C"]
    x = np.stack([np.concatenate(t) for t in taken])  # [L, N, T, K]
    for name, cut in (("dt", slice(0, RANK)), ("B", slice(RANK, RANK + STATE)),
                      ("C", slice(RANK + STATE, None))):
        part = x[..., cut]
        layer_means = part.mean(axis=(1, 2, 3))
        want = part[0].size * ((layer_means - part.mean()) ** 2).sum() / \
            ((part - part.mean()) ** 2).sum()
        assert parts[name].eta2_layer == pytest.approx(want, abs=1e-9), name
    md = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert "dt before dt\\_proj and softplus" in md or "dt before dt_proj and softplus" in md
