"""The objective registry (engine/objectives.py): every built-in entry's losses, hits and
compared tensors against a hand computation in numpy, ``--objective``'s choices and help
read off the registry, the registry light to import, and a throwaway objective added as
one entry (plus its function) and audited end to end."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import vision_toys as vt

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.cli.parser import build_parser
from fcaudit.core.errors import FcauditError
from fcaudit.engine import losses
from fcaudit.engine.objectives import (
    CLASSIFICATION,
    OBJECTIVES,
    REGISTRY,
    TOKEN_NLL,
    BuiltinObjective,
    Objective,
    check_targets,
    resolve,
)
from fcaudit.io.examples import ExampleBatch

FAST = dict(bootstrap=100, repeats=1, execution=False, progress=False, batch_size=8,
            per_layer=False)

# hand-made outputs: 2 sequences of 4 tokens over a vocabulary of 5; 4 examples, 3 classes
TOKEN_LOGITS = np.array([[[0.1, -1.0, 2.0, 0.5, 0.0], [1.5, 0.2, -0.3, 0.0, 0.7],
                          [-2.0, 0.0, 0.3, 1.1, 0.4], [0.0, 0.0, 0.0, 0.0, 0.0]],
                         [[3.0, 1.0, -1.0, 0.0, 0.5], [0.2, 0.2, 2.2, -0.8, 0.1],
                          [1.0, -1.0, 0.0, 0.6, -0.4], [0.9, 0.1, 0.1, 0.1, 0.1]]])
TOKEN_IDS = np.array([[2, 0, 4, 1], [1, 3, 2, 0]])
CLASS_LOGITS = np.array([[2.0, 0.5, -1.0], [0.1, 0.3, 0.2], [-0.5, 1.5, 0.0],
                         [1.0, 1.0, 3.0]])
CLASS_TARGETS = np.array([0, 2, 1, 0])
# selective copying: 4 sequences of 3 tokens over a vocabulary of 4, the last 2 answers
ANSWER_LOGITS = np.array([[[9.0, 9.0, 9.0, 9.0], [0.5, 2.0, -1.0, 0.0], [0.0, 0.1, 0.2, 3.0]],
                          [[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 2.0, 0.0]],
                          [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 4.0, 1.0], [-1.0, 2.5, 0.0, 0.3]],
                          [[0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.3, 0.0, 0.0, 0.2]]])
ANSWERS = np.array([[1, 3], [0, 1], [2, 1], [1, 3]])


def log_softmax(z: np.ndarray) -> np.ndarray:
    """By hand: z - log(sum(exp(z))), shifted by the max for range."""
    shifted = z - z.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def expected_token_nll() -> tuple[np.ndarray, None]:
    """Position t's loss is -log p(id at t+1 | logits at t), for t = 0..T-2."""
    lp = log_softmax(TOKEN_LOGITS)
    return np.array([[-lp[b, t, TOKEN_IDS[b, t + 1]] for t in range(3)]
                     for b in range(2)]), None


def expected_classification() -> tuple[np.ndarray, np.ndarray]:
    """Cross-entropy per example (one unit each); a hit where the argmax is the target."""
    lp = log_softmax(CLASS_LOGITS)
    ce = -lp[np.arange(4), CLASS_TARGETS]
    return ce[:, None], (CLASS_LOGITS.argmax(1) == CLASS_TARGETS).astype(np.float64)


def expected_answers() -> tuple[np.ndarray, np.ndarray]:
    """Answer k of an example is scored by the logits at position T - K + k (here 1 and
    2; position 0 is never read); a hit where both argmaxes are right."""
    lp = log_softmax(ANSWER_LOGITS)
    ce = np.array([[-lp[b, 1 + k, ANSWERS[b, k]] for k in range(2)] for b in range(4)])
    right = ANSWER_LOGITS[:, 1:].argmax(-1) == ANSWERS
    return ce, right.all(1).astype(np.float64)


