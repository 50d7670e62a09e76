"""Bounded tables: the one way the core and the adapters keep "the newest N" of something.

Every table a peer can grow (refused tags, failed transfers awaiting a drain confirmation, early
aborts, warned routes, an adapter's peers) is an ``OrderedDict`` in insertion order; a new entry
goes last and the oldest beyond the limit are dropped and handed back, so their owner can
release what they hold. Servers that take TCP connections bound them with a
:class:`ConnectionQuota`.
"""

from __future__ import annotations

import collections
import threading
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def put_newest(table: collections.OrderedDict[K, V], key: K, value: V, limit: int) -> list[tuple[K, V]]:
    """``table[key] = value`` as the newest entry; returns the oldest entries dropped to keep
    at most ``limit`` (oldest first)."""
    table.pop(key, None)
    table[key] = value
    dropped = []
    while len(table) > limit:
        dropped.append(table.popitem(last=False))
    return dropped


class ConnectionQuota:
    """At most ``total`` connections at once, and at most ``per_client`` from one address, so
    one client cannot take every slot. Thread-safe; a client's entry goes with its last
    connection, so the table never holds more addresses than connections."""

    def __init__(self, total: int, per_client: int) -> None:
        self.total, self.per_client = total, per_client
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def admit(self, client: str) -> bool:
        """Take a slot for ``client``; ``False`` (and nothing taken) when either bound is reached."""
        with self._lock:
            if sum(self._open.values()) >= self.total or self._open.get(client, 0) >= self.per_client:
                return False
            self._open[client] = self._open.get(client, 0) + 1
        return True

    def release(self, client: str) -> None:
        """Give back a slot :meth:`admit` took."""
        with self._lock:
            left = self._open.get(client, 1) - 1
            if left > 0:
                self._open[client] = left
            else:
                self._open.pop(client, None)
