"""The models a server serves, and the bridge from the event loop to their batchers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
from starlette.requests import Request

from carpool.admission import RETRY_AFTER_S
from carpool.batching import DynamicBatcher
from carpool.engine.async_engine import AsyncEngine
from carpool.engine.sampling_params import Grammar
from carpool.errors import InvalidRequest, ModelNotFound, ModelUnavailable
from carpool.models.causal_lm import LoadedLM, ModelFacts
from carpool.models.embedding import EmbeddingModel, TokenStates
from carpool.paths import PathTaken
from carpool.server.http.awaiting import gather_or_cancel, unless_disconnected
from carpool.server.registry.preprocess import Preprocessor, token_chars
from carpool.server.registry.served_ensemble import ServedEnsemble
from carpool.server.registry.served_user import ServedUserModel


@dataclass
class ServedEmbedding:
    """An embedding model behind a dynamic batcher."""

    name: str
    model: EmbeddingModel
    batcher: DynamicBatcher
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def paths(self) -> tuple[PathTaken, ...]:
        """Which code runs each part of the model (native kernels or torch)."""
        return self.model.paths

    async def embed(
        self,
        inputs: list[list[int]],
        *,
        priority: int | None = None,
        timeout_s: float | None = None,
        request: Request | None = None,
        token_states: bool = False,
    ) -> list[np.ndarray[Any, Any]]:
        """One embedding per input, all batched by the runtime (with
        ``token_states``: each input's token states, ``[tokens, hidden]``).

        Raises the first ``CarpoolError`` among the inputs; the others are cancelled.
        Raises ``ClientDisconnected`` (and cancels everything) if the client leaves.
        """
        payloads = [TokenStates(ids) if token_states else ids for ids in inputs]
        admitted = self.batcher.submit_many(
            [(p, len(ids)) for p, ids in zip(payloads, inputs, strict=True)],
            level=priority,
            timeout_s=timeout_s,
        )
        futures = [asyncio.wrap_future(f) for f in admitted]
        return await unless_disconnected(request, gather_or_cancel(futures))


@dataclass
class ServedGenerator:
    """A text-generation model behind its engine on the device runtime."""

    name: str
    lm: LoadedLM | ModelFacts  # facts alone where the engine runs in its own process
    engine: AsyncEngine
    default_timeout_s: float
    created: int = field(default_factory=lambda: int(time.time()))
    reasoning_parser: str | None = None  # splits chat replies' thinking (``reasoning``)
    # Sampling defaults for fields a request leaves unset (``--generation-config``).
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    # The most characters one token covers (``preprocess.token_chars``).
    token_chars: int = field(init=False)

    def __post_init__(self) -> None:
        # Here, while the model loads: it copies the whole vocabulary, and that copy's
        # memory is returned with the load's (heap.settle). Left to the first request,
        # a tokenizer thread kept ~7 MiB of it (64 streams of the 135M model).
        self.token_chars = token_chars(self.tokenizer)

    @property
    def tokenizer(self) -> Any:
        return self.lm.tokenizer

    @property
    def paths(self) -> tuple[PathTaken, ...]:
        """Which code runs each part of a step (native kernels or torch)."""
        return self.engine.worker.paths

    def compile_grammar(self, grammar: Grammar, param: str) -> None:
        """Compile ``grammar`` into the model's cache (any thread; the compiled
        grammars are shared under a lock). Raises ``InvalidRequest`` naming ``param``."""
        self.engine.worker.compile_grammar(grammar, param)

    @property
    def max_model_len(self) -> int:
        return self.engine.worker.max_model_len

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text (one batch call, which releases the GIL)."""
        encoded = self.tokenizer(texts, add_special_tokens=add_special_tokens)
        return [list(ids) for ids in encoded["input_ids"]]

    def timeout(self, requested: float | None) -> float:
        """The request's start deadline: the default, or a shorter one it asked for."""
        return (
            self.default_timeout_s if requested is None else min(requested, self.default_timeout_s)
        )


class Batched(Protocol):
    """Whatever runs behind a dynamic batcher (metrics and the dashboard read these)."""

    @property
    def name(self) -> str: ...

    @property
    def batcher(self) -> DynamicBatcher: ...


Builtin = ServedEmbedding | ServedGenerator


class Named(Protocol):
    @property
    def name(self) -> str: ...


M = TypeVar("M", bound=Named)


def the_only(found: Sequence[M], task: str) -> M:
    """The one model in ``found`` (the server's models that do ``task``), for a request
    that names none; else a 400 that names them."""
    if len(found) != 1:
        names = ", ".join(sorted(m.name for m in found))
        raise InvalidRequest(
            f"name the model that does {task} with 'model': "
            + (f"this server has {names}" if names else "this server serves none"),
            param="model",
        )
    return found[0]


