"""The README's Python example runs as written, and its commands exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def _python_example() -> str:
    section = README.read_text(encoding="utf-8").split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_python_api_example_runs(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", _python_example()], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].split(" dependence")[0] in ("Strong", "Weak", "Partial", "No measurable")
    assert lines[1].endswith("fcaudit.audit/1")
    assert list(tmp_path.iterdir()) == []  # in memory: nothing written


def test_every_command_the_readme_shows_exists() -> None:
    from fcaudit.cli import build_parser
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    blocks = "".join(re.findall(r"```bash\n(.*?)```", README.read_text(), re.S))
    shown = set(re.findall(r"^(?:torchrun .*?-m )?fcaudit (\w+)", blocks, re.M))
    assert shown and shown <= commands


def test_quoted_wall_times_come_from_the_timings_script() -> None:
    """benchmarks/timings.py measures them; README and --help quote the same numbers."""
    from fcaudit.cli import build_parser
    from fcaudit.runtime import measured_minutes
    text = README.read_text(encoding="utf-8")
    assert f"about {measured_minutes('demo')} minutes on a 2-core CPU" in text
    assert f"about {measured_minutes('tests')} minutes on 2 cores" in text
    assert f"{measured_minutes('reproduce_tiny')} minutes on 2 cores" in text
    assert f"about {measured_minutes('reproduce_trend')} minutes on 2 cores" in text
    help_text = build_parser().format_help()
    assert f"about {measured_minutes('demo')} minutes" in help_text
