"""Session-wide fixtures: the built-in generation model, converted once. Imports
nothing heavy at module level: the torch-free core tests (scripts/check_core.sh)
run where torch is not installed."""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from carpool.config import default_cache_dir

if TYPE_CHECKING:
    from carpool.models.causal_lm import LoadedLM


def pytest_configure(config: pytest.Config) -> None:
    """Without a GPU, the GPU's Triton kernels are tested under Triton's interpreter,
    which must be chosen before anything imports triton (transformers and torch's
    own modules may, while test modules are collected)."""
    if importlib.util.find_spec("torch") is None:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def carpool_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One cache folder for the session, also given to every server the tests start
    (through XDG_CACHE_HOME): the built-in GGUF is converted once. The native kernels
    the install built for this machine (``scripts/install.sh``) are copied in, as a
    user's server finds them: a build is keyed by its sources, flags and compiler,
    so a stale one is never loaded, only rebuilt (``tests/unit/models/test_native.py``
    builds them anew)."""
    built = default_cache_dir() / "kernels"
    base = tmp_path_factory.mktemp("xdg-cache")
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(base)
    kernels = default_cache_dir() / "kernels"
    kernels.mkdir(parents=True)
    for library in built.glob("*.so") if built.is_dir() else ():
        shutil.copy2(library, kernels / library.name)
    yield default_cache_dir()
    if before is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(scope="session")
def smollm_folder(carpool_cache: Path) -> Path:
    """The built-in chat model converted to a Hugging Face folder."""
    from carpool.models.causal_lm import convert_gguf
    from carpool.models.registry import BUILTIN_MODELS

    return convert_gguf(
        BUILTIN_MODELS["smollm2-135m-instruct"].locate(), carpool_cache, progress=False
    )


@pytest.fixture(scope="session")
def smollm(smollm_folder: Path) -> LoadedLM:
    from carpool.models.causal_lm import load_causal_lm

    return load_causal_lm(smollm_folder, name="smollm2-135m-instruct", progress=False)