class ServedModels:
    """Name -> served model, of every kind: embedders, generators and repository
    models. Model control adds and removes any of them at runtime, on the event loop;
    a built-in model it is unloading is ``closing``: looking it up is a 503 until it
    is gone. Iterating yields the embedding models; ``all`` yields every model."""

    def __init__(
        self,
        models: list[ServedEmbedding],
        generators: list[ServedGenerator] | None = None,
        aliases: dict[str, str] | None = None,
    ) -> None:
        self.aliases = dict(aliases or {})  # another name -> the served name it means
        self._models = {m.name: m for m in models}
        self._generators = {g.name: g for g in generators or []}
        self._user: dict[str, ServedUserModel] = {}
        self._ensembles: dict[str, ServedEnsemble] = {}
        self._closing: set[str] = set()
        self.preprocess = Preprocessor()

    def __iter__(self) -> Iterator[ServedEmbedding]:
        return iter(self._models.values())

    def all(self) -> list[ServedEmbedding | ServedGenerator | ServedUserModel | ServedEnsemble]:
        return [
            *self._generators.values(),
            *self._models.values(),
            *self._user.values(),
            *self._ensembles.values(),
        ]

    def batched(self) -> list[Batched]:
        """Every dynamic-batched model: embedders and each repository model's newest
        version (a snapshot: model control may change the set)."""
        return [*self._models.values(), *(u.latest for u in list(self._user.values()))]

    @property
    def user_models(self) -> dict[str, ServedUserModel]:
        """The repository models served now, by name."""
        return dict(self._user)

    def add_user(self, model: ServedUserModel) -> None:
        if model.name in self._models or model.name in self._generators:
            raise InvalidRequest(
                f"model '{model.name}' is already served as a built-in model", param="model"
            )
        self._user[model.name] = model

    def remove_user(self, name: str) -> None:
        self._user.pop(name, None)

    @property
    def ensembles(self) -> dict[str, ServedEnsemble]:
        """The repository's ensembles served now, by name."""
        return dict(self._ensembles)

    def add_ensemble(self, model: ServedEnsemble) -> None:
        if self.builtin(model.name) is not None:
            raise InvalidRequest(
                f"model '{model.name}' is already served as a built-in model", param="model"
            )
        self._ensembles[model.name] = model

    def remove_ensemble(self, name: str) -> None:
        self._ensembles.pop(name, None)

    def ensemble(self, name: str) -> ServedEnsemble | None:
        return self._ensembles.get(self.aliases.get(name, name))

    def is_from_repository(self, name: str) -> bool:
        """Whether ``name`` is a repository model or ensemble served now."""
        return self.is_user(name) or self.ensemble(name) is not None

    def builtin(self, name: str) -> Builtin | None:
        """The built-in (``--model``) model ``name`` if it is served, closing or not."""
        name = self.aliases.get(name, name)
        return self._models.get(name) or self._generators.get(name)

    def add_builtin(self, model: Builtin) -> None:
        """Serve a (re)loaded built-in model."""
        if model.name in self._user:
            raise InvalidRequest(
                f"model '{model.name}' is already served as a repository model", param="model"
            )
        if isinstance(model, ServedGenerator):
            self._generators[model.name] = model
        else:
            self._models[model.name] = model
        self._closing.discard(model.name)

    def close_builtin(self, name: str) -> None:
        """Refuse new requests for ``name`` (503 + Retry-After) while it drains."""
        self._closing.add(name)

    def is_closing(self, name: str) -> bool:
        return name in self._closing

    def remove_builtin(self, name: str) -> None:
        self._models.pop(name, None)
        self._generators.pop(name, None)
        self._closing.discard(name)

    def user(self, name: str) -> ServedUserModel:
        """The repository model ``name``."""
        name = self.aliases.get(name, name)
        model = self._user.get(name)
        if model is None:
            raise self._unknown(name)
        return model

    def is_user(self, name: str) -> bool:
        name = self.aliases.get(name, name)
        return name in self._user

    @property
    def generators(self) -> list[ServedGenerator]:
        return list(self._generators.values())

    def _unknown(self, name: str) -> ModelNotFound:
        served = ", ".join(m.name for m in self.all())
        return ModelNotFound(f"model {name!r} is not served here; served: {served}", param="model")

    def _refuse_closing(self, name: str) -> None:
        if name in self._closing:
            raise ModelUnavailable(f"model '{name}' is unloading", retry_after_s=RETRY_AFTER_S)

    def any(
        self, name: str
    ) -> ServedEmbedding | ServedGenerator | ServedUserModel | ServedEnsemble:
        """The model ``name``, of any kind."""
        name = self.aliases.get(name, name)
        self._refuse_closing(name)
        model = (
            self._models.get(name)
            or self._generators.get(name)
            or self._user.get(name)
            or self._ensembles.get(name)
        )
        if model is None:
            raise self._unknown(name)
        return model

    def embedder(self, name: str) -> ServedEmbedding:
        """The embedding model ``name``."""
        name = self.aliases.get(name, name)
        self._refuse_closing(name)
        model = self._models.get(name)
        if model is not None:
            return model
        if name in self._generators:
            raise InvalidRequest(
                f"model {name!r} generates text; it does not compute embeddings or tensors",
                param="model",
            )
        self._refuse_user(name)
        raise self._unknown(name)

    def _refuse_user(self, name: str) -> None:
        if name in self._user:
            raise InvalidRequest(
                f"model {name!r} is a repository model; call it at /v2/models/{name}/infer",
                param="model",
            )

    def generator(self, name: str) -> ServedGenerator:
        """The generation model ``name``."""
        name = self.aliases.get(name, name)
        self._refuse_closing(name)
        model = self._generators.get(name)
        if model is not None:
            return model
        if name in self._models:
            raise InvalidRequest(
                f"model {name!r} computes embeddings; it does not generate text", param="model"
            )
        self._refuse_user(name)
        raise self._unknown(name)
