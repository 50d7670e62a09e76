"""Cutting a batch's runs into ring-slot-sized chunks (vectorised)."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np

from kvtransport.spi.inbound import FEW_PIECES, Pieces, as_list, as_u64
from kvtransport.spi.plan import Runs
from kvtransport.staging.copy import U64


@dataclass(frozen=True)
class Chunk:
    """Pieces of runs packed back to back into one ring slot: piece i goes from ``src[i]`` to
    ``dst[i]`` through the slot at ``offset[i]``."""

    src: Pieces
    dst: Pieces
    length: Pieces
    offset: Pieces

    @functools.cached_property
    def nbytes(self) -> int:
        # Read several times per chunk on the hot path (inline checks, posting, the wire
        # stage's polling): summed once.
        if len(self.length) <= FEW_PIECES:  # a ufunc reduction costs more than a few pieces' sum
            return sum(as_list(self.length))
        return int(as_u64(self.length).sum())


def chunk_runs(runs: Runs, chunk_bytes: int) -> list[Chunk]:
    """Cut ``runs`` into chunks of at most ``chunk_bytes``, splitting runs at chunk borders."""
    if not len(runs):
        return []
    if runs.listed and len(runs) <= FEW_PIECES and runs.total_bytes <= chunk_bytes:
        # One chunk of a few planned runs (a small request): lists, their slot offsets summed in plain
        # Python (the runs' own lists shared: a planned Runs is never changed); the numpy path
        # below costs several times that for a few pieces, and so would arrays in the steps
        # after (gather, the notice, the checks and copies at the receiver).
        few_src, few_dst, few_len = runs.lists()
        return [Chunk(few_src, few_dst, few_len, list(itertools.accumulate(few_len[:-1], initial=0)))]
    length = runs.length.astype(np.uint64)
    end = np.cumsum(length, dtype=np.uint64)
    start = end - length
    total = int(end[-1])
    if total <= chunk_bytes:  # one chunk, no run split: the runs as they are (a small request)
        return [Chunk(runs.src.astype(np.uint64), runs.dst.astype(np.uint64), length, start)]
    borders = np.arange(chunk_bytes, total, chunk_bytes, dtype=np.uint64)
    # Sorted piece starts in the packed stream: the run starts (sorted, distinct) with the chunk
    # borders that fall inside runs merged in, in one pass (a sort of 500k starts cost 30 ms).
    at = np.searchsorted(start, borders)
    inside = start[np.minimum(at, len(start) - 1)] != borders
    cuts = np.insert(start, at[inside], borders[inside])
    piece_end = np.append(cuts[1:], np.uint64(total))
    run_of = np.searchsorted(start, cuts, side="right") - 1
    skew = cuts - start[run_of]
    src = _u64(runs.src)[run_of] + skew  # uint64 throughout: int64 + uint64 would be float64
    dst = _u64(runs.dst)[run_of] + skew
    plen = piece_end - cuts
    which = cuts // np.uint64(chunk_bytes)
    offset = cuts - which * np.uint64(chunk_bytes)
    bounds = np.flatnonzero(np.diff(which)) + 1
    return [
        Chunk(s, d, n, o)
        for s, d, n, o in zip(
            np.split(src, bounds), np.split(dst, bounds), np.split(plen, bounds), np.split(offset, bounds), strict=True
        )
    ]


def _u64(a: U64) -> U64:
    return a if a.dtype == np.uint64 else a.astype(np.uint64)
