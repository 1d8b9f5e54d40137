"""``carpool serve --replicas N``: start (or join) a Ray cluster, run carpool's Serve
application on it, say where it listens, and drain it on SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from typing import Any, NoReturn

from carpool.config import CarpoolConfig

log = logging.getLogger("carpool")

APP_NAME = "carpool"
INSTALL_HINT = "--replicas runs on Ray Serve, which is not installed: pip install 'carpool[ray]'"


class LaunchError(Exception):
    """carpool cannot start its replicas; the message says why and what to do."""


def serve_replicas(config: CarpoolConfig) -> int:
    """Serve ``config`` from its replicas until a signal; the exit code."""
    started = time.monotonic()
    try:
        import ray
        from ray import serve
    except ImportError:
        raise LaunchError(INSTALL_HINT) from None
    from carpool.distributed.deployment import build_app

    own_cluster = _start_ray(ray, config)
    try:
        placement = _placement(ray, config)
        port = config.server.port or _free_port(config.server.host)
        serve.start(
            http_options={"host": config.server.host, "port": port},
            proxy_location="HeadOnly",
        )
        serve.run(build_app(config, placement), name=APP_NAME, route_prefix="/")
        names = ", ".join(config.server.models)
        log.info(
            "carpool ready on http://%s:%d serving %s (%d replicas of %g CPUs%s on Ray "
            "Serve, started in %.1fs)",
            config.server.host,
            port,
            names,
            placement.replicas,
            placement.cpus,
            f" and {placement.gpus:g} GPU" if placement.gpus else "",
            time.monotonic() - started,
        )
        reason = _wait_for_signal()
        _drain(serve, reason, config.server.shutdown_timeout_s)
        serve.shutdown()
    finally:
        if own_cluster:
            ray.shutdown()
    return 0


def _drain(serve: Any, reason: str, timeout_s: float) -> None:
    """Let the requests in flight finish (new ones get 503) before Serve stops."""
    log.info("%s: draining the requests in flight (up to %.0fs)", reason, timeout_s)
    try:
        idle = (
            serve.get_app_handle(APP_NAME).drain.remote(timeout_s).result(timeout_s=timeout_s + 10)
        )
    except Exception as exc:  # the ingress is gone: nothing left to wait for there
        log.warning("cannot drain the ingress (%s); stopping", type(exc).__name__)
        return
    if not idle:
        log.warning("shutdown timeout: requests still in flight are cut")


def _start_ray(ray: Any, config: CarpoolConfig) -> bool:
    """Join ``--ray-address`` or start a small local cluster; whether we started it."""
    options = config.replicas
    # Nothing is sent home from a carpool cluster.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if options.ray_address:
        _check_reachable(options.ray_address)
        try:
            ray.init(address=options.ray_address, namespace=APP_NAME, configure_logging=False)
        except Exception as exc:
            raise LaunchError(
                f"cannot join the Ray cluster at {options.ray_address!r}: {exc}"
            ) from None
        return False
    if not config.runtime.device.startswith("cuda") and options.replicas > _local_cores():
        _placement_error(options.replicas, _local_cores(), "cores")
    ray.init(
        num_cpus=_local_cores(),
        object_store_memory=options.object_store_bytes,
        include_dashboard=False,
        namespace=APP_NAME,
        _node_ip_address="127.0.0.1",
        configure_logging=False,
    )
    return True


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a ``host:port`` (or ``ray://host:port``) nobody listens on: Ray
    itself would wait for minutes. ``auto`` and other forms are left to Ray."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise LaunchError(f"cannot reach the Ray cluster at {address!r}: {exc}") from None


def _local_cores() -> int:
    return len(os.sched_getaffinity(0))


def _placement(ray: Any, config: CarpoolConfig) -> Any:
    from carpool.distributed.deployment import Placement

    replicas = config.replicas.replicas
    resources = ray.cluster_resources()
    if config.runtime.device.startswith("cuda"):
        gpus = int(resources.get("GPU", 0))
        if replicas > gpus:
            _placement_error(replicas, gpus, "GPUs")
        return Placement(replicas=replicas, cpus=1.0, gpus=1.0)
    cores = int(resources.get("CPU", 0))
    if replicas > cores:
        _placement_error(replicas, cores, "cores")
    return Placement(replicas=replicas, cpus=float(cores // replicas))


def _placement_error(replicas: int, have: int, what: str) -> NoReturn:
    raise LaunchError(f"--replicas {replicas} needs {replicas} {what} (one each); there are {have}")


def _free_port(host: str) -> int:
    """A port free now, for ``--port 0`` (Ray Serve's proxy binds the port it is given)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def _wait_for_signal() -> str:
    """Block until SIGTERM or SIGINT; its name."""
    received: list[str] = []
    done = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        received.append(signal.Signals(signum).name)
        done.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)
    while not done.wait(1.0):
        pass
    return received[0]
