"""Result files read back: a tampered or damaged ``audit.json`` is refused at read.

``AuditResult.read`` / ``from_json`` (and so ``fcaudit compare``) walk the dataclasses that
define audit.json: a value of the wrong JSON type anywhere, a NaN or an infinity, a
missing or unknown field, a missing condition, is refused in one line that names the file
and the field's dotted path. The paths expected here are built by this file's own walker
over the JSON, not by fcaudit. A well-formed file whose bytes differ from the SHA-256 the
output folder's marker recorded is refused as edited; one whose numbers contradict each
other (a penalty that is not its NLL minus correct's, an estimate outside its own
interval) is refused wherever it lies. A hostile file (nested 100,000 deep, a number of
400 digits, a FIFO, ``/dev/zero``) is refused in one line, never a raw RecursionError,
OverflowError or a read that never ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import toys
from conftest import FAST, run_inprocess, toy_data

import fcaudit
from fcaudit.api import audit
from fcaudit.core.errors import FcauditError
from fcaudit.engine.result import AuditResult
from fcaudit.io.fileio import MAX_JSON_BYTES

FREE_FORM = ("settings", "runtime", "data")  # free-form sections (data: typed keys below)
TYPED_DATA = {"eval_sequences": int, "calib_sequences": int, "seq_len": int,
              "eval_tokens": int, "eval_fingerprint": str, "calib_fingerprint": str}


@pytest.fixture(scope="module")
def audits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Audits whose audit.json holds every optional section between them: execution with
    timing, routing and expert importance, a frontier, a --target-ci stopping section; and
    a position model on the same data, to compare against."""
    root = tmp_path_factory.mktemp("results")
    executed = dataclasses.replace(FAST, execution=True, timing_pairs=10)
    audit(toys.content_model(), root / "gate", sites=["gates.*"], data=toy_data(),
          dense=toys.constant_model(), blocks="gates.*", options=executed, report=False)
    audit(toys.position_model(), root / "position", sites=["gates.*"], data=toy_data(),
          options=FAST, report=False)
    audit(toys.token_router_model(), root / "router", data=toy_data(),
          options=dataclasses.replace(FAST, expert_ablation=True), report=False)
    audit(toys.informative_gated_model(), root / "frontier", data=toy_data(),
          options=dataclasses.replace(executed, frontier=True, timing_pairs=0), report=False)
    audit(toys.content_model(), root / "stop", sites=["gates.*"], data=toy_data(24),
          options=dataclasses.replace(FAST, target_ci=0.5, min_sequences=8), report=False)
    return {p.name: p for p in root.iterdir()}


def raw(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "audit.json").read_text(encoding="utf-8"))


def dotted(path: tuple[str | int, ...]) -> str:
    """A field's path as messages name it: ``conditions.reassign.ci95[0]``, a key that is
    not a plain word in brackets (``variance['gates.*']``)."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z0-9_+\-]+", part):
            text += ("." if text else "") + part
        else:
            text += f"[{part!r}]"
    return text


def leaves(node: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple, Any]]:
    """Every scalar of a JSON tree with its path."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from leaves(value, (*path, i))
    else:
        yield path, node


def one_per_field(data: dict) -> Iterator[tuple[tuple, Any]]:
    """One leaf per field of the schema: list items past the first repeat their type."""
    seen = set()
    for path, value in leaves(data):
        shape = tuple("*" if isinstance(p, int) else p for p in path)
        if shape not in seen:
            seen.add(shape)
            yield path, value


@contextlib.contextmanager
def put(data: dict, path: tuple, value: Any) -> Iterator[dict]:
    """``data`` with the leaf at ``path`` set to ``value`` for the block, then restored."""
    node = data
    for part in path[:-1]:
        node = node[part]
    kept = node[path[-1]]
    node[path[-1]] = value
    try:
        yield data
    finally:
        node[path[-1]] = kept


