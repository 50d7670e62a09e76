"""Page indices -> coalesced, bounds-checked runs of bytes.

The planner turns "these source pages go to those destination pages" into ``(src_addr,
dst_addr, length)`` runs, one set per region pair, vectorised with numpy: pages that are
consecutive on both sides merge into one run (coalescing halves the cost per byte of small
descriptors), and runs are cut at ``max_run_bytes``. Every index is checked against both
sides' regions before a single run exists, so nothing a driver is given can fall outside
registered memory.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtransport.spi.errors import InvalidPages
from kvtransport.spi.memory import Region
from kvtransport.spi.page_geometry import Regroup, plan_regroup

U64 = npt.NDArray[np.uint64]

#: Requests of at most this many pages are planned in plain Python (same result, less overhead).
SMALL = 32


class Runs:
    """Parallel arrays of byte runs: ``src[i]`` -> ``dst[i]``, ``length[i]`` bytes. Never
    changed once made. A small plan's runs are kept as the lists they were planned in
    (:meth:`of_lists`), its arrays made only if something asks for them: the small request's
    next steps take lists, and each numpy call costs several microseconds on a core whose
    caches went cold between requests."""

    __slots__ = ("__dict__", "_dst", "_length", "_lists", "_src")

    def __init__(self, src: U64, dst: U64, length: U64) -> None:
        self._src: U64 | None = src
        self._dst: U64 | None = dst
        self._length: U64 | None = length
        self._lists: tuple[list[int], list[int], list[int]] | None = None

    @classmethod
    def of_lists(cls, src: list[int], dst: list[int], length: list[int]) -> Runs:
        """Runs of these lists (ints in uint64's range, as long as each other), which the
        caller hands over: it must not change them."""
        runs = cls.__new__(cls)
        runs._src = runs._dst = runs._length = None
        runs._lists = (src, dst, length)
        runs.__dict__["total_bytes"] = sum(length)  # the cached property's slot
        return runs

    @property
    def src(self) -> U64:
        return self._src if self._src is not None else self._array(0, "_src")

    @property
    def dst(self) -> U64:
        return self._dst if self._dst is not None else self._array(1, "_dst")

    @property
    def length(self) -> U64:
        return self._length if self._length is not None else self._array(2, "_length")

    def _array(self, i: int, slot: str) -> U64:
        """The array of the ``i``-th list, made now and kept in ``slot`` (two threads racing
        make equal arrays)."""
        assert self._lists is not None
        made = np.array(self._lists[i], dtype=np.uint64)
        setattr(self, slot, made)
        return made

    def __len__(self) -> int:
        if self._lists is not None:
            return len(self._lists[2])
        return int(self.length.shape[0])

    def __repr__(self) -> str:
        return f"Runs({len(self)} runs, {self.total_bytes} bytes)"

    @functools.cached_property
    def total_bytes(self) -> int:
        # Cached: a send reads it several times, and each sum is a numpy call.
        return int(self.length.sum(dtype=np.uint64))

    @property
    def listed(self) -> bool:
        """Whether these runs were made of lists (:meth:`of_lists`)."""
        return self._lists is not None

    def lists(self) -> tuple[list[int], list[int], list[int]]:
        """``src``, ``dst`` and ``length`` as lists of ints, which the caller must not change:
        those a small plan was made of, else made now."""
        if self._lists is not None:
            return self._lists
        return self.src.tolist(), self.dst.tolist(), self.length.tolist()

    def batches(self, max_runs: int) -> list[Runs]:
        """Split into batches of at most ``max_runs`` runs (engines limit a batch's size)."""
        if max_runs <= 0:
            raise ValueError("max_runs must be positive")
        return [
            Runs(self.src[i : i + max_runs], self.dst[i : i + max_runs], self.length[i : i + max_runs])
            for i in range(0, len(self), max_runs)
        ]

    @classmethod
    def empty(cls) -> Runs:
        z = np.zeros(0, dtype=np.uint64)
        return cls(z, z.copy(), z.copy())

    @classmethod
    def concat(cls, parts: Sequence[Runs]) -> Runs:
        if not parts:
            return cls.empty()
        if sum(len(p) for p in parts) <= SMALL:
            # A small request's pages with its aux slot (its last chunk): lists, as its plan.
            listed = [p.lists() for p in parts]
            return cls.of_lists(*([x for lists in listed for x in lists[i]] for i in range(3)))
        return cls(
            np.concatenate([p.src for p in parts]),
            np.concatenate([p.dst for p in parts]),
            np.concatenate([p.length for p in parts]),
        )


def as_pages(values: Any, what: str) -> npt.NDArray[np.int64]:
    """A 1-D int64 array of page indices, or :class:`InvalidPages`."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise InvalidPages(f"{what}: page indices must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidPages(f"{what}: page indices must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def few_pages(values: Any) -> list[int] | None:
    """A small request's page indices as a list of ints, with no numpy call when they come
    as a list (or tuple) of ints and one when they come as an integer array; ``None`` when
    they are more than ``SMALL`` or anything else, for :func:`as_pages` (and its errors)."""
    if isinstance(values, list | tuple):
        if len(values) <= SMALL and only_ints(values):
            return list(values)
        return None
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.size <= SMALL and values.dtype.kind in "iu":
        listed: list[int] = values.tolist()
        return listed
    return None


def only_ints(values: Iterable[Any]) -> bool:
    """Whether every value is an ``int`` itself (not a bool, not a numpy integer): builtins
    only, where a generator expression would be an interpreter call per item."""
    return set(map(type, values)) <= _INT_TYPE


_INT_TYPE = frozenset({int})


def check_pages(pages: npt.NDArray[np.int64], num_pages: int, what: str) -> None:
    if not pages.size:
        return
    if pages.size <= SMALL:
        values = pages.tolist()
        lo, hi = min(values), max(values)
    else:
        lo, hi = int(pages.min()), int(pages.max())
    if lo >= 0 and hi < num_pages:
        return
    bad = np.flatnonzero((pages < 0) | (pages >= num_pages))
    if bad.size:
        k = int(bad[0])
        raise InvalidPages(
            f"{what}: page index {int(pages[k])} at position {k} is outside the registered "
            f"range [0, {num_pages}) ({bad.size} bad indices in all); nothing was submitted"
        )


def check_unique(pages: npt.NDArray[np.int64], what: str) -> None:
    """Refuse destination pages that repeat: two pages cannot be written to one place."""
    if pages.size <= SMALL and len(set(pages.tolist())) == pages.size:
        return  # the common small case without numpy's sort (the error path below says which)
    values, occurrences = np.unique(pages, return_counts=True)
    if values.size != pages.size:
        raise InvalidPages(
            f"{what}: page {int(values[occurrences > 1][0])} appears more than once; two pages "
            "cannot be written to one place"
        )


def plan(
    src_regions: Sequence[Region],
    dst_regions: Sequence[Region],
    src_pages: Any,
    dst_pages: Any,
    *,
    max_run_bytes: int | None = None,
) -> Runs:
    """Coalesced runs moving page ``src_pages[k]`` of every source region to page
    ``dst_pages[k]`` of the matching destination region.

    Raises :class:`InvalidPages` (and plans nothing) for mismatched lengths, indices outside
    either side's regions, duplicate destination pages, or region pairs whose page sizes differ.
    """
    if max_run_bytes is not None and max_run_bytes <= 0:
        raise ValueError("max_run_bytes must be positive")
    pair = _checked_pairs(src_regions, dst_regions, src_pages, dst_pages, same_pages=True)
    if pair is None:
        return Runs.empty()
    src, dst = pair

    if src.size <= SMALL:
        return _plan_small(src_regions, dst_regions, src.tolist(), dst.tolist(), max_run_bytes)

    # Runs of pages that are consecutive on both sides, in request order.
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts: U64 = np.diff(np.concatenate((starts, [src.size]))).astype(np.uint64)
    first_src: U64 = src[starts].astype(np.uint64)
    first_dst: U64 = dst[starts].astype(np.uint64)

    # Every region at once, region by region in order (a Python loop over 64 regions cost
    # about 1 ms of numpy calls for a 4k-token request).
    item = np.fromiter((r.item_len for r in src_regions), dtype=np.uint64, count=len(src_regions))[:, None]
    base_src = np.fromiter((r.ptr for r in src_regions), dtype=np.uint64, count=len(src_regions))[:, None]
    base_dst = np.fromiter((r.ptr for r in dst_regions), dtype=np.uint64, count=len(dst_regions))[:, None]
    return _cap(
        Runs(
            (base_src + first_src[None, :] * item).ravel(),
            (base_dst + first_dst[None, :] * item).ravel(),
            (counts[None, :] * item).ravel(),
        ),
        max_run_bytes,
    )


class RegionPairs:
    """Two sides' regions paired once for the many small plans between them (a session plans
    every request between the same regions): the per-region facts :func:`plan` would look up
    again for each request are kept, and a request of at most ``SMALL`` pages whose indices are
    all in range and unique is planned from plain lists. Anything else (a large request, any
    bad index, regions that do not pair) goes through :func:`plan`, which plans it or raises
    the error it always has; the runs are the same either way."""

    __slots__ = ("_bases", "_dst_pages", "_dst_regions", "_src_pages", "_src_regions")

    def __init__(self, src_regions: Sequence[Region], dst_regions: Sequence[Region]) -> None:
        self._src_regions, self._dst_regions = src_regions, dst_regions
        paired = (
            bool(src_regions)
            and len(src_regions) == len(dst_regions)
            and all(s.item_len == d.item_len for s, d in zip(src_regions, dst_regions, strict=False))
        )
        #: (source base, destination base, page bytes) per region pair; empty: use plan().
        self._bases = (
            tuple((s.ptr, d.ptr, s.item_len) for s, d in zip(src_regions, dst_regions, strict=True)) if paired else ()
        )
        self._src_pages = min((r.num_items for r in src_regions), default=0)
        self._dst_pages = min((r.num_items for r in dst_regions), default=0)

    def plan(self, src_pages: Any, dst_pages: Any, *, max_run_bytes: int | None = None) -> Runs:
        if max_run_bytes is not None and max_run_bytes <= 0:
            return plan(self._src_regions, self._dst_regions, src_pages, dst_pages, max_run_bytes=max_run_bytes)
        s, d = few_pages(src_pages), few_pages(dst_pages)
        if s is None or d is None:
            src = as_pages(src_pages, "source")
            dst = as_pages(dst_pages, "destination")
            if not self._bases or not 0 < src.size <= SMALL or dst.shape != src.shape:  # as_pages: both 1-D
                return plan(self._src_regions, self._dst_regions, src, dst, max_run_bytes=max_run_bytes)
            s, d = src.tolist(), dst.tolist()
        n = len(s)
        if not self._bases or not 0 < n <= SMALL or len(d) != n:
            return plan(self._src_regions, self._dst_regions, s, d, max_run_bytes=max_run_bytes)
        if min(s) < 0 or max(s) >= self._src_pages or min(d) < 0 or max(d) >= self._dst_pages or len(set(d)) != n:
            return plan(self._src_regions, self._dst_regions, s, d, max_run_bytes=max_run_bytes)
        return _runs_of_groups(self._bases, _page_groups(s, d), max_run_bytes)


def _page_groups(src: list[int], dst: list[int]) -> list[list[int]]:
    """``[first src page, first dst page, count]`` for each stretch of pages consecutive on both sides."""
    groups: list[list[int]] = []
    for s, d in zip(src, dst, strict=True):
        last = groups[-1] if groups else None
        if last is not None and s == last[0] + last[2] and d == last[1] + last[2]:
            last[2] += 1
        else:
            groups.append([s, d, 1])
    return groups


def _runs_of_groups(bases: Sequence[tuple[int, int, int]], groups: list[list[int]], max_run_bytes: int | None) -> Runs:
    out_src: list[int] = []
    out_dst: list[int] = []
    out_len: list[int] = []
    for src_base, dst_base, item in bases:
        for s, d, n in groups:
            out_src.append(src_base + s * item)
            out_dst.append(dst_base + d * item)
            out_len.append(n * item)
    runs = Runs.of_lists(out_src, out_dst, out_len)
    if max_run_bytes is not None and out_len and max(out_len) > max_run_bytes:
        return _cap(runs, max_run_bytes)
    return runs


def _checked_pairs(
    src_regions: Sequence[Region],
    dst_regions: Sequence[Region],
    src_pages: Any,
    dst_pages: Any,
    *,
    same_pages: bool,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None:
    """Both sides' page indices, checked (one to one, inside both sides' regions, no
    destination twice, and with ``same_pages`` equal page sizes region by region); ``None``
    when there is nothing to plan."""
    src = as_pages(src_pages, "source")
    dst = as_pages(dst_pages, "destination")
    if src.shape != dst.shape:
        raise InvalidPages(f"{src.size} source pages but {dst.size} destination pages; they pair one to one")
    if len(src_regions) != len(dst_regions):
        raise InvalidPages(f"{len(src_regions)} source regions but {len(dst_regions)} destination regions")
    if src.size == 0 or not src_regions:
        return None
    if same_pages:
        for i, (s, d) in enumerate(zip(src_regions, dst_regions, strict=True)):
            if s.item_len != d.item_len:
                raise InvalidPages(
                    f"region {i}: page of {s.item_len} bytes at the source, {d.item_len} at the destination"
                )
    check_pages(src, min(r.num_items for r in src_regions), "source")
    check_pages(dst, min(r.num_items for r in dst_regions), "destination")
    check_unique(dst, "destination")
    return src, dst


def _plan_small(
    src_regions: Sequence[Region],
    dst_regions: Sequence[Region],
    src: list[int],
    dst: list[int],
    max_run_bytes: int | None,
) -> Runs:
    """:func:`plan` for a few pages, in plain Python: the same runs, without the fixed cost of a
    dozen numpy calls (small requests are latency-bound; see ``kvtransport bench --layers 1``)."""
    bases = [(sr.ptr, dr.ptr, sr.item_len) for sr, dr in zip(src_regions, dst_regions, strict=True)]
    return _runs_of_groups(bases, _page_groups(src, dst), max_run_bytes)


def _cap(runs: Runs, max_run_bytes: int | None) -> Runs:
    """Cut every run longer than ``max_run_bytes`` into pieces of at most that size."""
    if max_run_bytes is None or not len(runs) or int(runs.length.max()) <= max_run_bytes:
        return runs
    cap = np.uint64(max_run_bytes)
    pieces = (runs.length + cap - np.uint64(1)) // cap
    owner = np.repeat(np.arange(len(runs)), pieces.astype(np.int64))
    # Index of each piece within its run: 0, 1, 2, ... restarting at each run.
    first_piece = np.concatenate(([0], np.cumsum(pieces)[:-1])).astype(np.int64)
    within = (np.arange(owner.size, dtype=np.int64) - first_piece[owner]).astype(np.uint64)
    offset = within * cap
    length = np.minimum(runs.length[owner] - offset, cap).astype(np.uint64)
    return Runs(runs.src[owner] + offset, runs.dst[owner] + offset, length)


def check_runs_within(addrs: U64, lengths: U64, regions: Sequence[Region], what: str) -> None:
    """Raise :class:`InvalidPages` unless every ``[addr, addr + length)`` lies inside one region.

    Drivers and fakes use it to enforce the contract the planner already guarantees.
    """
    if not len(addrs):
        return
    ordered = sorted(regions, key=lambda r: r.ptr)
    starts = np.array([r.ptr for r in ordered], dtype=np.uint64)
    ends = np.array([r.end for r in ordered], dtype=np.uint64)
    slot = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
    inside = slot >= 0
    safe = np.where(inside, slot, 0)
    end = ends[safe]
    # Compared as "length fits in what is left of the region", never as "addr + length <= end":
    # a peer's address near 2**64 would wrap the sum around in uint64 and pass.
    inside &= addrs <= end
    inside &= lengths <= end - np.minimum(addrs, end)
    if not bool(inside.all()):
        k = int(np.flatnonzero(~inside)[0])
        raise InvalidPages(f"{what}: run [{int(addrs[k]):#x}, +{int(lengths[k])}) is outside every registered region")


def plan_heads(
    src_regions: Sequence[Region],
    dst_regions: Sequence[Region],
    src_pages: Any,
    dst_pages: Any,
    *,
    page_tokens: int,
    src_heads: int,
    dst_heads: int,
    head_bytes: int,
    src_head: int,
    dst_head: int,
    count: int,
    max_run_bytes: int | None = None,
) -> Runs:
    """Runs moving ``count`` heads of every token of page ``src_pages[k]`` (local heads from
    ``src_head`` of a page holding ``src_heads`` per token) to page ``dst_pages[k]`` (local heads
    from ``dst_head`` of ``dst_heads``), in every region pair: the strided copy unequal tensor
    parallelism needs (a page is ``page_tokens`` rows of ``heads * head_bytes`` bytes, SGLang's
    ``[token, head, dim]``). A slice that is every head of both rows is a plain :func:`plan`.

    Raises :class:`InvalidPages` (and plans nothing) for anything :func:`plan` refuses, for a
    page whose size is not ``page_tokens * heads * head_bytes`` on either side, and for heads
    outside either row.
    """
    if min(page_tokens, src_heads, dst_heads, head_bytes, count) <= 0 or min(src_head, dst_head) < 0:
        raise InvalidPages("a head slice needs positive sizes and non-negative offsets")
    if max_run_bytes is not None and max_run_bytes <= 0:
        raise ValueError("max_run_bytes must be positive")
    if src_head + count > src_heads or dst_head + count > dst_heads:
        raise InvalidPages(
            f"heads [{src_head}, {src_head + count}) of {src_heads} at the source, [{dst_head}, {dst_head + count}) "
            f"of {dst_heads} at the destination: outside a token's row"
        )
    src_row, dst_row = src_heads * head_bytes, dst_heads * head_bytes
    for side, regions, row in (("source", src_regions, src_row), ("destination", dst_regions, dst_row)):
        for i, r in enumerate(regions):
            if r.item_len != page_tokens * row:
                raise InvalidPages(
                    f"{side} region {i}: pages of {r.item_len} bytes, not {page_tokens} tokens x {row // head_bytes} "
                    f"heads x {head_bytes} bytes"
                )
    if count == src_heads == dst_heads:
        return plan(src_regions, dst_regions, src_pages, dst_pages, max_run_bytes=max_run_bytes)
    pair = _checked_pairs(src_regions, dst_regions, src_pages, dst_pages, same_pages=False)
    if pair is None:
        return Runs.empty()
    src, dst = pair
    # One run per (region, page, token): rows of a page are not adjacent once sliced.
    tokens = np.arange(page_tokens, dtype=np.uint64)
    src_in_page = (tokens * np.uint64(src_row) + np.uint64(src_head * head_bytes))[None, :]
    dst_in_page = (tokens * np.uint64(dst_row) + np.uint64(dst_head * head_bytes))[None, :]
    length = np.uint64(count * head_bytes)
    parts = []
    for s, d in zip(src_regions, dst_regions, strict=True):
        src_base = np.uint64(s.ptr) + src.astype(np.uint64)[:, None] * np.uint64(s.item_len)
        dst_base = np.uint64(d.ptr) + dst.astype(np.uint64)[:, None] * np.uint64(d.item_len)
        addrs_src = (src_base + src_in_page).reshape(-1)
        addrs_dst = (dst_base + dst_in_page).reshape(-1)
        parts.append(_cap(Runs(addrs_src, addrs_dst, np.full(addrs_src.size, length, dtype=np.uint64)), max_run_bytes))
    return Runs.concat(parts)


def plan_regrouped(
    src_regions: Sequence[Region],
    dst_regions: Sequence[Region],
    src_pages: Any,
    dst_pages: Any,
    table: Regroup,
    *,
    only_src: Sequence[int] | None = None,
    max_run_bytes: int | None = None,
) -> Runs:
    """Runs moving page ``src_pages[k]`` of one engine's pool into page ``dst_pages[k]`` of
    another's by ``table`` (:func:`kvtransport.spi.page_geometry.regroup`; with ``only_src``, the
    runs out of those source regions only: a layer group's). The pages are checked as
    :func:`plan` checks them (inside every region on both sides, no destination twice)."""
    src = as_pages(src_pages, "source")
    dst = as_pages(dst_pages, "destination")
    if src.shape != dst.shape:
        raise InvalidPages(f"{src.size} source pages but {dst.size} destination pages; they pair one to one")
    if not src.size or not src_regions or not dst_regions:
        return Runs.empty()
    check_pages(src, min(r.num_items for r in src_regions), "source")
    check_pages(dst, min(r.num_items for r in dst_regions), "destination")
    check_unique(dst, "destination")
    addrs_src, addrs_dst, length = plan_regroup(src_regions, dst_regions, src, dst, table, only_src)
    return _cap(Runs(addrs_src, addrs_dst, length), max_run_bytes)
