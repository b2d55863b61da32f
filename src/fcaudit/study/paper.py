"""What "Dynamic Parameterization Is Not Dynamic Inference" reports, typed once: the study
and the trend quote these beside our own numbers (docs/method.md, Models)."""

from fcaudit.engine.result_views import DELTA_REASSIGN, DELTA_SHUFFLE

# parameter counts of the paper's models
PARAMS = {"76M": 76e6, "504M": 504e6, "1.4B": 1.4e9}
# FeatureGate: static per-layer retention (percent) and the seeds behind it, by size
RETENTION = {"76M": 98.70, "504M": 99.43}
RETENTION_SEEDS = {"76M": 7, "504M": 3}
# FeatureGate: share of gate variance layer identity explains, percent (sizes not given)
ETA2_LAYER = (87.0, 96.0)
# FeatureGate latency against Dense
SPEED_RATIO = 1.308
# MUDDPythia-1.4B: NLL penalties in nats
MUDD = {DELTA_REASSIGN: 1.9067, DELTA_SHUFFLE: 2.9637}  # by metric key


def retention_text() -> str:
    return "; ".join(f"{v:.2f}% ({size}, {RETENTION_SEEDS[size]} seeds)"
                     for size, v in RETENTION.items())


def eta2_text() -> str:
    return f"{ETA2_LAYER[0]:.0f}% to {ETA2_LAYER[1]:.0f}%"
