"""Models from well-kept libraries, served without a line of user code: Hugging Face
pipelines, sentence-transformers CrossEncoders (reranking) and embedders.

Each kind declares its own tensors (``signature``), one row per text (or pair, or
image), so requests of any size share batches row by row. The library is imported
only when such a model loads; a missing one is a load error that says what to install.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from carpool.batching.request import Failed
from carpool.errors import InvalidRequest
from carpool.repository.errors import RepositoryError
from carpool.repository.payload import TensorPayload
from carpool.repository.spec import ModelSpec, TensorSpec

Outputs = dict[str, np.ndarray[Any, Any]]

PIPELINE_TASKS = (
    "text-classification",
    "token-classification",
    "fill-mask",
    "zero-shot-classification",
    "feature-extraction",
    "image-classification",
)
_CLASSIFY_OUTPUTS = (
    TensorSpec("label", "BYTES", (1,)),
    TensorSpec("score", "FP32", (1,)),
    TensorSpec("scores", "FP32", (-1,)),
    TensorSpec("labels", "BYTES", (-1,)),
)
# How each text task's pipeline takes tokenizer options ("": as keywords of its own).
_TRUNCATION_KEYWORD = {
    "text-classification": "",
    "feature-extraction": "tokenize_kwargs",
    "fill-mask": "tokenizer_kwargs",
}
_JSON_OUTPUT = (TensorSpec("result", "BYTES", (1,)),)
_TEXT = (TensorSpec("text", "BYTES", (1,)),)


def signature(kind: str, task: str) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The inputs and outputs of a library model of ``kind`` (and pipeline ``task``)."""
    if kind == "sentence_transformer":
        return _TEXT, (TensorSpec("embedding", "FP32", (-1,)),)
    if kind == "cross_encoder":
        pair = (TensorSpec("query", "BYTES", (1,)), TensorSpec("document", "BYTES", (1,)))
        return pair, (TensorSpec("score", "FP32", (1,)),)
    if task in ("text-classification",):
        return _TEXT, _CLASSIFY_OUTPUTS
    if task == "image-classification":
        return (TensorSpec("image", "BYTES", (1,)),), _CLASSIFY_OUTPUTS
    if task == "zero-shot-classification":
        labels = TensorSpec("candidate_labels", "BYTES", (-1,), allow_ragged_batch=True)
        outs = (TensorSpec("labels", "BYTES", (-1,)), TensorSpec("scores", "FP32", (-1,)))
        return (_TEXT[0], labels), outs
    return _TEXT, _JSON_OUTPUT


def _rows(payloads: list[TensorPayload], name: str) -> tuple[list[bytes], list[int]]:
    """Every row of input ``name`` across the batch, and how many each request brought."""
    rows: list[bytes] = []
    counts = []
    for p in payloads:
        column = p.inputs[name].reshape(len(p.inputs[name]), -1)[:, 0]
        rows.extend(column.tolist())
        counts.append(len(column))
    return rows, counts


def _texts(rows: list[bytes], name: str) -> list[str]:
    try:
        return [r.decode("utf-8") for r in rows]
    except UnicodeDecodeError:
        raise InvalidRequest(f"input '{name}' holds bytes that are not UTF-8", param=name) from None


def _split(values: dict[str, np.ndarray[Any, Any]], counts: list[int]) -> list[Outputs | Failed]:
    out: list[Outputs | Failed] = []
    start = 0
    for count in counts:
        out.append({k: v[start : start + count] for k, v in values.items()})
        start += count
    return out


