"""One audit over several processes: ``torchrun --nproc-per-node K -m fcaudit audit ...``.

Evaluation and calibration batches are dealt out by rank (batch ``b`` goes to rank
``b % K``) for recording and for replay. Every rank writes its own cache shards into the
shared output folder (a folder every node sees); rank 0 validates and claims the folder
first, then reads every shard and writes the outputs. Because shards are keyed by the
global batch index and every number is computed per batch with the batch composition of
a single-process run, ``audit.json`` is the single-process one, and a resumed audit may
use another number of processes. CPU ranks use gloo; CUDA ranks NCCL, one GPU each.
Before recording, the ranks compare a digest of their first batch (coefficients and NLL):
a process whose model or code behaves differently stops every rank instead of being merged.

A rank that dies makes the others fail at their next barrier; they stop with one line
that says the finished shards are kept and the same command resumes.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from fcaudit.core.errors import FcauditError

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
    import torch
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
