"""Run a function right after a module is first imported (a test hook's way in)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any


class _After(importlib.abc.MetaPathFinder):
    """Finds ``name`` as the other finders do, and wraps its loading."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # once; and not met by the search below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            self.then()

        loader.exec_module = exec_module
        return spec


def after_import(name: str, then: Callable[[], None]) -> None:
    """Call ``then`` once module ``name`` has been imported (now, if it has been)."""
    if name in sys.modules:
        then()
    else:
        sys.meta_path.insert(0, _After(name, then))
