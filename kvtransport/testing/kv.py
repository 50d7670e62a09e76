"""A small KV pool in shared host memory, with deterministic contents and per-page digests,
so two processes can check that every byte arrived where it should."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from ..memory import KVLayout, RegionSet
from . import shm


@dataclass
class KVPool:
    num_pages: int
    num_layers: int
    item_len: int
    aux_slots: int = 0
    aux_item_len: int = 64
    #: ``True``: buffers in ``/dev/shm`` (the fake driver maps the peer's); ``False``: private
    #: anonymous memory, enough for real engines.
    shared: bool = True

    def __post_init__(self) -> None:
        allocate = shm.allocate if self.shared else shm.allocate_private
        self.buffers = [allocate(self.num_pages * self.item_len) for _ in range(self.num_layers)]
        self.aux = [allocate(self.aux_slots * self.aux_item_len)] if self.aux_slots else []
        self.regions = RegionSet.from_kv_args(
            [b.ptr for b in self.buffers],
            [b.size for b in self.buffers],
            [self.item_len] * self.num_layers,
            aux_data_ptrs=[b.ptr for b in self.aux],
            aux_data_lens=[b.size for b in self.aux],
            aux_item_lens=[self.aux_item_len] * len(self.aux),
        )
        self.layout = KVLayout(
            page_size=16,
            dtype="bfloat16",
            num_layers=self.num_layers // 2 or 1,
            kv_item_lens=(self.item_len,) * self.num_layers,
            aux_item_lens=(self.aux_item_len,) * len(self.aux),
        )

    def fill(self, seed: int) -> None:
        """Random bytes everywhere (eight at a time: filling a GiB takes about 2 s)."""
        rng = np.random.default_rng(seed)
        for b in self.buffers + self.aux:
            words = b.size // 8
            if words:
                b.array[: words * 8].view(np.uint64)[:] = rng.integers(0, 2**63, words, dtype=np.uint64)
            if b.size % 8:
                b.array[words * 8 :] = rng.integers(0, 256, b.size % 8, dtype=np.uint8)

    def poison(self, pages: list[int]) -> None:
        """Overwrite ``pages`` in every layer, so bytes left from an earlier transfer can never
        pass for a fresh one."""
        for b in self.buffers:
            rows = b.array.reshape(self.num_pages, self.item_len)
            rows[np.asarray(pages, dtype=np.int64)] = 0xA5

    def page_digests(self, pages: list[int]) -> list[int]:
        """crc32 of each page across every layer (order matters)."""
        out = []
        for p in pages:
            crc = 0
            for b in self.buffers:
                crc = zlib.crc32(b.array[p * self.item_len : (p + 1) * self.item_len].tobytes(), crc)
            out.append(crc)
        return out

    def aux_digest(self, slot: int) -> int:
        a = self.aux[0].array
        return zlib.crc32(a[slot * self.aux_item_len : (slot + 1) * self.aux_item_len].tobytes())

    def close(self) -> None:
        for b in self.buffers + self.aux:
            b.close()