def refusal(data: Any, source: str = "somewhere/audit.json") -> str:
    with pytest.raises(FcauditError) as raised:
        AuditResult.from_json(data, source)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(source), message
    return message


def wrong_kind(value: Any) -> Any:
    """A JSON value of another kind than ``value``'s: a string for a number, a number for a
    string, a string for true/false."""
    return 7 if isinstance(value, str) else str(value)


@pytest.mark.parametrize("name", ["gate", "router", "frontier", "stop"])
def test_every_typed_field_refuses_a_value_of_another_kind(audits: dict[str, Path],
                                                           name: str) -> None:
    data = raw(audits[name])
    checked = 0
    for path, value in one_per_field(data):
        if path[0] in FREE_FORM or value is None or path == ("schema",):
            continue
        with put(data, path, wrong_kind(value)) as edited:
            message = refusal(edited)
        assert f": {dotted(path)} is " in message, (path, message)
        checked += 1
    for key, kind in TYPED_DATA.items():  # data's keys fcaudit defines are typed too
        with put(data, ("data", key), "x" if kind is int else 7) as edited:
            message = refusal(edited)
        assert f": data.{key} is " in message, message
    assert checked > 60  # every section of the schema was reached


@pytest.mark.parametrize("name", ["gate", "router", "frontier", "stop"])
def test_every_number_refuses_nan_and_infinity(audits: dict[str, Path], name: str) -> None:
    """Nowhere, free-form sections included: fcaudit never writes them (allow_nan=False).
    Each number in turn is made NaN, +inf or -inf."""
    data = raw(audits[name])
    numbers = [p for p, v in one_per_field(data)
               if isinstance(v, (int, float)) and not isinstance(v, bool)]
    assert len(numbers) > 30
    for i, path in enumerate(numbers):
        bad = (math.nan, math.inf, -math.inf)[i % 3]
        with put(data, path, bad) as edited:
            message = refusal(edited)  # a count says "the number nan, expected a whole number"
        assert f": {dotted(path)} is " in message and f"{bad}, expected a " in message, message


def _delete(path: tuple) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        node = data
        for part in path[:-1]:
            node = node[part]
        del node[path[-1]]
    return edit


def _set(path: tuple, value: Any) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        node = data
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
    return edit