def _require(module: str, kind: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise RepositoryError(
            f"a {kind} model needs the '{module}' package: pip install {module.replace('_', '-')}"
        ) from None


def _torch_device(device: str) -> Any:
    return device if device.startswith("cuda") else "cpu"


def prepared_once(model: Any) -> Any:
    """``model`` (a sentence-transformers model) with its per-call preparation done
    once. Its ``predict`` and ``encode`` put it in eval mode and check every parameter's
    device on each call (``eval``, ``_resolve_inference_device``): two walks of the
    module tree, 1.6 ms of a 26 ms one-pair MiniLM-sized CrossEncoder call here (0.74 and
    0.83 ms, warm), more than the server's own work on a request. carpool never trains,
    moves or asks another device of a served model, so both are done here once and are
    no-ops on this instance from then on; a library version without them is left as
    it is."""
    resolve = getattr(model, "_resolve_inference_device", None)
    if not callable(resolve) or not callable(getattr(model, "eval", None)):
        return model
    model.eval()
    device = resolve(None)
    model._resolve_inference_device = lambda requested: device
    model.eval = _already_in_eval_mode
    return model


def _already_in_eval_mode() -> None:
    """What ``eval`` does on a model ``prepared_once`` has prepared: nothing."""


class SentenceTransformerBackend:
    """Embeddings from a sentence-transformers model folder."""

    def __init__(self, spec: ModelSpec, instance: int, device: str) -> None:
        library = _require("sentence_transformers", "sentence_transformer")
        self.model = prepared_once(
            library.SentenceTransformer(spec.source.path, device=_torch_device(device))
        )
        self.normalize = bool(spec.source.options.get("normalize", False))

    def execute(self, payloads: list[TensorPayload]) -> list[Outputs | Failed]:
        rows, counts = _rows(payloads, "text")
        vectors = self.model.encode(
            _texts(rows, "text"),
            batch_size=max(1, len(rows)),
            convert_to_numpy=True,
            normalize_embeddings=self.normalize,
            show_progress_bar=False,  # its default draws one per batch at log level info
        )
        return _split({"embedding": np.asarray(vectors, np.float32)}, counts)

    def finalize(self) -> None:
        del self.model


class CrossEncoderBackend:
    """Relevance scores of (query, document) pairs from a sentence-transformers
    CrossEncoder folder (rerankers)."""

    def __init__(self, spec: ModelSpec, instance: int, device: str) -> None:
        library = _require("sentence_transformers", "cross_encoder")
        self.model = prepared_once(
            library.CrossEncoder(spec.source.path, device=_torch_device(device))
        )

    def execute(self, payloads: list[TensorPayload]) -> list[Outputs | Failed]:
        queries, counts = _rows(payloads, "query")
        documents, _ = _rows(payloads, "document")
        pairs = list(zip(_texts(queries, "query"), _texts(documents, "document"), strict=True))
        scores = self.model.predict(
            pairs,
            batch_size=max(1, len(pairs)),
            convert_to_numpy=True,
            show_progress_bar=False,  # its default draws one per batch at log level info
        )
        return _split({"score": np.asarray(scores, np.float32).reshape(-1, 1)}, counts)

    def finalize(self) -> None:
        del self.model


class PipelineBackend:
    """A transformers pipeline (``task`` on a local folder), batched by carpool."""

    def __init__(self, spec: ModelSpec, instance: int, device: str) -> None:
        transformers = _require("transformers", "pipeline")
        self.task = spec.source.options.get("task", "")
        if self.task not in PIPELINE_TASKS:
            raise RepositoryError(
                f"model '{spec.name}': pipeline task '{self.task}' is not one of "
                f"{', '.join(PIPELINE_TASKS)}"
            )
        self.pipe = transformers.pipeline(
            self.task, model=spec.source.path, device=_torch_device(device)
        )
        self._run: Callable[[list[TensorPayload]], list[Outputs | Failed]] = {
            "text-classification": self._classify,
            "image-classification": self._classify,
            "zero-shot-classification": self._zero_shot,
        }.get(self.task, self._as_json)
        self.truncate = bool(spec.source.options.get("truncate", False))
        self.max_tokens = _max_tokens(self.pipe)

    def execute(self, payloads: list[TensorPayload]) -> list[Outputs | Failed]:
        """Each request's outputs. A text over the model's token limit is truncated
        when the request (parameter ``truncate``) or the model's options ask for it,
        as TEI does; else its request fails with a 400 naming the limit. (The
        zero-shot pipeline truncates of itself.)"""
        if self.task in ("image-classification", "zero-shot-classification"):
            return self._run(payloads)
        refused = {i: error for i, p in enumerate(payloads) if (error := self._too_long(p))}
        kept = [p for i, p in enumerate(payloads) if i not in refused]
        ran = iter(self._run(kept) if kept else [])
        return [refused[i] if i in refused else next(ran) for i in range(len(payloads))]

    def _too_long(self, payload: TensorPayload) -> Failed | None:
        """``Failed`` for a request with a text over the token limit that may not be
        truncated; None when it may run (truncation is then on for every call)."""
        if self.max_tokens is None or self.truncate or payload.parameters.get("truncate"):
            return None
        rows, _ = _rows([payload], "text")
        texts = _texts(rows, "text")
        # A character makes at most 4 tokens (a byte-level one, 4 UTF-8 bytes), plus a
        # few special tokens: short texts need no tokenizing here.
        if all(4 * len(t) + 8 <= self.max_tokens for t in texts):
            return None
        lengths = [len(ids) for ids in self.pipe.tokenizer(texts)["input_ids"]]
        longest = max(lengths, default=0)
        if longest <= self.max_tokens:
            return None
        row = lengths.index(longest)
        return Failed(
            InvalidRequest(
                f"input 'text' row {row} has {longest} tokens; this model takes at most "
                f"{self.max_tokens} (ask for truncation with the parameter 'truncate': true)",
                param="text",
            )
        )

    def _text_options(self) -> dict[str, Any]:
        """What every text call passes: truncation at the model's limit, in the
        task's own keyword (a longer text reaches the pipeline only when truncating it
        was asked for; token classification truncates of itself)."""
        if self.max_tokens is None:
            return {}
        truncation = {"truncation": True, "max_length": self.max_tokens}
        keyword = _TRUNCATION_KEYWORD.get(self.task)
        if keyword is None:
            return {}
        return truncation if keyword == "" else {keyword: truncation}

    def _call(self, inputs: list[Any], **kwargs: Any) -> list[Any]:
        """One answer per input. A pipeline given a list of one answers as for that one
        input alone in some tasks and as a list of one in others: one input is passed
        alone and its answer wrapped."""
        if len(inputs) == 1:
            return [self.pipe(inputs[0], **kwargs)]
        return list(self.pipe(inputs, batch_size=len(inputs), **kwargs))

    def _inputs(self, payloads: list[TensorPayload]) -> tuple[list[Any], list[int]]:
        if self.task == "image-classification":
            from PIL import Image

            rows, counts = _rows(payloads, "image")
            return [Image.open(io.BytesIO(r)).convert("RGB") for r in rows], counts
        rows, counts = _rows(payloads, "text")
        return _texts(rows, "text"), counts

    def _classify(self, payloads: list[TensorPayload]) -> list[Outputs | Failed]:
        inputs, counts = self._inputs(payloads)
        answers = self._call(inputs, top_k=None, **self._text_options())
        labels = self.pipe.model.config.id2label
        order = [labels[i] for i in sorted(labels)]
        scores = np.array(
            [
                [{a["label"]: a["score"] for a in answer}[label] for label in order]
                for answer in answers
            ],
            np.float32,
        )
        best = scores.argmax(axis=1)
        values = {
            "label": np.array([[order[i].encode()] for i in best], np.object_),
            "score": scores.max(axis=1, keepdims=True),
            "scores": scores,
            "labels": np.array([[label.encode() for label in order]] * len(scores), np.object_),
        }
        return _split(values, counts)

    def _zero_shot(self, payloads: list[TensorPayload]) -> list[Outputs | Failed]:
        results: list[Outputs | Failed] = []
        for p in payloads:  # the pipeline takes one label set per call: one row at a time
            texts = _texts(p.inputs["text"].reshape(-1).tolist(), "text")
            label_rows = p.inputs["candidate_labels"].reshape(len(texts), -1).tolist()
            answers = [
                self.pipe(text, candidate_labels=_texts(labels, "candidate_labels"))
                for text, labels in zip(texts, label_rows, strict=True)
            ]
            results.append(
                {
                    "labels": np.array(
                        [[a.encode() for a in x["labels"]] for x in answers], np.object_
                    ),
                    "scores": np.array([x["scores"] for x in answers], np.float32),
                }
            )
        return results

    def _as_json(self, payloads: list[TensorPayload]) -> list[Outputs | Failed]:
        inputs, counts = self._inputs(payloads)
        answers = self._call(inputs, **self._text_options())
        if self.task == "feature-extraction":
            # A batch is padded to its longest text: each answer keeps its own tokens,
            # as when the text runs alone.
            lengths = [
                min(len(ids), self.max_tokens or len(ids))
                for ids in self.pipe.tokenizer(inputs)["input_ids"]
            ]
            answers = [[a[0][:n]] for a, n in zip(answers, lengths, strict=True)]
        encoded = [[json.dumps(_plain(a)).encode()] for a in answers]
        return _split({"result": np.array(encoded, np.object_)}, counts)

    def finalize(self) -> None:
        del self.pipe


def _max_tokens(pipe: Any) -> int | None:
    """The most tokens the pipeline's model takes in one text: the smaller of its
    tokenizer's ``model_max_length`` (a tokenizer without one says about 1e30) and
    its config's ``max_position_embeddings``; None when neither says (images)."""
    if getattr(pipe, "tokenizer", None) is None:
        return None
    limits = [
        getattr(pipe.tokenizer, "model_max_length", None),
        getattr(pipe.model.config, "max_position_embeddings", None),
    ]
    known = [n for n in limits if isinstance(n, int) and 0 < n < 1_000_000]
    return min(known, default=None)


def _plain(value: Any) -> Any:
    """A pipeline's answer as JSON-ready values (numpy scalars and arrays included)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value
