"""The two kinds of audit data behind one protocol: token ids and other examples.

:class:`~fcaudit.io.data.AuditData` is what a user builds; the engine reads it through
:meth:`~fcaudit.io.data.AuditData.checked`, a :class:`TokenData` (integer ids ``[N, T]``,
next-token NLL, token-keyed profiles) or an :class:`ExampleData` (tensors or dicts of
them, scored by another objective). Each kind answers the engine's questions itself
(:class:`AuditInputs`), so that no engine module asks which kind it holds.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from fcaudit.core.errors import DataError, UsageError, arg

if TYPE_CHECKING:  # torch is imported only when a batch is made
    import torch
    from torch import Tensor

    from fcaudit.core.arrays import InputSpec
    from fcaudit.core.interventions import TokenSums
    from fcaudit.io.examples import Examples

Named = list[tuple[str, "Tensor"]]


def window_hashes(windows: np.ndarray) -> list[str]:
    """Content hash per window, to prove calibration and evaluation share no window."""
    return [hashlib.sha256(np.ascontiguousarray(w, dtype=np.int64).tobytes()).hexdigest()
            for w in windows]


def fingerprint_array(windows: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(windows, dtype=np.int64).tobytes()).hexdigest()


def check_id_range(ids: Any, vocab_size: int | None, what: str) -> None:
    """Token ids index the model's vocabulary: within ``[0, vocab_size)`` (from 0 when the
    model states none), or one line naming ``what``."""
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        size = f"has {vocab_size} entries" if vocab_size is not None else "starts at id 0"
        raise DataError(f"{what} span [{lo}, {hi}] but the model's vocabulary {size}; "
                        "tokenize with the model's tokenizer")


def _token_sums(coefficients: Mapping[str, Tensor], ids: Tensor | None) -> TokenSums | None:
    from fcaudit.core.interventions import token_sums
    return token_sums(coefficients, ids) if ids is not None else None


@runtime_checkable
class AuditInputs(Protocol):
    """What the engine asks of audit data, whichever kind it is."""

    sources: dict[str, object]
    # Execution.unit for this data: None (a token, the default) or "example"
    execution_unit: ClassVar[str | None]
    # True: token windows scored by next-token NLL, the ids their own targets (token
    # rules, the frontier, --target-ci); False: examples scored by the user's objective,
    # even when they are token ids
    next_token: ClassVar[bool]

    @property
    def n_eval(self) -> int:
        """Evaluation sequences or examples."""

    @property
    def n_calib(self) -> int:
        """Calibration sequences or examples."""

    @property
    def eval_source(self) -> Any:
        """What evaluation batches are cut from (:func:`fcaudit.engine.passes.batches`)."""

    @property
    def calib_source(self) -> Any:
        """What calibration batches are cut from."""

    @property
    def token_ids(self) -> np.ndarray | None:
        """The evaluation token ids ``[N, T]`` (token profiles, static-layer-token, the
        token-id share); None for inputs that are not token ids."""

    def batch_token_ids(self, x: Any) -> Tensor | None:
        """Batch ``x``'s token ids ``[B, T]`` on the CPU (None without token ids)."""

    def summary(self) -> dict[str, object]:
        """audit.json's ``data`` section."""

    def validate(self, vocab_size: int | None, max_len: int | None) -> None:
        """Check the audit's data rules; raise one clear error for the first broken one."""

    def position_counts(self, site_counts: Sequence[int]) -> list[int]:
        """The position counts random draws permute: the sites' (``site_counts``), after
        the windows' own length where there is one."""

    def routed_units(self, positions: Callable[[], int]) -> int:
        """The evaluation units a router routes; ``positions``: a router's positions per
        example, read only when the data do not say."""

    def calibration_token_sums(self, coefficients: Mapping[str, Tensor],
                               x: Any) -> TokenSums | None:
        """A calibration batch's sums per token id (None without token ids)."""

    def batch_context(self, start: int, stop: int, schedule: str,
                      objective: Callable[[], str]) -> tuple[Named, bytes]:
        """What rows ``start:stop``'s replays depend on besides their fed tensors: named
        tensors and a head (``objective``: the objective's cache identity)."""

    def targets(self) -> list[tuple[str, Any]]:
        """(which set, targets) the objective must be able to score, before any pass."""

    def execution_inputs(self, device: torch.device) -> Any:
        """The evaluation set as the execution audit takes it."""


