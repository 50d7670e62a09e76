"""State groups: how an endpoint describes its state buffers (SGLang's SWA window pool, Mamba
slots), how a peer's description is read, how a caller's items are checked, and how layouts
with other state buffers are told apart."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.negotiation.handshake import regions_from_dict, regions_to_dict
from kvtransport.negotiation.hello import layout_from_dict, layout_to_dict
from kvtransport.runtime.checks import read_announcement, state_items
from kvtransport.spi.errors import InvalidPages, MemoryLayoutError, ProtocolError
from kvtransport.spi.memory import HOST, KVLayout, Region, RegionSet

BASE = 1 << 32
KV = (Region(1 << 20, 4096 * 8, HOST, 4096),)


def _state(groups: list[list[tuple[int, int]]]) -> RegionSet:
    """Regions for groups of (items, item_len) buffers, laid out one after another."""
    regions, ptr = [], BASE
    for group in groups:
        for items, item_len in group:
            regions.append(Region(ptr, items * item_len, HOST, item_len))
            ptr += items * item_len + 4096
    return RegionSet(kv=KV, state=tuple(regions), state_groups=tuple(len(g) for g in groups))


groups_strategy = st.lists(
    st.lists(st.tuples(st.integers(1, 40), st.sampled_from([8, 64, 1000, 4096])), min_size=1, max_size=4),
    max_size=6,
)


@settings(max_examples=200)
@given(groups=groups_strategy)
def test_groups_survive_the_handshake_and_slice_the_state_regions(groups: list[list[tuple[int, int]]]) -> None:
    regions = _state(groups)
    back = regions_from_dict(regions_to_dict(regions))
    assert back == regions
    for g, group in enumerate(groups):
        assert [(r.num_items, r.item_len) for r in back.state_group(g)] == group
        assert back.state_slots(g) == min(items for items, _ in group)
    assert back.state_item_lens == tuple(tuple(n for _, n in g) for g in groups)


@settings(max_examples=200)
@given(
    groups=groups_strategy.filter(bool),
    entries=st.lists(
        st.one_of(st.none(), st.lists(st.integers(-3, 45), max_size=6)),
        max_size=8,
    ),
)
def test_state_items_agree_with_a_plain_model(groups: list[list[tuple[int, int]]], entries: list[object]) -> None:
    """Accepted exactly when every non-empty entry names a registered group, stays inside its
    items and repeats none; trailing empty entries are dropped."""
    regions = _state(groups)
    slots = [min(items for items, _ in g) for g in groups]
    ok = all(
        not e or (g < len(groups) and all(0 <= i < slots[g] for i in e) and len(set(e)) == len(e))
        for g, e in enumerate(entries)
        if isinstance(e, list)
    )
    if not ok:
        with pytest.raises(InvalidPages):
            state_items(entries, regions, "test")
        return
    got = state_items(entries, regions, "test")
    want = [list(e) if isinstance(e, list) else [] for e in entries]
    while want and not want[-1]:
        want.pop()
    assert [a.tolist() for a in got] == want


def test_mamba_payloads_are_flattened() -> None:
    """SGLang's Mamba payload is a list holding one array of the request's slot."""
    regions = _state([[(8, 64), (8, 1000)]])
    assert state_items([[np.array([5])]], regions, "t")[0].tolist() == [5]
    with pytest.raises(InvalidPages, match="not an array"):
        state_items([[np.array([1]), np.array([1, 2])]], regions, "t")
    with pytest.raises(InvalidPages, match="list with one entry per state group"):
        state_items("swa", regions, "t")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("groups", "words"),
    [
        ([3], "do not divide"),
        ([0, 2], "do not divide"),
        ([True, 1], "must be an integer"),
        ("2", "list"),
        ([1] * 65, "at most 64"),
    ],
)
def test_a_peers_bad_state_groups_are_a_protocol_error(groups: object, words: str) -> None:
    doc = regions_to_dict(_state([[(4, 8), (4, 8)]]))
    doc["state_groups"] = groups
    with pytest.raises(ProtocolError, match=words):
        regions_from_dict(doc)


def test_local_state_groups_are_checked() -> None:
    with pytest.raises(MemoryLayoutError, match="do not divide"):
        RegionSet(kv=KV, state=(Region(BASE, 64, HOST, 8),), state_groups=(2,))
    # Without groups, every state region is one group (what older callers registered).
    assert RegionSet(kv=KV, state=(Region(BASE, 64, HOST, 8), Region(BASE + 64, 64, HOST, 8))).state_groups == (2,)


def test_layouts_with_other_state_buffers_are_incompatible() -> None:
    base = KVLayout.llama3_8b()
    swa = KVLayout(**{**base.__dict__, "state_types": ("swa",), "state_item_lens": ((2048, 2048),)})
    mamba = KVLayout(**{**base.__dict__, "state_types": ("mamba",), "state_item_lens": ((2048, 2048),)})
    wider = KVLayout(**{**base.__dict__, "state_types": ("swa",), "state_item_lens": ((4096, 4096),)})
    assert swa.incompatibilities(swa) == []
    assert any("state_types" in p for p in swa.incompatibilities(mamba))
    assert any("state_item_lens" in p for p in swa.incompatibilities(wider))
    assert any("state_types" in p for p in swa.incompatibilities(base))
    assert layout_from_dict(layout_to_dict(swa)) == swa


@given(
    pages=st.binary(max_size=80),
    aux=st.integers(-(2**63), 2**63 - 1),
    state=st.lists(st.binary(max_size=40), max_size=6),
)
def test_a_peers_announcement_is_read_or_refused_with_invalid_pages(pages: bytes, aux: int, state: list[bytes]) -> None:
    """Whatever a peer announces, read_announcement returns pages, aux slot and state items
    inside the peer's regions, or raises InvalidPages: nothing else leaves."""
    regions = RegionSet(
        kv=KV,
        aux=(Region(1 << 24, 8 * 64, HOST, 64),),
        state=(Region(BASE, 5 * 64, HOST, 64), Region(BASE + 4096, 3 * 16, HOST, 16)),
        state_groups=(1, 1),
    )
    try:
        got, slot, items = read_announcement({"pages": pages, "aux": aux, "state": state}, regions, "peer")
    except InvalidPages:
        return
    assert ((0 <= got) & (got < regions.num_pages)).all() and len(set(got.tolist())) == got.size
    assert slot == aux and (slot < 0 or slot < min(r.num_items for r in regions.aux))
    for g, group in enumerate(items):
        assert ((0 <= group) & (group < regions.state_slots(g))).all()
