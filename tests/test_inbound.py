"""The inbound guard: which destination bytes a peer may write here (hypothesis against a
page-by-page model of the same rule)."""

from __future__ import annotations

from unittest import mock

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.runtime import endpoint as endpoint_module
from kvtransport.spi import inbound
from kvtransport.spi.errors import InvalidPages
from kvtransport.spi.inbound import Claim, InboundGuard
from kvtransport.spi.memory import HOST, Region, RegionSet

ITEM, PAGES = 256, 32
BASE_K, BASE_V, BASE_AUX = 1 << 20, 1 << 24, 1 << 28
#: Two state groups: a window pool of two buffers (16 pages of 128 bytes), one slot pool (4 x 512).
BASE_SWA_K, BASE_SWA_V, BASE_SLOTS = 1 << 30, 1 << 31, 1 << 32


def _regions() -> RegionSet:
    return RegionSet(
        kv=(Region(BASE_K, ITEM * PAGES, HOST, ITEM), Region(BASE_V, ITEM * PAGES, HOST, ITEM)),
        aux=(Region(BASE_AUX, 64 * 8, HOST, 64),),
        state=(
            Region(BASE_SWA_K, 128 * 16, HOST, 128),
            Region(BASE_SWA_V, 128 * 16, HOST, 128),
            Region(BASE_SLOTS, 512 * 4, HOST, 512),
        ),
        state_groups=(2, 1),
    )


#: The guard checks a few pieces in plain Python and more with numpy: every rule below is held to
#: both ways (0: numpy for any count; a count above the test's pieces: plain Python for all).
BOTH_PATHS = pytest.mark.parametrize("few", [0, 64], ids=["vectorised", "piece-by-piece"])


@BOTH_PATHS
@settings(max_examples=400)
@given(
    live=st.sets(st.integers(0, PAGES - 1)),
    revoked=st.sets(st.integers(0, PAGES - 1)),
    pieces=st.lists(
        st.tuples(st.sampled_from([BASE_K, BASE_V]), st.integers(0, PAGES * ITEM - 1), st.integers(1, 3 * ITEM)),
        min_size=1,
        max_size=6,
    ),
)
def test_check_agrees_with_a_page_by_page_model(
    few: int, live: set[int], revoked: set[int], pieces: list[tuple[int, int, int]]
) -> None:
    with mock.patch.object(inbound, "FEW_PIECES", few):
        _agrees_with_the_model(live, revoked, pieces)


