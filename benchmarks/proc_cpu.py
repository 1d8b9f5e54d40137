"""CPU time of processes and threads, from Linux's /proc: what a benchmark charges a
server (its threads, its child processes) beside the rates it measures."""

from __future__ import annotations

import os
from pathlib import Path


def stat_cpu_s(stat: Path) -> float:
    """User + system CPU seconds from a /proc stat file (a process's or a thread's);
    0 if it has gone."""
    try:
        fields = stat.read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """A process's CPU seconds, all its threads."""
    return stat_cpu_s(Path(f"/proc/{pid}/stat"))


def children(pid: int) -> list[int]:
    """The processes ``pid``'s main thread started (an engine process, say)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def tree_cpu_s(pid: int) -> float:
    """The CPU seconds of a process and of its children."""
    return process_cpu_s(pid) + sum(process_cpu_s(c) for c in children(pid))


def thread_cpu_s(pid: int) -> dict[int, float]:
    """Each thread's CPU seconds, by thread id (the main thread's id is ``pid``)."""
    tasks = Path(f"/proc/{pid}/task")
    return {int(t.name): stat_cpu_s(t / "stat") for t in tasks.iterdir()}
