"""Try other releases of the packages whose internals fcaudit reads, and widen the tested
range only when the README's test command passes on them.

fcaudit reads transformers' and accelerate's internals (module layouts, router outputs,
kernel dispatch), so a release it was never tested on may break it; pyproject.toml's
``hf`` extra therefore declares the range the suite passed on, and constraints.txt pins
exactly what CI runs (its pins are the range's ceilings). This script is how the range
moves:

    python .ci/dependency_ceiling.py                 # newest transformers, accelerate, gguf
    python .ci/dependency_ceiling.py --dry-run       # only say what is newer
    python .ci/dependency_ceiling.py --try transformers==5.24.0   # a floor to check

For each version tried it builds a fresh virtual environment (torch 2.13.0 first, then
``pip install -e .[test]`` with constraints.txt less the packages being moved and those
they pull in), runs the README's test command there (``python -m pytest -q``), and only
when it passes: a newer version raises the ceiling in pyproject.toml and rewrites
constraints.txt from what that environment resolved; an older one lowers the floor. A
failure changes nothing and exits 1. Commit the two files with the CI run that passes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT, CONSTRAINTS = ROOT / "pyproject.toml", ROOT / "constraints.txt"
TRACKED = ("transformers", "accelerate", "gguf")
# what a tracked package pulls in and constraints.txt pins: resolved afresh with it
PULLED = {"transformers": ("huggingface-hub", "kernels", "tokenizers", "safetensors"),
          "accelerate": ("huggingface-hub", "safetensors")}
TORCH = "torch==2.13.0"


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def declared(package: str) -> tuple[str, str]:
    """The (floor, ceiling) pyproject.toml's extras declare for ``package``."""
    found = re.search(rf'"{package}>=([\w.]+),<=([\w.]+)"', PYPROJECT.read_text())
    if found is None:
        sys.exit(f"pyproject.toml declares no '{package}>=FLOOR,<=CEILING' range")
    return found.group(1), found.group(2)


def newest(package: str) -> str:
    """The newest release on the package index, as pip sees it."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package],
                         capture_output=True, text=True, check=True).stdout
    return re.search(rf"^{re.escape(package)} \(([^)]+)\)", out, re.M).group(1)


def pins() -> dict[str, str]:
    lines = [ln for ln in CONSTRAINTS.read_text().splitlines() if "==" in ln
             and not ln.startswith("#")]
    return dict(ln.split("==", 1) for ln in lines)


def suite_passes(versions: dict[str, str], venv: Path) -> bool:
    """A fresh environment with ``versions``, then the README's test command in it."""
    moved = set(versions) | {p for name in versions for p in PULLED.get(name, ())}
    kept = {k: v for k, v in pins().items() if k not in moved}
    constraints = venv.parent / "constraints.txt"
    constraints.write_text("".join(f"{k}=={v}\n" for k, v in kept.items()))
    python = venv / "bin" / "python"
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "-q", TORCH],
             [str(python), "-m", "pip", "install", "-q", "-e", f"{ROOT}[test]", "-c",
              str(constraints), *(f"{k}=={v}" for k, v in versions.items())],
             [str(python), "-m", "pytest", "-q"]]
    for step in steps:
        print("$", " ".join(step), flush=True)
        env = {**os.environ, "CI": "1", "VIRTUAL_ENV": str(venv),
               "PATH": f"{venv}/bin{os.pathsep}{os.environ.get('PATH', '')}"}
        if subprocess.run(step, cwd=ROOT, env=env).returncode:
            return False
    return True


def resolved(venv: Path) -> dict[str, str]:
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format",
                          "json"], capture_output=True, text=True, check=True).stdout
    return {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(out)}


def widen(package: str, version: str, venv: Path) -> None:
    """pyproject.toml's range takes ``version`` in; a new ceiling also re-pins
    constraints.txt from what the passing environment resolved."""
    floor, ceiling = declared(package)
    if _key(version) > _key(ceiling):
        ceiling = version
        CONSTRAINTS.write_text(_repinned(resolved(venv)))
    floor = version if _key(version) < _key(floor) else floor
    PYPROJECT.write_text(re.sub(rf'"{package}>=[\w.]+,<=[\w.]+"',
                                f'"{package}>={floor},<={ceiling}"', PYPROJECT.read_text()))
    print(f"{package}: tested range now {declared(package)}")


def _repinned(got: dict[str, str]) -> str:
    """constraints.txt with each pin at the version ``got`` resolved (comments kept)."""
    lines = []
    for line in CONSTRAINTS.read_text().splitlines():
        name, _, pinned = line.partition("==")
        lines.append(line if line.startswith("#") or not pinned
                     else f"{name}=={got.get(name.lower(), pinned)}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--try", dest="tries", action="append", default=[], metavar="PKG==VER",
                        help="a version to test (default: the newest of each tracked package)")
    parser.add_argument("--dry-run", action="store_true", help="only say what is newer")
    args = parser.parse_args()
    tries = dict(t.split("==", 1) for t in args.tries) or \
        {p: v for p in TRACKED if _key(v := newest(p)) > _key(declared(p)[1])}
    for package in TRACKED:
        print(f"{package}: tested {declared(package)}, newest {newest(package)}")
    if not tries:
        print("the ceilings are the newest releases: nothing to try")
        return 0
    if args.dry_run:
        print("would try: " + ", ".join(f"{k}=={v}" for k, v in tries.items()))
        return 0
    with tempfile.TemporaryDirectory(prefix="fcaudit-ceiling-") as tmp:
        venv = Path(tmp) / "venv"
        if not suite_passes(tries, venv):
            print("the test command failed: the tested range stays as it is")
            return 1
        for package, version in tries.items():
            widen(package, version, venv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
