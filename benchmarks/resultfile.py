"""Result files of the benchmarks: numbers plus how, where and on what code they were taken.

Every benchmark writes one JSON file (by default ``docs/results/NAME.json``), which
``docs/make_docs.py`` renders into the docs: no measured number is typed by hand. The
file carries its provenance (commit, machine, threads, load average before and after)
so a doc can say how a machine-dependent figure was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fcaudit.io.runtime import cpu_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"


def add_json_option(parser: argparse.ArgumentParser, name: str) -> None:
    """``--json PATH``: where the result file goes (default: docs/results/NAME.json)."""
    parser.add_argument("--json", type=Path, default=RESULTS / f"{name}.json", metavar="PATH",
                        help=f"result file to write (default: docs/results/{name}.json)")


def _git(*args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


def machine_facts() -> dict[str, Any]:
    """What the numbers depend on besides the code."""
    import torch
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


class ResultFile:
    """Collects a benchmark's numbers; :meth:`write` adds provenance and saves them."""

    def __init__(self, script: str) -> None:
        self.script = script
        self.argv = sys.argv[1:]
        self.started = time.strftime("%Y-%m-%d", time.gmtime())
        self.commit = _git("rev-parse", "--short=12", "HEAD")
        # uncommitted changes to the code that was measured make the commit a lie
        # (timings.json is a result that benchmarks/timings.py writes, not code)
        self.dirty = bool(_git("status", "--porcelain", "--", "src", "benchmarks",
                               ":!src/fcaudit/timings.json"))
        self.before: dict[str, Any] | None = None

    def start(self) -> None:
        """Take the machine's facts (and load) now, before measuring."""
        self.before = machine_facts()

    def write(self, path: Path, results: Any) -> None:
        content = {"script": f"benchmarks/{self.script}", "argv": self.argv,
                   "date": self.started, "commit": self.commit, "dirty": self.dirty,
                   "machine": self.before or machine_facts(),
                   "load_average_after": machine_facts()["load_average"],
                   "results": results}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {path}")
