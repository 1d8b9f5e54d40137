"""Open Inference Protocol (KServe v2) routes, as ``tritonclient.http`` expects them."""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response

from carpool import __version__
from carpool.errors import InvalidRequest
from carpool.server.openai_routes import check_input_count, tokenize_texts
from carpool.server.served import ServedEmbedding, ServedModels
from carpool.server.v2_tensors import (
    HEADER_LENGTH,
    decode_bytes_tensor,
    encode_response,
    parse_request,
)
from carpool.stats import BatcherStatsData, Duration

INPUT_NAME = "text"
OUTPUT_NAME = "embedding"
VERSION = "1"


def router(models: ServedModels, is_ready: Any) -> APIRouter:
    api = APIRouter()

    @api.get("/v2")
    async def server_metadata() -> dict[str, Any]:
        return {
            "name": "carpool",
            "version": __version__,
            "extensions": ["binary_tensor_data", "statistics", "model_configuration"],
        }

    @api.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @api.get("/v2/health/ready")
    async def ready() -> Response:
        return Response(status_code=200 if is_ready() else 503)

    @api.get("/v2/models/stats")
    async def all_stats() -> dict[str, Any]:
        return {"model_stats": [model_stats(m) for m in models]}

    @api.get("/v2/models/{name}")
    @api.get("/v2/models/{name}/versions/{version}")
    async def model_metadata(name: str, version: str = VERSION) -> dict[str, Any]:
        served = models.get(name)
        return {
            "name": served.name,
            "versions": [VERSION],
            "platform": "pytorch",
            "inputs": [{"name": INPUT_NAME, "datatype": "BYTES", "shape": [-1]}],
            "outputs": [
                {"name": OUTPUT_NAME, "datatype": "FP32", "shape": [-1, served.model.dimensions]}
            ],
            # Not in the v2 protocol (clients ignore it): which code runs the model.
            "parameters": {"execution": [str(p) for p in served.paths]},
        }

    @api.get("/v2/models/{name}/config")
    async def model_config(name: str) -> dict[str, Any]:
        served = models.get(name)
        cfg = served.batcher.config
        return {
            "name": served.name,
            "platform": "pytorch",
            "max_batch_size": cfg.max_batch_size,
            "input": [{"name": INPUT_NAME, "data_type": "TYPE_STRING", "dims": [1]}],
            "output": [
                {"name": OUTPUT_NAME, "data_type": "TYPE_FP32", "dims": [served.model.dimensions]}
            ],
            "dynamic_batching": {
                "preferred_batch_size": list(cfg.preferred_batch_sizes),
                "max_queue_delay_microseconds": int(cfg.max_queue_delay_ms * 1000),
                "priority_levels": cfg.priority_levels,
                "default_priority_level": cfg.default_priority_level,
                "default_queue_policy": {
                    "max_queue_size": cfg.queue_policy.max_queue_size,
                    "default_timeout_microseconds": int(cfg.queue_policy.default_timeout_s * 1e6),
                    "allow_timeout_override": cfg.queue_policy.allow_timeout_override,
                },
            },
        }

    @api.get("/v2/models/{name}/ready")
    @api.get("/v2/models/{name}/versions/{version}/ready")
    async def model_ready(name: str, version: str = VERSION) -> Response:
        models.get(name)
        return Response(status_code=200 if is_ready() else 503)

    @api.get("/v2/models/{name}/stats")
    @api.get("/v2/models/{name}/versions/{version}/stats")
    async def stats(name: str, version: str = VERSION) -> dict[str, Any]:
        return {"model_stats": [model_stats(models.get(name))]}

    @api.post("/v2/models/{name}/infer")
    @api.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request, version: str = VERSION) -> Response:
        served = models.get(name)
        body, blobs = parse_request(await request.body(), request.headers.get(HEADER_LENGTH))
        params = body.parameters or {}
        texts = _texts(body.inputs, blobs)
        truncate = _param(params, "truncate", bool, False)
        check_input_count(served, len(texts))
        ids = await models.preprocess.run(
            tokenize_texts, served.model, texts, truncate, INPUT_NAME + "[{}]"
        )
        timeout_us = _param(params, "timeout", int, None)
        vectors = await served.embed(
            ids,
            priority=_param(params, "priority", int, None),
            timeout_s=None if not timeout_us else timeout_us / 1e6,
            request=request,
        )
        array = np.stack(vectors) if vectors else np.zeros((0, served.model.dimensions), np.float32)
        content, header_len = encode_response(
            {
                "model_name": served.name,
                "model_version": VERSION,
                **({"id": body.id} if body.id else {}),
            },
            [
                (
                    {"name": OUTPUT_NAME, "datatype": "FP32", "shape": list(array.shape)},
                    array,
                    _binary_output(body.outputs, params),
                )
            ],
        )
        if header_len is None:
            return Response(content, media_type="application/json")
        return Response(
            content,
            media_type="application/octet-stream",
            headers={"Inference-Header-Content-Length": str(header_len)},
        )

    return api


def _texts(inputs: list[Any], blobs: dict[str, bytes]) -> list[str]:
    if len(inputs) != 1 or inputs[0].name != INPUT_NAME:
        raise InvalidRequest(f"expected exactly one input named '{INPUT_NAME}'")
    texts = decode_bytes_tensor(inputs[0], blobs.get(INPUT_NAME))
    if not texts:
        raise InvalidRequest(f"input '{INPUT_NAME}' is empty")
    return texts


def _binary_output(outputs: list[Any] | None, params: dict[str, Any]) -> bool:
    if outputs:
        unknown = [o.name for o in outputs if o.name != OUTPUT_NAME]
        if unknown:
            raise InvalidRequest(f"unknown output '{unknown[0]}'; this model has '{OUTPUT_NAME}'")
        return bool((outputs[0].parameters or {}).get("binary_data", False))
    return bool(params.get("binary_data_output", False))


def _param(params: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = params.get(key, default)
    if value is default:
        return value
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidRequest(f"parameter '{key}' must be {kind.__name__}")
    return value


def _duration(d: Duration) -> dict[str, int]:
    return {"count": d.count, "ns": d.ns}


def model_stats(served: ServedEmbedding) -> dict[str, Any]:
    """One model's statistics in Triton's statistics-extension shape."""
    s: BatcherStatsData = served.batcher.stats.snapshot()
    zero = {"count": 0, "ns": 0}
    return {
        "name": served.name,
        "version": VERSION,
        "last_inference": s.last_inference_ms,
        "inference_count": s.inference_count,
        "execution_count": s.execution_count,
        "inference_stats": {
            "success": _duration(s.success),
            "fail": _duration(s.fail),
            "queue": _duration(s.queue),
            "compute_input": _duration(s.compute_input),
            "compute_infer": _duration(s.compute_infer),
            "compute_output": _duration(s.compute_output),
            "cache_hit": zero,
            "cache_miss": zero,
        },
        "batch_stats": [
            {
                "batch_size": size,
                "compute_input": _duration(b.compute_input),
                "compute_infer": _duration(b.compute_infer),
                "compute_output": _duration(b.compute_output),
            }
            for size, b in sorted(s.batch_sizes.items())
        ],
    }
