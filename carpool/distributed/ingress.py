"""The endpoint's front: every HTTP request, answered from the replicas. /health and
/metrics ask every replica (each by name, through the router's pin) and combine the
answers; anything else is forwarded whole to one replica (the router picks which by
prompt prefix and load) and its answer streamed back as it comes.

Plain code over a Ray Serve deployment handle; ``deployment.CarpoolIngress`` is the
thin Serve deployment around it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import cast

import orjson
import ray
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from carpool.distributed.forward import (
    ForwardedRequest,
    ReplicaReport,
    ReplicaUnavailable,
    ResponseHead,
)
from carpool.distributed.metrics_merge import merge_metrics
from carpool.distributed.replica_book import known_replicas
from carpool.distributed.routing import routing_text
from carpool.errors import CarpoolError, Overloaded, ReplicaFailed
from carpool.server.http import errors

log = logging.getLogger("carpool")

ATTEMPTS = 3
"""Replicas a request is offered to before it is refused (503) for want of one."""

REPORT_TIMEOUT_S = 5.0
"""How long /health and /metrics wait for one replica's report."""

# What a dead or unreachable replica raises through a handle.
_REPLICA_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class Ingress:
    """The front over ``replicas``, the handle of the deployment that
    ``known_replicas(deployment)`` names."""

    def __init__(self, replicas: DeploymentHandle, deployment: str) -> None:
        self.replicas = replicas
        self.deployment = deployment

    async def health(self) -> Response:
        """200 while at least one replica is ready, with how many are."""
        reports = await self._reports(with_metrics=False)
        ready = sum(r.ready for r in reports)
        body = {
            "status": "ok" if ready else "unavailable",
            "replicas_ready": ready,
            "replicas": [{"id": r.replica, "pid": r.pid, "ready": r.ready} for r in reports],
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    async def metrics(self) -> Response:
        """Every replica's carpool metrics, each sample labelled with its replica."""
        reports = await self._reports(with_metrics=True)
        text = merge_metrics({r.replica: r.metrics for r in reports})
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def forward(self, request: Request) -> Response:
        """``request`` answered by one replica. Draining is the caller's: ``carpool
        serve --replicas`` wraps its front in ``carpool.server.http.drain.Drain``, and a
        Serve application's ingress deployment has Ray Serve's graceful shutdown."""
        return await self._forward(request)

    async def _forward(self, request: Request) -> Response:
        body = await request.body()
        forwarded = ForwardedRequest(
            method=request.method,
            path=request.url.path,
            query_string=request.scope.get("query_string", b""),
            headers=tuple(request.scope["headers"]),
            body=body,
            prefix_text=routing_text(request.url.path, body),
        )
        stream, head = await self._start(forwarded)
        if not isinstance(head, ResponseHead):
            raise CarpoolError("a replica answered out of protocol")
        if not head.more:
            response = Response(head.body, status_code=head.status)
            response.raw_headers = list(head.headers)
            return response
        streaming = StreamingResponse(_rest(head, stream), status_code=head.status)
        streaming.raw_headers = list(head.headers)
        return streaming

    async def _start(
        self, forwarded: ForwardedRequest
    ) -> tuple[DeploymentResponseGenerator, object]:
        """Send ``forwarded`` to a replica and wait for the head of its answer; a replica
        whose runtime died says so before starting it, and the next one is tried."""
        for _ in range(ATTEMPTS):
            stream = cast(
                DeploymentResponseGenerator,
                self.replicas.options(stream=True).forward.remote(forwarded),
            )
            try:
                return stream, await stream.__anext__()
            except BackPressureError:
                raise Overloaded("every replica is at capacity; retry later") from None
            except ReplicaUnavailable as exc:
                gone = getattr(exc, "cause", exc).replica
                forwarded = dataclasses.replace(forwarded, avoid=(*forwarded.avoid, gone))
            except _REPLICA_GONE as exc:
                raise _failed(exc) from None
        raise Overloaded("no replica can run this request now; retry later")

    async def _reports(self, *, with_metrics: bool) -> list[ReplicaReport]:
        names = known_replicas(self.deployment)
        if not names:  # the handle's router is made at its first request
            first = await self._report("", with_metrics)
            names = known_replicas(self.deployment) or ((first.replica,) if first else ())
        # One at a time: inside a Ray Serve request (the ``CarpoolIngress`` deployment)
        # every call it makes carries that request's internal id, and Ray Serve's
        # router matches replicas to waiting calls by that id, so concurrent calls of
        # one request wait forever.
        answers = [await self._report(n, with_metrics) for n in names]
        unique = {a.replica: a for a in answers if a is not None}
        return [unique[name] for name in sorted(unique)]

    async def _report(self, replica: str, with_metrics: bool) -> ReplicaReport | None:
        pin = ForwardedRequest("GET", "/health", b"", (), b"", replica=replica)
        try:
            return await asyncio.wait_for(
                self.replicas.report.remote(pin, with_metrics), REPORT_TIMEOUT_S
            )
        except (TimeoutError, BackPressureError, *_REPLICA_GONE) as exc:
            log.warning("replica %s did not report: %s", replica or "(any)", type(exc).__name__)
            return None


async def _rest(head: ResponseHead, stream: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    """The body after the head; a replica that dies mid-stream ends an event stream with
    an error event (OpenAI's shape) and ``[DONE]``, any other body by cutting it."""
    if head.body:
        yield head.body
    try:
        async for chunk in stream:
            yield chunk
    except _REPLICA_GONE as exc:
        if not _is_event_stream(head):
            raise
        failed = _failed(exc)
        status, kind = errors.status_of(failed)
        body = errors.error_body(status, failed.message, kind=kind)
        yield f"data: {orjson.dumps(body).decode()}\r\n\r\ndata: [DONE]\r\n\r\n".encode()
    finally:
        stream.cancel()


def _is_event_stream(head: ResponseHead) -> bool:
    return any(
        k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in head.headers
    )


def _failed(exc: BaseException) -> ReplicaFailed:
    log.warning("a replica failed a request in flight: %s", type(exc).__name__)
    return ReplicaFailed(
        "the replica running this request died before finishing it; it did not complete "
        "and may be sent again"
    )
