"""The condition registry (core/conditions.py): the tuples callers read are derived from
it unchanged, each condition applies where its needs are met, and the engine feeds
through the same InterventionContext as user interventions (values by hand)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fcaudit
from fcaudit.core import conditions
from fcaudit.core.conditions import CONDITIONS, REGISTRY
from fcaudit.core.interventions import (
    InterventionContext,
    RandomDraw,
    builtin,
)
from fcaudit.core.layout import not_applicable

DEFAULT = [c for c in REGISTRY if c.default]  # what every audit may run


def test_the_tuples_callers_read_are_the_audits_conditions_in_report_order():
    assert conditions.MAIN_CONDITIONS == (
        "original", "correct", "reassign", "shuffle", "reassign+shuffle", "static-layer",
        "static-layer-position", "static-layer-token", "global-mean")
    assert conditions.RANDOM_CONDITIONS == ("reassign", "shuffle", "reassign+shuffle")
    assert conditions.STATIC_CONDITIONS == ("static-layer", "static-layer-position",
                                            "static-layer-token", "global-mean")
    assert conditions.PER_LAYER_CONDITIONS == ("reassign", "static-layer")
    assert conditions.RETENTION_PROFILES == ("static-layer", "static-layer-position",
                                             "static-layer-token")
    # --target-ci counts the penalties a user reads, not the retention's floor
    assert conditions.by_role("counted") == conditions.MAIN_CONDITIONS[2:-1]
    assert conditions.by_role("dependence") == ("reassign", "shuffle")
    assert (conditions.FRONTIER, conditions.EXPERT_ABLATION) == ("frontier", "expert-ablation")


def test_every_entry_is_whole_and_named_once():
    assert len({c.name for c in REGISTRY}) == len(REGISTRY)
    kinds = {"reference", "random", "static", "exit", "ablation", "frontier", "user"}
    needs = {"calibration", "positions", "token_ids", "routers", "exits"}
    for c in REGISTRY:
        assert c.kind in kinds and c.needs <= needs and c.meaning, c.name
        assert (c.profile is not None) == (c.kind == "static"), c.name
    # an opt-in condition stays out of what every audit runs
    assert [c.name for c in REGISTRY if c.kind != "user" and not c.default
            and c.name in conditions.MAIN_CONDITIONS] == []


def test_where_each_condition_applies_follows_its_needs():
    shapes = "[example, kernel]"
    applies = {c.name: c.why_not(True, True, shapes) for c in REGISTRY}
    assert set(applies.values()) == {None}
    no_positions = {c.name for c in DEFAULT if c.why_not(False, True, shapes)}
    assert no_positions == {"shuffle", "reassign+shuffle", "static-layer-position"}
    no_ids = {c.name for c in DEFAULT if c.why_not(True, False, shapes)}
    assert no_ids == {"static-layer-token"}
    assert CONDITIONS["shuffle"].why_not(False, True, shapes) == (
        "the coefficients ([example, kernel]) have no position axis, one value set per "
        "example: there are no positions to permute")


def test_layout_lists_the_default_conditions_that_do_not_apply():
    site = fcaudit.Site("k", "k", "f", 0, axes=("example", "kernel"), positions=())
    assert list(not_applicable([site], token_ids=False)) == [
        "shuffle", "reassign+shuffle", "static-layer-position", "static-layer-token"]


def _context(profiles, rows, draw=None, ids=None, pool=None):
    return InterventionContext((), rows, profiles, 0, np.random.default_rng(0),
                               lambda name, idx: pool[name][torch.as_tensor(idx)], ids, draw)


def test_reassign_feeds_donors_from_the_whole_set_through_the_context():
    """Rows 2..3 of a 4-sequence set with donors [3, 0, 1, 2]: row 2 gets sequence 1's
    coefficients, row 3 sequence 2's, read from outside the batch."""
    pool = {"s": torch.arange(8.0).view(4, 2)}  # sequence n: [2n, 2n + 1]
    draw = RandomDraw(0, np.array([3, 0, 1, 2]), np.zeros((4, 2), dtype=np.int64))
    fed = CONDITIONS["reassign"].feed({"s": pool["s"][2:4]},
                                      _context(None, range(2, 4), draw, pool=pool))
    assert fed["s"].tolist() == [[2.0, 3.0], [4.0, 5.0]]


def test_a_random_condition_without_the_audits_draw_is_refused_in_one_line():
    with pytest.raises(fcaudit.FcauditError, match="'shuffle' needs the audit's random draw"):
        CONDITIONS["shuffle"].feed({"s": torch.zeros(1, 2)}, _context(None, range(1)))


def test_builtin_refuses_random_and_unknown_conditions():
    for name in ("shuffle", "nope"):
        with pytest.raises(fcaudit.FcauditError, match=rf"builtin\('{name}'\): choose one of"):
            builtin(name)


def test_a_condition_the_audit_runs_its_own_way_has_no_feed():
    with pytest.raises(fcaudit.UsageError, match="'frontier' has no coefficient feed"):
        CONDITIONS["frontier"].feed({}, None)


def test_the_registry_and_the_result_schema_load_without_torch():
    """Reading an audit.json needs the condition names, never the engine's torch."""
    import subprocess
    import sys
    code = ("import sys, fcaudit.core.conditions, fcaudit.engine.result; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