@dataclass(frozen=True)
class TokenData:
    """Token ids: evaluation and calibration windows ``[N, T]`` (int64)."""

    eval_ids: np.ndarray
    calib_ids: np.ndarray
    sources: dict[str, object] = field(default_factory=dict)
    execution_unit: ClassVar[str | None] = None
    next_token: ClassVar[bool] = True

    @property
    def n_eval(self) -> int:
        return len(self.eval_ids)

    @property
    def n_calib(self) -> int:
        return len(self.calib_ids)

    @property
    def eval_source(self) -> np.ndarray:
        return self.eval_ids

    @property
    def calib_source(self) -> np.ndarray:
        return self.calib_ids

    @property
    def token_ids(self) -> np.ndarray:
        return self.eval_ids

    def summary(self) -> dict[str, object]:
        return {
            "eval_sequences": int(self.eval_ids.shape[0]),
            "calib_sequences": int(self.calib_ids.shape[0]),
            "seq_len": int(self.eval_ids.shape[1]),
            "eval_tokens": int(self.eval_ids.size),
            "eval_fingerprint": fingerprint_array(self.eval_ids),
            "calib_fingerprint": fingerprint_array(self.calib_ids),
            **self.sources,
        }

    def validate(self, vocab_size: int | None, max_len: int | None) -> None:
        n_eval, seq_len = self.eval_ids.shape
        ev_src = self.sources.get("eval_path") or "the evaluation data"
        ca_src = self.sources.get("calib_path") or "the calibration data"
        more = "pass an array with more rows" if self.sources.get("source") == "tokens" else \
            f"give more data or {self._shorter()}"
        if n_eval < 2:
            raise DataError(
                f"the audit needs at least 2 evaluation sequences of {seq_len} tokens, {ev_src} "
                f"gives {n_eval}: reassignment has no derangement of one sequence; {more}")
        if len(self.calib_ids) < 1:
            more = f"pass a {arg('calib_tokens')} array with rows" \
                if self.sources.get("source") == "tokens" else \
                f"give more calibration data or {self._shorter()}"
            raise DataError(f"{ca_src} gives no calibration sequences of {seq_len} tokens; "
                            f"{more}")
        if self.calib_ids.shape[1] != seq_len:
            raise DataError(f"calibration sequences have length {self.calib_ids.shape[1]} "
                            f"in {ca_src}, evaluation sequences {seq_len} in {ev_src}; cut "
                            "both to the same length")
        if max_len is not None and seq_len > max_len:
            raise DataError(f"sequence length {seq_len} exceeds the model's context of "
                            f"{max_len} tokens; {self._shorter(max_len)}")
        self._check_ids(vocab_size, ev_src, ca_src)

    def _check_ids(self, vocab_size: int | None, ev_src: object, ca_src: object) -> None:
        """Ids within the vocabulary, and no window in both sets."""
        for name, src, arr in (("evaluation", ev_src, self.eval_ids),
                               ("calibration", ca_src, self.calib_ids)):
            check_id_range(arr, vocab_size, f"{name} token ids in {src}")
        shared = set(window_hashes(self.eval_ids)) & set(window_hashes(self.calib_ids))
        if shared:
            raise DataError(
                f"calibration ({ca_src}) and evaluation ({ev_src}) share {len(shared)} identical "
                "window(s); static profiles must come from independent data: pass disjoint sets")

    def _shorter(self, most: int | None = None) -> str:
        """How to cut shorter windows, in the words of their source: ``--seq-len`` cuts
        text, while token arrays and ids given directly are cut by their owner."""
        source = self.sources.get("source")
        at_most = f" of at most {most} tokens" if most else ""
        if source == "tokens":
            return f"re-cut the token arrays into windows{at_most} (their width sets the length)"
        if source in ("text", "builtin"):
            return f"use {arg('seq_len', most)} or less" if most else \
                f"a shorter {arg('seq_len')}"
        return f"cut the ids into shorter windows{at_most}"

    def position_counts(self, site_counts: Sequence[int]) -> list[int]:
        return [int(self.eval_ids.shape[1]), *site_counts]

    def routed_units(self, positions: Callable[[], int]) -> int:
        return int(self.eval_ids.size)

    def batch_token_ids(self, x: Any) -> Tensor:
        return x.cpu()

    def calibration_token_sums(self, coefficients: Mapping[str, Tensor],
                               x: Any) -> TokenSums | None:
        return _token_sums(coefficients, self.batch_token_ids(x))

    def batch_context(self, start: int, stop: int, schedule: str,
                      objective: Callable[[], str]) -> tuple[Named, bytes]:
        import torch
        ids = torch.from_numpy(np.ascontiguousarray(self.eval_ids[start:stop]))
        return [("ids", ids)], schedule.encode()

    def targets(self) -> list[tuple[str, Any]]:
        return []  # next-token NLL: the ids are their own targets

    def execution_inputs(self, device: torch.device) -> Tensor:
        import torch
        return torch.from_numpy(np.ascontiguousarray(self.eval_ids)).to(device)


