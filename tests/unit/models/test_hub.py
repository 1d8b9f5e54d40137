"""A model named by hub id is found in a hand-made Hugging Face cache with no network
(the cache's own layout: refs/main -> snapshots/<commit>/), loads and generates
transformers' tokens; a GGUF repository's file is picked by its quant; an id in no
cache, offline, is a clear error."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants
import pytest

from carpool.errors import ModelNotFound
from carpool.models import registry
from carpool.models.hub import is_hub_id
from tests import tiny_models
from tests.unit.models.test_causal_lm import generate

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No network: a lookup that is not cached must not reach for it."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def cached_repo(cache: Path, repo_id: str) -> Path:
    """An empty snapshot of ``repo_id`` in ``cache``, laid out as the library lays it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    return snapshot


def test_a_hub_id_in_the_cache_loads_and_generates(tmp_path: Path, smollm_folder: Path) -> None:
    cache = tmp_path / "hub"
    snapshot = cached_repo(cache, "tiny-org/tiny-qwen3")
    reference = tiny_models.build("qwen3", snapshot, smollm_folder)
    (snapshot / "generation_config.json").write_text('{"temperature": 0.6, "top_k": 20}')
    source = registry.resolve("tiny-org/tiny-qwen3", hub_cache=cache)
    assert source.path == snapshot and source.name == "tiny-org/tiny-qwen3"
    assert source.architecture == "Qwen3ForCausalLM"
    lm = registry.load(source, registry.LoadOptions(progress=False))
    assert lm.generation_defaults == {"temperature": 0.6, "top_k": 20}
    prompt = [5, 6, 7, 8]
    assert generate(lm, [prompt], 12) == [tiny_models.hf_greedy(reference, prompt, 12)]


def test_a_gguf_repository_file_is_picked_by_its_quant(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    snapshot = cached_repo(cache, "org/model-GGUF")
    for quant in ("Q4_K_M", "Q8_0"):
        (snapshot / f"model-{quant}.gguf").write_bytes(b"GGUF")
    from carpool.models.hub import hub_model

    assert hub_model("org/model-GGUF:q8_0", cache) == snapshot / "model-Q8_0.gguf"
    with pytest.raises(ModelNotFound) as caught:
        hub_model("org/model-GGUF", cache)
    assert "model-Q4_K_M.gguf" in caught.value.message and "QUANT" in caught.value.message


def test_an_id_in_no_cache_is_a_clear_error_offline(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound) as caught:
        registry.resolve("nobody/nothing", hub_cache=tmp_path)
    assert "'nobody/nothing' is not in" in caught.value.message
    assert "could not be downloaded" in caught.value.message


def test_what_reads_as_a_hub_id() -> None:
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("org/x-GGUF:Q4_K_M")
    assert not is_hub_id("./folder/x") and not is_hub_id("name") and not is_hub_id("/abs/x")
