"""Checking what a caller or a peer names in a request before anything is kept or planned:
its tag, the aux slot, and the items of each state group (page indices themselves are
``spi.plan``'s). Every refusal is :class:`~kvtransport.spi.errors.InvalidPages` (or, for a tag,
:class:`~kvtransport.spi.errors.KVTransportError`) with a message naming what was wrong."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtransport.spi.errors import InvalidPages, KVTransportError
from kvtransport.spi.memory import MAX_STATE_GROUPS, RegionSet
from kvtransport.spi.plan import as_pages, check_pages, check_unique

NO_ITEMS: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)


#: What replaces a malformed ``expect.state`` (see :meth:`Session.on_expect`): it fails the
#: transfer with InvalidPages when checked, and costs nothing to keep.
MALFORMED_STATE: list[Any] = [None]


def well_formed_state(raw: Any) -> bool:
    """A peer's ``expect.state``: at most ``MAX_STATE_GROUPS`` packed int64 arrays."""
    return (
        isinstance(raw, list)
        and len(raw) <= MAX_STATE_GROUPS
        and all(isinstance(x, bytes) and len(x) % 8 == 0 for x in raw)
    )


def state_items(state: Sequence[Any] | None, regions: RegionSet, what: str) -> tuple[npt.NDArray[np.int64], ...]:
    """A caller's items per state group (``None`` or an empty entry: none of that group), each
    checked against the group's registered items and for repeats; trailing empty groups dropped."""
    if state is None:
        return ()
    if isinstance(state, str | bytes) or not isinstance(state, Sequence | np.ndarray):
        raise InvalidPages(f"{what}: state items must be a list with one entry per state group")
    groups = len(regions.state_groups)
    out: list[npt.NDArray[np.int64]] = []
    for g, entry in enumerate(state):
        try:
            flat = NO_ITEMS if entry is None else np.asarray(entry).reshape(-1)
        except (TypeError, ValueError) as exc:
            raise InvalidPages(f"{what} state group {g}: not an array of item indices ({exc})") from exc
        items = as_pages(flat, f"{what} state group {g}")
        if items.size:
            if g >= groups:
                raise InvalidPages(f"{what}: state group {g} given, but {groups} state groups are registered")
            check_pages(items, regions.state_slots(g), f"{what} state group {g}")
            check_unique(items, f"{what} state group {g}")
        out.append(items)
    while out and not out[-1].size:
        out.pop()
    return tuple(out)


def peer_state_items(raw: list[Any], regions: RegionSet, what: str) -> tuple[npt.NDArray[np.int64], ...]:
    """The state items a peer announced (a list of packed int64 arrays), checked like
    :func:`state_items` against that peer's regions."""
    if len(raw) > MAX_STATE_GROUPS:
        raise InvalidPages(f"{what}: {len(raw)} state groups; an endpoint registers at most {MAX_STATE_GROUPS}")
    arrays = []
    for g, packed in enumerate(raw):
        if not isinstance(packed, bytes) or len(packed) % 8:
            raise InvalidPages(f"{what}: state group {g} is not a packed int64 array")
        arrays.append(np.frombuffer(packed, dtype=np.int64).copy())
    return state_items(arrays, regions, what)


def check_aux(index: Any, regions: RegionSet, what: str) -> None:
    if not regions.aux:
        raise InvalidPages(f"{what}: no aux regions are registered")
    slots = min(r.num_items for r in regions.aux)
    if not isinstance(index, int | np.integer) or isinstance(index, bool) or not 0 <= index < slots:
        raise InvalidPages(f"{what}: aux slot {index!r} is outside the registered range [0, {slots})")


def check_tag(tag: Any) -> None:
    if not isinstance(tag, str) or not tag or len(tag) > 256:
        raise KVTransportError(f"a transfer tag must be a non-empty string of at most 256 characters, got {tag!r}")


def read_announcement(
    msg: Any, regions: RegionSet, peer: str
) -> tuple[npt.NDArray[np.int64], int, tuple[npt.NDArray[np.int64], ...]]:
    """A peer's ``expect``, checked against the peer's own regions (``regions``): the announced
    pages (packed int64, each a registered page, none twice), the aux slot (-1: none) and the
    state items per group. Raises :class:`InvalidPages` naming what is wrong."""
    raw = msg["pages"]
    if len(raw) % 8:
        raise InvalidPages(f"page list of {len(raw)} bytes is not a whole number of int64")
    pages = np.frombuffer(raw, dtype=np.int64).copy()
    check_pages(pages, regions.num_pages, f"pages announced by {peer}")
    check_unique(pages, f"pages announced by {peer}")
    if msg["aux"] >= 0:
        check_aux(msg["aux"], regions, f"aux slot announced by {peer}")
    return pages, int(msg["aux"]), peer_state_items(msg["state"], regions, f"state items announced by {peer}")
