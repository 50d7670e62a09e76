"""The raw-engine baseline a driver offers to ``kvtransport bench``.

A benchmark figure means little without the engine's own figure beside it, measured on the
same workload in the same run. A driver package may therefore name, in its class attribute
``raw_engine`` (``"package.module:Class"``), a class that drives its engine directly, with
none of kvtransport in the way: no control channel, no planner, no endpoint. The bench hands
both sides the same registered buffers and the same descriptors kvtransport would send, and
reports the ratio. The class is imported only by the bench, so the core still imports no engine.
"""

from __future__ import annotations

import importlib
from typing import Protocol

from kvtransport.spi.driver import KVTransport
from kvtransport.spi.errors import DriverLoadError
from kvtransport.spi.memory import RegionSet
from kvtransport.spi.plan import Runs


class RawEngine(Protocol):
    """An engine used directly: register, exchange one blob, write, close."""

    def __init__(self, regions: RegionSet, host: str) -> None:
        """Start the engine and register ``regions`` (both sides do this)."""

    def info(self) -> bytes:
        """What the writing side needs to reach this side."""
        ...

    def connect(self, info: bytes) -> None:
        """Writing side: prepare to write to the side that produced ``info``."""

    def write(self, runs: Runs) -> None:
        """Writing side: write every run and return once all bytes are at the peer; raises on
        failure."""

    def close(self) -> None:
        """Release the engine."""


def raw_engine_of(cls: type[KVTransport]) -> type[RawEngine] | None:
    """The raw-engine class a driver names, imported now; ``None`` if it names none."""
    target = getattr(cls, "raw_engine", "")
    if not target:
        return None
    module, _, attr = str(target).partition(":")
    try:
        found: type[RawEngine] = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise DriverLoadError(f"{cls.name}: raw engine {target!r} cannot be imported: {exc}") from exc
    return found
