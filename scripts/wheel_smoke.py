"""Run from a virtual environment holding carpool's built wheel (not a checkout):
check that carpool is imported from the installed package, that every native kernel
builds and loads, and that ``carpool serve`` starts with the native paths on, says
so, serves the dashboard's files, warns of nothing, and compiles nothing on its
second start.

    python scripts/wheel_smoke.py   (scripts/ is on sys.path, the checkout is not)
"""

from __future__ import annotations

import re
import signal
import sys
import sysconfig
import urllib.request
from pathlib import Path

import carpool
from carpool.models.native import kernel_report
from carpool.testing import spawn

READY = re.compile(r"carpool ready on (\S+)")
EXPECTED = {
    "smollm2-135m-instruct": (
        "linear layers: native",
        "decoder stack: native",
        "decode attention: native",
    ),
    "all-minilm-l6-v2": ("encoder attention: native",),
}


def check(condition: bool, message: str) -> None:
    if not condition:
        print(f"wheel check FAILED: {message}", file=sys.stderr)
        raise SystemExit(1)


DASHBOARD = (
    "/dashboard",
    "/dashboard/assets/dashboard.js",
    "/dashboard/assets/vendor/uPlot.iife.min.js",
)


def serve_once() -> list[str]:
    """Start ``carpool serve`` on a free port, check the dashboard's files are served
    (they are package data), stop it, return its log."""
    command = [str(Path(sys.executable).parent / "carpool"), "serve", "--port", "0"]
    process, ready, lines = spawn(command, READY, timeout_s=300)
    for path in DASHBOARD:
        with urllib.request.urlopen(ready.group(1) + path, timeout=30) as response:
            check(response.status == 200 and len(response.read()) > 100, f"{path} is missing")
    process.send_signal(signal.SIGINT)
    check(process.wait(timeout=60) == 0, "carpool serve did not exit 0")
    return lines


def main() -> None:
    installed = Path(sysconfig.get_paths()["purelib"])
    check(
        Path(carpool.__file__).is_relative_to(installed),
        f"carpool comes from {carpool.__file__}, not from the installed wheel",
    )
    report = kernel_report()
    print("\n".join(report))
    check(all(": native (" in line for line in report[1:]), "a kernel did not build")
    first = serve_once()
    said = [line for line in first if " runs: " in line]
    print("".join(said), end="")
    for model, parts in EXPECTED.items():
        line = next((s for s in said if f" {model} runs: " in s), "")
        check(all(p in line for p in parts), f"{model} does not run natively: {line!r}")
    warnings = [line for line in first if " WARNING " in line]
    check(not warnings, f"warnings at start: {warnings}")
    second = serve_once()
    compiled = [line for line in second if "compiled kernel" in line]
    check(not compiled, f"the second start compiled again: {compiled}")
    print("wheel check passed: installed package, native kernels, nothing compiled twice")


if __name__ == "__main__":
    main()