def _agrees_with_the_model(live: set[int], revoked: set[int], pieces: list[tuple[int, int, int]]) -> None:
    guard = InboundGuard(_regions())
    guard.add(Claim(np.array(sorted(live), dtype=np.int64), -1))
    dead = sorted(revoked - live)
    guard.add(Claim(np.array(dead, dtype=np.int64), -1))
    guard.revoke(Claim(np.array(dead, dtype=np.int64), -1))
    dst = np.array([b + off for b, off, _ in pieces], dtype=np.uint64)
    length = np.array([n for _, _, n in pieces], dtype=np.uint64)
    outside = any(off + n > PAGES * ITEM for _, off, n in pieces)
    touched = {p for _, off, n in pieces for p in range(off // ITEM, (off + n - 1) // ITEM + 1)}
    if outside:
        with pytest.raises(InvalidPages):
            guard.check(dst, length, "test")
    elif touched <= live:
        assert guard.check(dst, length, "test") is True
    elif touched <= live | set(dead):
        assert guard.check(dst, length, "test") is False  # late data: dropped, not an error
    else:
        with pytest.raises(InvalidPages, match="not announced"):
            guard.check(dst, length, "test")


@pytest.mark.parametrize(
    ("dst", "length"),
    [
        (2**64 - 16, 64),  # the sum wraps around in uint64
        (BASE_K + 100, 2**64 - 50),
        (BASE_K - 1, 2),  # below the region
        (5, 1),  # below every region
        (BASE_K, 0),  # empty piece
    ],
)
@BOTH_PATHS
def test_hostile_pieces_are_refused_without_overflow(few: int, dst: int, length: int) -> None:
    guard = InboundGuard(_regions())
    guard.add(Claim(np.arange(PAGES, dtype=np.int64), 0))
    with mock.patch.object(inbound, "FEW_PIECES", few), pytest.raises(InvalidPages):
        guard.check(np.array([dst], dtype=np.uint64), np.array([length], dtype=np.uint64), "test")


@BOTH_PATHS
def test_aux_slots_are_guarded_like_pages(few: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inbound, "FEW_PIECES", few)
    guard = InboundGuard(_regions())
    guard.add(Claim(np.array([], dtype=np.int64), 3))
    slot3 = np.array([BASE_AUX + 3 * 64], dtype=np.uint64)
    assert guard.check(slot3, np.array([64], dtype=np.uint64), "test")
    with pytest.raises(InvalidPages, match="aux slot"):
        guard.check(slot3 + np.uint64(64), np.array([64], dtype=np.uint64), "test")
    guard.remove(Claim(np.array([], dtype=np.int64), 3))
    with pytest.raises(InvalidPages):
        guard.check(slot3, np.array([64], dtype=np.uint64), "test")


def _one(addr: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    return np.array([addr], dtype=np.uint64), np.array([length], dtype=np.uint64)


@BOTH_PATHS
def test_state_items_are_guarded_per_group(few: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transfer that announced window pages 2 and 3 and slot 1 may write exactly those, in
    every buffer of their group; the same index in the other group is not announced."""
    monkeypatch.setattr(inbound, "FEW_PIECES", few)
    guard = InboundGuard(_regions())
    claim = Claim(np.array([0], dtype=np.int64), -1, (np.array([2, 3], dtype=np.int64), np.array([1], dtype=np.int64)))
    guard.add(claim)
    assert guard.check(*_one(BASE_SWA_K + 2 * 128, 256), "test")
    assert guard.check(*_one(BASE_SWA_V + 3 * 128, 128), "test")
    assert guard.check(*_one(BASE_SLOTS + 512, 512), "test")
    with pytest.raises(InvalidPages, match="state group 0"):
        guard.check(*_one(BASE_SWA_V + 4 * 128, 128), "test")
    with pytest.raises(InvalidPages, match="state group 1"):
        guard.check(*_one(BASE_SLOTS + 2 * 512, 512), "test")
    with pytest.raises(InvalidPages, match="outside the registered region"):
        guard.check(*_one(BASE_SLOTS + 3 * 512, 1024), "test")
    guard.revoke(claim)
    assert guard.check(*_one(BASE_SLOTS + 512, 512), "test") is False  # late: dropped
    guard.forget_revoked(claim)
    with pytest.raises(InvalidPages):
        guard.check(*_one(BASE_SLOTS + 512, 512), "test")


_NEAR = [BASE_K, BASE_V, BASE_AUX, BASE_SWA_K, BASE_SWA_V, BASE_SLOTS, BASE_K + ITEM * PAGES, BASE_AUX + 64 * 8]


def _outcome(
    guard: InboundGuard, dst: npt.NDArray[np.uint64] | list[int], length: npt.NDArray[np.uint64] | list[int]
) -> object:
    try:
        return guard.check(dst, length, "test")
    except InvalidPages as exc:
        return str(exc)


@settings(max_examples=500)
@given(
    pieces=st.lists(
        st.tuples(
            st.one_of(
                st.integers(0, 2**64 - 1),
                st.builds(lambda b, d: max(0, b + d), st.sampled_from(_NEAR), st.integers(-600, 9000)),
            ),
            st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 3 * ITEM)),
        ),
        min_size=1,
        max_size=8,
    ),
    live=st.sets(st.integers(0, PAGES - 1)),
    revoked=st.sets(st.integers(0, PAGES - 1)),
    aux=st.integers(-1, 7),
    adjacent=st.booleans(),
)
def test_both_paths_give_the_same_answer_for_any_integers(
    pieces: list[tuple[int, int]], live: set[int], revoked: set[int], aux: int, adjacent: bool
) -> None:
    """Whatever a peer puts in a chunk notice (any uint64 on either field, any mix of regions,
    regions that touch or not, revoked pages, aux slots and state items), the piece-by-piece
    check answers exactly as the vectorised one: the same verdict, or the same error."""
    guard = InboundGuard(_adjacent_regions() if adjacent else _regions())
    guard.add(Claim(np.array(sorted(live), dtype=np.int64), aux, (np.array([1, 2], dtype=np.int64), _NO_ITEMS)))
    dead = np.array(sorted(revoked - live), dtype=np.int64)
    late = Claim(dead, 7 if aux != 7 else -1, (np.array([5], dtype=np.int64), np.array([3], dtype=np.int64)))
    guard.add(late)
    guard.revoke(late)
    dst = np.array([min(d, 2**64 - 1) for d, _ in pieces], dtype=np.uint64)
    length = np.array([n for _, n in pieces], dtype=np.uint64)
    with mock.patch.object(inbound, "FEW_PIECES", 0):
        vectorised = _outcome(guard, dst, length)
    with mock.patch.object(inbound, "FEW_PIECES", 64):
        piecewise = _outcome(guard, dst, length)
        # As a small chunk's notice is decoded (lists of ints), and with a piece's pages
        # looked up item by item or as one slice whatever its span.
        listed = _outcome(guard, dst.tolist(), length.tolist())
        with mock.patch.object(inbound, "SHORT_SPAN", 0):
            sliced = _outcome(guard, dst.tolist(), length.tolist())
        with mock.patch.object(inbound, "SHORT_SPAN", 1 << 20):
            itemwise = _outcome(guard, dst.tolist(), length.tolist())
    assert piecewise == vectorised == listed == sliced == itemwise


@pytest.mark.parametrize(("dst", "length"), [(BASE_K, -1), (-1, 8), (BASE_K, 1 << 64), (1 << 64, 8)])
def test_list_pieces_outside_uint64_are_refused(dst: int, length: int) -> None:
    """Lists skip numpy's uint64 conversion: a negative length would pass a check that adds it
    (and a ``memmove`` of -1 bytes is one of 2**64 - 1), so values outside uint64 are refused,
    by the guard and by the endpoint before it (what a two-sided driver calls)."""
    guard = InboundGuard(_regions())
    guard.add(Claim(np.arange(PAGES, dtype=np.int64), 0))
    with pytest.raises(InvalidPages):
        guard.check([dst], [length], "test")
    with pytest.raises(InvalidPages, match="uint64"):
        endpoint_module._pieces([dst] if dst < 0 or dst >= 1 << 64 else [length])


_NO_ITEMS = np.zeros(0, dtype=np.int64)


def _adjacent_regions() -> RegionSet:
    """The same index spaces, each region starting exactly where the one before it ends."""
    k, v = BASE_K, BASE_K + ITEM * PAGES
    a = v + ITEM * PAGES
    w1 = a + 64 * 8
    w2 = w1 + 128 * 16
    sl = w2 + 128 * 16
    return RegionSet(
        kv=(Region(k, ITEM * PAGES, HOST, ITEM), Region(v, ITEM * PAGES, HOST, ITEM)),
        aux=(Region(a, 64 * 8, HOST, 64),),
        state=(Region(w1, 128 * 16, HOST, 128), Region(w2, 128 * 16, HOST, 128), Region(sl, 512 * 4, HOST, 512)),
        state_groups=(2, 1),
    )
