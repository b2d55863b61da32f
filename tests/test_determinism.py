"""Two audits of the same model and data are byte-identical outside the listed
nondeterministic keys (``runtime``, ``command``, timings).
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import (
    audit_argv,
    canonical,
    run_subprocess,
)

from fcaudit.engine.result import NONDETERMINISTIC_KEYS

# ----------------------------------------------------------------------- determinism

def test_two_audits_are_byte_identical_outside_the_runtime_section(
        tmp_path: Path, tokens: dict[str, Path]) -> None:
    audits = []
    for name in ("a", "b"):
        res = run_subprocess(audit_argv(tmp_path / name, tokens), tmp_path)
        assert res.returncode == 0, res.stderr
        audits.append(tmp_path / name / "audit.json")
    a, b = (json.loads(p.read_text()) for p in audits)
    assert a["nondeterministic_keys"] == list(NONDETERMINISTIC_KEYS) == [
        "runtime", "command", "execution.timing", "execution.speed_ratio_vs_dense",
        "execution.controller_cost"]
    assert set(a["runtime"]) == {"host", "timings", "schedule", "cache", "reuse", "plan"}
    assert "host" not in a and "timings" not in a
    assert a["command"] != b["command"]  # it names --out; that is why it is listed
    assert canonical(audits[0]) == canonical(audits[1])
    # the file itself is written in the canonical form: only the listed keys differ
    assert audits[0].read_text() == json.dumps(a, indent=2, sort_keys=True) + "\n"
    differing = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert differing <= {k.split(".")[0] for k in a["nondeterministic_keys"]}
