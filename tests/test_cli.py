"""The command line as a newcomer meets it: instant help, sites that teach, progress in
logs, factories imported from the current folder."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_inprocess

from fcaudit.report.progress import ProgressReporter

TESTS = Path(__file__).parent


def test_help_and_argument_errors_do_not_import_torch() -> None:
    code = ("import sys\nfrom fcaudit.cli import main\ntry:\n    main(['--help'])\n"
            "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    bad = subprocess.run([sys.executable, "-m", "fcaudit", "audit"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "--model" in bad.stderr


def test_sites_all_shows_outputs_and_marks_likely_controllers(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    res = run_inprocess(["sites", "--model", "toys:content_model", "--all"], capsys)
    assert res.returncode == 0, res.stderr
    assert "no declared controller sites" in res.stdout
    line = next(ln for ln in res.stdout.splitlines() if ln.strip().startswith("gates.0"))
    assert "Tensor[2, 7, 64]" in line and "likely controller" in line


def test_sites_help_describes_itself(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run_inprocess(["sites", "--help"], capsys)
    text = capsys.readouterr().out
    assert "controller" in text and "--all" in text and "output type and shape" in text


def test_progress_prints_plain_lines_when_not_a_terminal() -> None:
    stream = io.StringIO()
    with ProgressReporter(True, stream=stream, interval=0.0) as progress:
        for done in range(1, 4):
            progress("replay", done, 3, f"batch {done}")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("fcaudit: replay: 1/3 batch 1") and len(lines) == 3
    within = io.StringIO()  # a stage that starts over each batch: the interval only
    with ProgressReporter(True, stream=within, interval=3600.0) as progress:
        for batch in range(1, 5):
            for done in range(1, 31):
                progress("passes of this batch", done, 30, f"batch {batch} of 4")
            progress("replay", batch, 4, f"batch {batch} of 4")
    lines = within.getvalue().splitlines()
    # the inner stage's first line and its first completion, then nothing until the
    # interval; the batch stage's first line and its completion
    assert [ln.split(" [")[0] for ln in lines] == [
        "fcaudit: passes of this batch: 1/30 batch 1 of 4",
        "fcaudit: passes of this batch: 30/30 batch 1 of 4",
        "fcaudit: replay: 1/4 batch 1 of 4", "fcaudit: replay: 4/4 batch 4 of 4"]
    quiet = io.StringIO()
    with ProgressReporter(False, stream=quiet) as progress:
        progress("replay", 1, 3)
    assert quiet.getvalue() == ""


def test_a_factory_in_the_current_folder_is_importable(tmp_path: Path) -> None:
    (tmp_path / "mymodel.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nimport toys\n\ndef build():\n"
        "    return toys.content_model()\n")
    proc = subprocess.run([sys.executable, "-m", "fcaudit", "sites", "--model",
                           "mymodel:build"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "no declared controller sites" in proc.stdout


def test_the_summary_says_the_identity_check_as_the_report_does(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The console names the identity replay's outcome: bitwise exact, or how far from it
    and why the audit went on (before, only the report said it)."""
    import dataclasses

    import toys
    from conftest import FAST, toy_data

    import fcaudit
    from fcaudit.cli.commands import print_summary
    from fcaudit.engine.result import Identity
    result = fcaudit.audit(toys.content_model(), None, sites=["gates.*"], data=toy_data(),
                           options=FAST)
    measured = "max |per-token NLL(correct) − NLL(original)|"
    print_summary(result, Path("out"))
    said = " ".join(capsys.readouterr().out.split())
    assert (f"identity replay: bitwise exact: replaying the recorded coefficients reproduced "
            f"the original pass bit for bit ({measured} = 0.0000)") in said
    inexact = Identity(exact=False, max_abs_diff=2.5e-6, allowed_nonexact=True,
                       note="cuBLAS kernels are not deterministic")
    print_summary(dataclasses.replace(result, identity=inexact), Path("out"))
    said = " ".join(capsys.readouterr().out.split())
    assert (f"identity replay: not exact ({measured} = 2.500e-06), accepted only because the "
            "audit was run with --allow-nonexact-identity") in said
    assert "**" not in said and "`" not in said  # the console's words, not Markdown
