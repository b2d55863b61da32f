"""static-layer-token-position, the condition added as one registry entry: each token
gets the calibration mean of its token id at its position (a pair calibration never had:
the static-layer mean), by hand on a 2-position calibration; opt-in (an audit's
calibration does not collect its sums), so it is refused in one line without them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fcaudit
from fcaudit.core.conditions import CONDITIONS, MAIN_CONDITIONS, STATIC_CONDITIONS
from fcaudit.core.interventions import InterventionContext, StaticProfiles, builtin, static

NEW = "static-layer-token-position"


def test_it_is_one_opt_in_static_entry_needing_positions_and_token_ids():
    c = CONDITIONS[NEW]
    assert (c.kind, c.default, c.needs) == ("static", False,
                                            {"calibration", "positions", "token_ids"})
    assert NEW not in MAIN_CONDITIONS and NEW not in STATIC_CONDITIONS  # no audit changes
    assert c.why_not(False, True, "[example, kernel]").endswith("no positions to permute")
    assert c.why_not(True, False, "") == ("the inputs are not token ids: there is no token "
                                          "id to key a profile by")


@pytest.fixture()
def profiles():
    """Calibration of one site over 2 positions: ids [[1, 2], [1, 1]] with coefficients
    [[10, 20], [30, 40]]."""
    site = fcaudit.Site("s", "s", "f", 0)
    p = StaticProfiles([site])
    p.add({"s": torch.tensor([[10.0, 20.0], [30.0, 40.0]])}, ids=torch.tensor([[1, 2], [1, 1]]))
    return p


def test_static_layer_token_position_feeds_the_mean_of_the_id_at_the_position(profiles):
    """By hand: (id 1, pos 0) was seen twice: (10 + 30) / 2 = 20; (id 1, pos 1): 40;
    (id 2, pos 1): 20; (id 2, pos 0) and id 7 never: the static-layer mean 25."""
    ids = torch.tensor([[1, 1], [2, 2], [7, 1]])
    fed = static({"s": torch.zeros(3, 2)}, profiles, NEW, ids)
    assert fed["s"].tolist() == [[20.0, 40.0], [25.0, 20.0], [25.0, 40.0]]
    # the per-token-id profile of the same calibration ignores the position: id 1 is 80/3
    by_id = static({"s": torch.zeros(1, 2)}, profiles, "static-layer-token",
                   torch.tensor([[1, 1]]))
    assert by_id["s"][0].tolist() == pytest.approx([80 / 3, 80 / 3])


def test_static_layer_token_position_through_the_intervention_context(profiles):
    ids = torch.tensor([[2, 1]])
    context = InterventionContext((), range(1), profiles, 0, np.random.default_rng(0),
                                  lambda name, idx: None, ids)
    via_context = builtin(NEW).fn({"s": torch.zeros(1, 2)}, context)
    assert via_context["s"].tolist() == [[25.0, 40.0]]


def test_static_layer_token_position_without_its_sums_is_refused_in_one_line():
    site = fcaudit.Site("s", "s", "f", 0)
    sums_only = StaticProfiles([site])
    sums_only.add_sums({"s": torch.ones(2)}, 1)  # how an audit's calibration adds
    with pytest.raises(fcaudit.FcauditError, match=f"^{NEW} needs per-token-id-and-position"):
        static({"s": torch.zeros(1, 2)}, sums_only, NEW, torch.tensor([[1, 2]]))


def test_static_refuses_a_condition_that_is_not_static_naming_the_choices(profiles):
    with pytest.raises(fcaudit.FcauditError, match=f"global-mean, {NEW}$"):
        static({"s": torch.zeros(1, 2)}, profiles, "shuffle")
