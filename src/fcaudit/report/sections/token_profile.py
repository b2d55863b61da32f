"""The token profile's section: what static-layer-token could not cover."""

from __future__ import annotations

from fcaudit.engine.result import AuditResult, TokenProfile
from fcaudit.report.format import fmt_num
from fcaudit.report.sections.base import Renderer


def render(r: AuditResult, t: TokenProfile) -> list[str]:
    return ["## Token-id profiles",
            f"`static-layer-token` has a profile for each of the "
            f"{fmt_num(t.calibration_token_ids)} token ids of the calibration set; "
            f"{fmt_num(t.eval_tokens_unseen)} of the {fmt_num(t.eval_tokens)} evaluation "
            f"tokens ({fmt_num(t.eval_token_ids_unseen)} distinct ids) have an id it "
            "lacks and were fed the static-layer profile."]


RENDERER = Renderer("token_profile", render)