# what each built-in entry scores: (model output, its input x, hand-computed units and hits)
HAND = {
    TOKEN_NLL: (lambda: SimpleNamespace(logits=torch.tensor(TOKEN_LOGITS, dtype=torch.float32)),
                lambda: torch.tensor(TOKEN_IDS), expected_token_nll),
    CLASSIFICATION: (lambda: torch.tensor(CLASS_LOGITS, dtype=torch.float32),
                     lambda: ExampleBatch(torch.zeros(4, 2), torch.tensor(CLASS_TARGETS)),
                     expected_classification),
    "selective-copy": (lambda: torch.tensor(ANSWER_LOGITS, dtype=torch.float32),
                       lambda: ExampleBatch(torch.zeros(4, 3, dtype=torch.int64),
                                            torch.tensor(ANSWERS)),
                       expected_answers),
}


def test_every_registry_entry_has_a_hand_computation() -> None:
    """A new built-in objective needs its row in HAND: this test names the one missing."""
    assert set(HAND) == set(OBJECTIVES) == {o.name for o in REGISTRY}
    assert (TOKEN_NLL, CLASSIFICATION) == ("token-nll", "classification")


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_entry_losses_and_hits_match_a_hand_computation(name: str) -> None:
    make_output, make_x, expected = HAND[name]
    units, hits = expected()
    objective = resolve(name)
    got = objective.units(make_output(), make_x())
    assert got.dtype == torch.float32 and tuple(got.shape) == units.shape
    np.testing.assert_allclose(got.numpy(), units, rtol=1e-6, atol=1e-6)
    got_hits = objective.hits(make_output(), make_x())
    if hits is None:
        assert got_hits is None and not objective.accuracy
    else:
        assert objective.accuracy and got_hits.dtype == torch.float64
        assert got_hits.tolist() == hits.tolist() == [1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_entry_compares_the_logits_bit_for_bit(name: str) -> None:
    """The identity replay compares the logits, read off an object's ``.logits`` too."""
    make_output, _, _ = HAND[name]
    output = make_output()
    logits = getattr(output, "logits", output)
    assert resolve(name).logits(output) is logits
    assert resolve(name).logits(SimpleNamespace(logits=logits)) is logits


def test_entry_words_are_the_objectives_messages() -> None:
    assert [resolve(n).unit for n in (TOKEN_NLL, CLASSIFICATION)] == ["token", "example"]
    assert resolve(TOKEN_NLL).describe() == "objective 'token-nll': the model's next-token " \
        "NLL is"
    assert resolve(CLASSIFICATION).describe() == "objective 'classification': the model's " \
        "cross-entropy of its logits is"
    assert resolve(TOKEN_NLL).tokens and not resolve(CLASSIFICATION).tokens
    assert [resolve(n).checks_targets for n in (TOKEN_NLL, CLASSIFICATION)] == [False, True]


def test_classification_checks_targets_against_the_logits_classes() -> None:
    logits = torch.tensor(CLASS_LOGITS, dtype=torch.float32)
    check_targets(resolve(CLASSIFICATION), logits, torch.tensor([0, 2, 1]), "evaluation")
    with pytest.raises(FcauditError, match=r"^evaluation targets span \[0, 3\] but the "
                       r"model's logits have 3 classes; targets must be class indices in "
                       r"\[0, 3\)$"):
        check_targets(resolve(CLASSIFICATION), logits, torch.tensor([0, 3]), "evaluation")
    check_targets(resolve(TOKEN_NLL), logits, torch.tensor([0, 3]), "evaluation")  # no check


def _objective_action() -> argparse.Action:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return next(a for a in sub.choices["audit"]._actions if "--objective" in a.option_strings)


def test_cli_choices_and_help_are_read_off_the_registry() -> None:
    action = _objective_action()
    assert tuple(action.choices) == tuple(OBJECTIVES) == ("token-nll", "classification",
                                                          "selective-copy")
    for entry in REGISTRY:
        assert entry.help in " ".join(action.help.split())


def test_the_registry_and_options_import_no_torch() -> None:
    """``fcaudit --help`` builds ``--objective`` from the registry without torch."""
    code = ("import sys, fcaudit.engine.objectives, fcaudit.engine.options; "
            "assert not {'torch', 'numpy'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def mse_units(output: torch.Tensor, batch: ExampleBatch) -> torch.Tensor:
    """Mean squared distance of the logits to the one-hot target, one unit per example."""
    onehot = torch.nn.functional.one_hot(batch.targets.long(), output.shape[-1])
    return ((output.float() - onehot) ** 2).mean(1, keepdim=True)


def test_a_new_objective_is_one_entry_and_its_function(monkeypatch) -> None:
    """What adding a built-in objective takes: its function in engine/losses.py and one
    registry entry; ``AuditOptions`` validates it and the audit scores with it."""
    with pytest.raises(FcauditError, match="choose one of token-nll, classification, "
                                           "selective-copy, or"):
        AuditOptions(objective="mse").validate()
    monkeypatch.setattr(losses, "mse_units", mse_units, raising=False)
    mse = BuiltinObjective("mse", "example", "squared distance to the one-hot target",
                           "mse (squared distance of [N, C] logits to one-hot targets)",
                           losses="mse_units")
    with OBJECTIVES.added(mse):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(16, 1, 8, 8)).astype(np.float32)
        y, xc = np.arange(16) % vt.CLASSES, rng.normal(size=(16, 1, 8, 8)).astype(np.float32)
        r = fcaudit.audit(vt.tiny_condconv(), data=AuditData(inputs=x, targets=y, calib_inputs=xc),
                          options=AuditOptions(objective="mse", **FAST))
        with torch.no_grad():
            logits = vt.tiny_condconv()(torch.from_numpy(x)).double().numpy()
        expected = ((logits - np.eye(vt.CLASSES)[y]) ** 2).mean(1).mean()
        assert r.settings["objective"] == "mse"
        for name in ("original", "correct"):
            assert r.conditions[name].nll == pytest.approx(expected, rel=1e-5)
            assert r.conditions[name].accuracy is None
        assert r.identity_replay_max_abs_diff == 0.0
        assert Objective("mse").describe() == "objective 'mse': the model's squared " \
            "distance to the one-hot target is"
    assert "mse" not in OBJECTIVES  # the registry as the test found it


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_objective_name_spelled_only_in_the_registry(name: str) -> None:
    """No module but the registry holds a string equal to a built-in objective's name:
    every other one asks :class:`Objective` or a name constant (TOKEN_NLL, CLASSIFICATION)."""
    src = Path(fcaudit.__file__).parent
    files = [str(p.relative_to(src)) for p in sorted(src.rglob("*.py"))
             if name in {n.value for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                         if isinstance(n, ast.Constant) and isinstance(n.value, str)}]
    assert files == ["engine/objectives.py"]


def test_an_entry_is_an_objective_choice_and_help_on_the_command_line() -> None:
    """A registry entry present when the options are read (as one written in the registry
    is) is an ``--objective`` choice with its help phrase: no other file names it."""
    code = """if True:
        import argparse
        from fcaudit.engine import objectives as o
        with o.OBJECTIVES.added(o.BuiltinObjective("mse", "example", "squared distance",
                                                   "mse (squared distance)",
                                                   losses="mse_units")):
            from fcaudit.cli.parser import build_parser
            sub = next(a for a in build_parser()._actions
                       if isinstance(a, argparse._SubParsersAction))
            flag = next(a for a in sub.choices["audit"]._actions
                        if "--objective" in a.option_strings)
            print(list(flag.choices), " ".join(flag.help.split()))"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    assert out.strip() == "['token-nll', 'classification', 'selective-copy', 'mse'] per-unit " \
        "loss: token-nll (token ids, the default) or classification (cross-entropy and " \
        "accuracy of [N, C] logits; the default with --inputs) or selective-copy " \
        "(cross-entropy of token logits [N, T, V] at the last K positions against answer " \
        "tokens [N, K]; accuracy: all K right; the default for a run of the task) or mse " \
        "(squared distance)"


def test_objective_mistakes_are_of_their_kind() -> None:
    """An unknown name is a usage mistake naming the option; targets that do not fit the
    logits are a data mistake."""
    from fcaudit.core.errors import DataError, UsageError
    with pytest.raises(UsageError) as unknown:
        resolve("mse")
    assert unknown.value.option == "objective"
    assert str(unknown.value) == "AuditOptions(objective='mse'): choose one of token-nll, " \
        "classification, selective-copy, or pass a callable (model_output, batch) -> " \
        "per-unit losses [B] or [B, T]"
    with pytest.raises(DataError, match=r"^evaluation targets are float32 \[2\]; "
                       r"classification needs integer class indices \[N\] \(np.int64\)$"):
        check_targets(resolve(CLASSIFICATION), torch.zeros(2, 3), torch.zeros(2), "evaluation")
