"""Models named by Hugging Face hub id (``Qwen/Qwen3-0.6B``), found in the local
Hugging Face cache first (no network), downloaded (with the library's progress bar)
only when they are not there and the network allows.

``org/name:QUANT`` picks the one GGUF file of a GGUF repository whose name holds
QUANT (llama.cpp's ``-hf`` convention); a GGUF repository of one file needs no QUANT.
Where the cache is: ``huggingface_hub``'s own setting (``HF_HUB_CACHE``/``HF_HOME``),
or the ``cache_dir`` given.
"""

from __future__ import annotations

import re
from pathlib import Path

from carpool.errors import ModelNotFound

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")
# What serving needs from a safetensors repository (no .bin, .pt, ONNX or GGUF copies).
_WEIGHTS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "tokenizer*"]


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` reads as a hub id (``org/name``, ``org/name:QUANT``)."""
    return _REPO_ID.match(spec) is not None


def hub_model(spec: str, cache_dir: Path | None = None) -> Path:
    """The local path of hub id ``spec``: its snapshot folder, or its GGUF file."""
    repo_id, _, quant = spec.partition(":")
    patterns = [f"*{quant}*.gguf", "*.json"] if quant else _WEIGHTS
    folder = _snapshot(repo_id, cache_dir, patterns)
    if (folder / "config.json").exists() and not quant:
        return folder
    ggufs = sorted(p for p in folder.glob("*.gguf") if quant.lower() in p.name.lower())
    if len(ggufs) == 1:
        return ggufs[0]
    if not ggufs and not quant:
        folder = _snapshot(repo_id, cache_dir, ["*.gguf"])  # a GGUF-only repository
        ggufs = sorted(folder.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    names = ", ".join(p.name for p in ggufs) or "none"
    raise ModelNotFound(
        f"{spec!r}: name one GGUF file with {repo_id}:QUANT (GGUF files here: {names})"
    )


def _snapshot(repo_id: str, cache_dir: Path | None, patterns: list[str]) -> Path:
    """The repository's snapshot: the cached one, else a download."""
    from huggingface_hub import snapshot_download

    try:
        found = snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True)
        return Path(found)
    except Exception:  # not cached (the library raises several kinds): try the network
        pass
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache_dir, allow_patterns=patterns))
    except Exception as exc:
        where = cache_dir or "the Hugging Face cache"
        raise ModelNotFound(
            f"{repo_id!r} is not in {where} and could not be downloaded "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
