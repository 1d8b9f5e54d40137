"""A model's own sampling defaults, from its ``generation_config.json``: what a
request that leaves a field unset gets (vLLM's ``--generation-config auto``).

Read: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
``max_new_tokens`` (as ``max_tokens``). A value of the wrong type or out of range is
left out, with a warning: the file is the model author's, not the request's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "temperature": ("temperature", lambda v: _number(v) and 0 <= v <= 2),
    "top_p": ("top_p", lambda v: _number(v) and 0 < v <= 1),
    "top_k": ("top_k", lambda v: _integer(v) and v >= 0),
    "min_p": ("min_p", lambda v: _number(v) and 0 <= v <= 1),
    "repetition_penalty": ("repetition_penalty", lambda v: _number(v) and 0 < v <= 10),
    "max_new_tokens": ("max_tokens", lambda v: _integer(v) and v >= 1),
}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_generation_defaults(folder: Path) -> dict[str, Any]:
    """The sampling defaults in ``folder``'s ``generation_config.json`` (request field
    name -> value); {} without the file."""
    path = folder / "generation_config.json"
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        log.warning("%s is not JSON (%s): no sampling defaults from it", path, exc)
        return {}
    if not isinstance(config, dict):
        return {}
    defaults = {}
    for key, (field, valid) in _CHECKS.items():
        if key not in config or config[key] is None:
            continue
        if valid(config[key]):
            defaults[field] = config[key]
        else:
            log.warning("%s: %s=%r is out of range; not used", path, key, config[key])
    return defaults
