"""Errors speak the caller's language: a Python caller reads the argument (``sites=``),
the command line reads the flag (``--sites``), and neither message names the other."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
import toys
from conftest import TOY, run_inprocess

import fcaudit
from fcaudit.core.errors import FcauditError, arg, render

SRC = Path(fcaudit.__file__).parent
LIBRARY = ("core", "engine", "io", "models", "report", "api.py")


def test_an_argument_renders_for_each_reader() -> None:
    message = f"{arg('seq_len', 512)} exceeds; use {arg('text', cli='--data')} or " \
              f"{arg('repeats', 3, owner='AuditOptions')}"
    assert render(message) == "seq_len=512 exceeds; use text= or AuditOptions(repeats=3)"
    assert render(message, cli=True) == "--seq-len 512 exceeds; use --data or --repeats 3"
    error = FcauditError(message)
    assert str(error) == render(message) and error.for_cli() == render(message, cli=True)
    quoted = FcauditError(f"outer: {error}")  # quoting keeps the options unrendered
    assert quoted.for_cli() == "outer: " + render(message, cli=True)


def _data() -> fcaudit.AuditData:
    return fcaudit.AuditData(toys.pair_sequences(8, 16, 1), toys.pair_sequences(8, 16, 2),
                             {"source": "tokens"})


CASES = [  # (Python call, CLI arguments, Python words, CLI words)
    (lambda: fcaudit.audit(toys.content_model(), sites=["nothing.*"], data=_data()),
     ["--sites", "nothing.*"], "sites='nothing.*'", "--sites 'nothing.*'"),
    (lambda: fcaudit.audit(toys.content_model(), sites=["gates.*"], data=_data(),
                           options=fcaudit.AuditOptions(repeats=0)),
     [*TOY[2:], "--repeats", "0"], "AuditOptions(repeats=0)", "--repeats 0"),
    (lambda: fcaudit.audit(toys.content_model(), sites=["gates.*"], data=_data(),
                           dense="toys:content_model",
                           options=fcaudit.AuditOptions(execution=False)),
     [*TOY[2:], "--dense", "toys:content_model", "--no-execution"],
     "execution=False", "--no-execution"),
    (lambda: fcaudit.audit(toys.content_model(), sites=["gates.*"],
                           data=fcaudit.DataSpec(tokens="e.npy")),
     [*TOY[2:], "--tokens", "{eval}"], "calib_tokens=", "--calib-tokens"),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_python_and_cli_each_read_their_own_words(case: int, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    call, argv, py_words, cli_words = CASES[case]
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "e.npy", toys.pair_sequences(8, 16, 1))
    with pytest.raises(FcauditError) as raised:
        call()
    python = str(raised.value)
    commands_aside = re.sub(r"`[^`]*`", "", python)  # `fcaudit sites --all` is a command
    assert py_words in python and not re.search(r"(?<![\w-])--[a-z]", commands_aside), python
    argv = [a.replace("{eval}", str(tmp_path / "e.npy")) for a in argv]
    result = run_inprocess(["audit", "--model", TOY[1], *argv, "--out", tmp_path / "out"],
                           capsys)
    assert result.returncode == 2 and cli_words in result.stderr, result.stderr
    assert py_words not in result.stderr, result.stderr


# FcauditError and every kind of it (UsageError, DataError, ...), by class name
ERROR_KINDS = {cls.__name__ for cls in (FcauditError, *FcauditError.__subclasses__(),
                                        *(k for c in FcauditError.__subclasses__()
                                          for k in c.__subclasses__()))}


def _messages(tree: ast.AST) -> list[tuple[int, str]]:
    """The literal text of every FcauditError(...) message (of any kind) in a module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ERROR_KINDS:
            for part in ast.walk(node):
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    found.append((part.lineno, part.value))
    return found


def test_no_library_message_names_a_command_line_flag() -> None:
    """Library layers name options through arg(); a literal --flag would reach a Python
    caller as a flag (a command shown in backticks, like `fcaudit sites --all`, is fine)."""
    offending = []
    for path in sorted(p for name in LIBRARY for p in
                       ([SRC / name] if name.endswith(".py") else (SRC / name).rglob("*.py"))):
        for line, text in _messages(ast.parse(path.read_text(), str(path))):
            outside = re.sub(r"`[^`]*`", "", text)
            if re.search(r"(?<![\w-])--[a-z]", outside):
                offending.append(f"{path.relative_to(SRC)}:{line}: {text.strip()[:70]}")
    assert offending == []
