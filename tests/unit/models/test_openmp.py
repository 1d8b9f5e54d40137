"""Releasing a thread's OpenMP team: its worker threads end, and a later parallel
region on that thread still runs (with a new team). In a fresh interpreter, so no
other test's teams are counted."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import os, time
import torch
from carpool.models.openmp import release_thread_team

def threads():
    return len(os.listdir("/proc/self/task"))

def settled(expected):
    # a released worker leaves /proc once it has exited, just after the release returns
    deadline = time.monotonic() + 30
    while threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()

torch.set_num_threads(2)
alone = threads()
total = torch.ones(1 << 22).add_(1).sum().item()  # a parallel region: a team of 2
with_team = threads()
released = release_thread_team()
after = settled(alone)
again = torch.ones(1 << 22).add_(1).sum().item()
print(alone, with_team, released, after, total == again == 2 * (1 << 22))
"""


def test_release_thread_team_ends_the_calling_threads_workers() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True
    ).stdout.split()
    alone, with_team, released, after, same = out
    assert int(with_team) == int(alone) + 1  # the team's one worker thread
    assert released == "True"
    assert int(after) == int(alone)
    assert same == "True"
