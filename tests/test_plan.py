"""The planner: exact coverage for any index arrays, coalescing, caps, and refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.spi.errors import InvalidPages, MemoryLayoutError
from kvtransport.spi.memory import HOST, MemoryKind, Region, RegionSet
from kvtransport.spi.plan import SMALL, RegionPairs, check_runs_within, plan


def regions(base: int, n: int, pages: int, item: int) -> tuple[Region, ...]:
    stride = pages * item + 4096  # gaps between regions catch runs that spill over
    return tuple(Region(base + i * stride, pages * item, HOST, item, f"r{i}") for i in range(n))


@st.composite
def cases(draw: st.DrawFn) -> tuple[tuple[Region, ...], tuple[Region, ...], np.ndarray, np.ndarray, int | None]:
    n_regions = draw(st.integers(1, 3))
    item = draw(st.sampled_from([1, 8, 64, 100]))
    src_pages = draw(st.integers(1, 40))
    dst_pages = draw(st.integers(1, 40))
    count = draw(st.integers(0, min(src_pages, dst_pages)))
    src = draw(st.lists(st.integers(0, src_pages - 1), min_size=count, max_size=count))
    dst = draw(st.permutations(range(dst_pages)))[:count]
    cap = draw(st.none() | st.integers(1, 5 * item))
    return (
        regions(1 << 20, n_regions, src_pages, item),
        regions(1 << 30, n_regions, dst_pages, item),
        np.array(src, dtype=np.int64),
        np.array(dst, dtype=np.int64),
        cap,
    )


@settings(max_examples=400)
@given(cases())
def test_runs_cover_exactly_the_requested_bytes(case) -> None:  # type: ignore[no-untyped-def]
    src_r, dst_r, src, dst, cap = case
    runs = plan(src_r, dst_r, src, dst, max_run_bytes=cap)
    expected = {}
    for s_reg, d_reg in zip(src_r, dst_r, strict=True):
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            for b in range(s_reg.item_len):
                expected[d_reg.ptr + d * d_reg.item_len + b] = s_reg.ptr + s * s_reg.item_len + b
    written = {}
    for s, d, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist(), strict=True):
        assert n > 0 and (cap is None or n <= cap)
        for b in range(n):
            assert d + b not in written, "a destination byte written twice"
            written[d + b] = s + b
    assert written == expected
    assert runs.total_bytes == len(expected)  # however it was counted (small plans count as they go)
    check_runs_within(runs.src, runs.length, src_r, "src")
    check_runs_within(runs.dst, runs.length, dst_r, "dst")


def _outcome(fn: object, *args: object, **kw: object) -> object:
    try:
        runs = fn(*args, **kw)  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 - the error is the outcome compared
        return (type(exc), str(exc))
    # The lists a small plan keeps (or any plan's, made on asking) say what its arrays say.
    listed = tuple(list(x) for x in runs.lists())
    arrays = (runs.src.tolist(), runs.dst.tolist(), runs.length.tolist())
    assert listed == arrays and len(runs) == len(arrays[2])
    assert all(a.dtype == np.uint64 for a in (runs.src, runs.dst, runs.length))
    return (*arrays, runs.total_bytes)


@settings(max_examples=600)
@given(
    n_regions=st.integers(0, 3),
    dst_regions=st.integers(0, 3),
    item=st.sampled_from([8, 64]),
    dst_item=st.sampled_from([8, 64]),
    src_pages=st.integers(1, 12),
    dst_pages=st.integers(1, 12),
    fault=st.sampled_from(["none", "src -1", "src past", "dst -1", "dst past", "dst twice", "one more"]),
    cap=st.none() | st.integers(-1, 200),
    data=st.data(),
)
def test_paired_regions_plan_exactly_what_plan_does(
    n_regions: int,
    dst_regions: int,
    item: int,
    dst_item: int,
    src_pages: int,
    dst_pages: int,
    fault: str,
    cap: int | None,
    data: st.DataObject,
) -> None:
    """The sessions' planner (regions paired once, small requests from plain lists) gives the
    same runs, or the same error, as :func:`plan`: on requests in range and on each way one
    index can be wrong (just outside either side's range, a destination twice, one page more
    on one side), with regions that do not pair, and caps of zero or below."""
    count = data.draw(st.integers(1, min(SMALL, dst_pages)))
    src = data.draw(st.lists(st.integers(0, src_pages - 1), min_size=count, max_size=count))
    dst = data.draw(st.permutations(range(dst_pages)))[:count]
    at = data.draw(st.integers(0, count - 1))
    if fault == "src -1":
        src[at] = -1
    elif fault == "src past":
        src[at] = src_pages
    elif fault == "dst -1":
        dst[at] = -1
    elif fault == "dst past":
        dst[at] = dst_pages
    elif fault == "dst twice" and count > 1:
        dst[at] = dst[(at + 1) % count]
    elif fault == "one more":
        src.append(0)
    src_r = regions(1 << 20, n_regions, src_pages, item)
    dst_r = regions(1 << 30, dst_regions, dst_pages, dst_item)
    pairs = RegionPairs(src_r, dst_r)
    got = _outcome(pairs.plan, np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), max_run_bytes=cap)
    want = _outcome(plan, src_r, dst_r, np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), max_run_bytes=cap)
    assert got == want
    # Pages that are not integers, or not one-dimensional, with any cap: the same error first.
    for odd in ([0.5] * len(src), [[p] for p in src], [True] * len(src)):
        want_odd = _outcome(plan, src_r, dst_r, odd, dst, max_run_bytes=cap)
        assert _outcome(pairs.plan, odd, dst, max_run_bytes=cap) == want_odd
    # ... and a second plan between the same regions too (the pairing is kept).
    assert _outcome(pairs.plan, src, dst, max_run_bytes=cap) == _outcome(
        plan, src_r, dst_r, src, dst, max_run_bytes=cap
    )


@settings(max_examples=400)
@given(cases())
def test_paired_regions_plan_valid_requests_as_plan_does(case) -> None:  # type: ignore[no-untyped-def]
    src_r, dst_r, src, dst, cap = case
    assert _outcome(RegionPairs(src_r, dst_r).plan, src, dst, max_run_bytes=cap) == _outcome(
        plan, src_r, dst_r, src, dst, max_run_bytes=cap
    )


def test_a_small_plan_makes_no_array_until_one_is_asked_for() -> None:
    """Its next steps (a direct driver's small post, a one-chunk staged request) take lists;
    numpy's calls are what a small request's latency is made of on a cold core."""
    src_r, dst_r = regions(1 << 20, 2, 8, 64), regions(1 << 30, 2, 8, 64)
    runs = RegionPairs(src_r, dst_r).plan([1, 2, 5], [0, 1, 7])
    assert (runs._src, runs._dst, runs._length) == (None, None, None)
    src, dst, length = runs.lists()
    assert len(runs) == 4 and runs.total_bytes == 2 * 3 * 64
    assert (runs._src, runs._dst, runs._length) == (None, None, None)
    assert runs.dst.tolist() == dst and runs.src.tolist() == src and runs.length.tolist() == length == [128, 64] * 2


def test_consecutive_pages_coalesce_into_one_run_per_region() -> None:
    src_r, dst_r = regions(1 << 20, 64, 4096, 32768), regions(1 << 40, 64, 4096, 32768)
    runs = plan(src_r, dst_r, np.arange(256), np.arange(1000, 1256))
    assert len(runs) == 64 and set(runs.length.tolist()) == {256 * 32768}
    runs = plan(src_r, dst_r, np.arange(256), np.arange(1000, 1256), max_run_bytes=1 << 20)
    assert len(runs) == 64 * 8


def test_large_plan_is_vectorised() -> None:
    import time

    src_r, dst_r = regions(1 << 20, 64, 20000, 32768), regions(1 << 40, 64, 20000, 32768)
    src = np.random.default_rng(0).permutation(20000)[:16384]
    start = time.perf_counter()
    runs = plan(src_r, dst_r, src, np.arange(16384))
    assert len(runs) >= 16384 * 64 * 0.9
    assert time.perf_counter() - start < 5.0  # a per-page Python loop would take far longer


@pytest.mark.parametrize(
    ("src", "dst", "words"),
    [
        ([0, 1], [0], "pair one to one"),
        ([-1], [0], "outside the registered range"),
        ([0], [10], "outside the registered range"),
        ([0, 1], [3, 3], "appears more than once"),
        ([[0]], [[1]], "one-dimensional"),
        ([0.5], [1], "must be integers"),
    ],
)
def test_bad_indices_are_refused(src: object, dst: object, words: str) -> None:
    with pytest.raises(InvalidPages, match=words):
        plan(regions(1 << 20, 2, 10, 8), regions(1 << 30, 2, 10, 8), src, dst)


def test_mismatched_page_sizes_are_refused() -> None:
    with pytest.raises(InvalidPages, match="page of 8 bytes"):
        plan(regions(1 << 20, 1, 10, 8), regions(1 << 30, 1, 10, 16), [0], [0])


def test_region_sets_reject_what_cannot_be_right() -> None:
    with pytest.raises(MemoryLayoutError, match="overlap"):
        RegionSet((Region(4096, 100, HOST, 10), Region(4100, 100, HOST, 10)))
    with pytest.raises(MemoryLayoutError, match="zero or negative length"):
        Region(4096, 0, HOST, 10)
    with pytest.raises(MemoryLayoutError, match="does not divide"):
        Region(4096, 100, HOST, 30)
    with pytest.raises(MemoryLayoutError, match="three lists"):
        RegionSet.from_kv_args([4096], [100, 200], [10])
    with pytest.raises(MemoryLayoutError, match="different page counts"):
        RegionSet((Region(4096, 100, HOST, 10), Region(8192, 100, HOST, 20)))


def test_regions_from_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    k = torch.zeros((32, 16, 8, 128), dtype=torch.bfloat16)
    v = torch.zeros((32, 16, 8, 128), dtype=torch.bfloat16)
    aux = torch.zeros((8, 16), dtype=torch.int32)
    rs = RegionSet.from_tensors([k, v], aux=[aux])
    assert rs.num_pages == 32 and rs.kv_item_lens == (32768, 32768)
    assert rs.kv[0].ptr == k.data_ptr() and str(rs.kv_kind) == "host"
    assert rs.aux[0].item_len == 64
    with pytest.raises(MemoryLayoutError, match="contiguous"):
        RegionSet.from_tensors([k.transpose(0, 1)])


def test_device_kv_with_host_aux_is_a_valid_region_set() -> None:
    """SGLang's layout: KV on the GPU, aux slots in host memory (mixed kinds must sort)."""
    gpu = MemoryKind(0)
    rs = RegionSet.from_kv_args(
        [1 << 30, (1 << 30) + 4096],
        [4096, 4096],
        [1024, 1024],
        kind=gpu,
        aux_data_ptrs=[1 << 20],
        aux_data_lens=[256],
        aux_item_lens=[64],
    )
    assert rs.kv_kind == gpu and rs.aux[0].kind == HOST
    # The same numbers in two address spaces do not overlap; within one they do.
    RegionSet(kv=(Region(4096, 100, gpu, 10),), aux=(Region(4096, 100, HOST, 10),))
    with pytest.raises(MemoryLayoutError, match="overlap"):
        RegionSet(kv=(Region(4096, 100, gpu, 10), Region(4100, 100, gpu, 10)), aux=(Region(8192, 10, HOST, 10),))
