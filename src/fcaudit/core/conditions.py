"""The names of the audit's conditions (docs/method.md, Conditions): defined once, light
to import (no torch), so audit.json can be read without loading the engine."""

# every condition the audit replays, in report order
MAIN_CONDITIONS = ("original", "correct", "reassign", "shuffle", "reassign+shuffle",
                   "static-layer", "static-layer-position", "static-layer-token", "global-mean")
RANDOM_CONDITIONS = ("reassign", "shuffle", "reassign+shuffle")
STATIC_CONDITIONS = ("static-layer", "static-layer-position", "static-layer-token",
                     "global-mean")
