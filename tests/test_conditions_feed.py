"""One implementation per intervention: what the engine feeds under every main condition
equals the public ``reassign`` / ``shuffle`` / ``static`` applied to the whole evaluation
set (the engine's only extra: donors from any batch), and the engine calls them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import toys
from conftest import replay_inputs, toy_data

from fcaudit.core import interventions
from fcaudit.core.conditions import MAIN_CONDITIONS, STATIC_CONDITIONS
from fcaudit.engine.plan import OneSite, Run, feed

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    data = toy_data(n_eval=10)  # batches of 4: the last one is short, donors cross batches
    inputs = replay_inputs(toys.content_model(), data, tmp_path_factory.mktemp("feed"))
    calib = torch.from_numpy(data.calib_ids)
    for batch in calib.split(5):  # the content gates are one_hot(token id)
        inputs.profiles.add({s.name: toys.F.one_hot(batch, toys.V).float()
                             for s in inputs.sites}, ids=batch)
    return dataclasses.replace(inputs, ids=data.eval_ids)


def _whole_set(inputs) -> dict[str, torch.Tensor]:
    cache = inputs.cache
    return {s.name: torch.cat([cache.coefficients(b, s.name) for b in range(cache.n_batches)])
            for s in inputs.sites}


def _reference(condition: str, inputs) -> dict[str, torch.Tensor]:
    """The condition over the whole evaluation set by the public functions alone."""
    full, rand = _whole_set(inputs), inputs.draws[0]
    if condition in ("reassign", "reassign+shuffle"):
        full = dict(interventions.reassign(full, rand.donor))
    if condition in ("shuffle", "reassign+shuffle"):
        full = dict(interventions.shuffle(full, rand.positions))
    if condition in STATIC_CONDITIONS:
        ids = torch.from_numpy(inputs.ids)
        full = dict(interventions.static(full, inputs.profiles, condition, ids))
    return full


@pytest.mark.parametrize("condition", [c for c in MAIN_CONDITIONS if c != "original"])
def test_engine_feed_is_the_public_intervention(condition, inputs):
    expected = _reference(condition, inputs)
    for b in range(inputs.cache.n_batches):
        rows = inputs.cache.batch_range(b)
        fed = feed(Run(condition), b, inputs, CPU)
        for site in inputs.sites:  # every site of every batch, bit for bit
            assert torch.equal(fed[site], expected[site.name][rows.start:rows.stop]), \
                (condition, b, site.name)


@pytest.mark.parametrize("condition", ["reassign", "static-layer"])
def test_per_layer_feed_changes_only_its_site(condition, inputs):
    expected, whole = _reference(condition, inputs), _whole_set(inputs)
    for target in inputs.sites:
        for b in range(inputs.cache.n_batches):
            rows = inputs.cache.batch_range(b)
            fed = feed(Run(condition, 0, OneSite(target)), b, inputs, CPU)
            for site in inputs.sites:
                source = expected if site == target else whole
                assert torch.equal(fed[site], source[site.name][rows.start:rows.stop])


def test_engine_calls_the_public_functions(inputs, monkeypatch):
    """A second implementation in the engine could drift from the documented one."""
    calls: list[str] = []
    for name in ("reassign", "shuffle", "static"):
        original = getattr(interventions, name)

        def spy(*args, _name=name, _original=original, **kw):
            calls.append(_name)
            return _original(*args, **kw)
        monkeypatch.setattr(interventions, name, spy)  # the registry's feeds call these
    expected = {"reassign": ["reassign"], "shuffle": ["shuffle"],
                "reassign+shuffle": ["reassign", "shuffle"], "correct": []}
    for condition in STATIC_CONDITIONS:
        expected[condition] = ["static"]
    for condition, names in expected.items():
        calls.clear()
        feed(Run(condition), 1, inputs, CPU)
        assert calls == names, condition
