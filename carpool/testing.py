"""Starting servers as subprocesses and waiting for their ready line (tests, benchmarks)."""

from __future__ import annotations

import re
import selectors
import socket
import subprocess
import threading
import time
from typing import IO


def spawn(
    command: list[str],
    ready: re.Pattern[str],
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> tuple[subprocess.Popen[str], re.Match[str], list[str]]:
    """Start ``command`` and read its merged output until a line matches ``ready``.

    Returns the process, the match and its output lines; after the ready line a
    daemon thread goes on appending to that list (so the pipe never fills and a
    test can read what the child logged). Kills the process and raises
    ``RuntimeError`` (with its output) if it exits or stays silent past ``timeout_s``.
    """
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd
    )
    assert process.stdout is not None
    lines: list[str] = []
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not selector.select(timeout=deadline - time.monotonic()):
            break
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        match = ready.search(line)
        if match:
            threading.Thread(target=_drain, args=(process.stdout, lines), daemon=True).start()
            return process, match, lines
    process.kill()
    raise RuntimeError(f"{command[0]} did not become ready:\n" + "".join(lines))


def _drain(stream: IO[str], lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 just now (for a server that takes its port as a
    number; ``carpool serve --port 0`` picks its own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
