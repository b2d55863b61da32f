"""benchmarks/memlimit.py: the measurements behind "a model bigger than memory".

A child that allocates a known number of bytes is the independent reference: its sampled
anonymous peak and its ``ru_maxrss`` must reach that size; under a memory cgroup whose
limit is below it, the kernel must kill it (and the run must say so); above it, the child
finishes and the cgroup's own peak holds the allocation. The offload block of
docs/performance.md must say what each outcome means, never more.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "docs"))

import doc_blocks  # noqa: E402
import memlimit  # noqa: E402

MIB = 2**20
HOLD = 300 * MIB  # what the child allocates, touches and holds for a moment


def allocating_child(nbytes: int) -> list[str]:
    return [sys.executable, "-c",
            f"import time; b = bytearray({nbytes}); b[::4096] = b'x' * len(b[::4096]); "
            "time.sleep(0.5)"]


def test_a_child_s_peaks_reach_what_it_allocated() -> None:
    run = memlimit.run_measured(allocating_child(HOLD))
    assert run.returncode == 0, run.stderr
    assert run.peak_anon_bytes >= HOLD
    assert run.peak_rss_bytes >= HOLD
    assert run.limit_bytes is None and run.cgroup_peak_bytes is None and not run.oom_killed


def test_a_child_over_the_cgroup_limit_is_killed_and_one_under_it_finishes() -> None:
    for limit, fits in ((150 * MIB, False), (HOLD + 300 * MIB, True)):
        with memlimit.memory_cgroup(limit) as group:
            if isinstance(group, str):
                pytest.skip(group)
            run = memlimit.run_measured(allocating_child(HOLD), group)
        assert run.limit_bytes == limit
        if fits:
            assert (run.returncode, run.oom_killed) == (0, False), run.stderr
            assert HOLD <= run.cgroup_peak_bytes <= limit
        else:
            assert (run.returncode, run.oom_killed) == (-9, True), run.stderr
            assert run.cgroup_peak_bytes <= limit
    assert not group.path.exists()  # the cgroup is removed afterwards


def test_no_cgroup_where_none_can_be_made_says_why(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    monkeypatch.setattr(memlimit, "ROOT", tmp_path / "absent")
    with memlimit.memory_cgroup(HOLD) as group:
        assert isinstance(group, str) and "no memory cgroup could be made" in group


class _Results(doc_blocks.Results):
    def __init__(self, data: dict) -> None:
        super().__init__(REPO)
        self.json = lambda rel: data  # type: ignore[assignment]

    def has(self, rel: str) -> bool:
        return True


def _render(edit: dict[str, dict] | None = None, not_made: str | None = None) -> str:
    data = json.loads((REPO / "docs" / "results" / "offload.json").read_text())
    data = copy.deepcopy(data)
    for case, fields in (edit or {}).items():
        data["results"]["rows"][case].update(fields)
    if not_made:
        data["results"]["capped_not_made"] = not_made
        for case in ("offloaded_capped", "in_memory_capped"):
            data["results"]["rows"].pop(case)
    return doc_blocks.offload(_Results(data))


def test_the_offload_block_says_what_each_capped_outcome_means() -> None:
    rows = json.loads((REPO / "docs" / "results" / "offload.json").read_text())["results"]["rows"]
    assert len(rows) == 4  # every row of the committed file is a line of the table
    text = _render()
    for case, row in rows.items():
        memory = f"capped at {row['limit_bytes'] / 2**30:.2f} GiB" if row["limit_bytes"] \
            else "free"
        loaded = "whole model" if case.startswith("in_memory") else "offloaded"
        assert f"| {loaded} | {memory} | " in text, case
        assert f"| {row['peak_rss_bytes'] / 2**30:.2f} | {row['peak_anon_bytes'] / 2**30:.2f} |" \
            in text, case
    fit = _render({"in_memory_capped": {"finished": True, "oom_killed": False, "returncode": 0,
                                        "identity_exact": True, "identity_max_abs_diff": 0.0}})
    assert "**finished there too**: the limit is not below what the whole model needs" in fit
    failed = _render({"offloaded_capped": {"finished": False, "oom_killed": True,
                                           "returncode": -9}})
    assert "the offloaded audit **did not finish**" in failed
    assert "killed by the OOM killer" in failed
    skipped = _render(not_made="no memory cgroup could be made (Permission denied)")
    assert "The capped runs were not made: no memory cgroup could be made" in skipped
    assert "capped at" not in skipped