# name -> (edit of the gate audit's JSON, the words of the one line after the file's name)
TAMPERED: dict[str, tuple[Callable[[dict], None], str]] = {
    "string delta": (_set(("conditions", "reassign", "delta"), "0.5"),
                     "conditions.reassign.delta is the string '0.5', expected a number"),
    "missing condition": (_delete(("conditions", "shuffle")),
                          "conditions.shuffle is missing (and not_applicable does not list it)"),
    "missing correct": (_delete(("conditions", "correct")), "conditions.correct is missing"),
    "correct not applicable": (
        lambda d: (d["conditions"].pop("correct"), d.update(not_applicable={"correct": "x"})),
        "not_applicable.correct names a condition every audit runs"),
    "condition also not applicable": (
        _set(("not_applicable",), {"shuffle": "no positions"}),
        "conditions.shuffle is measured, yet not_applicable lists it"),
    "unknown condition": (lambda d: d["conditions"].update(mystery=d["conditions"]["reassign"]),
                          "conditions.mystery is not a condition this schema defines"),
    "nan": (_set(("conditions", "reassign", "nll"), math.nan),
            "conditions.reassign.nll is nan, expected a finite number"),
    "missing nested key": (_delete(("model", "fingerprint")), "model.fingerprint is missing"),
    "missing retention": (_delete(("retention", "static-layer")),
                          "retention.static-layer is missing"),
    "missing interaction": (_set(("interaction",), None),
                            "interaction is missing, yet shuffle was measured"),
    "interval of three": (_set(("conditions", "reassign", "ci95"), [0.1, 0.2, 0.3]),
                          "conditions.reassign.ci95 holds 3 values, expected 2"),
    "reversed interval": (_set(("conditions", "reassign", "ci95"), [0.3, 0.1]),
                          "conditions.reassign.ci95 is [0.3, 0.1], whose bounds are reversed"),
    "true for a number": (_set(("per_layer", "reassign", 1, "delta"), True),
                          "per_layer.reassign[1].delta is true, expected a number"),
    "null for a number": (_set(("execution", "timing", "pairs"), None),
                          "execution.timing.pairs is null, expected a whole number"),
    "fraction for a count": (_set(("model", "n_params"), 1.5),
                             "model.n_params is the number 1.5, expected a whole number"),
    "unknown field": (_set(("conditions", "reassign", "note"), "mine"),
                      "conditions.reassign.note is not a field of this schema"),
    "list for an object": (_set(("verdict",), ["yes"]), "verdict is a list, expected an object"),
    "object for a list": (_set(("sites", 0, "trailing_shape"), {"0": 64}),
                          "sites[0].trailing_shape is an object, expected a list"),
    "number for a string": (_set(("sites", 1, "name"), 1),
                            "sites[1].name is the number 1, expected a string"),
    "data count": (_set(("data", "eval_sequences"), "12"),
                   "data.eval_sequences is the string '12', expected a whole number"),
    "nested map key": (_set(("variance", "gates.*", "components", 2, "index"), "2"),
                       "variance['gates.*'].components[2].index is the string '2', expected "
                       "a list"),
    # well typed, but the numbers contradict each other (edited by hand)
    "delta not nll minus correct": (_set(("conditions", "reassign", "delta"), 0.001),
                                    "conditions.reassign.delta is 0.001, but the penalty is "
                                    "nll - correct.nll: "),
    "nll not the mean of its repeats": (_set(("conditions", "reassign", "repeats", 0), 99.0),
                                        "conditions.reassign.nll is "),
    "repeat penalty": (_set(("conditions", "shuffle", "repeat_deltas", 1), 0.5),
                       "conditions.shuffle.repeat_deltas[1] is 0.5, but a repeat's penalty is "
                       "its NLL minus correct.nll: "),
    "penalty outside its interval": (lambda d: _shift(d["per_layer"]["reassign"][0], 1.0),
                                     "per_layer.reassign[0].delta is "),
    "retention value": (_set(("retention", "static-layer", "value"), 50.0),
                        "retention.static-layer.value is 50.0, but the share is 100 "
                        "(global-mean - static-layer) / gap (nll): "),
    "retention gap": (_set(("retention", "static-layer-token", "gap"), 9.0),
                      "retention.static-layer-token.gap is 9.0, but the gap is global-mean "
                      "minus correct (nll): "),
    "retention defined without a value": (_set(("retention", "static-layer", "defined"), False),
                                          "retention.static-layer.defined is false, yet the "
                                          "value is "),
    "retention outside its interval": (lambda d: d["retention"]["static-layer"].update(
        ci95=[d["retention"]["static-layer"]["value"] + 1, 200.0]),
        "retention.static-layer.value is "),
    "interaction": (_set(("interaction", "value"), 1.0),
                    "interaction.value is 1.0, but the interaction is Delta(reassign+shuffle) "
                    "- Delta(reassign) - Delta(shuffle): "),
}


def _edit_reassign(data: dict, delta: float) -> None:
    """reassign's penalty set to ``delta`` everywhere it enters (its NLL, repeats, interval
    and the interaction), so the edited numbers still agree with each other."""
    by = delta - data["conditions"]["reassign"]["delta"]
    reassign = data["conditions"]["reassign"]
    _shift(reassign, by)
    reassign["ci95"] = [v + by for v in reassign["ci95"]]
    data["interaction"] = {"value": data["interaction"]["value"] - by,
                           "ci95": [v - by for v in data["interaction"]["ci95"]]}


