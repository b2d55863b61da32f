"""The token profile: how far static-layer-token's profiles (one per layer and token id,
from the calibration set) cover the evaluation tokens; a token whose id no calibration
token had is fed the static-layer profile instead. No runs of its own: it reads the
calibration profiles and the evaluation token ids (audits of token ids only)."""

from __future__ import annotations

from typing import Any

from fcaudit.engine.analyses.base import Analysis
from fcaudit.engine.result_parts import TokenProfile


def summarise(measured: Any, analysis: Analysis) -> TokenProfile | None:
    ids, profiles = measured.setup.token_ids, measured.profiles
    if ids is None:
        return None
    assert profiles.tokens is not None
    unseen, distinct = profiles.unseen(ids)
    return TokenProfile(len(profiles.tokens.ids), int(ids.size), unseen, distinct)


ANALYSIS = Analysis("token_profile", plan=lambda setup, probe: [], summarise=summarise,
                    section_type=TokenProfile)
