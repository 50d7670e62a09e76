"""Stand-in for torchvision (see tests/stand_ins/README.md): importable, unusable.

Every submodule (``torchvision.transforms``, ``torchvision.io``, ...) imports, and every name
in it is a placeholder that raises ``RuntimeError`` when called."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0"


class _Unusable:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is a test stand-in (tests/stand_ins/README.md)")

    def __getattr__(self, attr: str) -> _Unusable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unusable(f"{self._name}.{attr}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)  # ``class X(torchvision.Something)`` at import time


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unusable(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.insert(0, _Finder())


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unusable(f"torchvision.{name}")