@dataclass(frozen=True)
class ExampleData:
    """Inputs that are not token ids, materialised as :class:`Examples`."""

    examples: Examples
    calib_examples: Examples
    sources: dict[str, object] = field(default_factory=dict)
    execution_unit: ClassVar[str | None] = "example"
    next_token: ClassVar[bool] = False

    @property
    def n_eval(self) -> int:
        return len(self.examples)

    @property
    def n_calib(self) -> int:
        return len(self.calib_examples)

    @property
    def eval_source(self) -> Examples:
        return self.examples

    @property
    def calib_source(self) -> Examples:
        return self.calib_examples

    @functools.cached_property
    def token_ids(self) -> np.ndarray | None:
        """Inputs that are one integer tensor ``[N, T]`` are token ids (a task's sequences,
        a classifier over tokens): token-keyed profiles and the token-id share apply, while
        the objective stays the one that scores them."""
        from fcaudit.io.examples import is_token_ids
        x = self.examples.inputs
        return x.numpy().astype(np.int64) if is_token_ids(x) else None

    def batch_token_ids(self, x: Any) -> Tensor | None:
        return x.inputs.cpu().long() if self.token_ids is not None else None

    def summary(self) -> dict[str, object]:
        return {"eval_examples": len(self.examples),
                "calib_examples": len(self.calib_examples),
                "inputs": self.examples.layout(),
                "eval_fingerprint": self.examples.fingerprint(),
                "calib_fingerprint": self.calib_examples.fingerprint(), **self.sources}

    def check_inputs(self, spec: InputSpec | None) -> None:
        """Refuse inputs that a model known to take others (a run folder's: ``spec``)
        cannot take, in one line naming the array, before any pass."""
        if spec is None:
            return
        for name, examples in (("inputs", self.examples), ("calib_inputs",
                                                           self.calib_examples)):
            spec.check(examples.inputs, arg(name, py=f"AuditData.{name}"))

    def validate(self, vocab_size: int | None, max_len: int | None) -> None:
        """``vocab_size`` and ``max_len`` bound token ids only (integer inputs ``[N, T]``),
        each where the model states it."""
        ev, ca = self.examples, self.calib_examples
        if len(ev) < 2:
            raise DataError(f"the audit needs at least 2 evaluation examples, AuditData "
                            f"gives {len(ev)}: reassignment has no derangement of one")
        if len(ca) < 1:
            raise DataError("AuditData gives no calibration examples; pass calib_inputs")
        if ev.layout() != ca.layout():
            raise DataError(f"calibration inputs {ca.layout()} and evaluation inputs "
                            f"{ev.layout()} differ in shape or dtype; give both alike")
        if (ev.targets is None) != (ca.targets is None) and ca.targets is not None:
            raise UsageError("AuditData: calib_targets given without targets",
                             option="calib_targets")
        shared = set(ev.example_hashes()) & set(ca.example_hashes())
        if shared:
            raise DataError(f"calibration and evaluation share {len(shared)} identical "
                            "example(s); static profiles must come from independent data: "
                            "pass disjoint sets")
        if self.token_ids is not None:
            self._check_ids(vocab_size, max_len)

    def _check_ids(self, vocab_size: int | None, max_len: int | None) -> None:
        """Token ids given as inputs obey the model's stated vocabulary and context."""
        length = int(self.examples.inputs.shape[1])  # type: ignore[union-attr]
        if max_len is not None and length > max_len:
            raise DataError(f"{arg('inputs', py='AuditData.inputs')} hold sequences of "
                            f"{length} token ids, beyond the model's context of {max_len}; "
                            f"cut them to at most {max_len}")
        if vocab_size is None:
            return  # nothing states what the ids index
        for name, examples in (("inputs", self.examples), ("calib_inputs",
                                                           self.calib_examples)):
            check_id_range(examples.inputs, vocab_size,
                           f"the token ids of {arg(name, py=f'AuditData.{name}')}")

    def position_counts(self, site_counts: Sequence[int]) -> list[int]:
        return list(dict.fromkeys(site_counts))  # no window length: the sites' own, once

    def routed_units(self, positions: Callable[[], int]) -> int:
        return self.n_eval * positions()

    def calibration_token_sums(self, coefficients: Mapping[str, Tensor],
                               x: Any) -> TokenSums | None:
        return _token_sums(coefficients, self.batch_token_ids(x))

    def batch_context(self, start: int, stop: int, schedule: str,
                      objective: Callable[[], str]) -> tuple[Named, bytes]:
        # every input and target tensor, bitwise, and the objective that scores them
        return self.examples.named(start, stop), f"{schedule}\n{objective()}".encode()

    def targets(self) -> list[tuple[str, Any]]:
        calib = self.calib_examples.targets
        return [("evaluation", self.examples.targets),
                *([("calibration", calib)] if calib is not None else [])]

    def execution_inputs(self, device: torch.device) -> Examples:
        return self.examples
