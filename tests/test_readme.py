"""The README's Python example runs as written, and its commands exist."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import optional_extra

README = Path(__file__).parent.parent / "README.md"


def _python_example() -> str:
    section = README.read_text(encoding="utf-8").split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


FEATUREGATE_LINE = 'model = GPT(PRESETS["tiny"]).eval()         # any nn.Module: here ' \
    "fcaudit's tiny FeatureGate"
# the same example on a tiny random Hugging Face MoE, whose forward returns `.logits`
MIXTRAL = ("import transformers\nmodel = transformers.AutoModelForCausalLM.from_config("
           "transformers.MixtralConfig(vocab_size=2048, hidden_size=32, num_hidden_layers=2, "
           "num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, "
           "num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)).eval()")
DUMP = "\nimport json\nprint('RESULT ' + json.dumps(result.to_json()))\n"


def expected_dependence(result: dict) -> str:
    """The verdict word from the rules docs/method.md states (computed here, not by
    fcaudit.engine.verdicts): a change counts above 1% of perplexity, log(1.01) nats; the
    static-layer retention counts when it has a value on a gap above that; strong, weak,
    none (only intervals below 0), none measurable or partial."""
    c, ret = result["conditions"], result["retention"]["static-layer"]
    small = math.log(1.01)
    kept = ret["ci95"] if ret["value"] is not None and ret["gap_ci95"][0] > small else None
    r, s = c["reassign"], c["shuffle"]
    if max(r["ci95"][0], s["ci95"][0]) > 0.1 or (kept is not None and kept[1] < 50):
        return "Strong"
    if kept is not None and kept[0] >= 90 and max(r["ci95"][1], s["ci95"][1]) < 0.05:
        return "Weak"
    penalties = [c[k]["ci95"] for k in ("reassign", "shuffle", "reassign+shuffle",
                                        "static-layer", "static-layer-position",
                                        "static-layer-token")]
    if kept is None and not any(lo > small for lo, _ in penalties):
        return "No" if any(hi < 0 for _, hi in penalties) else "No measurable"
    return "Partial"


def _run_example(code: str, cwd: Path) -> tuple[list[str], dict]:
    proc = subprocess.run([sys.executable, "-c", code + DUMP], cwd=cwd, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1].removeprefix("RESULT "))
    return lines[:-1], result


@pytest.mark.parametrize("model", ["as written", "tiny Hugging Face Mixtral"])
def test_the_python_api_example_runs(model: str, tmp_path: Path) -> None:
    code = _python_example()
    if model != "as written":
        optional_extra("transformers")
        assert FEATUREGATE_LINE in code
        code = code.replace(FEATUREGATE_LINE, MIXTRAL)
    lines, result = _run_example(code, tmp_path)
    verdict = expected_dependence(result)
    assert lines[0] == result["verdict"]["dependence"]
    assert lines[0].startswith(f"{verdict} dependence on the coefficient assignment")
    delta = result["custom_conditions"]["last-site-at-zero"]["delta"]
    assert lines[1] == f"{delta} fcaudit.audit/1"
    assert lines[2] == "reassigned gates change the logits: True"
    if model != "as written":
        assert {s["adapter"] for s in result["sites"]} == {"router"}
    assert list(tmp_path.iterdir()) == []  # in memory: nothing written


def test_every_command_the_readme_shows_exists() -> None:
    from fcaudit.cli import build_parser
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    blocks = "".join(re.findall(r"```bash\n(.*?)```", README.read_text(), re.S))
    shown = set(re.findall(r"^(?:torchrun .*?-m )?fcaudit (\w+)", blocks, re.M))
    assert shown and shown <= commands


def test_quoted_wall_times_come_from_the_timings_script() -> None:
    """benchmarks/timings.py measures them, with the load and threads beside each; README
    and --help quote the same numbers, and the README says at what load and threads."""
    from fcaudit.cli import build_parser
    from fcaudit.io.runtime import measured_minutes
    text = " ".join(README.read_text(encoding="utf-8").split())
    timings = json.loads((README.parent / "src" / "fcaudit" / "timings.json").read_text())
    for key in ("demo", "demo_train", "tests"):
        load = timings["load_average"][key]
        assert f"about {measured_minutes(key)} minutes on " in text, key
        assert f"load average {load['before'][0]:.2f} before and {load['after'][0]:.2f} " \
               "after" in text, key
    host = timings["host"]["demo"]
    assert f"{measured_minutes('demo')} minutes on {host['cores']} cores ({host['cpu']}) at " \
           f"{host['threads']} torch thread" in text
    assert f"{measured_minutes('reproduce_tiny')} minutes on 2 cores" in text
    assert f"about {measured_minutes('reproduce_trend')} minutes on 2 cores" in text
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["demo"]
                         .format_help().split())
    assert f"about {measured_minutes('demo_train')} minutes" in help_text
    assert f"about {measured_minutes('demo')} minutes" in " ".join(
        build_parser().format_help().split())


def _demo_block() -> str:
    text = README.read_text(encoding="utf-8")
    return re.search(r"<!-- fcaudit:begin demo -->(.*?)<!-- fcaudit:end demo -->", text,
                     re.S).group(1)


# (a number of the README's demo block, how `fcaudit demo` prints that number)
PRINTED_AS = (
    (r"across inputs costs ([+-]\d\.\d{4} \[[^]]+\]) nats", "{}"),
    (r"across tokens ([+-]\d\.\d{4} \[[^]]+\]);", "{}"),
    (r"per-layer profile keeps (\d+\.\d\d% \[[^]]+\])", "retention static-layer: {}"),
    (r"\(layer, token id\) (\d+\.\d\d% \[[^]]+\])", "retention static-layer-token: {}"),
    (r"gates vary: (sd across inputs [^;]+);", "({})"),
    (r"layer identity explains ([\d.]+%)", "layer identity {}"),
    (r"input and token content ([\d.]+%)", "input and token content {}"),
    (r"token id (explains [\d.]+% beyond chance \([\d.]+% against a chance level of "
     r"[\d.]+%\))", "the current token id {}"),
    (r"\| (\d\.\d\d of \d+ blocks run per token),", "{}"),
    (r"(FLOPs \d\.\d{3}x Dense), latency", "{}"),
    (r"(eval NLL \d\.\d{4} vs unigram \d\.\d{4})", "{}"),  # the FeatureGate's run
    (r"identity replay is (bitwise exact)", "identity replay: {}: replaying the recorded "
     "coefficients reproduced the original pass bit for bit"),
)
LATENCY = re.compile(r"latency [\d.]+x Dense \[[\d.]+, [\d.]+\]")


def test_the_readme_demo_is_what_fcaudit_demo_prints(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    """`fcaudit demo` audits the shipped models, here on whatever CPU and thread count this
    test runs at, and prints every number of the README's demo table but the latency:
    penalties, retentions, spreads and shares are found verbatim in its output, and the
    table rendered from this run's audit.json is the README's."""
    sys.path.insert(0, str(README.parent / "docs"))
    try:
        import doc_blocks
        import extract_results
    finally:
        sys.path.remove(str(README.parent / "docs"))
    from conftest import run_inprocess
    out = tmp_path / "demo"
    result = run_inprocess(["demo", "--quiet", "--out", out], capsys)
    assert result.returncode == 0, result.stderr
    printed = " ".join(result.stdout.split())  # rich may wrap a long line
    block = _demo_block()
    for pattern, as_printed in PRINTED_AS:
        [number] = re.findall(pattern, block)
        assert as_printed.format(number) in printed, (pattern, number)
    table = [line for line in block.splitlines() if line.startswith("|")]
    for number, millions in re.findall(r"(\d+\.\d+)(M?)",
                                       LATENCY.sub("latency", "\n".join(table))):
        if millions:  # 1.34M parameters: the demo prints the count in full
            counts = [int(c.replace(",", "")) for c in re.findall(r"([\d,]+) parameters",
                                                                  printed)]
            assert f"{counts[0] / 1e6:.2f}" == number, (number, counts)
        else:  # every other number of the table, as the demo prints it
            assert number in printed, number
    fresh = doc_blocks._demo_table(extract_results.demo(out)).splitlines()
    assert [LATENCY.sub("latency", line) for line in fresh] == \
        [LATENCY.sub("latency", line) for line in table]


def test_the_readme_explains_the_slow_tests_its_test_command_deselects() -> None:
    """The test command's last line ends "N deselected": README says which tests those are,
    why (pyproject's addopts, quoted as it is) and how to run them."""
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib
    pyproject = tomllib.loads((README.parent / "pyproject.toml").read_text(encoding="utf-8"))
    addopts = pyproject["tool"]["pytest"]["ini_options"]["addopts"]
    text = " ".join(README.read_text(encoding="utf-8").split())
    command = text.index("python -m pytest -q ```")  # the README's test command
    said = text[command:command + 600]
    assert 'ends with "N deselected": the slow tests' in said
    assert f'(`addopts = "{addopts}"` in pyproject.toml)' in said
    assert "run them with `python -m pytest -q -m slow`" in said
    slow = [p.name for p in (README.parent / "tests").glob("test_*.py")
            if "@pytest.mark.slow" in p.read_text(encoding="utf-8")]
    assert slow and addopts == "-m 'not slow'"
