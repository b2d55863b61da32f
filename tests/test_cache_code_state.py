"""A user objective's cache identity follows its code *and* the state it reads.

Each case builds two callables that compute different numbers with the same name and
bytecode (the fault: a cache keyed on name and bytecode reused the first one's losses for
the second), and one more built the same way as the first, which must digest alike (so a
rerun still resumes). End to end, an audit resumed with a changed closure value is
refused, not answered from the old losses; an objective whose state cannot be read is
never resumed.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import vision_toys as vt

import fcaudit
from fcaudit import AuditData, AuditOptions
from fcaudit.core.codestate import Unreadable, digest_state
from fcaudit.core.errors import FcauditError

FAST = dict(bootstrap=50, repeats=1, execution=False, progress=False, batch_size=8,
            per_layer=False)


def closure(k: float) -> Callable:
    return lambda out, batch: out.sum(-1) * k


def default(k: float) -> Callable:
    def fn(out, batch, k=k):
        return out.sum(-1) * k
    return fn


def module_global(k: float) -> Callable:
    scope: dict[str, Any] = {"K": k}
    exec("def fn(out, batch):\n    return out.sum(-1) * K\n", scope)
    return scope["fn"]


def helper(k: float) -> Callable:
    """The objective calls a helper whose code differs (its constant)."""
    scope: dict[str, Any] = {}
    exec(f"def scale(x):\n    return x * {k}\ndef fn(out, batch):\n    return scale(out.sum(-1))\n",
         scope)
    return scope["fn"]


def tensor(k: float) -> Callable:
    weights = torch.full((10,), k)
    return lambda out, batch: (out * weights).sum(-1)


def loss_object(k: float) -> Callable:
    loss = torch.nn.CrossEntropyLoss(reduction="none", label_smoothing=k / 10)
    return lambda out, batch: loss(out, batch.targets)


def class_weights(k: float) -> Callable:
    loss = torch.nn.CrossEntropyLoss(weight=torch.linspace(1, k, 10), reduction="none")
    return lambda out, batch: loss(out, batch.targets)


def smoothed(out: torch.Tensor, batch: Any, smoothing: float) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, batch.targets, reduction="none",
                                             label_smoothing=smoothing)


def partial(k: float) -> Callable:
    return functools.partial(smoothed, smoothing=k / 10)


def callable_object(k: float) -> Callable:
    class Scaled:
        def __init__(self) -> None:
            self.k = k

        def __call__(self, out, batch):
            return out.sum(-1) * self.k
    return Scaled()


def array(k: float) -> Callable:
    table = np.full(10, k)
    return lambda out, batch: out.sum(-1) * float(table[0])


CASES = [closure, default, module_global, helper, tensor, loss_object, class_weights, partial,
         callable_object, array]


@pytest.mark.parametrize("make", CASES, ids=lambda f: f.__name__)
def test_state_that_changes_the_numbers_changes_the_digest(make: Callable) -> None:
    x = torch.randn(4, 10)
    batch = type("Batch", (), {"targets": torch.arange(4)})()
    one, same, other = make(1.0), make(1.0), make(3.0)
    assert not torch.equal(one(x, batch), other(x, batch))  # the fault: other numbers...
    assert digest_state(one) != digest_state(other)  # ... so another identity
    assert digest_state(one) == digest_state(same)  # and built alike, the same one


def test_cycles_are_digested_once_and_unreadable_state_is_named() -> None:
    class Node:
        pass
    node = Node()
    node.me = node  # a cycle: no endless recursion
    assert digest_state(lambda o, b: node) == digest_state(lambda o, b: node)
    generator = torch.Generator().manual_seed(0)  # a C object: read as pickling saves it
    draws = lambda o, b: torch.randn(3, generator=generator)  # noqa: E731
    before = digest_state(draws)
    torch.randn(3, generator=generator)
    assert digest_state(draws) != before  # its state moved on: another objective
    lock = threading.Lock()
    with pytest.raises(Unreadable, match="lock"):
        digest_state(lambda o, b: lock)
    pattern = re.compile(r"\d+")
    assert digest_state(lambda o, b: pattern) != digest_state(
        lambda o, b: re.compile(r"\w+"))


def test_copying_an_instance_leaves_its_class_s_digest_as_it_was() -> None:
    """``copy.deepcopy`` (and pickle) cache ``__slotnames__`` on the class of what they
    copy: no behaviour, so no other identity (a model whose config was copied once would
    otherwise differ from itself)."""
    import copy
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Config:
        width: int = 4

    def model(o: Any, b: Any, config: Config = Config()) -> Any:
        return o * config.width
    before = digest_state(model)
    copy.deepcopy(Config())
    assert "__slotnames__" in vars(Config) and digest_state(model) == before


def _audit(out: Path, objective: Callable) -> fcaudit.AuditResult:
    x, y = vt.mixer_data(16, 0)
    data = AuditData(inputs=x, targets=y, calib_inputs=vt.mixer_data(16, 1)[0])
    return fcaudit.audit(vt.class_mixer(), out, data=data,
                         options=AuditOptions(objective=objective, **FAST))


def scaled(k: float) -> Callable:
    return lambda out, batch: torch.nn.functional.cross_entropy(
        out, batch.targets, reduction="none") * k


def test_a_resumed_audit_with_a_changed_closure_is_refused_not_answered_from_the_cache(
        tmp_path: Path) -> None:
    out = tmp_path / "audit"
    first = _audit(out, scaled(1.0))
    again = _audit(out, scaled(1.0))  # the same objective, built anew: resumed
    assert again.conditions["correct"].nll == first.conditions["correct"].nll
    reused = json.loads((out / "audit.json").read_text())["runtime"]["reuse"]
    assert reused, "the same objective resumes from its cache"
    with pytest.raises(FcauditError, match="recorded with a different objective"):
        _audit(out, scaled(2.0))
    fresh = _audit(tmp_path / "fresh", scaled(2.0))  # what the changed objective gives
    assert fresh.conditions["correct"].nll == pytest.approx(
        2 * first.conditions["correct"].nll, rel=1e-6)


def test_an_objective_with_unreadable_state_runs_but_never_resumes(tmp_path: Path) -> None:
    lock = threading.Lock()

    def locked(out, batch):  # a thread-safe objective: a lock has no state to digest
        with lock:
            return torch.nn.functional.cross_entropy(out, batch.targets, reduction="none")

    out = tmp_path / "audit"
    result = _audit(out, locked)
    assert result.identity_replay_max_abs_diff == 0.0
    with pytest.raises(FcauditError, match=r"reads a _thread\.lock, whose state fcaudit "
                                           r"cannot read as bits.*delete that folder"):
        _audit(out, locked)


DIGESTS = """
import sys
sys.path.insert(0, {tests!r})
import torch
from fcaudit.io.loading import classes_read
from fcaudit.models.featuregate import GPT, PRESETS
from fcaudit.models.moe import MoEGPT, MoEConfig
from fcaudit.models.mudd import PRESETS as MUDD, MuddModel
from fcaudit.core.codestate import digest_state
import test_cache_code_state as t
for model in (GPT(PRESETS["tiny"]), MoEGPT(MoEConfig()), MuddModel(MUDD["tiny"])):
    print(classes_read(model, None, "")[0])
for make in t.CASES:
    print(digest_state(make(1.0)))
"""


def test_digests_are_the_same_in_every_process() -> None:
    """A CLI rerun resumes only if a new process digests the same code alike: string
    hashing is randomised per process (set order), ids differ; neither may enter."""
    tests = str(Path(__file__).parent)
    outputs = []
    for seed in ("1", "2"):
        proc = subprocess.run([sys.executable, "-c", DIGESTS.format(tests=tests)],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONHASHSEED": seed})
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout.split())
    assert len(outputs[0]) == 3 + len(CASES) and "None" not in outputs[0]
    assert outputs[0] == outputs[1]
