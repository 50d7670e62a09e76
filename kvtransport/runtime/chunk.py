"""A sending transfer's chunk once checked: what ``runtime.planning`` hands a send (a plain one
or a layer-wise one, ``runtime.layerwise``) to plan its runs from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtransport.spi.plan import Runs


@dataclass(frozen=True)
class Chunk:
    """A sending transfer's chunk, checked: its source pages, the receiver's pages they land
    on (announced pages ``start`` to ``stop``), and the runs of its aux slot and state items
    (empty unless it is the last chunk)."""

    src: Any
    dst: Any
    start: int
    stop: int
    tail: Runs
