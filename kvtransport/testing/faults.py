"""A fault-injecting wrapper around any driver, real engines included.

:func:`faulty` gives a subclass of a driver class with the same name and behaviour, whose data
path fails on command: while the file its endpoint's option ``faults.<driver name>`` names
exists, every ``submit`` and ``poll`` of a batch raises an :class:`EngineError`, as an engine
whose rail went down or whose NIC reset would; while it holds ``stall``, batches are submitted
but ``poll`` never reports one finished (completions that stopped: a black-holed rail, which
no error reports). A file, so that a test can arm and disarm a
driver in another process (or another simulated host) by creating and removing it. The
control plane and every other call are the driver's own.

Like :mod:`kvtransport.testing.fake`, it is never registered: tests and ``kvtransport.tools.peer``
(``--options '{"faults.nixl-ucx": PATH}'``) wrap drivers with it explicitly.
"""

from __future__ import annotations

from typing import Any

from kvtransport.spi.driver import DriverContext, KVTransport
from kvtransport.spi.errors import EngineError
from kvtransport.spi.plan import Runs

#: The endpoint option that names a driver's fault file.
OPTION_PREFIX = "faults."


def faulty(cls: type[KVTransport]) -> type[KVTransport]:
    """``cls``, failing its batches while its fault file exists (module docstring)."""

    class Faulty(cls):  # type: ignore[valid-type,misc]
        def __init__(self, context: DriverContext) -> None:
            super().__init__(context)
            self._fault_file = context.options.get(OPTION_PREFIX + cls.name, "")
            self.faults_injected = 0
            #: Batches the engine finished while completions were stalled (reported later).
            self._hidden: set[int] = set()

        def _armed(self) -> str:
            """The fault armed now: "" (none), "stall", or "error"."""
            if not self._fault_file:
                return ""
            try:
                with open(self._fault_file) as f:
                    return "stall" if f.read(16).strip() == "stall" else "error"
            except FileNotFoundError:
                return ""

        def _inject(self, what: str) -> str:
            mode = self._armed()
            if mode == "error":
                self.faults_injected += 1
                raise EngineError(f"{cls.name}: injected fault in {what} ({self._fault_file} exists)")
            return mode

        def submit(self, peer: str, runs: Runs) -> int:
            self._inject("submit")
            handle: int = super().submit(peer, runs)
            return handle

        def poll(self, handle: int) -> bool:
            # Under "error" the engine's batch goes on or not: the core aborts it next.
            stalled = self._inject("poll") == "stall"
            if handle in self._hidden:  # finished in the engine while completions were stalled
                if stalled:
                    return False
                self._hidden.discard(handle)
                return True
            done: bool = super().poll(handle)
            if done and stalled:
                self._hidden.add(handle)
                return False
            return done

        def abort(self, handle: int) -> None:
            if handle in self._hidden:
                self._hidden.discard(handle)  # the engine forgot it when it reported it finished
                return
            super().abort(handle)

    # What the core reads of a driver class it takes from that class alone (not an ancestor's).
    Faulty.capabilities = cls.capabilities
    Faulty.__name__ = Faulty.__qualname__ = f"Faulty{cls.__name__}"
    Faulty.__module__ = cls.__module__
    return Faulty


def with_faults(drivers: dict[str, type[KVTransport]], options: dict[str, Any]) -> dict[str, type[KVTransport]]:
    """``drivers`` with those ``options`` name a fault file for wrapped by :func:`faulty`."""
    return {n: faulty(c) if OPTION_PREFIX + n in options else c for n, c in drivers.items()}
