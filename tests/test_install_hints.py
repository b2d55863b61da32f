"""Every suggestion to install an extra works from a clone: fcaudit is not on PyPI, so
`pip install "fcaudit[hf]"` fails. In the source, README, docs and every `--help`, an
extra is suggested only as `pip install -e ".[NAME]"` and NAME is an extra pyproject.toml
declares; the messages that suggest one say exactly that."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from fcaudit.cli.parser import build_parser
from fcaudit.core.errors import install_extra

ROOT = Path(__file__).parent.parent
# every page a user follows (the reliability catalogue quotes the faults it fixed)
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md",
         *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "reliability.md")]
SOURCES = sorted((ROOT / "src" / "fcaudit").rglob("*.py"))
# an extra named with the package (fails: not on PyPI), or any install of a bracketed extra
BY_NAME = re.compile(r"fcaudit\[")
EXTRA = re.compile(r"pip install(?: -\w+)* ([\"']?)([^\s\"']*)\[([\w,-]+)\]\1")


def _extras() -> set[str]:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return set(project["optional-dependencies"])


def _help_texts() -> dict[str, str]:
    top = build_parser()
    commands = top._subparsers._group_actions[0].choices
    return {"fcaudit --help": top.format_help(),
            **{f"fcaudit {name} --help": p.format_help() for name, p in commands.items()}}


def _suggestions(text: str) -> list[tuple[str, str, str]]:
    return [(m.group(0), m.group(2), m.group(3)) for m in EXTRA.finditer(" ".join(text.split()))]


def test_no_text_names_an_extra_by_the_package_name() -> None:
    texts = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in PAGES + SOURCES}
    texts |= _help_texts()
    named = [name for name, text in texts.items() if BY_NAME.search(text)]
    assert named == []


def test_every_suggested_extra_is_the_clone_form_of_a_declared_extra() -> None:
    extras = _extras()
    texts = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in PAGES}
    texts |= _help_texts()
    found = 0
    for name, text in texts.items():
        for said, target, extra in _suggestions(text):
            assert said.startswith("pip install -e ") and target == ".", (name, said)
            assert set(extra.split(",")) <= extras, (name, said)
            found += 1
    assert found >= 6  # README's four extras, --help's hf and vision


def test_the_source_suggests_an_extra_only_through_install_extra() -> None:
    """A literal `pip install ...[x]` in the source would bypass the one wording."""
    literal = [str(p.relative_to(ROOT)) for p in SOURCES
               if EXTRA.search(p.read_text(encoding="utf-8"))]
    assert literal == []
    assert install_extra("hf") == 'pip install -e ".[hf]" in the fcaudit clone'
    for extra in _extras():
        [(said, target, named)] = _suggestions(install_extra(extra))
        assert (target, named) == (".", extra)
