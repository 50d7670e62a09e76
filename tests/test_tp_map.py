"""Unequal tensor parallelism: the head mapping (every destination head written exactly once,
from the right global head) and the sliced planner (against a byte-by-byte model)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.spi.errors import InvalidPages, MemoryLayoutError
from kvtransport.spi.memory import HOST, KVLayout, Region
from kvtransport.spi.plan import plan_heads
from kvtransport.spi.tp_map import HeadSlice, head_slice, held_heads, latent_source, pair_shape, sources, targets

SIZES = [1, 2, 4, 8]
HEADS = [1, 2, 4, 8, 16]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("prefill_tp", SIZES)
@pytest.mark.parametrize("decode_tp", SIZES)
def test_every_decode_head_is_written_once_from_the_same_global_head(
    heads: int, prefill_tp: int, decode_tp: int
) -> None:
    for d in range(decode_tp):
        wanted = held_heads(heads, decode_tp, d)
        writes = [0] * len(wanted)
        for p in range(prefill_tp):
            s = head_slice(heads, prefill_tp, p, decode_tp, d)
            if s is None:
                continue
            assert p in sources(prefill_tp, decode_tp, d), f"prefill {p} writes decode {d}, which it does not feed"
            held = held_heads(heads, prefill_tp, p)
            for c in range(s.count):
                assert s.src_head + c < len(held) and s.dst_head + c < len(wanted)
                assert held[s.src_head + c] == wanted[s.dst_head + c], "a head lands where another belongs"
                writes[s.dst_head + c] += 1
        assert writes == [1] * len(wanted), f"decode rank {d}: heads written {writes} times"


@pytest.mark.parametrize("prefill_tp", SIZES)
@pytest.mark.parametrize("decode_tp", SIZES)
def test_sources_follow_sglangs_rank_arithmetic_and_each_latent_has_one_sender(prefill_tp: int, decode_tp: int) -> None:
    fed = [0] * prefill_tp
    for d in range(decode_tp):
        src = sources(prefill_tp, decode_tp, d)
        if decode_tp >= prefill_tp:
            assert list(src) == [d // (decode_tp // prefill_tp)]  # common/conn.py, target_tp_rank
        else:
            ratio = prefill_tp // decode_tp
            assert list(src) == list(range(d * ratio, (d + 1) * ratio))  # target_tp_ranks
        assert latent_source(prefill_tp, decode_tp, d) == src[0]
        for p in src:
            fed[p] += 1
    assert all(n >= 1 for n in fed), "a prefill rank feeds nobody"


@pytest.mark.parametrize("prefill_tp", SIZES)
@pytest.mark.parametrize("decode_tp", SIZES)
def test_a_prefill_ranks_targets_are_the_decode_ranks_it_is_a_source_of(prefill_tp: int, decode_tp: int) -> None:
    for p in range(prefill_tp):
        fed = [d for d in range(decode_tp) if p in sources(prefill_tp, decode_tp, d)]
        assert list(targets(prefill_tp, p, decode_tp)) == fed


def test_shapes_that_do_not_divide_are_refused() -> None:
    with pytest.raises(MemoryLayoutError, match="cannot be sharded"):
        head_slice(6, 4, 0, 2, 0)
    with pytest.raises(MemoryLayoutError, match="one must divide the other"):
        sources(3, 2, 0)
    with pytest.raises(MemoryLayoutError, match="one must divide the other"):
        targets(2, 0, 3)


def _regions(base: int, pages: int, item: int, layers: int) -> tuple[Region, ...]:
    return tuple(Region(base + i * (pages * item + 4096), pages * item, HOST, item) for i in range(layers))


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    page_tokens=st.sampled_from([1, 2, 16]),
    src_heads=st.sampled_from([1, 2, 4]),
    dst_heads=st.sampled_from([1, 2, 4]),
    head_bytes=st.sampled_from([8, 32]),
    layers=st.integers(1, 3),
)
def test_sliced_runs_move_exactly_the_slice(
    data: st.DataObject, page_tokens: int, src_heads: int, dst_heads: int, head_bytes: int, layers: int
) -> None:
    """Simulate the runs on byte arrays: every destination byte inside the slice of an
    announced page comes from the same token and head offset of its source page; every other
    byte is untouched."""
    count = data.draw(st.integers(1, min(src_heads, dst_heads)))
    src_head = data.draw(st.integers(0, src_heads - count))
    dst_head = data.draw(st.integers(0, dst_heads - count))
    pages = 6
    n = data.draw(st.integers(0, pages))
    src_pages = data.draw(st.permutations(range(pages)))[:n]
    dst_pages = data.draw(st.permutations(range(pages)))[:n]
    src_item, dst_item = page_tokens * src_heads * head_bytes, page_tokens * dst_heads * head_bytes
    src_base, dst_base = 1 << 20, 1 << 30
    src_regions = _regions(src_base, pages, src_item, layers)
    dst_regions = _regions(dst_base, pages, dst_item, layers)
    runs = plan_heads(
        src_regions,
        dst_regions,
        src_pages,
        dst_pages,
        page_tokens=page_tokens,
        src_heads=src_heads,
        dst_heads=dst_heads,
        head_bytes=head_bytes,
        src_head=src_head,
        dst_head=dst_head,
        count=count,
        max_run_bytes=data.draw(st.sampled_from([None, 8, 1 << 20])),
    )
    rng = np.random.default_rng(0)
    src_mem = {r.ptr: rng.integers(0, 256, r.length, dtype=np.uint8) for r in src_regions}
    dst_mem = {r.ptr: np.zeros(r.length, dtype=np.uint8) for r in dst_regions}

    def locate(mem: dict[int, np.ndarray], addr: int, length: int) -> tuple[np.ndarray, int]:
        for ptr, buf in mem.items():
            if ptr <= addr and addr + length <= ptr + buf.size:
                return buf, addr - ptr
        raise AssertionError(f"run [{addr:#x}, +{length}) outside every region")

    for s, d, ln in zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist(), strict=True):
        sbuf, so = locate(src_mem, s, ln)
        dbuf, do = locate(dst_mem, d, ln)
        dbuf[do : do + ln] = sbuf[so : so + ln]

    for sr, dr in zip(src_regions, dst_regions, strict=True):
        want = np.zeros(dr.length, dtype=np.uint8)
        for sp, dp in zip(src_pages, dst_pages, strict=True):
            for t in range(page_tokens):
                so = sp * src_item + t * src_heads * head_bytes + src_head * head_bytes
                do = dp * dst_item + t * dst_heads * head_bytes + dst_head * head_bytes
                want[do : do + count * head_bytes] = src_mem[sr.ptr][so : so + count * head_bytes]
        assert np.array_equal(dst_mem[dr.ptr], want)


def test_sliced_plans_refuse_what_cannot_be_right() -> None:
    src, dst = _regions(1 << 20, 4, 16 * 4 * 8, 2), _regions(1 << 30, 4, 16 * 2 * 8, 2)
    shape = {"page_tokens": 16, "src_heads": 4, "dst_heads": 2, "head_bytes": 8}
    with pytest.raises(InvalidPages, match="outside a token's row"):
        plan_heads(src, dst, [0], [0], **shape, src_head=3, dst_head=0, count=2)
    with pytest.raises(InvalidPages, match="outside the registered range"):
        plan_heads(src, dst, [0], [4], **shape, src_head=0, dst_head=0, count=2)
    with pytest.raises(InvalidPages, match="not 16 tokens"):
        plan_heads(src, dst, [0], [0], **{**shape, "dst_heads": 4}, src_head=0, dst_head=0, count=2)
    with pytest.raises(InvalidPages, match="more than once"):
        plan_heads(src, dst, [0, 1], [2, 2], **shape, src_head=0, dst_head=0, count=2)
    assert len(plan_heads(src, dst, [0, 1], [2, 3], **shape, src_head=2, dst_head=0, count=2)) == 2 * 2 * 16


def _layout(tp: int, rank: int, heads: int, *, stated: bool = True, mla: bool = False, item: int = 0) -> KVLayout:
    local = 1 if mla else len(held_heads(heads, tp, rank))
    item = item or 16 * local * 256
    return KVLayout(
        page_size=16,
        dtype="bfloat16",
        num_layers=2,
        kv_item_lens=(item,) * (2 if mla else 4),
        kv_split="mla" if mla else "kv",
        tp_rank=rank,
        tp_size=tp,
        total_kv_heads=heads if stated and not mla else 0,
    )


def test_unequal_tp_layouts_are_checked_at_the_handshake() -> None:
    assert _layout(2, 1, 8).incompatibilities(_layout(4, 3, 8)) == []
    # SGLang's decode side states no head count: the prefill side's is enough.
    assert _layout(2, 1, 8, stated=False).incompatibilities(_layout(4, 3, 8)) == []
    problems = _layout(2, 1, 8, stated=False).incompatibilities(_layout(4, 3, 8, stated=False))
    assert any("total KV heads" in p for p in problems)
    assert any("total_kv_heads" in p for p in _layout(2, 0, 8).incompatibilities(_layout(4, 0, 16)))
    assert any("kv_item_lens" in p for p in _layout(2, 0, 8).incompatibilities(_layout(4, 0, 8, item=1000)))
    assert any("divide" in p for p in _layout(2, 0, 6).incompatibilities(_layout(3, 0, 6)))
    # A peer's hello is not trusted: a rank outside its TP size, or absurd sizes, are refused.
    bad_rank = dataclasses.replace(_layout(4, 3, 8), tp_rank=4)
    assert any("tp_rank 4 of tp_size 4" in p for p in _layout(2, 0, 8).incompatibilities(bad_rank))
    huge = dataclasses.replace(_layout(4, 3, 8), total_kv_heads=1 << 40)
    assert any("total_kv_heads" in p for p in _layout(2, 0, 8).incompatibilities(huge))
    assert _layout(2, 0, 0, mla=True).incompatibilities(_layout(4, 1, 0, mla=True)) == []
    # Each rank's state (SWA window pages, Mamba) holds its own heads' share: refused, named.
    swa = dataclasses.replace(_layout(2, 1, 8), state_types=("swa",), state_item_lens=(64,))
    problems = swa.incompatibilities(dataclasses.replace(_layout(4, 3, 8), state_types=("swa",), state_item_lens=(32,)))
    assert any("state buffers (swa)" in p and "equal TP sizes only" in p for p in problems), problems
    assert any(
        "kv_item_lens" in p for p in _layout(2, 0, 0, mla=True).incompatibilities(_layout(1, 0, 0, mla=True, item=512))
    )


def test_pair_shapes_name_who_sends_what() -> None:
    # Prefill TP 2 -> decode TP 1, 8 heads: each prefill rank sends its 4 heads; rank 0 also the aux.
    first, second = pair_shape(_layout(2, 0, 8), _layout(1, 0, 8)), pair_shape(_layout(2, 1, 8), _layout(1, 0, 8))
    assert (first.kind, first.primary, first.slice) == ("heads", True, HeadSlice(0, 0, 4))
    assert (second.kind, second.primary, second.slice) == ("heads", False, HeadSlice(0, 4, 4))
    assert first.kv_bytes_per_page((16 * 8 * 256,) * 4) == 4 * 16 * 4 * 256
    # MLA: one source sends the latent, the other completes with nothing.
    mla = [pair_shape(_layout(2, p, 0, mla=True), _layout(1, 0, 0, mla=True)) for p in (0, 1)]
    assert [(s.kind, s.primary) for s in mla] == [("all", True), ("none", False)]
    assert mla[1].kv_bytes_per_page((4096,) * 2) == 0
    assert pair_shape(_layout(2, 1, 8), _layout(2, 1, 8)).kind == "all"


def test_the_head_check_catches_a_wrong_head_a_wrong_page_and_a_stray_byte() -> None:
    """Controls for the unequal-TP tests and bench: a decode pool whose pages hold exactly what
    its heads should passes; a page from the wrong source page, the wrong rank's heads, or one
    flipped byte does not."""
    from kvtransport.tools.kv_pool import KVPool

    right = KVPool(8, 2, 16 * 2 * 32, 0, shared=False, tp=(4, 2, 1))  # heads 2-3
    wrong = KVPool(8, 2, 16 * 2 * 32, 0, shared=False, tp=(4, 2, 0))  # heads 0-1
    try:
        right.fill_heads()
        wrong.fill_heads()
        assert right.check_heads([0, 1, 2], [0, 1, 2]) == ""
        assert "page 1 (from 2)" in right.check_heads([0, 2], [0, 1])
        right.buffers[1].array[3 * right.item_len] ^= 1
        assert "region 1: page 3" in right.check_heads([3], [3])
        # The other rank's content under this rank's heads: every row differs.
        right.buffers[0].array[:] = wrong.buffers[0].array
        assert "region 0" in right.check_heads([0], [0])
    finally:
        right.close()
        wrong.close()
