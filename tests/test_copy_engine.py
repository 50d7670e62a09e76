"""The host copy engine of the staged path: merged pieces, rows of one indexed copy and strided
groups copied as one 2-D copy must write exactly what one ``memmove`` per piece writes
(hypothesis, on real memory)."""

from __future__ import annotations

from unittest import mock

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtransport.staging import copy as copy_module
from kvtransport.staging.copy import ROWS_MAX_LEN, ROWS_MIN, STRIDED_MIN, MemcpyCopyEngine, coalesce, strided_groups

SIZE = 1 << 16


@st.composite
def pieces(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    """(src offset, dst offset, length): strided rows like a head slice, mixed with others;
    destinations never overlap (the staged path never writes one byte twice)."""
    out: list[tuple[int, int, int]] = []
    dst_at = 0
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            n = draw(st.sampled_from([8, 64, 100]))
            step_s = n * draw(st.integers(1, 4))
            step_d = n * draw(st.integers(1, 3))
            count = draw(st.integers(1, 20))
            s0 = draw(st.integers(0, SIZE - step_s * count - n))
            for i in range(count):
                if dst_at + step_d * i + n > SIZE:
                    break
                out.append((s0 + step_s * i, dst_at + step_d * i, n))
            dst_at += step_d * count + n
        else:
            n = draw(st.integers(1, 300))
            s0 = draw(st.integers(0, SIZE - n))
            out.append((s0, dst_at, n))
            dst_at += n + draw(st.integers(0, 16))
        if dst_at >= SIZE - 400:
            break
    return [p for p in out if p[1] + p[2] <= SIZE]


@st.composite
def rows(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    """Many pieces of one length at addresses that line up on it (a head slice of token rows,
    scattered pages, into or out of a ring chunk), some runs of them adjacent on both sides,
    shuffled, with a few odd pieces among them."""
    n = draw(st.sampled_from([16, 64, 128]))
    cells = SIZE // n
    count = draw(st.integers(ROWS_MIN - 2, 2 * ROWS_MIN))
    dst_cells = draw(st.lists(st.integers(0, cells - 1), min_size=count, max_size=count, unique=True))
    if draw(st.booleans()):  # back to back at the source, like a ring chunk
        first = draw(st.integers(0, cells - count))
        src_cells = list(range(first, first + count))
    else:
        src_cells = draw(st.lists(st.integers(0, cells - 1), min_size=count, max_size=count))
    shift_s = draw(st.integers(0, n - 1)) if draw(st.booleans()) else 0
    out = [(min(c * n + shift_s, SIZE - n), d * n, n) for c, d in zip(src_cells, dst_cells, strict=True)]
    if draw(st.booleans()):  # an odd piece in a free cell
        free = sorted(set(range(cells)) - set(dst_cells))
        if free:
            out.append((draw(st.integers(0, SIZE - n)), free[0] * n, draw(st.integers(1, n))))
    return out


def _copy_like_memmove(ps: list[tuple[int, int, int]], size: int = SIZE) -> None:
    """Copy ``(src offset, dst offset, length)`` pieces between two buffers of ``size`` bytes
    with the engine; every byte must land where one memmove per piece puts it."""
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, size, dtype=np.uint8)
    got, want = np.zeros(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)
    for s, d, n in ps:
        want[d : d + n] = src[s : s + n]
    base_s, base_d = int(src.ctypes.data), int(got.ctypes.data)
    MemcpyCopyEngine().copy(
        np.array([base_d + d for _, d, _ in ps], dtype=np.uint64),
        np.array([base_s + s for s, _, _ in ps], dtype=np.uint64),
        np.array([n for _, _, n in ps], dtype=np.uint64),
    )
    assert np.array_equal(got, want)


@settings(max_examples=300, deadline=None)
@given(ps=pieces())
def test_grouped_copies_equal_one_memmove_per_piece(ps: list[tuple[int, int, int]]) -> None:
    _copy_like_memmove(ps)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.large_base_example])
@given(ps=rows())
def test_row_copies_equal_one_memmove_per_piece(ps: list[tuple[int, int, int]]) -> None:
    _copy_like_memmove(ps)


def test_pieces_that_follow_one_another_on_both_sides_merge() -> None:
    """A page's 16 token rows gathered into a ring chunk: one piece; a gap on either side
    keeps pieces apart."""
    dst = np.array([0, 8, 16, 100, 108], np.uint64)
    src = np.array([50, 58, 66, 74, 200], np.uint64)
    d, s, n = coalesce(dst, src, np.full(5, 8, np.uint64))
    assert d.tolist() == [0, 100, 108] and s.tolist() == [50, 74, 200] and n.tolist() == [24, 8, 8]


