"""The two seams of the staged path: the copy engine (KV memory <-> host ring) and the wire link
(this ring -> the peer's ring)."""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]


class CopyEngine(Protocol):
    """Copies pieces between KV memory and the host ring; ``copy`` returns when every byte is
    in place (for device copies: when the stream's work has completed)."""

    name: str

    def copy(self, dst: U64, src: U64, length: U64) -> None: ...

    def close(self) -> None: ...


class MemcpyCopyEngine:
    """Host memory to host memory with ``memmove`` (the GIL is released during each copy)."""

    name = "memcpy"

    def copy(self, dst: U64, src: U64, length: U64) -> None:
        for d, s, n in zip(dst.tolist(), src.tolist(), length.tolist(), strict=True):
            ctypes.memmove(d, s, n)

    def close(self) -> None:
        return None


class WireLink(Protocol):
    """How a host driver moves one chunk to one peer: ``post`` starts writing ``length`` bytes
    from this ring to the peer's ring and returns a token; ``check`` says whether it is there
    (raises if it failed). Neither may block for the transfer."""

    def post(self, local: int, remote: int, length: int) -> Any: ...

    def check(self, token: Any) -> bool: ...
