"""Our BERT embedder reproduces sentence-transformers and Hugging Face BERT, and batching
never changes an embedding."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from carpool.errors import InvalidRequest
from carpool.models.bert import BertConfig, BertEncoder, Ragged
from carpool.models.embedding import EmbeddingModel, TokenStates
from carpool.models.ragged_attention import compile_ragged_kernel
from carpool.models.registry import BUILTIN_MODELS

TEXTS = [
    "Hello world",
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog. " * 8,
    "a",
    "Ünïcödé, emoji 🚗 and CJK 汉字 share the ride",
    "   leading and trailing spaces   ",
    "numbers 3.14159 and symbols #$%&*()",
]


@pytest.fixture(scope="module")
def minilm() -> EmbeddingModel:
    return EmbeddingModel(BUILTIN_MODELS["all-minilm-l6-v2"].locate())


def test_matches_sentence_transformers(minilm: EmbeddingModel) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm.folder), device="cpu").encode(TEXTS)
    ours = minilm.embed(TEXTS)
    assert ours.shape == (len(TEXTS), 384)
    cosine = (
        (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    )
    assert cosine.min() >= 0.9999
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_attention_runs_natively_and_as_torch_does(minilm: EmbeddingModel) -> None:
    """On the CPU the encoder attends a ragged batch in one native call per layer;
    its embeddings are those of the per-sequence torch path."""
    kernel = minilm.encoder.attention_kernel
    assert kernel is not None
    native = minilm.embed(TEXTS)
    minilm.encoder.attention_kernel = None
    try:
        torch_path = minilm.embed(TEXTS)
    finally:
        minilm.encoder.attention_kernel = kernel
    assert np.abs(native - torch_path).max() < 1e-5


def test_the_ragged_kernel_attends_within_each_sequence() -> None:
    lengths, heads, dim = [1, 5, 40, 3, 130], 4, 12  # 12: not a multiple of 8
    qkv = torch.randn(sum(lengths), 3 * heads * dim, generator=torch.Generator().manual_seed(0))
    offsets = torch.tensor([0, *np.cumsum(lengths).tolist()])
    out = compile_ragged_kernel()(qkv, offsets, heads, 0.3)
    q, k, v = qkv.view(-1, 3, heads, dim).permute(1, 2, 0, 3)  # each [heads, tokens, dim]
    expected = torch.cat(
        [
            F.scaled_dot_product_attention(qs, ks, vs, scale=0.3)
            for qs, ks, vs in zip(
                q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1), strict=True
            )
        ],
        dim=1,
    )
    torch.testing.assert_close(out, expected.transpose(0, 1).reshape(-1, heads * dim))


@pytest.mark.parametrize(
    ("offsets", "width", "match"),
    [
        ([0, 3, 9], 24, "rise from 0 to the 6 tokens"),  # past the last token
        ([0, 4, 2, 6], 24, "rise from 0"),  # falls back
        ([1, 6], 24, "starting at 0"),
        ([0, 6], 20, "not q, k and v of 2 heads"),
    ],
)
def test_the_ragged_kernel_refuses_offsets_that_point_outside(
    offsets: list[int], width: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        compile_ragged_kernel()(torch.zeros(6, width), torch.tensor(offsets), 2, 1.0)


def test_token_states_share_a_batch_and_pool_to_the_sentence_vector(
    minilm: EmbeddingModel,
) -> None:
    # TEI's /embed_all: an input that asks for its token states rides with inputs
    # that ask for sentence vectors; its states are what the vector is the mean of.
    ids = [minilm.tokenize(t) for t in TEXTS[:3]]
    payloads = [ids[0], TokenStates(ids[1]), ids[2]]
    rows = minilm.split(minilm.forward(minilm.collate(payloads)), 3)
    assert rows[0].shape == rows[2].shape == (minilm.dimensions,)
    assert rows[1].shape == (len(ids[1]), minilm.dimensions)
    mean = rows[1].mean(axis=0)
    pooled = mean / np.linalg.norm(mean) if minilm.normalize else mean
    assert np.abs(pooled - minilm.embed([TEXTS[1]])[0]).max() < 1e-5
    assert np.abs(rows[0] - minilm.embed([TEXTS[0]])[0]).max() < 1e-5


def test_batching_never_changes_an_embedding(minilm: EmbeddingModel) -> None:
    together = minilm.embed(TEXTS)
    alone = np.stack([minilm.embed([t])[0] for t in TEXTS])
    assert np.abs(together - alone).max() < 1e-5


def test_too_long_input_is_refused_unless_truncation_is_asked(minilm: EmbeddingModel) -> None:
    long_text = "word " * 400
    with pytest.raises(InvalidRequest, match="over this model's maximum of 256"):
        minilm.tokenize(long_text)
    ids = minilm.tokenize(long_text, truncate=True)
    assert len(ids) == 256 and ids[-1] == minilm.tokenizer.token_to_id("[SEP]")
    with pytest.raises(InvalidRequest, match="empty"):
        minilm.tokenize("")
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        minilm.check_ids([101, 10**6])


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ),
    ],
)
def test_tiny_random_bert_matches_transformers(tmp_path: Path, device: str) -> None:
    from transformers import BertConfig as HFConfig
    from transformers import BertModel

    torch.manual_seed(0)
    hf_config = HFConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
    )
    hf = BertModel(hf_config, add_pooling_layer=False).eval().to(device)
    hf.config.to_json_file(tmp_path / "config.json")
    ours = BertEncoder(BertConfig.from_hf(json.loads((tmp_path / "config.json").read_text())))
    ours.load_hf_state_dict(hf.state_dict())
    ours.to(device)
    lengths = [5, 17, 1, 9]
    sequences = [torch.randint(0, 99, (n,), device=device) for n in lengths]
    with torch.inference_mode():
        flat = ours(torch.cat(sequences), Ragged(lengths, torch.device(device)))
        offset = 0
        for seq in sequences:
            expected = hf(input_ids=seq[None]).last_hidden_state[0]
            assert torch.allclose(flat[offset : offset + len(seq)], expected, atol=1e-5)
            offset += len(seq)


def test_every_builtin_model_is_found_in_its_installed_package() -> None:
    for model in BUILTIN_MODELS.values():
        assert model.locate().exists(), model.name