def test_token_rows_of_a_head_slice_form_one_group_per_page() -> None:
    """16 rows of 512 bytes every 1024 bytes at the source, back to back at the destination,
    for 3 pages: 3 groups of 16 (or fewer, larger ones where pages line up)."""
    src = [p * 65536 + t * 1024 for p in (0, 5, 9) for t in range(16)]
    dst = [i * 512 for i in range(48)]
    groups = strided_groups(np.array(dst, np.uint64), np.array(src, np.uint64), np.full(48, 512, np.uint64))
    assert sum(c for _, c in groups) == 48 and all(c >= STRIDED_MIN for _, c in groups)
    assert len(groups) == 3


def test_the_cuda_2d_copy_descriptor_has_cudas_layout() -> None:
    """``CUDA_MEMCPY2D`` as cuda.h lays it out (x86-64): the CUDA copy engine's strided groups
    go through it, and a field at the wrong offset would copy from the wrong place."""
    import ctypes

    from kvtransport.staging.cuda_copy import _Memcpy2D

    offsets = {name: getattr(_Memcpy2D, name).offset for name, _ in _Memcpy2D._fields_}
    assert ctypes.sizeof(_Memcpy2D) == 128
    assert offsets == {
        "srcXInBytes": 0,
        "srcY": 8,
        "srcMemoryType": 16,
        "srcHost": 24,
        "srcDevice": 32,
        "srcArray": 40,
        "srcPitch": 48,
        "dstXInBytes": 56,
        "dstY": 64,
        "dstMemoryType": 72,
        "dstHost": 80,
        "dstDevice": 88,
        "dstArray": 96,
        "dstPitch": 104,
        "WidthInBytes": 112,
        "Height": 120,
    }


@settings(max_examples=50, deadline=None)
@given(
    pages=st.lists(st.integers(0, 23), min_size=1, max_size=24, unique=True),
    length=st.integers(ROWS_MAX_LEN + 1, 64 << 10),
    back_to_back=st.booleans(),
)
def test_whole_pages_are_copied_one_memmove_each_byte_exact(pages: list[int], length: int, back_to_back: bool) -> None:
    """Pieces longer than ``ROWS_MAX_LEN`` (a layer's page, gathered into a ring chunk or
    scattered out of one) skip the row and strided searches and are copied byte-exact."""
    stride = 64 << 10
    ps = [(p * stride, (i if back_to_back else 23 - p) * stride, length) for i, p in enumerate(pages)]
    with (
        mock.patch.object(copy_module, "_copy_row_sets", side_effect=AssertionError("rows searched")),
        mock.patch.object(copy_module, "strided_groups", side_effect=AssertionError("strided groups searched")),
    ):
        _copy_like_memmove(ps, 24 * stride)


@settings(max_examples=30, deadline=None)
@given(
    short=st.sampled_from([1024, 4096, ROWS_MAX_LEN]),
    count=st.integers(ROWS_MIN, 2 * ROWS_MIN),
    seed=st.integers(0, 99),
)
def test_short_pieces_go_as_rows_and_long_ones_one_memmove_each_in_one_copy(short: int, count: int, seed: int) -> None:
    """Many pieces of a short length and many of a long one in one copy (a ring chunk holding
    head slices and whole pages): the short ones as rows, the long ones skipped by the row copy
    and moved one by one; every byte where one memmove per piece puts it."""
    rng = np.random.default_rng(seed)
    long_len = 32 << 10
    cells = 2 * count
    src_cells = rng.permutation(cells)
    dst_cells = rng.permutation(cells)
    ps = [
        (int(s) * long_len, int(d) * long_len, short if i < count else long_len)
        for i, (s, d) in enumerate(zip(src_cells, dst_cells, strict=True))
    ]
    row_lengths: list[int] = []
    real_rows = copy_module._copy_rows

    def rows(d0: int, drow: object, s0: int, srow: object, n: int, span_d: int, span_s: int) -> None:
        row_lengths.append(n)
        real_rows(d0, drow, s0, srow, n, span_d, span_s)  # type: ignore[arg-type]

    with mock.patch.object(copy_module, "_copy_rows", rows):
        _copy_like_memmove(ps, cells * long_len)
    assert short in row_lengths and long_len not in row_lengths
