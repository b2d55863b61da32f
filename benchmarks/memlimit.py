"""Run a child process, optionally under a hard memory limit, and measure what it used.

``--max-memory cpu=2GiB`` caps the weights accelerate keeps in CPU memory, not the
process: its peak RSS also counts every page of a memory-mapped checkpoint it has read,
which the kernel keeps mapped while memory is free and drops under pressure. So a peak
RSS above the budget does not say the audit *needs* that much. What does say it is a run
under a ceiling the kernel enforces: a memory cgroup (v2 ``memory.max`` or v1
``memory.limit_in_bytes``) charges the child's anonymous memory and the page cache it
reads in, reclaims clean file pages when the limit is reached, and kills the child when
what it cannot reclaim exceeds the limit. The child's own file pages must be charged to
it, so the model's files are evicted from the page cache first (pages cached by an
earlier run would be charged to that run's cgroup and used here for free).

Making a cgroup needs root and a writable cgroup file system; where either is missing,
:func:`memory_cgroup` says why and the caller reports the limited runs as not made.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
_STATUS = re.compile(r"^(RssAnon|RssFile):\s+(\d+) kB", re.MULTILINE)


@dataclass
class ChildRun:
    """What one child process did: its exit, wall time and memory."""

    returncode: int
    wall_s: float
    peak_rss_bytes: int  # ru_maxrss: anonymous and file-backed pages at their highest
    peak_anon_bytes: int  # RssAnon sampled every 20 ms: what no pressure can take back
    peak_file_bytes: int  # RssFile sampled likewise: mapped file pages, reclaimable
    stderr: str
    limit_bytes: int | None = None  # the cgroup's ceiling, when run under one
    cgroup_peak_bytes: int | None = None  # the cgroup's own high-water mark (page cache too)
    oom_killed: bool = False  # the kernel's OOM killer ended it for the cgroup's limit


class MemoryCgroup:
    """A fresh memory cgroup with a hard limit (v2 where the memory controller is there,
    else v1), removed on :meth:`close`."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        name = f"fcaudit-bench-{os.getpid()}"
        self.v2 = "memory" in _read(ROOT / "cgroup.controllers").split()
        self.path = ROOT / name if self.v2 else ROOT / "memory" / name
        self.path.mkdir()
        limit, swap = (("memory.max", "memory.swap.max") if self.v2 else
                       ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"))
        try:
            (self.path / limit).write_text(str(limit_bytes))
        except OSError:
            self.close()  # made but unusable (no memory controller there): leave nothing
            raise
        with contextlib.suppress(OSError):  # no swap accounting: no swap to cap
            (self.path / swap).write_text(str(limit_bytes if not self.v2 else 0))

    def enter(self) -> None:
        """Move the calling process in (run in the child between fork and exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        return int(_read(self.path / ("memory.peak" if self.v2 else
                                      "memory.max_usage_in_bytes")) or 0)

    def oom_kills(self) -> int:
        text = _read(self.path / ("memory.events" if self.v2 else "memory.oom_control"))
        found = re.search(r"^oom_kill (\d+)", text, re.MULTILINE)
        return int(found.group(1)) if found else 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[MemoryCgroup | str]:
    """A :class:`MemoryCgroup`, or the reason none could be made here."""
    try:
        group = MemoryCgroup(limit_bytes)
    except OSError as exc:
        yield (f"no memory cgroup could be made ({exc.strerror or exc}: it needs root and a "
               "writable cgroup file system)")
        return
    try:
        yield group
    finally:
        group.close()


def evict(files: Sequence[Path]) -> None:
    """Drop these files' clean pages from the page cache (so a child reading them is
    charged for them)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_measured(argv: Sequence[str], group: MemoryCgroup | None = None) -> ChildRun:
    """Run ``argv`` (stdout discarded) in ``group`` if given; its exit, wall time, peak RSS
    (``os.wait4``: this child's own rusage) and sampled anonymous and file-backed peaks."""
    kills = group.oom_kills() if group else 0
    start = time.perf_counter()
    proc = subprocess.Popen(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, preexec_fn=group.enter if group else None)
    peaks = {"RssAnon": 0, "RssFile": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            for key, kb in _STATUS.findall(_read(Path(f"/proc/{proc.pid}/status"))):
                peaks[key] = max(peaks[key], int(kb) * 1024)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stderr = proc.stderr.read() if proc.stderr else ""
    done.set()  # the child closed stderr: it is exiting; stop before it is reaped
    sampler.join()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return ChildRun(proc.returncode, time.perf_counter() - start, usage.ru_maxrss * 1024,
                    peaks["RssAnon"], peaks["RssFile"], stderr,
                    group.limit_bytes if group else None, group.peak() if group else None,
                    bool(group) and group.oom_kills() > kills)
