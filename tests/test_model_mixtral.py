"""fcaudit's Mixtral (models/mixtral.py): the same numbers as transformers' Mixtral on the
same weights (the independent reference), its routers as controller sites, training
from a preset, and the configurations it refuses to stand in for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fcaudit.core.errors import ModelError
from fcaudit.models.mixtral import Mixtral, from_hf

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=48, num_local_experts=4,
             num_experts_per_tok=2, max_position_embeddings=64)


def _hf(dtype: torch.dtype = torch.float32, **extra: Any) -> Any:
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**{**SHAPE, **extra})).to(dtype).eval()


@pytest.mark.parametrize("extra", [
    {}, {"sliding_window": 5}, {"tie_word_embeddings": True}, {"head_dim": 16},
    {"num_key_value_heads": 4, "num_experts_per_tok": 1, "rms_norm_eps": 1e-3},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},
    {"dtype": torch.bfloat16, "num_experts_per_tok": 3},
    {"dtype": torch.float16, "sliding_window": 7},
], ids=["gqa", "window-shorter-than-sequence", "tied", "head-dim", "mha-top1", "rope-base",
        "bfloat16-top3", "float16-window"])
def test_it_computes_what_transformers_mixtral_computes_bit_for_bit(extra: dict) -> None:
    """The same weights give the same logits, bit for bit, as transformers' own Mixtral
    on the same ids: norms, rotary angles, grouped heads, the window, the routing rule
    (softmax over all experts in float32, top-k renormalised) and the experts' sum order
    and precision (in bfloat16 and float16 too, where a different order shows)."""
    hf = _hf(**extra)
    ours = from_hf(hf)
    assert ours.config.fixed == "" and len(ours.controller_sites()) == SHAPE["num_hidden_layers"]
    ids = torch.randint(0, SHAPE["vocab_size"], (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(ids).logits, ours(ids)
    assert torch.equal(got, want), float((got - want).abs().max())
    assert not any(p.data_ptr() == q.data_ptr() for p in ours.parameters()
                   for q in hf.parameters())  # copies: healing the fold never moves the source


@pytest.mark.parametrize("extra, what", [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
     "rotary type 'linear'"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
], ids=["rope-scaling", "activation"])
def test_a_configuration_it_does_not_compute_is_refused(extra: dict, what: str) -> None:
    with pytest.raises(ModelError, match=f"{what} is not what fcaudit's Mixtral computes"):
        from_hf(_hf(**extra), "layer_token", [])


def test_a_fixed_table_routes_each_token_by_its_row() -> None:
    """Folded per token id, a block routes token ``t`` exactly as the routed block does
    when its router returns row ``t`` of the table for that token (worked out here by
    replacing the router with a lookup module)."""
    hf = _hf()
    routed = from_hf(hf)
    table = [torch.randn(SHAPE["vocab_size"], 4, generator=torch.Generator().manual_seed(i))
             for i in range(2)]
    folded = routed.folded("layer_token", table)
    assert not [n for n in folded.state_dict() if "router" in n]
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))

    class Lookup(torch.nn.Module):
        def __init__(self, rows: torch.Tensor) -> None:
            super().__init__()
            self.rows = rows

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rows[ids]

    for block, rows in zip(routed.blocks, table, strict=True):
        block.router = Lookup(rows)
    with torch.no_grad():
        assert torch.equal(folded(ids), routed(ids))


def test_a_preset_trains_and_exposes_its_routers(tmp_path: Path) -> None:
    """``fcaudit train --arch mixtral``: a run folder whose model declares one router site
    per block and adds the load-balancing term in training."""
    from fcaudit.io.loading import load_run
    from fcaudit.study.train import train
    folder = train("mixtral", "tiny", 0, tmp_path / "run", steps=2, progress=False)
    model = load_run(folder).model
    assert isinstance(model, Mixtral)
    sites = model.controller_sites()
    assert [s.path for s in sites] == [f"blocks.{i}.router" for i in range(model.config.n_layer)]
    assert {s.family for s in sites} == {"moe"}
    model.train()
    model(torch.randint(0, model.config.vocab_size, (2, 8)))
    assert float(torch.as_tensor(model.aux_loss).detach()) > 0
