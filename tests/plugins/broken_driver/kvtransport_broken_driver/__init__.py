"""Drivers that must be refused: built for another API version, not a driver at all, and one
whose class claims another driver's capabilities by inheritance (refused at class creation)."""

from __future__ import annotations

from typing import ClassVar

from kvtransport.spi.driver import Capabilities, DriverStatus, KVTransport


class OldApiDriver(KVTransport):
    name: ClassVar[str] = "broken-api"
    api_version: ClassVar[int] = 0
    capabilities: ClassVar[Capabilities] = Capabilities(frozenset({"host"}), frozenset({"host"}))

    @classmethod
    def probe(cls) -> DriverStatus:
        return DriverStatus(True, "should never be probed")

    @classmethod
    def offer(cls, local, remote):  # type: ignore[no-untyped-def]
        raise AssertionError("never called")

    open = connect = submit = poll = abort = close = lambda *a: None  # type: ignore[assignment]


not_a_driver = "just a string"


def _make_inheritor() -> object:
    try:

        class InheritsClaims(OldApiDriver):  # declares a name, inherits capabilities: refused
            name: ClassVar[str] = "broken-inherits"

    except TypeError as exc:
        raise ImportError(str(exc)) from exc
    return InheritsClaims


def __getattr__(attr: str) -> object:
    if attr == "InheritsClaims":
        return _make_inheritor()
    raise AttributeError(attr)
