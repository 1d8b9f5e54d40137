"""Each served kind as the Open Inference Protocol sees it: metadata, config,
readiness, statistics and inference. The routes in ``v2_routes`` only pick the
model's adapter; what differs between kinds lives here."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from starlette.requests import Request

from carpool.errors import InvalidRequest, ModelNotFound
from carpool.repository.payload import TensorPayload, parameters_of
from carpool.repository.spec import (
    CheckedRequest,
    ModelSpec,
    TensorSpec,
    check_inputs,
    check_unique,
    config_tensor,
)
from carpool.server.generation.schemas import V2InferRequest
from carpool.server.kserve import llm_tensors
from carpool.server.kserve.v2_tensors import decode_bytes_tensor, decode_tensor
from carpool.server.openai.openai_routes import check_input_count, tokenize_texts
from carpool.server.registry.served import ServedEmbedding, ServedGenerator, ServedModels
from carpool.server.registry.served_ensemble import ServedEnsemble
from carpool.server.registry.served_user import ServedUserModel, ServedVersion
from carpool.stats import BatcherStats, BatcherStatsData, Duration
from carpool.version import __version__

EMBEDDING_INPUT = "text"
EMBEDDING_OUTPUT = "embedding"
BUILTIN_VERSION = "1"  # a built-in model has this one version

Output = tuple[str, np.ndarray[Any, Any]]


@dataclass(frozen=True)
class Answer:
    """One response of a model: its outputs in order, and the response parameters the
    model set (a repository model's ``InferenceResponse(parameters=...)``)."""

    outputs: list[Output]
    parameters: Mapping[str, Any] = field(default_factory=dict)


class V2Model(Protocol):
    """One served model behind the /v2 routes."""

    name: str

    def metadata(self, version: str | None) -> dict[str, Any]: ...

    def config(self) -> dict[str, Any]: ...

    async def ready(self, version: str | None) -> bool:
        """Whether the model (version) takes requests; may ask the model itself."""

    def stats(self, version: str | None) -> list[dict[str, Any]]: ...

    def version_of(self, version: str | None) -> str: ...

    @property
    def decoupled(self) -> bool:
        """Whether the model answers a request with any number of responses."""

    async def infer(
        self,
        body: V2InferRequest,
        blobs: dict[str, bytes],
        request: Request | None,
        version: str | None,
    ) -> Answer:
        """The outputs the request asked for (all, when it named none), in order."""

    def responses(
        self, body: V2InferRequest, blobs: dict[str, bytes], version: str | None
    ) -> AsyncIterator[Answer]:
        """Each response, in order: one, but for a decoupled model."""


def adapter(models: ServedModels, name: str, runtime_alive: Callable[[], bool]) -> V2Model:
    """The /v2 view of the model ``name``."""
    if models.is_user(name):
        return UserV2(models.user(name), runtime_alive)
    ensemble = models.ensemble(name)
    if ensemble is not None:
        return EnsembleV2(ensemble, runtime_alive)
    builtin = models.builtin(name)
    if isinstance(builtin, ServedGenerator):
        models.any(name)  # a generator being unloaded is a 503, as for every route
        return GeneratorV2(builtin, models, runtime_alive)
    return EmbeddingV2(models.embedder(name), models, runtime_alive)


def server_metadata() -> dict[str, Any]:
    """The server's metadata: its name, version and protocol extensions."""
    return {
        "name": "carpool",
        "version": __version__,
        "extensions": [
            "binary_tensor_data",
            "statistics",
            "model_configuration",
            "model_repository",
        ],
    }


def all_stats(models: ServedModels, runtime_alive: Callable[[], bool]) -> list[dict[str, Any]]:
    """Every served model version's statistics (a model being unloaded left out)."""
    names = [m.name for m in models if not models.is_closing(m.name)]
    names += sorted(models.user_models) + sorted(models.ensembles)
    return [s for name in names for s in adapter(models, name, runtime_alive).stats(None)]


def request_param(params: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    """A request parameter of type ``kind``; ``InvalidRequest`` naming it otherwise."""
    value = params.get(key, default)
    if value is default:
        return value
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidRequest(f"parameter '{key}' must be {kind.__name__}", param=key)
    return value


def only_version(name: str, version: str | None) -> str:
    """A built-in model's version: ``version`` must be empty or its one version."""
    if version and version != BUILTIN_VERSION:
        raise InvalidRequest(f"model '{name}' has only version {BUILTIN_VERSION}", param="version")
    return BUILTIN_VERSION


def priority_and_timeout(params: dict[str, Any]) -> tuple[int | None, float | None]:
    """Triton's request parameters: ``priority`` (0: the model's default level) and
    ``timeout`` in microseconds (0: the model's default)."""
    priority = request_param(params, "priority", int, None)
    timeout_us = request_param(params, "timeout", int, None)
    if timeout_us is not None and timeout_us < 0:
        raise InvalidRequest("parameter 'timeout' must be >= 0", param="timeout")
    return priority or None, (timeout_us / 1e6 if timeout_us else None)


class _BuiltinV2:
    """What the built-in models share: one version, ready while the runtime lives."""

    def __init__(self, name: str, runtime_alive: Callable[[], bool]) -> None:
        self.name = name
        self._alive = runtime_alive

    decoupled = False

    def version_of(self, version: str | None) -> str:
        return only_version(self.name, version)

    async def ready(self, version: str | None) -> bool:
        self.version_of(version)
        return self._alive()

    async def infer(
        self,
        body: V2InferRequest,
        blobs: dict[str, bytes],
        request: Request | None,
        version: str | None,
    ) -> Answer:
        raise NotImplementedError

    async def responses(
        self, body: V2InferRequest, blobs: dict[str, bytes], version: str | None
    ) -> AsyncIterator[Answer]:
        yield await self.infer(body, blobs, None, version)


class EmbeddingV2(_BuiltinV2):
    """The built-in embedder: one BYTES input of texts, one FP32 output."""

    def __init__(
        self, served: ServedEmbedding, models: ServedModels, runtime_alive: Callable[[], bool]
    ) -> None:
        super().__init__(served.name, runtime_alive)
        self.served = served
        self._models = models

    def metadata(self, version: str | None) -> dict[str, Any]:
        self.version_of(version)
        return {
            "name": self.name,
            "versions": [BUILTIN_VERSION],
            "platform": "pytorch",
            "inputs": [{"name": EMBEDDING_INPUT, "datatype": "BYTES", "shape": [-1]}],
            "outputs": [
                {
                    "name": EMBEDDING_OUTPUT,
                    "datatype": "FP32",
                    "shape": [-1, self.served.model.dimensions],
                }
            ],
            # Not in the v2 protocol (clients ignore it): which code runs the model.
            "parameters": {"execution": [str(p) for p in self.served.paths]},
        }

    def config(self) -> dict[str, Any]:
        cfg = self.served.batcher.config
        return {
            "name": self.name,
            "platform": "pytorch",
            "max_batch_size": cfg.max_batch_size,
            "input": [{"name": EMBEDDING_INPUT, "data_type": "TYPE_STRING", "dims": [1]}],
            "output": [
                {
                    "name": EMBEDDING_OUTPUT,
                    "data_type": "TYPE_FP32",
                    "dims": [self.served.model.dimensions],
                }
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

    def stats(self, version: str | None) -> list[dict[str, Any]]:
        return [model_stats(self.name, self.version_of(version), self.served.batcher.stats)]

    async def infer(
        self,
        body: V2InferRequest,
        blobs: dict[str, bytes],
        request: Request | None,
        version: str | None,
    ) -> Answer:
        self.version_of(version)
        params = body.parameters or {}
        _check_outputs(body, {EMBEDDING_OUTPUT})
        if len(body.inputs) != 1 or body.inputs[0].name != EMBEDDING_INPUT:
            raise InvalidRequest(f"expected exactly one input named '{EMBEDDING_INPUT}'")
        texts = decode_bytes_tensor(body.inputs[0], blobs.get(EMBEDDING_INPUT))
        if not texts:
            raise InvalidRequest(f"input '{EMBEDDING_INPUT}' is empty")
        truncate = request_param(params, "truncate", bool, False)
        check_input_count(self.served, len(texts))
        ids = await self._models.preprocess.run(
            tokenize_texts, self.served.model, texts, truncate, EMBEDDING_INPUT + "[{}]"
        )
        priority, timeout_s = priority_and_timeout(params)
        vectors = await self.served.embed(
            ids, priority=priority, timeout_s=timeout_s, request=request
        )
        array = (
            np.stack(vectors)
            if vectors
            else np.zeros((0, self.served.model.dimensions), np.float32)
        )
        return Answer([(EMBEDDING_OUTPUT, array)])


class GeneratorV2(_BuiltinV2):
    """A generation model as Triton's vLLM backend shows an LLM (``llm_tensors``):
    ``text_input`` and sampling parameters in, ``text_output`` out; one response, or
    with ``stream`` one per step (decoupled, as the vLLM backend is)."""

    decoupled = True

    def __init__(
        self, served: ServedGenerator, models: ServedModels, runtime_alive: Callable[[], bool]
    ) -> None:
        super().__init__(served.name, runtime_alive)
        self.served = served
        self.models = models
        self.spec = llm_tensors.llm_spec(served.name)

    def metadata(self, version: str | None) -> dict[str, Any]:
        self.version_of(version)
        return spec_metadata(self.spec, [BUILTIN_VERSION], "vllm")

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "backend": "vllm",
            "max_batch_size": 0,
            "model_transaction_policy": {"decoupled": True},
            "input": [config_tensor(t) for t in self.spec.inputs],
            "output": [config_tensor(t) for t in self.spec.outputs],
            "parameters": {"max_model_len": {"string_value": str(self.served.max_model_len)}},
        }

    def stats(self, version: str | None) -> list[dict[str, Any]]:
        data = self.served.engine.worker.stats.snapshot()
        done = sum(data.finished.values())
        stats = model_stats(self.name, self.version_of(version), BatcherStats())
        stats["inference_count"] = done
        stats["execution_count"] = data.steps
        stats["inference_stats"]["success"] = {
            "count": done,
            "ns": int(data.e2e_latency.total * 1e9),
        }
        return [stats]

    async def infer(
        self,
        body: V2InferRequest,
        blobs: dict[str, bytes],
        request: Request | None,
        version: str | None,
    ) -> Answer:
        """The one response (a streaming request's steps must be read as a stream)."""
        answers = [r async for r in self.responses(body, blobs, version)]
        if len(answers) != 1:
            raise InvalidRequest(
                f"model '{self.name}' sent {len(answers)} responses to this request; read "
                "them from a stream (gRPC ModelStreamInfer, or generate_stream)",
                param="stream",
            )
        return answers[0]

    async def responses(
        self, body: V2InferRequest, blobs: dict[str, bytes], version: str | None
    ) -> AsyncIterator[Answer]:
        self.version_of(version)
        check_unique([t.name for t in body.inputs])
        arrays = {t.name: decode_tensor(t, blobs.get(t.name)) for t in body.inputs}
        wanted = _check_outputs(body, {t.name for t in self.spec.outputs})
        async for outputs in self.generate(arrays, body.parameters or {}):
            yield _ordered(outputs, wanted or [t.name for t in self.spec.outputs])

    def generate(
        self, arrays: dict[str, np.ndarray[Any, Any]], params: dict[str, Any]
    ) -> AsyncGenerator[dict[str, np.ndarray[Any, Any]], None]:
        """Each response's outputs for a request's tensors and parameters."""
        asked = llm_tensors.read_request(self.spec, arrays, params)
        return llm_tensors.responses(self.served, self.models, asked)


class UserV2:
    """A repository model: the tensors its config declares."""

    def __init__(self, served: ServedUserModel, runtime_alive: Callable[[], bool]) -> None:
        self.served = served
        self.name = served.name
        self._alive = runtime_alive

    def version_of(self, version: str | None) -> str:
        return str(self.served.version(version).spec.version)

    def metadata(self, version: str | None) -> dict[str, Any]:
        spec = self.served.version(version).spec
        config = spec.model_config
        versions = [str(v) for v in sorted(self.served.versions)]
        return spec_metadata(
            spec, versions, config.get("platform") or config.get("backend", "python")
        )

    def config(self) -> dict[str, Any]:
        return dict(self.served.latest.spec.model_config)

    async def ready(self, version: str | None) -> bool:
        """Alive, not unloading, an instance healthy, and the model's own ``is_ready``
        saying so where it has one (asked off the event loop, within 5 s)."""
        served = self.served.version(version)
        if not (self._alive() and self.served.ready):
            return False
        return await asyncio.to_thread(served.model.check_ready)

    def stats(self, version: str | None) -> list[dict[str, Any]]:
        chosen = [self.served.version(version)] if version else list(self.served.versions.values())
        return [model_stats(self.name, str(v.spec.version), v.batcher.stats) for v in chosen]

    @property
    def decoupled(self) -> bool:
        return self.served.latest.spec.decoupled

    async def infer(
        self,
        body: V2InferRequest,
        blobs: dict[str, bytes],
        request: Request | None,
        version: str | None,
    ) -> Answer:
        served, checked, payload, priority, timeout_s = self._prepare(body, blobs, version)
        outputs = await self.served.infer(
            served, checked, payload, priority=priority, timeout_s=timeout_s, request=request
        )
        return _ordered(outputs, payload.outputs or [t.name for t in served.spec.outputs])

    async def responses(
        self, body: V2InferRequest, blobs: dict[str, bytes], version: str | None
    ) -> AsyncIterator[Answer]:
        served, checked, payload, priority, timeout_s = self._prepare(body, blobs, version)
        order = payload.outputs or [t.name for t in served.spec.outputs]
        answers = self.served.responses(
            served, checked, payload, priority=priority, timeout_s=timeout_s, request=None
        )
        async with contextlib.aclosing(answers):
            async for outputs in answers:
                yield _ordered(outputs, order)

    def _prepare(
        self, body: V2InferRequest, blobs: dict[str, bytes], version: str | None
    ) -> tuple[ServedVersion, CheckedRequest, TensorPayload, int | None, float | None]:
        """The request checked against the version's config, as the batcher takes it."""
        served = self.served.version(version)
        return served, *tensor_request(served.spec, body, blobs)


def tensor_request(
    spec: ModelSpec, body: V2InferRequest, blobs: dict[str, bytes]
) -> tuple[CheckedRequest, TensorPayload, int | None, float | None]:
    """A /v2 request's tensors checked against ``spec``, its payload, priority and
    timeout; ``InvalidRequest`` naming what is wrong."""
    check_unique([t.name for t in body.inputs])
    arrays = {t.name: decode_tensor(t, blobs.get(t.name)) for t in body.inputs}
    checked = check_inputs(spec, arrays)
    wanted = _check_outputs(body, {t.name for t in spec.outputs})
    params = body.parameters or {}
    priority, timeout_s = priority_and_timeout(params)
    payload = TensorPayload(
        checked.arrays,
        tuple(wanted),
        request_id=body.id or "",
        parameters=scalar_parameters(params),
    )
    return checked, payload, priority, timeout_s


def scalar_parameters(params: dict[str, Any]) -> dict[str, Any]:
    """The request parameters a model sees (Triton's: strings, numbers, booleans)."""
    return {k: v for k, v in params.items() if isinstance(v, str | int | float | bool)}


class EnsembleV2:
    """A repository ensemble: the tensors its config declares, answered by its steps."""

    decoupled = False

    def __init__(self, served: ServedEnsemble, runtime_alive: Callable[[], bool]) -> None:
        self.served = served
        self.name = served.name
        self._alive = runtime_alive

    def version_of(self, version: str | None) -> str:
        own = str(self.served.spec.version)
        if version and version != own:
            raise ModelNotFound(
                f"model '{self.name}' has no version {version!r}; served: {own}", param="version"
            )
        return own

    def metadata(self, version: str | None) -> dict[str, Any]:
        return spec_metadata(self.served.spec, [self.version_of(version)], "ensemble")

    def config(self) -> dict[str, Any]:
        return dict(self.served.spec.model_config)

    async def ready(self, version: str | None) -> bool:
        self.version_of(version)
        return self._alive() and self.served.ready

    def stats(self, version: str | None) -> list[dict[str, Any]]:
        return [model_stats(self.name, self.version_of(version), self.served.stats)]

    async def infer(
        self,
        body: V2InferRequest,
        blobs: dict[str, bytes],
        request: Request | None,
        version: str | None,
    ) -> Answer:
        self.version_of(version)
        spec = self.served.spec
        checked, payload, priority, timeout_s = tensor_request(spec, body, blobs)
        outputs = await self.served.infer(
            checked, payload, priority=priority, timeout_s=timeout_s, request=request
        )
        return _ordered(outputs, payload.outputs or [t.name for t in spec.outputs])

    async def responses(
        self, body: V2InferRequest, blobs: dict[str, bytes], version: str | None
    ) -> AsyncIterator[Answer]:
        yield await self.infer(body, blobs, None, version)


def _ordered(outputs: dict[str, np.ndarray[Any, Any]], order: Sequence[str]) -> Answer:
    """The outputs in ``order`` (a decoupled model's response may hold some only), with
    the response parameters they carry."""
    ordered = [(name, outputs[name]) for name in order if name in outputs]
    return Answer(ordered, parameters_of(outputs))


def spec_metadata(spec: ModelSpec, versions: list[str], platform: str) -> dict[str, Any]:
    """A model's metadata from its spec: its tensors, a batch dimension first where
    it batches."""
    batch = [-1] if spec.max_batch_size > 0 else []
    return {
        "name": spec.name,
        "versions": versions,
        "platform": platform,
        "inputs": [_tensor_metadata(t, batch) for t in spec.inputs],
        "outputs": [_tensor_metadata(t, batch) for t in spec.outputs],
    }


def _tensor_metadata(tensor: TensorSpec, batch: list[int]) -> dict[str, Any]:
    return {"name": tensor.name, "datatype": tensor.datatype, "shape": [*batch, *tensor.dims]}


def _check_outputs(body: V2InferRequest, known: set[str]) -> list[str]:
    """The outputs the request names (empty: all); ``InvalidRequest`` for an unknown or
    repeated one (a repeated name would copy the output once per mention)."""
    names = [o.name for o in body.outputs or []]
    check_unique(names, "output")
    for name in names:
        if name not in known:
            raise InvalidRequest(
                f"unknown output '{name}'; this model has {', '.join(sorted(known))}", param=name
            )
    return names


def binary_outputs(body: V2InferRequest) -> dict[str, bool]:
    """Per named output, whether it is asked for as binary data; ``""`` holds the
    request-wide default (``binary_data_output``)."""
    params = body.parameters or {}
    default = request_param(params, "binary_data_output", bool, False)
    chosen = {"": default}
    for output in body.outputs or []:
        value = (output.parameters or {}).get("binary_data", default)
        if not isinstance(value, bool):
            raise InvalidRequest(
                f"output '{output.name}': parameter 'binary_data' must be bool", param=output.name
            )
        chosen[output.name] = value
    return chosen


def _duration(d: Duration) -> dict[str, int]:
    return {"count": d.count, "ns": d.ns}


def model_stats(name: str, version: str, stats: BatcherStats) -> dict[str, Any]:
    """One model version's statistics in Triton's statistics-extension shape."""
    s: BatcherStatsData = stats.snapshot()
    zero = {"count": 0, "ns": 0}
    return {
        "name": name,
        "version": version,
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
