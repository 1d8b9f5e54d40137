"""Session-wide fixtures: the built-in generation model, converted once."""

from __future__ import annotations

from pathlib import Path

import pytest

from carpool.models.causal_lm import LoadedLM, convert_gguf, load_causal_lm
from carpool.models.registry import BUILTIN_MODELS


@pytest.fixture(scope="session")
def carpool_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache folder for the session: the built-in GGUF is converted once."""
    return tmp_path_factory.mktemp("carpool-cache")


@pytest.fixture(scope="session")
def smollm_folder(carpool_cache: Path) -> Path:
    """The built-in chat model converted to a Hugging Face folder."""
    return convert_gguf(
        BUILTIN_MODELS["smollm2-135m-instruct"].locate(), carpool_cache, progress=False
    )


@pytest.fixture(scope="session")
def smollm(smollm_folder: Path) -> LoadedLM:
    return load_causal_lm(smollm_folder, name="smollm2-135m-instruct", progress=False)
