"""Result files read back: a tampered or damaged ``audit.json`` is refused at read.

``AuditResult.read`` / ``from_json`` (and so ``fcaudit compare``) walk the dataclasses that
define audit.json: a value of the wrong JSON type anywhere, a NaN or an infinity, a
missing or unknown field, a missing condition, is refused in one line that names the file
and the field's dotted path. The paths expected here are built by this file's own walker
over the JSON, not by fcaudit. A well-formed file whose bytes differ from the SHA-256 the
output folder's marker recorded is refused as edited.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import shutil
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
}


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


def test_an_edited_number_is_refused_by_the_recorded_digest(
        audits: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A well-formed edit (a penalty made smaller) in the audit's own folder: the marker's
    SHA-256 no longer matches, and compare refuses rather than table a number the audit
    never measured. The same bytes outside any output folder carry no record and read."""
    folder = tmp_path / "gate"
    shutil.copytree(audits["gate"], folder)
    data = raw(folder)
    data["conditions"]["reassign"]["delta"] = 0.001
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    (folder / "audit.json").write_text(text, encoding="utf-8")
    res = run_inprocess(["compare", audits["position"], folder, "--out", tmp_path / "cmp"],
                        capsys)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"audit result {folder / 'audit.json'} was changed after fcaudit wrote it" in \
        res.stderr and ".fcaudit-output.json recorded" in res.stderr, res.stderr
    assert not (tmp_path / "cmp").exists()
    loose = tmp_path / "loose.json"
    loose.write_text(text, encoding="utf-8")
    assert AuditResult.read(loose).conditions["reassign"].delta == 0.001
    restored = tmp_path / "restored"  # the original bytes back: read again
    shutil.copytree(audits["gate"], restored)
    assert AuditResult.read(restored / "audit.json").conditions["reassign"].delta == \
        raw(audits["gate"])["conditions"]["reassign"]["delta"]


def test_an_edited_result_can_be_compared_when_loaded_on_purpose(
        audits: dict[str, Path], tmp_path: Path) -> None:
    """The deliberate route: parse it yourself and pass the AuditResult (checked the same)."""
    data = raw(audits["gate"])
    data["conditions"]["reassign"]["delta"] = 0.001
    edited = AuditResult.from_json(data)
    comparison = fcaudit.compare([audits["position"], edited], labels=["position", "edited"])
    penalty = next(q for q in comparison.to_json()["tables"]["quantities"]
                   if q["name"] == "reassign")
    assert penalty["models"]["edited"]["value"] == 0.001


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
