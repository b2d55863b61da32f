"""The audit's conditions (docs/method.md, Conditions) as objects, defined once: the
registry :data:`CONDITIONS` holds each condition's name, kind, needs, feed, the layouts
it applies to, its one-line meaning, its penalty phrase and its roles; every other module
asks the registry (by name constant, kind or role) and spells no condition's name.

Light to import (no torch), so audit.json can be read without loading the engine: a
condition's feed is a function of :mod:`fcaudit.core.interventions`, named here and
resolved on first use. Adding a built-in condition is one :class:`Condition` entry below
(plus its feed when it needs a new one, and its tests).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fcaudit.core.errors import UsageError
from fcaudit.core.registry import Registry

# a per-layer variant (one site intervened, the others correct) is a role of a random or
# static condition, not a kind of its own: it reuses that condition's feed
# exit: a reference exit rule of an early-exit model (fixed or oracle exit), fed as scores
Kind = Literal["reference", "random", "static", "exit", "ablation", "frontier", "user"]
Need = Literal["calibration", "positions", "token_ids", "routers", "exits"]
# what a condition does in the audit's derived numbers (besides its own penalty):
# dependence: its interval decides the dependence verdict; penalty: listed when it lowers
# the NLL; retention: a static profile whose share of the Correct-to-GlobalMean gap is
# reported; floor: the other end of that gap; interaction: part of the reassign x shuffle
# contrast (pair: both at once); per-layer: also run on one site at a time; counted: its
# interval must reach --target-ci; rerouted: its expert re-routing is compared; exit-fixed,
# exit-oracle: the two ends of the gap the learned exit controller is placed in
Role = Literal["dependence", "penalty", "retention", "floor", "interaction", "pair",
               "per-layer", "counted", "rerouted", "exit-fixed", "exit-fixed-position",
               "exit-oracle"]

# why a condition needing this cannot act on these sites or inputs (core/layout.py adds
# the sites' shapes before the positions reason)
UNAVAILABLE: dict[str, str] = {
    "positions": "there are no positions to permute",
    "token_ids": "the inputs are not token ids: there is no token id to key a profile by",
    "exits": "the model has no exit sites (Site.exit): it has no exit to fix or to place "
             "by an oracle",
}


@dataclass(frozen=True)
class Condition:
    """One condition the audit can replay: ``feed(coefficients, context)`` gives the
    tensors to feed the targeted sites (an :class:`~fcaudit.core.interventions.
    InterventionContext`, as for user interventions)."""

    name: str
    kind: Kind
    meaning: str  # one line, in the report's conditions table
    needs: frozenset[str] = frozenset()  # of Need
    feeder: str | None = None  # function of core.interventions: (condition, coefficients, context)
    profile: str | None = None  # static conditions: the calibration profile they feed
    penalty: str | None = None  # the phrase verdict sentences use for it
    roles: frozenset[str] = frozenset()  # of Role
    # why it does not apply without a need, when the generic reason (UNAVAILABLE) is not it
    unavailable: Mapping[str, str] | None = None
    # run by every audit; False: opt-in, run where asked (AuditOptions.conditions,
    # --condition), or through fcaudit.static / interventions.builtin
    default: bool = True
    # the calibration sums its profile reads besides the default ones (a key of
    # engine/stages.py's collections): gathered only by audits that run it
    collects: str | None = None
    # what ``fcaudit fold`` fixes into a model under this condition (a key an
    # architecture's ``folds`` names, the model's ``folded(key, values)``): a static
    # profile's rows, or the one exit depth; None: no fold writes it
    fold: str | None = None

    def feed(self, coefficients: Mapping[str, Any], context: Any) -> Mapping[str, Any]:
        """The coefficients to feed under this condition (tensors by site name)."""
        if self.feeder is None:
            raise UsageError(f"condition {self.name!r} has no coefficient feed: the audit "
                             "runs it its own way (frontier points, expert ablations)")
        fn: Callable[..., Mapping[str, Any]] = getattr(
            importlib.import_module("fcaudit.core.interventions"), self.feeder)
        return fn(self, coefficients, context)

    def why_not(self, positions: bool, token_ids: bool, shapes: str,
                exits: bool = True, no_ids: str | None = None) -> str | None:
        """Why it cannot act on sites with(out) a position axis, inputs with(out) token ids
        and sites with(out) exit scores (``shapes``: the sites' axes, for the reason;
        ``no_ids``: why there are no token ids, when not the generic reason), or None when
        it applies."""
        own = self.unavailable or {}
        if "exits" in self.needs and not exits:
            return own.get("exits", UNAVAILABLE["exits"])
        if "positions" in self.needs and not positions:
            return (f"the coefficients ({shapes}) have no position axis, one value set per "
                    f"example: {own.get('positions', UNAVAILABLE['positions'])}")
        if "token_ids" in self.needs and not token_ids:
            return own.get("token_ids", no_ids or UNAVAILABLE["token_ids"])
        return None


_CALIB = frozenset({"calibration"})
_RANDOM_ROLES = frozenset({"dependence", "penalty", "interaction", "counted", "rerouted"})

# in report order: the main conditions (reference, random, static), then the run kinds
REGISTRY: tuple[Condition, ...] = (
    Condition("original", "reference", "controller live (record pass)", feeder="feed_own"),
    Condition("correct", "reference", "own coefficients replayed (reference)",
              feeder="feed_own"),
    Condition("reassign", "random", "coefficients of another sequence", feeder="feed_reassign",
              penalty="reassigning coefficients across inputs",
              roles=_RANDOM_ROLES | {"per-layer"}),
    Condition("shuffle", "random", "own coefficients, positions permuted",
              frozenset({"positions"}), feeder="feed_shuffle",
              penalty="shuffling them across tokens", roles=_RANDOM_ROLES),
    Condition("reassign+shuffle", "random", "both at once", frozenset({"positions"}),
              feeder="feed_reassign_shuffle", penalty="reassigning and shuffling them",
              roles=frozenset({"penalty", "interaction", "pair", "counted"}),
              unavailable={"positions": "shuffle does not apply, so neither does the pair"}),
    Condition("static-layer", "static", "per-site calibration mean", _CALIB,
              feeder="feed_static", profile="layer", penalty="a static per-layer profile",
              roles=frozenset({"penalty", "retention", "per-layer", "counted", "rerouted"}),
              fold="layer"),
    Condition("static-layer-position", "static", "per-site, per-position calibration mean",
              _CALIB | {"positions"}, feeder="feed_static", profile="layer_position",
              penalty="a static per-layer-and-position profile",
              roles=frozenset({"penalty", "retention", "counted"}),
              unavailable={"positions": "a per-position profile is the per-layer one"},
              fold="layer_position"),
    Condition("static-layer-token", "static", "per-site, per-token-id calibration mean",
              _CALIB | {"token_ids"}, feeder="feed_static", profile="layer_token",
              penalty="a static per-layer-and-token-id profile",
              roles=frozenset({"penalty", "retention", "counted"}), fold="layer_token"),
    Condition("global-mean", "static", "one mean for the whole family", _CALIB,
              feeder="feed_static", profile="global_mean", roles=frozenset({"floor"})),
    # opt-in (its calibration sums grow with ids x positions, so only an audit that asks
    # collects them): --condition, or fcaudit.static with profiles from StaticProfiles.add
    Condition("static-layer-token-position", "static",
              "per-site, per-token-id-and-position calibration mean",
              _CALIB | {"positions", "token_ids"}, feeder="feed_static",
              profile="layer_token_position",
              penalty="a static per-layer, token-id-and-position profile",
              roles=frozenset({"penalty", "retention"}), default=False, collects="cells"),
    # opt-in, for models with exit sites (an Exit role): the exit references the learned exit
    # controller is placed between (docs/method.md, Early exit). Each feeds the scores that
    # make the model's own rule stop every unit (token, patch or example) at the layer the
    # reference gives it; the words fit any unit, as the report names it (ExitSummary.unit)
    Condition("fixed-exit", "exit", "one exit layer for all, the one closest to "
              "the mean executed depth on calibration", _CALIB | {"exits"},
              feeder="feed_exit", penalty="one fixed exit layer for all",
              roles=frozenset({"penalty", "exit-fixed"}), default=False, fold="exit_depth"),
    Condition("fixed-exit-position", "exit", "each position exits at one layer, the one "
              "closest to its mean executed depth on calibration",
              _CALIB | {"positions", "exits"}, feeder="feed_exit",
              penalty="one fixed exit layer per position",
              roles=frozenset({"penalty", "exit-fixed-position"}), default=False),
    Condition("oracle-exit", "exit", "for each, the earliest exit layer whose "
              "prediction is the full-depth one", frozenset({"exits"}), feeder="feed_exit",
              roles=frozenset({"exit-oracle"}), default=False),
    Condition("frontier", "frontier", "a savings-frontier point: a rule skips blocks",
              frozenset({"calibration"})),
    Condition("expert-ablation", "ablation", "one expert of one router never picked",
              frozenset({"routers"})),
)
CONDITIONS: Registry[Condition] = Registry("condition", REGISTRY, option="conditions")


def by_kind(*kinds: str, default: bool | None = True) -> tuple[str, ...]:
    """The names of the conditions of these kinds, in registry order (``default``: only
    those every audit runs; None: opt-in ones too)."""
    return tuple(c.name for c in REGISTRY if c.kind in kinds
                 and (default is None or c.default == default))


def by_role(role: str, default: bool | None = True) -> tuple[str, ...]:
    """The names of the conditions every audit runs that play ``role``, in registry order
    (``default`` None: opt-in ones too)."""
    return tuple(c.name for c in REGISTRY if role in c.roles
                 and (default is None or c.default == default))


def the(role: str) -> str:
    """The one condition playing ``role`` (the reference pass, the interaction's pair)."""
    (name,) = by_role(role)
    return name


def the_opt_in(role: str) -> str:
    """The one opt-in condition playing ``role``."""
    (name,) = by_role(role, default=False)
    return name


def needing(need: str) -> tuple[str, ...]:
    """The conditions (opt-in ones too) that need ``need``, in registry order."""
    return tuple(c.name for c in REGISTRY if need in c.needs)


ORIGINAL, CORRECT = by_kind("reference")  # the record pass; the identity replay
REASSIGN, SHUFFLE = by_role("dependence")  # the two penalties the verdict rests on
REASSIGN_SHUFFLE = the("pair")  # both at once: the interaction's other end
GLOBAL_MEAN = the("floor")  # the far end of the retention gap
(FRONTIER,), (EXPERT_ABLATION,) = by_kind("frontier"), by_kind("ablation")
# the exit references: the fixed exit and the oracle exit (opt-in, exit models only)
FIXED_EXIT, ORACLE_EXIT = the_opt_in("exit-fixed"), the_opt_in("exit-oracle")
FIXED_EXIT_POSITION = the_opt_in("exit-fixed-position")

# every condition the audit replays, in report order
MAIN_CONDITIONS = by_kind("reference", "random", "static", "exit")
# those an audit runs only where asked (AuditOptions.conditions)
OPT_IN_CONDITIONS = by_kind("reference", "random", "static", "exit", default=False)
# what an audit.json may hold (opt-in ones where asked), in report order: for its readers
REPORTED_CONDITIONS = by_kind("reference", "random", "static", "exit", default=None)
REPORTED_RETENTION = by_role("retention", default=None)
RANDOM_CONDITIONS = by_kind("random")
STATIC_CONDITIONS = by_kind("static")
PER_LAYER_CONDITIONS = by_role("per-layer")  # one site intervened, the others correct
RETENTION_PROFILES = by_role("retention")
# the static profiles: per layer (the verdict's retention), per position, per token id
STATIC_LAYER, STATIC_LAYER_POSITION, STATIC_LAYER_TOKEN = RETENTION_PROFILES


def audited(opted: Collection[str] = (), names: Sequence[str] = REPORTED_CONDITIONS
            ) -> tuple[str, ...]:
    """The conditions of ``names`` an audit runs: every default one and the opt-in ones in
    ``opted`` (AuditOptions.conditions), in registry order (so the default runs keep
    their order and an opted-in one comes after them in its kind)."""
    return tuple(n for n in names if CONDITIONS[n].default or n in opted)


def collections(opted: Collection[str]) -> frozenset[str]:
    """The calibration sums beyond the default ones the opted-in conditions read."""
    return frozenset(c for n in opted if (c := CONDITIONS[n].collects) is not None)
