"""``carpool serve --replicas N``: start (or join) a Ray cluster, run carpool's replicas
on it as a Ray Serve application, put carpool's HTTP front on their handle in this
process, say where it listens, and drain on SIGTERM/SIGINT before Serve stops."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
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
    from carpool.distributed.deployment import REPLICA_DEPLOYMENT, replicas_app
    from carpool.distributed.front import front_app, serve_front
    from carpool.distributed.ingress import Ingress
    from carpool.distributed.replica_book import deployment_key
    from carpool.server.http.listen import bind

    try:  # before Ray starts: a port in use fails at once
        sock = bind(config.server.host, config.server.port)
    except OSError as exc:
        raise LaunchError(f"cannot bind {config.server.host}:{config.server.port}: {exc}") from None
    own_cluster = _start_ray(ray, config)
    try:
        placement = _placement(ray, config)
        serve.start(proxy_location="Disabled")
        handle = serve.run(replicas_app(config, placement), name=APP_NAME, route_prefix=None)
        ingress = Ingress(handle, deployment_key(APP_NAME, REPLICA_DEPLOYMENT))
        host, port = sock.getsockname()[:2]
        gpus = f" and {placement.gpus:g} GPU" if placement.gpus else ""
        ready_line = (
            f"carpool ready on http://{host}:{port} serving {', '.join(config.server.models)} "
            f"({placement.replicas} replicas of {placement.cpus:g} CPUs{gpus} on Ray Serve, "
            f"started in {time.monotonic() - started:.1f}s)"
        )
        asyncio.run(serve_front(front_app(ingress, config), sock, ready_line, config))
        log.info("stopping the replicas")
        serve.shutdown()
    finally:
        sock.close()
        if own_cluster:
            ray.shutdown()
    return 0


def _start_ray(ray: Any, config: CarpoolConfig) -> bool:
    """Join ``--ray-address`` or start a small local cluster; whether we started it."""
    options = config.replicas
    # Nothing is sent home from a carpool cluster. Ray starts its workers at niceness
    # 15, below the front in this process: every streamed token the front handles
    # would then preempt a replica's torch threads (c=64 throughput fell 0.98x ->
    # 0.71x of one process here). Read by a cluster this process starts, as Ray's jobs
    # set it; a joined cluster keeps its own.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_worker_niceness", "0")
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
    ray.init(namespace=APP_NAME, **local_cluster(_local_cores(), options.object_store_bytes))
    return True


def local_cluster(num_cpus: int, object_store_bytes: int) -> dict[str, Any]:
    """``ray.init``'s arguments for a small local cluster (the one ``carpool serve
    --replicas`` starts, and those the tests and benchmarks start): on 127.0.0.1 only,
    no dashboard, an object store of ``object_store_bytes``, Ray's logging left as the
    process has it."""
    return {
        "num_cpus": num_cpus,
        "object_store_memory": object_store_bytes,
        "include_dashboard": False,
        "_node_ip_address": "127.0.0.1",
        "configure_logging": False,
    }


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
