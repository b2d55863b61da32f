"""Wall times the README and ``--help`` quote, measured by running the commands.

Runs, one after another on an otherwise idle machine: ``fcaudit demo`` into a new
folder, the README's test command, and (with ``--study``) ``fcaudit reproduce --preset
tiny --seeds 3``. Writes the minutes to ``src/fcaudit/timings.json``, which ``--help``
reads and a test compares with the README, so every quoted time comes from here.

    python benchmarks/timings.py --study --keep study-tiny --keep-demo demo
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "src" / "fcaudit" / "timings.json"


def timed(argv: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=cwd, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--study", action="store_true", help="also time reproduce --preset tiny")
    p.add_argument("--keep", type=Path, default=None,
                   help="keep the study folder here (its numbers go into the README)")
    p.add_argument("--keep-demo", type=Path, default=None,
                   help="keep the demo folder here (its audit goes into the README)")
    args = p.parse_args()
    fcaudit = [sys.executable, "-m", "fcaudit"]
    minutes = json.loads(TARGET.read_text()) if TARGET.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        demo = args.keep_demo or work / "demo"
        minutes["demo"] = timed([*fcaudit, "demo", "--quiet", "--out", str(demo)], work) / 60
        minutes["tests"] = timed([sys.executable, "-m", "pytest", "-q"], ROOT) / 60
        if args.study:
            study = args.keep or work / "study"
            minutes["reproduce_tiny"] = timed([*fcaudit, "reproduce", "--preset", "tiny",
                                               "--seeds", "3", "--quiet", "--out", str(study)],
                                              work) / 60
    minutes = {k: round(v, 1) if isinstance(v, float) else v for k, v in minutes.items()}
    minutes["measured_on"] = f"{os.cpu_count()} cores, {platform.machine()}, " \
                             f"Python {platform.python_version()}"
    TARGET.write_text(json.dumps(minutes, indent=2, sort_keys=True) + "\n")
    print(json.dumps(minutes, indent=2))
    shutil.rmtree(ROOT / ".pytest_cache", ignore_errors=True)


if __name__ == "__main__":
    main()
