"""The versions of the packages whose internals fcaudit reads are the ones the suite
passed on: pyproject.toml's ``hf`` extra declares a closed range, constraints.txt pins
its ceiling (what CI and the README's commands install), and an installed version outside
the range is said in one line at run time."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from conftest import optional_extra

from fcaudit.io import runtime

ROOT = Path(__file__).resolve().parent.parent
packaging = optional_extra("packaging.specifiers")


def _pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return dict(ln.split("==", 1) for ln in lines if ln and not ln.startswith("#"))


def _extra(name: str) -> dict[str, str]:
    """Package -> specifier of one extra of pyproject.toml (its list of quoted strings)."""
    text = (ROOT / "pyproject.toml").read_text()
    listed = re.search(rf"^{name} = \[(.*?)\]$", text, re.M | re.S).group(1)
    return dict(re.match(r"([\w-]+)(.*)", req).groups()
                for req in re.findall(r'"([^"]+)"', listed))


def test_every_internals_package_has_a_closed_range_whose_ceiling_is_the_pin() -> None:
    pins = _pins()
    internals = {**_extra("hf"), **_extra("gguf"), **_extra("lm-eval")}
    internals.pop("fcaudit")  # gguf's extra takes hf's in by name
    assert set(internals) == {"transformers", "accelerate", "gguf", "lm_eval"}
    for package, spec in internals.items():
        floor, ceiling = re.fullmatch(r">=([\w.]+),<=([\w.]+)", spec).groups()
        assert pins[package] == ceiling, package
        assert packaging.SpecifierSet(spec).contains(floor), package


def test_every_pin_satisfies_what_fcaudit_declares() -> None:
    declared = {**_extra("hf"), **_extra("gguf"), **_extra("lm-eval"), **_extra("test")}
    for package, version in _pins().items():
        assert re.fullmatch(r"[\d.]+", version), package
        if package in declared:
            assert packaging.SpecifierSet(declared[package]).contains(version), package


def test_the_readme_and_ci_install_with_the_constraints() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^python3 -m venv .*$", readme, re.M)
    assert len(commands) == 2
    for command in commands:
        assert "-c constraints.txt" in command
    assert re.search(r'pip install -q -e "\.\[test\]" -c constraints\.txt',
                     (ROOT / ".ci" / "run").read_text())


def test_an_installed_version_outside_the_range_is_said_in_one_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    optional_extra("transformers")
    try:
        metadata.requires("fcaudit")
    except metadata.PackageNotFoundError:
        pytest.skip("fcaudit's metadata is not installed (a source tree on PYTHONPATH)")
    assert runtime.untested_versions() == []  # what CI installs is within the range
    real = metadata.version
    monkeypatch.setattr(metadata, "version",
                        lambda name: "99.0.0" if name == "transformers" else real(name))
    lines = runtime.untested_versions()
    spec = _extra("hf")["transformers"]
    assert lines == [f"transformers 99.0.0 is outside the versions fcaudit's tests passed on "
                     f"({packaging.SpecifierSet(spec)}): fcaudit reads its internals, which "
                     "may have moved; check the site list and the identity replay, or install "
                     f"a tested one (pip install 'transformers{packaging.SpecifierSet(spec)}')"]
