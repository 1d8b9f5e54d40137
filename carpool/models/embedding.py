"""A sentence-embedding model: tokenizer, BERT encoder, pooling, normalisation.

Implements the dynamic batcher's ``BatchModel``: a payload is one input's token ids
(its sentence vector is wanted) or ``TokenStates`` (every token's last hidden state,
TEI's ``/embed_all``); the batch is ragged (no padding in the linear layers) and both
kinds share it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from tokenizers import Tokenizer

from carpool.errors import InvalidRequest
from carpool.models.bert import BertConfig, BertEncoder, Ragged, mean_pool
from carpool.models.ragged_attention import select_ragged_kernel
from carpool.models.weights import load_safetensors, read_json, read_json_list
from carpool.paths import PathTaken


@dataclass(frozen=True)
class TokenStates:
    """A payload that asks for each token's last hidden state (not pooled, not
    normalised) instead of the sentence vector."""

    ids: list[int]


Payload = list[int] | TokenStates


class Encoded(NamedTuple):
    """A batch's answer: each input's sentence vector, and the token states of the
    whole batch where any input asked for them (``offsets``: where input ``i``'s
    tokens lie in ``states``)."""

    pooled: torch.Tensor
    states: torch.Tensor | None
    offsets: list[int]
    wants_states: list[bool]


class EmbeddingModel:
    """Sentence embeddings from a sentence-transformers folder (BERT, mean pooling)."""

    ragged = True

    def __init__(self, folder: Path, device: str = "cpu") -> None:
        self.folder = folder
        self.device = torch.device(device)
        config = BertConfig.from_hf(read_json(folder / "config.json"))
        st_config = read_json(folder / "sentence_bert_config.json")
        pooling = read_json(folder / "1_Pooling" / "config.json")
        if pooling and not pooling.get("pooling_mode_mean_tokens", False):
            raise ValueError(f"{folder}: only mean pooling is supported")
        modules = read_json_list(folder / "modules.json")
        self.normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
        self.max_length = int(st_config.get("max_seq_length", config.max_position_embeddings))  # type: ignore[call-overload]
        self.dimensions = config.hidden_size
        # sentence-transformers' named prompts (e.g. "query": "query: "), for TEI's prompt_name.
        prompts = read_json(folder / "config_sentence_transformers.json").get("prompts")
        self.prompts: dict[str, str] = (
            {str(k): str(v) for k, v in prompts.items()} if isinstance(prompts, dict) else {}
        )
        self.vocab_size = config.vocab_size
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.encoder = BertEncoder(config)
        self.encoder.load_hf_state_dict(load_safetensors(folder))
        self.encoder.to(self.device).eval()
        self.encoder.attention_kernel, path = select_ragged_kernel(self.device, torch.float32)
        self.paths: tuple[PathTaken, ...] = (path,)

    # --- request side (event loop thread): validation and tokenization ------------

    def tokenize(self, text: str, truncate: bool = False, param: str = "input") -> list[int]:
        """Token ids of ``text`` with the model's special tokens.

        Raises ``InvalidRequest`` for empty text, or for text longer than the model's
        maximum unless ``truncate`` (then the ids keep their first tokens and the
        closing special token)."""
        if not text:
            raise InvalidRequest("input must not be empty", param=param)
        return self.fit(self.encode_batch([text])[0], truncate, param)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text with the special tokens, uncut (the tokenizer's
        batch call, which releases the GIL while it works)."""
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def check_ids(self, ids: list[int], truncate: bool = False, param: str = "input") -> list[int]:
        """Validate token ids given directly by a client (used as they are); the
        length first, so an overlong list is refused without a pass over it."""
        if not ids:
            raise InvalidRequest("input must not be empty", param=param)
        fitted = self.fit(ids, truncate, param)
        bad = [i for i in fitted if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                param=param,
            )
        return fitted

    def fit(self, ids: list[int], truncate: bool, param: str = "input") -> list[int]:
        """``ids`` if they fit the model's maximum; else cut to it (``truncate``: the
        first tokens and the closing special token) or refused with ``InvalidRequest``."""
        if len(ids) <= self.max_length:
            return ids
        if not truncate:
            raise InvalidRequest(
                f"input is {len(ids)} tokens, over this model's maximum of {self.max_length}; "
                "shorten it or ask for truncation",
                param=param,
            )
        return [*ids[: self.max_length - 1], ids[-1]]

    # --- BatchModel (runtime thread) ---------------------------------------------

    def collate(self, payloads: list[Payload]) -> tuple[torch.Tensor, Ragged, list[bool]]:
        rows = [p.ids if isinstance(p, TokenStates) else p for p in payloads]
        flat = torch.tensor([t for ids in rows for t in ids], dtype=torch.long, device=self.device)
        wants = [isinstance(p, TokenStates) for p in payloads]
        return flat, Ragged([len(ids) for ids in rows], self.device), wants

    def forward(self, batch: tuple[torch.Tensor, Ragged, list[bool]]) -> Encoded:
        ids, ragged, wants = batch
        with torch.inference_mode():
            hidden = self.encoder(ids, ragged)
            pooled = mean_pool(hidden, ragged, self.normalize)
        offsets = list(itertools.accumulate(ragged.sizes, initial=0))
        return Encoded(pooled, hidden if any(wants) else None, offsets, wants)

    def split(self, output: Encoded, count: int) -> list[np.ndarray[Any, Any]]:
        rows = output.pooled.float().cpu().numpy()
        states = None if output.states is None else output.states.float().cpu().numpy()
        at = output.offsets
        return [
            states[at[i] : at[i + 1]] if output.wants_states[i] and states is not None else rows[i]
            for i in range(count)
        ]

    def embed(self, texts: list[str]) -> np.ndarray[Any, Any]:
        """Embed texts directly, in one batch (for offline use and tests)."""
        out = self.forward(self.collate([self.tokenize(t, truncate=True) for t in texts]))
        return out.pooled.float().cpu().numpy()
