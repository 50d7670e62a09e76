"""Host KV buffers that two processes can both map: files in ``/dev/shm`` mapped with mmap.

The fake driver moves bytes between processes through these mappings; real drivers register
them like any host memory. The creator removes the file when it closes the buffer.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import uuid
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

#: ptr -> (path, size) of every buffer created or attached in this process.
_SEGMENTS: dict[int, tuple[str, int]] = {}


@dataclass
class SharedBuffer:
    path: str
    size: int
    owner: bool
    _file: object = field(repr=False, default=None)
    _map: mmap.mmap | None = field(repr=False, default=None)
    array: npt.NDArray[np.uint8] = field(repr=False, default_factory=lambda: np.zeros(0, np.uint8))

    @property
    def ptr(self) -> int:
        return int(self.array.ctypes.data)

    def close(self) -> None:
        _SEGMENTS.pop(self.ptr, None) if self.array.size else None
        self.array = np.zeros(0, np.uint8)
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive; the OS unmaps at exit
                pass
            self._map = None
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _map(path: str, size: int, owner: bool) -> SharedBuffer:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if owner else 0), 0o600)
    try:
        if owner:
            os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    array = np.frombuffer(mapping, dtype=np.uint8)
    buf = SharedBuffer(path, size, owner, None, mapping, array)
    _SEGMENTS[buf.ptr] = (path, size)
    return buf


def allocate(size: int) -> SharedBuffer:
    """A new zero-filled buffer of ``size`` bytes that other processes can attach to."""
    return _map(os.path.join(_SHM_DIR, f"kvtransport-{os.getpid()}-{uuid.uuid4().hex}"), size, True)


def allocate_private(size: int) -> SharedBuffer:
    """A zero-filled anonymous buffer of ``size`` bytes, for real engines that need no mapping
    by the peer (no ``/dev/shm`` space used, which containers often keep small)."""
    mapping = mmap.mmap(-1, size)
    return SharedBuffer("", size, False, None, mapping, np.frombuffer(mapping, dtype=np.uint8))


def attach(path: str, size: int) -> SharedBuffer:
    return _map(path, size, False)


def segment_of(ptr: int, length: int) -> tuple[str, int] | None:
    """(path, offset) of the shared buffer holding ``[ptr, ptr + length)``, if any."""
    for base, (path, size) in _SEGMENTS.items():
        if base <= ptr and ptr + length <= base + size:
            return path, ptr - base
    return None
