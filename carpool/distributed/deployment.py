"""carpool on Ray Serve: ``CarpoolReplica`` is one whole carpool (device runtime,
engines, dynamic batchers, its own HTTP app run in process); ``CarpoolIngress`` takes
HTTP from Ray Serve's proxy, reads the prompt for routing, forwards each request whole
to a replica through a deployment handle (``PrefixAffinityRouter`` picks which) and
streams the answer back as it comes. ``build_app`` binds the two for ``serve.run``.
"""

# No ``from __future__ import annotations``: Ray Serve hands the ingress's route
# signatures to FastAPI, which must see their types, not strings. Ray Serve copies the
# ingress class by value (module globals too), so its logic lives in ``ingress``.
import dataclasses
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from carpool.config import CarpoolConfig
from carpool.distributed.forward import (
    ForwardedRequest,
    ReplicaReport,
    ReplicaUnavailable,
    ResponseHead,
    call_app,
)
from carpool.distributed.ingress import Ingress
from carpool.distributed.replica_book import deployment_key
from carpool.distributed.router import PrefixAffinityRouter
from carpool.server.http import errors
from carpool.server.http.guards import guard

REPLICA_DEPLOYMENT = "CarpoolReplica"
ROUTER = f"{PrefixAffinityRouter.__module__}.{PrefixAffinityRouter.__qualname__}"


@dataclass(frozen=True)
class Placement:
    """What each replica gets of the cluster."""

    replicas: int
    cpus: float
    gpus: float = 0.0


class CarpoolReplica:
    """One whole carpool, built from ``config`` on ``placement``'s share."""

    def __init__(self, config: CarpoolConfig, placement: Placement) -> None:
        from carpool.server.bootstrap import build_server

        runtime = config.runtime
        if runtime.threads == 0 and not placement.gpus:
            runtime = dataclasses.replace(runtime, threads=max(1, int(placement.cpus)))
        if placement.gpus:
            # Ray shows this replica only its own GPU(s), numbered from 0. The engine stays
            # in the replica's process unless asked for its own: no GPU run has tried an
            # engine process spawned from a Ray actor.
            engine_process = bool(runtime.engine_process)
            runtime = dataclasses.replace(runtime, device="cuda", engine_process=engine_process)
        self.bundle = build_server(dataclasses.replace(config, runtime=runtime))
        self.app = self.bundle.create_app()
        self.name = serve.get_replica_context().replica_id.to_full_id_str()

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The response to ``request``: its head, then any further body chunks. Raises
        ``ReplicaUnavailable`` if this replica's device runtime has died."""
        if not self.bundle.runtime.alive:
            raise ReplicaUnavailable(self.name)
        async for part in call_app(self.app, request):
            yield part

    async def report(self, _pin: ForwardedRequest, with_metrics: bool) -> ReplicaReport:
        """Who and how this replica is; ``_pin`` names it, for the router."""
        text = ""
        if with_metrics:
            get = ForwardedRequest("GET", "/metrics", b"", (), b"")
            parts = [p async for p in call_app(self.app, get)]
            head = parts[0]
            assert isinstance(head, ResponseHead)
            text = b"".join([head.body, *(p for p in parts[1:] if isinstance(p, bytes))]).decode()
        return ReplicaReport(self.name, os.getpid(), self.bundle.runtime.alive, text)

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose device runtime died is replaced."""
        if not self.bundle.runtime.alive:
            raise RuntimeError("the device runtime died")

    def __del__(self) -> None:
        bundle = getattr(self, "bundle", None)
        if bundle is not None:
            bundle.runtime.stop()


# The replicas serve their own /docs and /openapi.json; the ingress forwards them.
ingress_app = FastAPI(title="carpool", docs_url=None, redoc_url=None, openapi_url=None)
errors.install(ingress_app)


@serve.ingress(ingress_app)
class CarpoolIngress:
    """The Serve deployment of ``Ingress``: its routes, nothing more (Ray Serve copies
    this class by value, so it keeps no state of its own beyond ``self.front``)."""

    def __init__(self, replicas: DeploymentHandle, config: CarpoolConfig) -> None:
        # Body limit and key are checked here, before a body is read or forwarded.
        server = config.server
        guard(ingress_app, max_body_bytes=server.max_body_bytes, api_key=server.api_key)
        app_name = serve.get_replica_context().app_name
        self.front = Ingress(replicas, deployment_key(app_name, REPLICA_DEPLOYMENT))

    @ingress_app.get("/health")
    async def health(self) -> Response:
        """200 while at least one replica is ready, with how many are."""
        return await self.front.health()

    @ingress_app.get("/metrics")
    async def metrics(self) -> Response:
        """Every replica's carpool metrics, each sample labelled with its replica."""
        return await self.front.metrics()

    @ingress_app.api_route(
        "/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
    )
    async def forward(self, request: Request) -> Response:
        """Anything else: to one replica."""
        return await self.front.forward(request)


def capacity(config: CarpoolConfig) -> int:
    """Requests one replica admits at once: its engines' running and waiting slots and
    its batchers' queues. Ray Serve's cap on requests in flight per replica is set just
    above it, so that a full replica answers 503 itself, as one process does."""
    generators = config.engine.max_num_seqs + config.engine.max_waiting_requests
    embeddings = config.batching.queue_policy.max_queue_size
    return generators + embeddings


def replicas_app(config: CarpoolConfig, placement: Placement) -> serve.Application:
    """The replicas alone, as an application whose handle routes with carpool's router
    (``carpool serve --replicas`` puts its own HTTP front on that handle)."""
    limit = capacity(config)
    resources: dict[str, float] = {"num_cpus": placement.cpus}
    if placement.gpus:
        resources["num_gpus"] = placement.gpus
    replica: Any = serve.deployment(
        CarpoolReplica,
        name=REPLICA_DEPLOYMENT,
        num_replicas=placement.replicas,
        ray_actor_options=resources,
        max_ongoing_requests=limit + 8,
        # Requests wait here only while the router picks a replica (the replicas admit
        # or refuse them themselves): room for as many as all replicas admit.
        max_queued_requests=limit * placement.replicas,
        health_check_period_s=config.replicas.health_check_period_s,
        graceful_shutdown_timeout_s=config.server.shutdown_timeout_s,
        request_router_config={
            "request_router_class": ROUTER,
            "request_router_kwargs": {
                "max_imbalance": config.replicas.route_max_imbalance,
                "policy": config.replicas.route_policy,
            },
        },
    )
    application: serve.Application = replica.bind(config, placement)
    return application


def build_app(config: CarpoolConfig, placement: Placement | None = None) -> serve.Application:
    """The carpool application for ``serve.run``: ``placement.replicas`` replicas
    (default ``config.replicas.replicas``, at least 1) of ``placement.cpus`` CPUs each
    (default 1) and ``placement.gpus`` GPUs, behind one ingress deployment that takes
    HTTP from Ray Serve's proxy.

    Example: ``serve.run(build_app(CarpoolConfig()), route_prefix="/")``.
    """
    if placement is None:
        placement = Placement(replicas=max(1, config.replicas.replicas), cpus=1.0)
    ingress: Any = serve.deployment(
        CarpoolIngress,
        name="CarpoolIngress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=(capacity(config) + 8) * placement.replicas + 64,
        graceful_shutdown_timeout_s=config.server.shutdown_timeout_s,
    )
    return ingress.bind(replicas_app(config, placement), config)
