"""The grouping of layer-wise sends (``runtime.layer_groups``), by hypothesis: every layer goes
out exactly once, never before it was marked, never later than its group filled; short
requests go in one batch; groups merge only when posting fell behind; and the layer of each
KV region is what SGLang's and MLA's layouts say, or refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.runtime.layer_groups import BACKLOG, POST_SHARE, Grouper, LayerwisePolicy, region_layers
from kvtransport.spi.errors import ConfigError
from kvtransport.spi.memory import KVLayout, RegionSet


@st.composite
def policies(draw: st.DrawFn) -> LayerwisePolicy:
    first = draw(st.integers(1, 8))
    return LayerwisePolicy(
        min_tokens=draw(st.integers(0, 4096)),
        first_group=first,
        max_group=draw(st.one_of(st.just(0), st.integers(first, 16))),
        adaptive=draw(st.booleans()),
    )


@settings(max_examples=400, deadline=None)
@given(
    policy=policies(),
    data=st.data(),
    layers=st.integers(1, 48),
    tokens=st.integers(0, 8192),
)
def test_every_layer_goes_out_once_no_earlier_than_marked_no_later_than_due(
    policy: LayerwisePolicy, data: st.DataObject, layers: int, tokens: int
) -> None:
    g = Grouper(layers, tokens, policy)
    order = data.draw(st.permutations(range(layers)))
    cap = layers if not policy.max_group else min(policy.max_group, layers)
    marked: set[int] = set()
    posted: list[tuple[int, ...]] = []
    sizes = [g.size]
    for i, layer in enumerate(order):
        backlog = data.draw(st.integers(0, 4))
        share = data.draw(st.floats(0, 1))
        before = g.size
        marked.add(layer)
        group = g.mark(layer, backlog=backlog, post_share=share)
        # Groups grow only when adaptive, above the minimum length, and posting fell behind.
        grew = g.size != before
        behind = policy.adaptive and not g.whole and (backlog >= BACKLOG or share > POST_SHARE)
        assert grew == (behind and before < cap), "groups grow exactly when posting fell behind"
        if grew:
            assert g.size == min(before * 2, cap)
        sizes.append(g.size)
        if group is not None:
            assert group, "an empty group is never posted"
            assert set(group) <= marked, "a layer went out before it was marked"
            assert not set(group) & {x for p in posted for x in p}, "a layer went out twice"
            assert len(group) <= max(g.size, 1)
            posted.append(group)
        # Nothing that is due waits: fewer pending layers than a group, unless all are out.
        assert len(g.pending) < g.size or (i == layers - 1 and not g.pending)
    assert sorted(x for p in posted for x in p) == list(range(layers))
    assert g.complete
    assert sizes == sorted(sizes), "groups never shrink"
    assert max(len(p) for p in posted) <= cap or g.whole
    if g.whole:
        assert posted == [tuple(order)], "a short request goes in one batch once every layer is ready"
    if not policy.adaptive and not g.whole:
        size = min(policy.first_group, layers)
        assert all(len(p) == size for p in posted[:-1])


def test_short_requests_go_whole_and_long_ones_start_small() -> None:
    policy = LayerwisePolicy(min_tokens=512, first_group=1)
    short, long = Grouper(32, 511, policy), Grouper(32, 512, policy)
    assert short.whole and not long.whole
    assert [short.mark(x) for x in range(31)] == [None] * 31
    assert short.mark(31) == tuple(range(32))
    assert long.mark(0) == (0,)


def test_marks_that_are_not_layers_are_refused() -> None:
    g = Grouper(4, 1000, LayerwisePolicy(min_tokens=0, first_group=2))
    for bad in (-1, 4, True, 1.0):
        with pytest.raises(ConfigError):
            g.mark(bad)  # type: ignore[arg-type]
    g.mark(1)
    with pytest.raises(ConfigError, match="already"):
        g.mark(1)


def _layout(layers: int, regions: int) -> tuple[KVLayout, RegionSet]:
    kv = RegionSet.from_kv_args([4096 * (i + 1) * 16 for i in range(regions)], [4096] * regions, [1024] * regions)
    layout = KVLayout(page_size=16, dtype="bfloat16", num_layers=layers, kv_item_lens=(1024,) * regions)
    return layout, kv


@given(st.integers(1, 64))
def test_region_layers_of_known_layouts(n: int) -> None:
    assert region_layers(*_layout(n, n)) == tuple(range(n))  # one buffer per layer (MLA)
    assert region_layers(*_layout(n, 2 * n)) == tuple(range(n)) * 2  # every K, then every V


def test_region_layers_unknown_or_wrong_are_refused() -> None:
    with pytest.raises(ConfigError, match="pass region_layers"):
        region_layers(*_layout(4, 6))
    layout, regions = _layout(2, 4)
    assert region_layers(layout, regions, [0, 0, 1, 1]) == (0, 0, 1, 1)  # K,V of layer 0, then of 1
    for bad, match in (([0, 1, 0], "one per region"), ([0, 0, 0, 0], "without a region"), ([0, 1, 2, 0], "outside")):
        with pytest.raises(ConfigError, match=match):
            region_layers(layout, regions, bad)


def test_policy_from_the_environment() -> None:
    env = {
        "KVTRANSPORT_LAYERWISE_MIN_TOKENS": "0",
        "KVTRANSPORT_LAYERWISE_GROUP": "4",
        "KVTRANSPORT_LAYERWISE_MAX_GROUP": "8",
        "KVTRANSPORT_LAYERWISE_ADAPTIVE": "0",
    }
    assert LayerwisePolicy.from_env(env) == LayerwisePolicy(0, 4, 8, False)
    assert LayerwisePolicy.from_env({}) == LayerwisePolicy()
    for name, value in (
        ("KVTRANSPORT_LAYERWISE_GROUP", "0"),
        ("KVTRANSPORT_LAYERWISE_MIN_TOKENS", "many"),
        ("KVTRANSPORT_LAYERWISE_ADAPTIVE", "maybe"),
    ):
        with pytest.raises(ConfigError, match=name):
            LayerwisePolicy.from_env({name: value})
    with pytest.raises(ConfigError, match="below first_group"):
        LayerwisePolicy(first_group=4, max_group=2)
