"""One forward pass over one batch: recorded (controllers live) or replayed (stubs).

Every pass of the audit goes through an :class:`Executor` (the stages never call the model
themselves), so where the passes run is one implementation of two methods: :class:`Local`
runs them in this process (each torchrun rank holds its own). Its checks live here: a site
that runs twice, a stub the model does not call, non-finite values.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from fcaudit.core.adapters import same_bits
from fcaudit.core.contract import Site
from fcaudit.core.errors import FcauditError, ModelError
from fcaudit.core.recording import recording
from fcaudit.core.replaying import BlockTrace, OutputStub, replaying, selecting, swapped, tracing
from fcaudit.engine.objectives import Objective, default_for, output_tensors
from fcaudit.io.examples import ExampleBatch, Examples, call_model

TOKEN_NLL = Objective(default_for(tokens=True))


def batches(ids: np.ndarray | Examples, batch_size: int, device: torch.device,
            only: Sequence[int] | None = None) -> Iterator[tuple[int, Any]]:
    """Batches of token ids ``[B, T]`` (a tensor) or of :class:`Examples` (an
    :class:`ExampleBatch`), on ``device``."""
    for b, start in enumerate(range(0, len(ids), batch_size)):
        if only is None or b in only:
            if isinstance(ids, Examples):
                yield b, ids.rows(start, start + batch_size).to(device)
                continue
            chunk = np.ascontiguousarray(ids[start:start + batch_size])
            yield b, torch.from_numpy(chunk).to(device)


def batch_shape(x: Any) -> tuple[int, int | None]:
    """(examples, positions) of a batch: token ids ``[B, T]`` (given as such or as
    inputs), or examples of unknown positions (each site's layout says)."""
    if isinstance(x, ExampleBatch):
        return len(x), x.positions
    return int(x.shape[0]), int(x.shape[1])


@torch.no_grad()
def record_batch(model: nn.Module, sites: Sequence[Site], x: Any,
                 objective: Objective | None = TOKEN_NLL
                 ) -> tuple[Any, dict[str, Tensor], Any]:
    """One unperturbed pass: logits, every site's coefficients, per-unit losses (None
    without an objective: calibration passes score nothing)."""
    with recording(model, sites, *batch_shape(x)) as captured:
        output = call_model(model, x)
    coefficients = {s.name: captured[s.name] for s in sites}
    if objective is None:
        return output_tensors(output), coefficients, None
    return objective.logits(output), coefficients, objective.units(output, x)


@dataclass
class Replayed:
    """One replay pass: logits, the block trace (if asked) and the routers' choices."""

    logits: Any
    trace: BlockTrace | None = None
    chosen: dict[str, Tensor] = field(default_factory=dict)
    output: Any = None  # the model's whole output, which the objective scores


@torch.no_grad()
def replay_batch(model: nn.Module, x: Any, fed: Mapping[Site, Tensor], *,
                 known: Mapping[str, Any] | None = None, trace: Sequence[str] | None = None,
                 select: bool = False, objective: Objective = TOKEN_NLL) -> Replayed:
    """One pass with the given sites fed; each stub must run exactly once.

    ``known``: block outputs to stand in for those blocks (prefix reuse); sites inside
    them do not run. ``trace``: block paths whose call order and outputs to record.
    ``select``: also return the experts each router site selects.
    """
    known = known or {}
    observed = tracing(model, trace, [s.path for s in fed]) if trace else \
        contextlib.nullcontext()
    with replaying(model, fed) as stubs, \
            swapped(model, {p: OutputStub(model.get_submodule(p), out)
                           for p, out in known.items()}), \
            observed as traced, \
            selecting(stubs) if select else contextlib.nullcontext({}) as chosen:
        output = call_model(model, x)
        logits = objective.logits(output)
    skipped = {s.name for s in fed
               if any(s.path == p or s.path.startswith(p + ".") for p in known)}
    wrong = {n: s.calls for n, s in stubs.items() if s.calls != (0 if n in skipped else 1)}
    if wrong:
        name, calls = next(iter(wrong.items()))
        raise ModelError(f"site {name} ran {calls} times during replay (once when recorded); "
                         "the model takes another path when its controller is replaced: "
                         "name a module the model calls exactly once per forward pass")
    return Replayed(logits, traced, chosen, output)


Recorded = tuple[Any, dict[str, Tensor], Any]  # logits, coefficients by site, losses


class Executor(Protocol):
    """Where an audit's passes run: a record pass (controllers live, their outputs kept)
    and a replay pass (the given sites fed); see :func:`record_batch` and
    :func:`replay_batch` for what each returns and checks."""

    def record(self, x: Any, objective: Objective | None = TOKEN_NLL,
               sites: Sequence[Site] | None = None) -> Recorded: ...

    def replay(self, x: Any, fed: Mapping[Site, Tensor], *,
               known: Mapping[str, Any] | None = None, trace: Sequence[str] | None = None,
               select: bool = False, objective: Objective = TOKEN_NLL) -> Replayed: ...


@dataclass(frozen=True)
class Local:
    """Passes on the model in this process (``sites``: those recorded unless others are
    named, as the frontier's calibration does)."""

    model: nn.Module
    sites: Sequence[Site]

    def record(self, x: Any, objective: Objective | None = TOKEN_NLL,
               sites: Sequence[Site] | None = None) -> Recorded:
        return record_batch(self.model, self.sites if sites is None else sites, x, objective)

    def replay(self, x: Any, fed: Mapping[Site, Tensor], **kw: Any) -> Replayed:
        return replay_batch(self.model, x, fed, **kw)


def check_finite(values: Mapping[str, Tensor], where: str) -> None:
    bad = {k: int((~torch.isfinite(v)).sum()) for k, v in values.items()
           if not torch.isfinite(v).all()}
    if bad:
        listing = ", ".join(f"{k} ({n} values)" for k, n in bad.items())
        raise ModelError(f"non-finite (NaN or inf) coefficients recorded on {where} at "
                         f"{listing}; no dependence metric is computed on them: fix the "
                         "model or its weights (try float32)")


def check_finite_losses(losses: Tensor, objective: Objective, where: str) -> None:
    """Refuse NaN or inf per-unit losses, naming the objective that gave them."""
    bad = int((~torch.isfinite(losses)).sum())
    if bad:
        raise ModelError(f"{objective.describe()} not finite (NaN or inf) for {bad} of "
                         f"{losses.numel()} {objective.unit}s in {where}; no metric can be "
                         f"computed: {objective.fix}")


def check_units(losses: Tensor, recorded: torch.Size, objective: Objective, where: str) -> None:
    """Refuse losses whose shape is not the record pass's for the same examples: replayed
    and recorded units are compared one for one."""
    if losses.shape != recorded:
        raise ModelError(f"objective {objective.name} returned losses {list(losses.shape)} in "
                         f"{where}, but {list(recorded)} for the same examples in their record "
                         "pass; per-unit losses must depend on the batch alone, not on the "
                         "pass (the same units of the same examples every time)")


# ---------------------------------------------------------------------- carried_state
# Why two unperturbed passes over the same batch differ: randomness, or state the model
# carries from one call to the next.
#
# A recurrent model that keeps its state between calls (a hidden state buffer, a generation
# cache such as ``past_key_values`` or ``cache_params`` kept on the model) computes the
# replay from what the record pass left behind: the replay cannot reproduce the record, and
# no number would mean what it says. The identity probe already sees that two passes differ;
# this module says which cause it is, so the one-line refusal can say what to do.

STATE_FIX = ("reset that state at the start of every forward pass (or keep it outside the "
             "model) and disable any generation cache (use_cache=False, no past_key_values or "
             "cache_params kept between calls)")
STATE_CAUSE = "the model's output depends on earlier calls"


def _held_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The tensors a model holds besides its parameters: buffers, and tensors (or lists,
    tuples and dicts of them) kept as plain attributes of its modules."""
    yield from model.named_buffers()
    for prefix, module in model.named_modules():
        for key, value in vars(module).items():
            if key.startswith("_"):  # _parameters, _buffers, _modules, hooks
                continue
            items = value.items() if isinstance(value, dict) else \
                enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
            for sub, item in items:
                if isinstance(item, Tensor):
                    name = f"{prefix}.{key}" if prefix else key
                    yield (name if sub is None else f"{name}[{sub!r}]"), item


def changed_by_a_call(model: nn.Module, call: Callable[[], Any]) -> list[str]:
    """The names of the tensors the model holds that one ``call`` added, removed or
    changed: state carried to the next call."""
    before = {name: t.detach().clone() for name, t in _held_tensors(model)}
    call()
    after = dict(_held_tensors(model))
    return [name for name in dict.fromkeys([*before, *after])
            if name not in before or name not in after
            or not same_bits(before[name], after[name].detach())]


def _seeded(call: Callable[[], Any], seed: int) -> Any:
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())
                               if torch.cuda.is_available() else []):
        torch.manual_seed(seed)
        return call()


def why_passes_differ(model: nn.Module, call: Callable[[], Any]) -> tuple[str, str | None]:
    """The cause of two passes over one batch giving different outputs, in words, and what
    to do when it is (or may be) state carried across calls, else None: a pass that changes
    the model's own tensors is state; two passes from the same random seed that still
    differ are state kept out of sight or nondeterministic kernels; otherwise randomness
    (dropout, sampling, a model in training mode)."""
    changed = changed_by_a_call(model, call)
    if changed:
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3
                                          else "")
        return (f"{STATE_CAUSE}: a forward pass changes tensors the model keeps ({shown}), "
                "state carried across calls such as a recurrent state or a generation cache, "
                "so a replay starts from what the record pass left behind"), STATE_FIX
    if not same_bits(_seeded(call, 0), _seeded(call, 0)):
        return (f"{STATE_CAUSE}: two passes over the same batch from the same random seed "
                "differ, so the model carries state across calls (a recurrent state or a "
                "generation cache, kept where fcaudit cannot see it) or runs nondeterministic "
                "kernels"), f"{STATE_FIX}, or use deterministic kernels,"
    return ("two unperturbed passes over the same batch already differ: the forward pass is "
            "not deterministic (dropout, sampling or training mode?)"), None


# ---------------------------------------------------------------------- distributed
# One audit over several processes: ``torchrun --nproc-per-node K -m fcaudit audit ...``.
#
# Evaluation and calibration batches are dealt out by rank (batch ``b`` goes to rank
# ``b % K``) for recording and for replay. Every rank writes its own cache shards into the
# shared output folder (a folder every node sees); rank 0 validates and claims the folder
# first, then reads every shard and writes the outputs. Because shards are keyed by the
# global batch index and every number is computed per batch with the batch composition of
# a single-process run, ``audit.json`` is the single-process one, and a resumed audit may
# use another number of processes. CPU ranks use gloo; CUDA ranks NCCL, one GPU each.
# Before recording, the ranks compare a digest of their first batch (coefficients and NLL):
# a process whose model or code behaves differently stops every rank instead of being merged.
#
# A rank that dies makes the others fail at their next barrier; they stop with one line
# that says the finished shards are kept and the same command resumes.

TIMEOUT_ENV = "FCAUDIT_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 3 * 3600  # a barrier waits for the slowest rank's share of one stage


class RankStopped(FcauditError):
    """Another process of the same torchrun audit stopped; this one cannot go on."""


@dataclass(frozen=True)
class Ranks:
    """This process's place among the audit's processes."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    backend: str | None = None  # the process group's ("gloo", "nccl"), None without one

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mine(self, items: list[int]) -> list[int]:
        """The batches this rank records or replays."""
        return [b for b in items if b % self.world == self.rank]

    def barrier(self, stage: str) -> None:
        """Wait for every rank; a dead or failed rank becomes one clear error here."""
        if self.backend is None:
            return
        import torch.distributed as dist
        try:
            dist.barrier()
        except Exception as exc:  # gloo / NCCL report a vanished peer as RuntimeError
            raise stopped(self, stage, exc) from exc

    def gather(self, value: Any, stage: str) -> list[Any]:
        """Every rank's ``value`` (a small picklable object), in rank order, on every rank;
        also a barrier."""
        if self.backend is None:
            return [value]
        import torch.distributed as dist
        out: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(out, value)
        except Exception as exc:  # a vanished peer, as in barrier()
            raise stopped(self, stage, exc) from exc
        return out


def stopped(ranks: Ranks, stage: str, cause: Any = None) -> RankStopped:
    first = " ".join(str(cause).split()).split(". ")[0][:200] if cause else ""
    detail = f" ({first})" if first else ""
    return RankStopped(f"another process of this {ranks.world}-process audit stopped while "
                       f"rank {ranks.rank} was at '{stage}'{detail}; finished cache shards are "
                       "kept: rerun the same command (with any number of processes) to resume")


SINGLE = Ranks()


def current() -> Ranks:
    """The ranks of an initialised process group, else a single process."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size(),
                     int(os.environ.get("LOCAL_RANK", dist.get_rank())), dist.get_backend())
    return SINGLE


def launched() -> bool:
    """True inside ``torchrun``, also with one process: a 1-process group runs the same
    barriers and gathers as K processes do (NCCL on one GPU can be checked that way).
    ``WORLD_SIZE`` alone is not enough, as other launchers and clusters set it too."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return True
    return "TORCHELASTIC_RUN_ID" in os.environ and "MASTER_ADDR" in os.environ


def init(device: str) -> Ranks:
    """Join torchrun's process group (gloo on CPU, NCCL on CUDA); returns this rank."""
    import torch.distributed as dist
    if not launched():
        return SINGLE
    if not dist.is_initialized():
        timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    ranks = current()
    # torchrun ends the other processes with SIGTERM when one fails: say so, in one line
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(stopped(ranks, "SIGTERM")))
    return ranks


def device_for(device: str, ranks: Ranks) -> str:
    """One GPU per rank: ``cuda`` becomes ``cuda:LOCAL_RANK`` under torchrun."""
    return f"cuda:{ranks.local_rank}" if device == "cuda" and ranks.world > 1 else device


def finish() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
