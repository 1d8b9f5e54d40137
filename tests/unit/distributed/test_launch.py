"""Start-up errors of ``carpool serve --replicas``, each clear and before any model
loads; and without the flag, nothing of Ray is imported."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from carpool.cli import build_config, parser
from carpool.config import CarpoolConfig, ConfigError, ReplicasConfig


def config_of(*flags: str) -> CarpoolConfig:
    return build_config(parser().parse_args(["serve", *flags]))


def test_replica_flags_are_validated_with_the_config() -> None:
    with pytest.raises(ConfigError, match="at least 1"):
        config_of("--replicas", "0")
    with pytest.raises(ConfigError, match="needs --replicas"):
        config_of("--ray-address", "auto")
    with pytest.raises(ConfigError, match="75MiB"):
        ReplicasConfig(replicas=2, ray_object_store_memory="10MiB")
    assert config_of("--replicas", "2").replicas.replicas == 2
    assert config_of().replicas.replicas == 0


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "carpool.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_more_replicas_than_cores_is_refused_at_once() -> None:
    cores = len(os.sched_getaffinity(0))
    done = run_cli("serve", "--replicas", str(cores + 1))
    assert done.returncode == 2
    assert f"needs {cores + 1} cores (one each); there are {cores}" in done.stderr


def test_an_unreachable_ray_address_is_refused_at_once() -> None:
    with socket.socket() as bound:  # bound, never listening: connections are refused
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        done = run_cli("serve", "--replicas", "1", "--ray-address", f"127.0.0.1:{port}")
    assert done.returncode == 2
    assert f"cannot reach the Ray cluster at '127.0.0.1:{port}'" in done.stderr


def test_without_ray_the_flag_says_how_to_install_it(tmp_path: Path) -> None:
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('no ray here')\n")
    done = run_cli("serve", "--replicas", "1", env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 2
    assert "pip install 'carpool[ray]'" in done.stderr


def test_one_process_imports_nothing_of_ray() -> None:
    probe = (
        "import sys\n"
        "from carpool import cli\n"
        "from carpool.server import bootstrap\n"
        "from carpool.server.http import app\n"
        "cli.build_config(cli.parser().parse_args(['serve']))\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]"
