"""Bounded tables: the one way the core and the adapters keep "the newest N" of something.

Every table a peer can grow (refused tags, failed transfers awaiting a drain confirmation, early
aborts, warned routes, an adapter's peers) is an ``OrderedDict`` in insertion order; a new entry
goes last and the oldest beyond the limit are dropped and handed back, so their owner can
release what they hold.
"""

from __future__ import annotations

import collections
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
