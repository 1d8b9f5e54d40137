"""The KServe v2 gRPC protocol (Triton's ``GRPCInferenceService``, as
``tritonclient.grpc`` and ``tritonclient.grpc.aio`` speak it), on the HTTP server's
event loop and over the same model adapters (``v2_models``), admission, limits,
priorities, timeouts and API key as the /v2 HTTP routes. Messages are converted by
``v2_grpc_messages``; errors get their gRPC status from ``errors.grpc_code_of``.
Shared memory, tracing and log settings are not served (UNIMPLEMENTED)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from carpool.errors import CarpoolError, Overloaded, Unauthorized
from carpool.server.http import errors
from carpool.server.http.auth import ApiKey
from carpool.server.kserve.repository_routes import refuse_overrides
from carpool.server.kserve.v2_grpc_messages import (
    EMPTY_FINAL,
    from_dict,
    infer_request,
    infer_response,
    parameters,
)
from carpool.server.kserve.v2_models import (
    Answer,
    V2Model,
    adapter,
    all_stats,
    server_metadata,
)
from carpool.server.registry.model_control import ModelControl
from carpool.server.registry.served import ServedModels

log = logging.getLogger(__name__)

T = TypeVar("T")


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Each RPC reads its request, asks the model's /v2 adapter, and shapes the
    answer; ``_answer`` maps every failure to a gRPC status."""

    def __init__(
        self,
        models: ServedModels,
        is_ready: Callable[[], bool],
        control: ModelControl,
        api_key: str = "",
    ) -> None:
        self.models = models
        self.is_ready = is_ready
        self.control = control
        self.key = ApiKey(api_key) if api_key else None

    def _model(self, name: str) -> V2Model:
        return adapter(self.models, name, self.is_ready)

    async def _answer(
        self, context: grpc.aio.ServicerContext, work: Callable[[], Awaitable[T]], *, open_: bool
    ) -> T:
        """``work``'s answer; the API key checked first unless the call is ``open_``
        (liveness, readiness and server metadata, as over HTTP)."""
        try:
            if not open_:
                self._check_key(context)
            return await work()
        except CarpoolError as exc:
            await _abort(context, exc)
        except Exception:
            log.exception("gRPC call failed")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")
        raise AssertionError("abort returns by raising")

    def _check_key(self, context: grpc.aio.ServicerContext) -> None:
        if self.key is None:
            return
        metadata = {k: v for k, v in context.invocation_metadata() or ()}
        authorization = str(metadata.get("authorization", "")).encode()
        if not self.key.accepts(authorization, str(metadata.get("x-api-key", "")).encode()):
            raise Unauthorized("missing or wrong API key (send authorization: Bearer <key>)")

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            return service_pb2.ServerLiveResponse(live=True)

        return await self._answer(context, work, open_=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            return service_pb2.ServerReadyResponse(ready=self.is_ready())

        return await self._answer(context, work, open_=True)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            return from_dict(server_metadata(), service_pb2.ServerMetadataResponse())

        return await self._answer(context, work, open_=True)

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            ready = await self._model(request.name).ready(request.version or None)
            return service_pb2.ModelReadyResponse(ready=ready)

        return await self._answer(context, work, open_=False)

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            metadata = self._model(request.name).metadata(request.version or None)
            return from_dict(metadata, service_pb2.ModelMetadataResponse())

        return await self._answer(context, work, open_=False)

    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            model = self._model(request.name)
            model.version_of(request.version or None)
            config = from_dict(model.config(), model_config_pb2.ModelConfig())
            return service_pb2.ModelConfigResponse(config=config)

        return await self._answer(context, work, open_=False)

    async def ModelStatistics(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            if request.name:
                stats = self._model(request.name).stats(request.version or None)
            else:
                stats = all_stats(self.models, self.is_ready)
            return from_dict({"model_stats": stats}, service_pb2.ModelStatisticsResponse())

        return await self._answer(context, work, open_=False)

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            body, blobs = infer_request(request)
            model = self._model(request.model_name)
            version = request.model_version or None
            answer = await model.infer(body, blobs, None, version)
            return infer_response(model.name, model.version_of(version), body.id or "", answer)

        return await self._answer(context, work, open_=False)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """Each request of the stream runs as it arrives, beside the others; each of
        its responses (a decoupled model's, any number) is sent as it comes. A failed
        request is answered in the stream (``error_message``), not by ending it."""
        await self._answer(context, _nothing, open_=False)
        sent: asyncio.Queue[Any] = asyncio.Queue()
        reader = asyncio.ensure_future(self._read_stream(requests, sent))
        try:
            while (item := await sent.get()) is not None:
                yield item
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _read_stream(self, requests: AsyncIterator[Any], sent: asyncio.Queue[Any]) -> None:
        running: set[asyncio.Task[None]] = set()
        try:
            async for request in requests:
                task = asyncio.ensure_future(self._stream_one(request, sent))
                running.add(task)
                task.add_done_callback(running.discard)
            while running:
                await asyncio.wait(set(running))
            await sent.put(None)
        finally:
            for task in running:
                task.cancel()

    async def _stream_one(self, request: Any, sent: asyncio.Queue[Any]) -> None:
        request_id = request.id
        try:
            body, blobs = infer_request(request)
            model = self._model(request.model_name)
            version = request.model_version or None
            name, number = model.name, model.version_of(version)
            final = None if not model.decoupled else False
            async for answer in model.responses(body, blobs, version):
                response = infer_response(name, number, request_id, answer, final=final)
                await sent.put(service_pb2.ModelStreamInferResponse(infer_response=response))
            if model.decoupled and parameters(request.parameters).get(EMPTY_FINAL):
                response = infer_response(name, number, request_id, Answer([]), final=True)
                await sent.put(service_pb2.ModelStreamInferResponse(infer_response=response))
        except CarpoolError as exc:
            await sent.put(_stream_error(request, exc.message))
        except Exception:
            log.exception("gRPC stream request failed")
            await sent.put(_stream_error(request, "internal error"))

    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            response = service_pb2.RepositoryIndexResponse()
            for entry in self.control.index(ready_only=request.ready):
                response.models.add(
                    name=entry.name,
                    version=entry.version or "",
                    state=entry.state,
                    reason=entry.reason or "",
                )
            return response

        return await self._answer(context, work, open_=False)

    async def RepositoryModelLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            refuse_overrides({"parameters": parameters(request.parameters)})
            await self.control.load(request.model_name)
            return service_pb2.RepositoryModelLoadResponse()

        return await self._answer(context, work, open_=False)

    async def RepositoryModelUnload(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def work() -> Any:
            await self.control.unload(request.model_name)
            return service_pb2.RepositoryModelUnloadResponse()

        return await self._answer(context, work, open_=False)


async def _nothing() -> None:
    return None


def _stream_error(request: Any, message: str) -> Any:
    response = service_pb2.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    return service_pb2.ModelStreamInferResponse(error_message=message, infer_response=response)


async def _abort(context: grpc.aio.ServicerContext, exc: CarpoolError) -> NoReturn:
    if isinstance(exc, Overloaded):
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        context.set_trailing_metadata((("retry-after", retry),))
    await context.abort(grpc.StatusCode[errors.grpc_code_of(exc)], exc.message)
    raise AssertionError("abort returns by raising")


async def start(
    service: InferenceService, host: str, port: int, max_message_bytes: int
) -> tuple[grpc.aio.Server, int]:
    """The gRPC server serving ``service`` on ``host:port`` (-1: a free port), started;
    and its port. A message over ``max_message_bytes`` (the HTTP body limit) is
    refused with RESOURCE_EXHAUSTED. Raises ``OSError`` when the port cannot be bound:
    no two servers share it (gRPC's default SO_REUSEPORT is off)."""
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", -1),
        ]
    )
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(service, server)
    address = f"[{host}]" if ":" in host else host
    try:
        bound = server.add_insecure_port(f"{address}:{max(port, 0)}")
    except RuntimeError as exc:
        raise OSError(str(exc)) from None
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    return server, bound
