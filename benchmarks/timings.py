"""Wall times the README and ``--help`` quote, measured by running the commands.

Runs, one after another on an otherwise idle machine: ``fcaudit demo`` (the shipped
models) and ``fcaudit demo --train`` into new folders, the README's test command, and (with
``--study``) ``fcaudit reproduce --preset tiny --seeds 3``. Writes the minutes to
``src/fcaudit/timings.json``, which ``--help`` reads and a test compares with the README,
so every quoted time comes from here. The trend study (about 1.5 hours) is not rerun here:
``--trend-timings`` takes the ``timings.json`` a finished ``fcaudit reproduce --preset
trend`` wrote (each run's and audit's seconds) and records their sum.

    python benchmarks/timings.py --study --keep study-tiny --keep-demo demo
    python benchmarks/timings.py --demo --keep-demo demo     # the shipped-model demo alone
    python benchmarks/timings.py --demo-train                # `fcaudit demo --train` alone
    python benchmarks/timings.py --trend-timings study-trend/timings.json

Each measured entry also records the load average before and after it (``load_average``)
and the machine it ran on (``host``: CPU model, cores, and the torch threads the command
ran with: ``OMP_NUM_THREADS`` when set, else torch's default of one per core), since the
machine may be shared and threads contend with other jobs: the README states every time
with its load and threads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fcaudit.io.runtime import cpu_model

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "src" / "fcaudit" / "timings.json"


def timed(argv: list[str], cwd: Path, key: str, minutes: dict) -> None:
    """Run ``argv``; its minutes go to ``minutes[key]``, the load around it and its torch
    threads beside them."""
    before = [round(x, 2) for x in os.getloadavg()]
    start = time.perf_counter()
    subprocess.run(argv, cwd=cwd, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    minutes[key] = (time.perf_counter() - start) / 60
    minutes.setdefault("load_average", {})[key] = {
        "before": before, "after": [round(x, 2) for x in os.getloadavg()]}
    minutes.setdefault("host", {})[key] = {"cpu": cpu_model(), "cores": os.cpu_count(),
                                           "threads": torch_threads()}
    minutes.setdefault("measured_at", {})[key] = today()


def torch_threads() -> int:
    """The threads torch starts with in a child of this process (it reads
    ``OMP_NUM_THREADS``; unset, one per core)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         check=True, capture_output=True, text=True, env=os.environ)
    return int(out.stdout)


def today() -> str:
    return time.strftime("%Y-%m-%d", time.gmtime())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--study", action="store_true", help="also time reproduce --preset tiny")
    p.add_argument("--demo", action="store_true",
                   help="time the demo of the shipped models only (keep the other entries "
                        "as they are)")
    p.add_argument("--demo-train", action="store_true",
                   help="time `fcaudit demo --train` only (keep the other entries as they are)")
    p.add_argument("--keep", type=Path, default=None,
                   help="keep the study folder here (its numbers go into the README)")
    p.add_argument("--keep-demo", type=Path, default=None,
                   help="keep the demo folder here (its audit goes into the README)")
    p.add_argument("--trend-timings", type=Path, default=None, metavar="PATH",
                   help="a trend study's timings.json: record its total; skip demo and tests")
    args = p.parse_args()
    minutes = json.loads(TARGET.read_text()) if TARGET.exists() else {}
    if args.trend_timings:
        seconds = json.loads(args.trend_timings.read_text())
        minutes["reproduce_trend"] = sum(seconds.values()) / 60
        minutes.setdefault("measured_at", {})["reproduce_trend"] = today()
    else:
        measure(args, minutes)
    minutes = {k: round(v, 1) if isinstance(v, float) else v for k, v in minutes.items()}
    TARGET.write_text(json.dumps(minutes, indent=2, sort_keys=True) + "\n")
    print(json.dumps(minutes, indent=2))


def measure(args: argparse.Namespace, minutes: dict) -> None:
    """Time the demo, the tests and (with ``--study``) the tiny study into ``minutes``."""
    fcaudit = [sys.executable, "-m", "fcaudit"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        demo = args.keep_demo or work / "demo"
        if not args.demo_train:
            timed([*fcaudit, "demo", "--quiet", "--out", str(demo)], work, "demo", minutes)
        if not args.demo:
            timed([*fcaudit, "demo", "--train", "--quiet", "--out", str(work / "demo-train")],
                  work, "demo_train", minutes)
        if args.demo or args.demo_train:
            return
        timed([sys.executable, "-m", "pytest", "-q"], ROOT, "tests", minutes)
        if args.study:
            study = args.keep or work / "study"
            timed([*fcaudit, "reproduce", "--preset", "tiny", "--seeds", "3", "--quiet",
                   "--out", str(study)], work, "reproduce_tiny", minutes)
    shutil.rmtree(ROOT / ".pytest_cache", ignore_errors=True)


if __name__ == "__main__":
    main()