def _shift(cond: dict, by: float) -> None:
    """A condition's NLL and penalty moved by ``by`` everywhere but its interval."""
    cond["nll"] += by
    cond["delta"] += by
    cond["repeats"] = [v + by for v in cond["repeats"]]
    cond["repeat_deltas"] = [v + by for v in cond["repeat_deltas"]]


@pytest.mark.parametrize("case", list(TAMPERED))
def test_compare_refuses_a_tampered_audit_at_read(case: str, audits: dict[str, Path],
                                                  tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A copy outside its folder (no marker to consult): the content alone is refused."""
    edit, words = TAMPERED[case]
    data = raw(audits["gate"])
    edit(data)
    folder = tmp_path / "tampered"
    folder.mkdir()
    file = folder / "audit.json"
    file.write_text(json.dumps(data), encoding="utf-8")  # NaN written as NaN, as Python does
    out = tmp_path / "cmp"
    res = run_inprocess(["compare", audits["position"], folder, "--out", out], capsys)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(f"fcaudit: error: {file} is not a valid fcaudit.audit/1 "
                                 f"result: {words}"), res.stderr
    assert "rerun the audit or restore the file" in res.stderr
    assert not out.exists()
    with pytest.raises(FcauditError, match=re.escape(words)):
        AuditResult.read(file)


def test_the_field_is_named_in_the_audit_folder_too(audits: dict[str, Path],
                                                    tmp_path: Path) -> None:
    """In its own folder (the marker's digest no longer matches) a malformed file is still
    refused by the field it breaks, the more useful of the two lines."""
    folder = tmp_path / "gate"
    shutil.copytree(audits["gate"], folder)
    data = raw(folder)
    data["conditions"]["reassign"]["delta"] = "0.5"
    (folder / "audit.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(FcauditError, match=r"conditions\.reassign\.delta is the string '0\.5'"):
        AuditResult.read(folder / "audit.json")


def _estimates(node: Any, path: str = "") -> Iterator[tuple[str, dict]]:
    """Every ``{value, ci95}`` estimate in the JSON with the dotted path messages use."""
    if isinstance(node, dict):
        if isinstance(node.get("value"), float) and isinstance(node.get("ci95"), list):
            yield path, node
        for key, value in node.items():
            yield from _estimates(value, f"{path}.{key}" if path else key)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _estimates(value, f"{path}[{i}]")


def test_an_analysis_s_estimate_outside_its_interval_is_named_at_its_key(
        audits: dict[str, Path]) -> None:
    """An analysis's section sits at audit.json's top level: an estimate moved outside its
    own interval is refused by the path a reader finds it at (no ``analyses.`` before it),
    for every estimate of the frontier's section and of an exit model's."""
    from tests.test_exit_conditions import audit as exit_audit
    from tests.test_exit_conditions import make as exit_model
    for data, key in ((raw(audits["frontier"]), "frontier"), (exit_audit(exit_model()), "exits")):
        found = list(_estimates(data[key], key))
        assert found, key
        for path, _ in found:
            edited = json.loads(json.dumps(data))
            target = dict(_estimates(edited[key], key))[path]
            target["value"] = target["ci95"][1] + 1.0
            with pytest.raises(FcauditError, match=re.escape(f"result: {path}.value is ")):
                AuditResult.from_json(edited)


def test_an_edited_number_is_refused_by_the_recorded_digest(
        audits: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A well-formed edit (a penalty made smaller) in the audit's own folder: the marker's
    SHA-256 no longer matches, and compare refuses rather than table a number the audit
    never measured (the edit moves the penalty everywhere it enters, so only the digest
    can tell). The same bytes outside any output folder carry no record and read; a
    penalty that is not its NLL minus correct's is refused there too."""
    folder = tmp_path / "gate"
    shutil.copytree(audits["gate"], folder)
    data = raw(folder)
    _edit_reassign(data, 0.001)  # consistent: only the recorded digest can tell
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    (folder / "audit.json").write_text(text, encoding="utf-8")
    res = run_inprocess(["compare", audits["position"], folder, "--out", tmp_path / "cmp"],
                        capsys)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"audit result {folder / 'audit.json'} was changed after fcaudit wrote it" in \
        res.stderr and ".fcaudit-output.json recorded" in res.stderr, res.stderr
    assert not (tmp_path / "cmp").exists()
    loose = tmp_path / "loose.json"  # no record to consult: it reads (edited consistently)
    loose.write_text(text, encoding="utf-8")
    assert AuditResult.read(loose).conditions["reassign"].delta == pytest.approx(0.001)
    data["conditions"]["reassign"]["delta"] = 0.002  # not its NLL minus correct's
    loose.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(FcauditError, match=re.escape(
            f"{loose} is not a valid fcaudit.audit/1 result: conditions.reassign.delta is "
            "0.002, but the penalty is nll - correct.nll: ")):
        AuditResult.read(loose)
    restored = tmp_path / "restored"  # the original bytes back: read again
    shutil.copytree(audits["gate"], restored)
    assert AuditResult.read(restored / "audit.json").conditions["reassign"].delta == \
        raw(audits["gate"])["conditions"]["reassign"]["delta"]


def test_an_edited_result_can_be_compared_when_loaded_on_purpose(
        audits: dict[str, Path], tmp_path: Path) -> None:
    """The deliberate route: parse it yourself and pass the AuditResult (checked the same:
    the edit moves reassign's penalty everywhere it enters, interval and interaction
    included, so the numbers still agree with each other)."""
    data = raw(audits["gate"])
    _edit_reassign(data, 0.001)
    edited = AuditResult.from_json(data)
    comparison = fcaudit.compare([audits["position"], edited], labels=["position", "edited"])
    penalty = next(q for q in comparison.to_json()["tables"]["quantities"]
                   if q["name"] == "reassign")
    assert penalty["models"]["edited"]["value"] == pytest.approx(0.001, abs=1e-12)


def test_every_audit_reads_back_equal(audits: dict[str, Path]) -> None:
    """The strict reader accepts everything fcaudit writes, unchanged."""
    for folder in audits.values():
        result = AuditResult.read(folder / "audit.json")
        assert result.to_json() == raw(folder)


def test_a_file_of_another_version_says_which_wrote_it(audits: dict[str, Path]) -> None:
    """The same schema tag with a field this version does not know: the advice names the
    version that wrote it rather than calling the file damaged."""
    data = raw(audits["gate"])
    data["fcaudit_version"] = "99.0"
    data["conditions"]["reassign"]["new_measure"] = 1.0
    message = refusal(data)
    assert "conditions.reassign.new_measure is not a field of this schema; it was written " \
        "by fcaudit 99.0 (this is " in message and "edited" not in message, message


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def _sparse(path: Path, size: int) -> None:
    """A file of ``size`` bytes that takes no disk space (a hole)."""
    with path.open("wb") as fh:
        fh.truncate(size)


def _text_edit(field: str, literal: str) -> Callable[[Path, dict], str]:
    """The gate audit's text with one number (``conditions.reassign.FIELD``) replaced by
    ``literal`` as written (a number Python's json would never write)."""
    def text(_: Path, data: dict) -> str:
        data["conditions"]["reassign"][field] = "@"
        return json.dumps(data).replace('"@"', literal)
    return text


# a hostile file at PATH (built from the gate audit's JSON) -> the words after its name
HOSTILE: dict[str, tuple[Callable[[Path, dict], str | None], str]] = {
    "nested 100,000 deep": (lambda _, __: _deep(100_000),
                            "nests arrays or objects more than 100 levels deep"),
    "nested 150 deep in settings": (
        lambda _, d: json.dumps({**d, "settings": {**d["settings"], "x": json.loads(_deep(150))}}),
        "nests arrays or objects more than 100 levels deep"),
    "an integer of 400 digits": (_text_edit("nll", str(10 ** 400)),
                                 "holds an integer of 401 digits, beyond the range of a float"),
    "a count of 5000 digits": (_text_edit("nll", "9" * 5000),
                               "holds an integer of 5000 digits, beyond the range of a float"),
    "a float literal beyond the range": (_text_edit("delta", "1e400"),
                                         "holds the number 1e400, beyond the range of a float"),
    "a FIFO": (lambda path, _: os.mkfifo(path), "is a FIFO (named pipe), not a file"),
    "a file beyond the reader's bound": (lambda path, _: _sparse(path, MAX_JSON_BYTES + 1),
                                         f"holds more than {MAX_JSON_BYTES} bytes"),
}


def _within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``'s value or exception, failing the test if it takes longer (a blocked read)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "the read did not return: it blocked"
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_file_is_refused_in_one_line(case: str, audits: dict[str, Path],
                                               tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    make, words = HOSTILE[case]
    folder = tmp_path / "hostile"
    folder.mkdir()
    file = folder / "audit.json"
    text = make(file, raw(audits["gate"]))
    if text is not None:
        file.write_text(text, encoding="utf-8")
    with pytest.raises(FcauditError) as err:
        _within(20, lambda: AuditResult.read(file))
    assert str(err.value).startswith(f"audit result {file} {words}"), str(err.value)
    res = _within(20, lambda: run_inprocess(["compare", audits["position"], file, "--out",
                                             tmp_path / "cmp"], capsys))
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(f"fcaudit: error: audit result {file} {words}"), res.stderr
    assert not (tmp_path / "cmp").exists()


def test_a_device_is_refused_before_it_is_read() -> None:
    """``/dev/zero`` never ends: refused by its kind, before a byte is read."""
    with pytest.raises(FcauditError, match=r"^audit result /dev/zero is a character device, "
                                           r"not a file; give the path of the file itself$"):
        _within(20, lambda: AuditResult.read("/dev/zero"))


def test_hostile_values_given_in_memory_are_refused_too(audits: dict[str, Path]) -> None:
    """``from_json`` of parsed data (no file, so no reader's bounds): nesting past Python's
    recursion limit and an integer no float holds are still one line each."""
    data = raw(audits["gate"])
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with put(data, ("settings",), {"x": deep}) as edited:
        assert "it nests too deeply to be one" in refusal(edited)
    for value in (10 ** 400, -(10 ** 400)):
        with put(data, ("conditions", "reassign", "nll"), value) as edited:
            assert "conditions.reassign.nll is an integer of 1329 bits, beyond the range of " \
                "a float" in refusal(edited)
        with put(data, ("model", "n_params"), value) as edited:
            assert "model.n_params is an integer of 1329 bits" in refusal(edited)
        with put(data, ("settings",), {**data["settings"], "x": value}) as edited:
            assert "settings.x is an integer of 1329 bits" in refusal(edited)


def test_every_other_reader_of_result_files_refuses_them_alike(tmp_path: Path) -> None:
    """The trend's point summaries, a study's timings, the cache's manifest and the output
    folder's recognition read through the same guarded reader: a FIFO never blocks them."""
    from fcaudit.io.fileio import read_json
    from fcaudit.io.outdir import check_output
    from fcaudit.study.trend import read_points
    points = tmp_path / "points"
    points.mkdir()
    os.mkfifo(points / "a.json")
    with pytest.raises(FcauditError, match="trend point summary .*a.json is a FIFO"):
        _within(20, lambda: read_points(points))
    with pytest.raises(FcauditError, match="study timings .*is a FIFO"):
        _within(20, lambda: read_json(points / "a.json", "study timings"))
    with pytest.raises(FcauditError, match=f"^audit result {tmp_path} is a folder, not a file"):
        AuditResult.read(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "audit.json")  # not recognised as an audit folder: refused, not blocked
    with pytest.raises(FcauditError, match="holds files fcaudit did not write"):
        _within(20, lambda: check_output(out, "audit"))
