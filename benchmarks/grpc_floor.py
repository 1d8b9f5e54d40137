"""The floor of a gRPC round trip on this machine: grpcio's asyncio server doing
nothing but answer the KServe v2 ``ServerLive`` (tritonclient's generated stubs), so
``tritonclient.grpc``'s ``is_server_live`` against it times grpcio at both ends and
nothing of carpool. ``benchmarks.onnx_protocols`` starts it beside carpool and reports
its round trip next to carpool's: what a gRPC call costs before any server code runs.

    python -m benchmarks.grpc_floor   # prints "floor on 127.0.0.1:PORT", serves until killed
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc


class _Live(service_pb2_grpc.GRPCInferenceServiceServicer):
    async def ServerLive(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerLiveResponse(live=True)


async def serve() -> None:
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_Live(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"floor on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    sys.exit(asyncio.run(serve()))
