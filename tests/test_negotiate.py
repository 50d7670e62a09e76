"""Negotiation: the decision table on realistic hosts, and properties over random pairs."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtransport.negotiation.cost_model import NOMINAL
from kvtransport.negotiation.hello import Hello
from kvtransport.negotiation.negotiate import LEARNING_LANES, negotiate, sliced_pages
from kvtransport.negotiation.registry import FAILOVER_SETTINGS, Policy
from kvtransport.spi.driver import TransferPath
from kvtransport.spi.errors import (
    ConfigError,
    DriverUnavailable,
    LayoutMismatch,
    NegotiationError,
    NoUsableDriver,
)
from kvtransport.spi.memory import KVLayout, MemoryKind

from .hellos import FIRST_PARTY, hello, host, sliced_layout


def decide(a: Hello, b: Hello):  # type: ignore[no-untyped-def]
    return negotiate(a, b, FIRST_PARTY)


# --- the decision table ---------------------------------------------------------------------


def test_same_host_gpus_pick_cuda_local() -> None:
    h = host("box", gpus=2)
    d = decide(hello(h, "cuda:0", endpoint="prefill"), hello(h, "cuda:1", endpoint="decode"))
    assert d.driver == "cuda-local"
    assert d.path is TransferPath.PCIE
    reasons = {c.driver: c for c in d.candidates}
    assert reasons["nixl-ucx"].outcome == "lost"
    assert reasons["mooncake-gdr"].outcome == "rejected"  # no GDR on this box


def test_same_gpu_is_a_device_local_copy() -> None:
    h = host("box", gpus=1)
    d = decide(hello(h, "cuda:0", endpoint="a"), hello(h, "cuda:0", endpoint="b"))
    assert (d.driver, d.path) == ("cuda-local", TransferPath.MEMCPY)


def test_gdr_on_both_sides_picks_mooncake_gdr_over_rdma() -> None:
    a, b = host("a", gpus=8, gdr=True, rdma=True), host("b", gpus=8, gdr=True, rdma=True)
    d = decide(hello(a, "cuda:3"), hello(b, "cuda:5"))
    assert (d.driver, d.path) == ("mooncake-gdr", TransferPath.RDMA)
    assert {c.driver: c.outcome for c in d.candidates}["cuda-local"] == "rejected"


@pytest.mark.parametrize("rdma", [True, False])
def test_device_kv_without_gdr_on_one_side_is_staged(rdma: bool) -> None:
    a, b = host("a", gpus=1, gdr=True, rdma=rdma), host("b", gpus=1, gdr=False, rdma=rdma)
    d = decide(hello(a, "cuda:0"), hello(b, "cuda:0"))
    # Over RDMA both staged drivers estimate the same and the preference list picks Mooncake;
    # over TCP UCX's estimate is higher (as measured on loopback), so the NIXL ring wins.
    assert (d.driver, d.path) == ("mooncake-staged" if rdma else "nixl-staged", TransferPath.PCIE_STAGED)
    gdr = next(c for c in d.candidates if c.driver == "mooncake-gdr")
    assert gdr.outcome == "rejected" and "GPUDirect" in gdr.reason
    ucx = next(c for c in d.candidates if c.driver == "nixl-ucx")
    assert ucx.outcome == "lost" and ucx.gbps < d.gbps  # UCX bouncing device memory itself ranks lower


def test_device_kv_without_gdr_and_without_nixl_uses_mooncake_staged() -> None:
    a, b = host("a", gpus=1, gdr=True), host("b", gpus=1, gdr=False)
    d = decide(hello(a, "cuda:0", nixl=False), hello(b, "cuda:0", nixl=False))
    assert (d.driver, d.path) == ("mooncake-staged", TransferPath.PCIE_STAGED)


def test_device_kv_without_mooncake_or_gdr_goes_through_nixl_and_says_why() -> None:
    a, b = host("a", gpus=1, rdma=True), host("b", gpus=1, rdma=True)
    d = decide(hello(a, "cuda:0", mooncake=False), hello(b, "cuda:0", mooncake=False))
    assert (d.driver, d.path) == ("nixl-staged", TransferPath.PCIE_STAGED)
    ucx = next(c for c in d.candidates if c.driver == "nixl-ucx")
    assert ucx.outcome == "lost" and ucx.gbps < d.gbps
    staged = next(c for c in d.candidates if c.driver == "mooncake-staged")
    assert "not installed" in staged.reason or "pip install" in staged.reason
    # Without the staged NIXL driver, UCX moves the device memory itself.
    d = decide(
        hello(a, "cuda:0", mooncake=False, policy=Policy(exclude=("nixl-staged",))),
        hello(b, "cuda:0", mooncake=False),
    )
    assert d.driver == "nixl-ucx" and "bounced through host" in d.reason


def test_cpu_only_peers_on_two_hosts_use_a_host_memory_driver() -> None:
    d = decide(hello(host("a")), hello(host("b")))
    assert (d.driver, d.path) == ("nixl-ucx", TransferPath.TCP)
    outcomes = {c.driver: c.outcome for c in d.candidates}
    assert outcomes["mooncake-gdr"] == "lost" and outcomes["mooncake-staged"] == "lost"


def test_staging_host_kv_ranks_below_writing_it_directly() -> None:
    d = decide(hello(host("a"), policy=Policy(exclude=("nixl-ucx", "nixl-staged"))), hello(host("b")))
    assert d.driver == "mooncake-gdr"
    staged = next(c for c in d.candidates if c.driver == "mooncake-staged")
    assert staged.outcome == "lost" and staged.gbps < d.gbps
    forced = decide(hello(host("a"), policy=Policy(force="mooncake-staged")), hello(host("b")))
    assert forced.driver == "mooncake-staged" and "staging rings" in forced.reason


def test_cpu_only_peers_on_one_host_use_shared_memory() -> None:
    h = host("box")
    d = decide(hello(h, endpoint="p"), hello(h, endpoint="d"))
    assert (d.driver, d.path) == ("nixl-ucx", TransferPath.SHM)


def test_pages_sliced_by_head_go_to_a_driver_that_gathers_them() -> None:
    """Prefill TP 2 -> decode TP 1 (MHA): each page is 16 short runs, so a staged driver ranks
    above the direct ones whatever their nominal bandwidth, and the decision says why; a
    forced direct driver is still used, and an MLA pair (whole latent pages) is not sliced."""
    h = host("box")
    d = decide(
        hello(h, endpoint="p", layout=sliced_layout(tp_size=2)), hello(h, endpoint="d", layout=sliced_layout(tp_size=1))
    )
    assert d.driver in ("mooncake-staged", "nixl-staged") and "sliced by KV head (TP 1 and 2)" in d.reason, d.reason
    lost = {c.driver: c.reason for c in d.candidates if c.outcome == "lost"}
    assert "gathers them" in lost["nixl-ucx"] and "gathers them" in lost["mooncake-gdr"], lost
    forced = decide(
        hello(h, endpoint="p", layout=sliced_layout(tp_size=2), policy=Policy(force="nixl-ucx")),
        hello(h, endpoint="d", layout=sliced_layout(tp_size=1)),
    )
    assert forced.driver == "nixl-ucx"
    whole = decide(hello(h, endpoint="p"), hello(h, endpoint="d"))
    assert whole.driver == "nixl-ucx" and "sliced" not in whole.reason
    # 8 heads over TP 8 and TP 16: one head a rank on both sides, whole pages, not sliced.
    replicated = decide(
        hello(h, endpoint="p", layout=sliced_layout(tp_size=8)),
        hello(h, endpoint="d", layout=sliced_layout(tp_size=16)),
    )
    assert replicated.driver == "nixl-ucx" and "sliced" not in replicated.reason, replicated.reason


def test_pages_regrouped_across_engines_go_to_a_driver_that_gathers_them() -> None:
    """An SGLang prefill and a vLLM decode: every head's K and V of every token is a run of its
    own (measured: nixl-ucx 0.04x of its whole-page bandwidth, nixl-staged 0.32x, docs/vllm.md),
    so a staged driver ranks first, and the decision says why."""
    h = host("box")
    sglang = dataclasses.replace(
        sliced_layout(tp_size=1), num_kv_heads=8, extra={"engine": "sglang", "role": "prefill"}
    )
    vllm = dataclasses.replace(
        sliced_layout(tp_size=1),
        kv_item_lens=(2 * 16 * 8 * 128 * 2,) * 32,
        num_kv_heads=8,
        head_dim=256,
        extra={"engine": "vllm", "block_size": 16, "token_layout": "NHD", "packing": "layer"},
    )
    d = decide(hello(h, endpoint="d", layout=vllm), hello(h, endpoint="p", layout=sglang))
    assert d.driver in ("mooncake-staged", "nixl-staged"), d.reason
    assert "regrouped per head between vllm and sglang pools" in d.reason, d.reason
    lost = {c.driver: c.reason for c in d.candidates if c.outcome == "lost"}
    assert "gathers them" in lost["nixl-ucx"], lost


def test_sliced_pages_between_gpus_of_one_host_still_use_the_fastest_device_path() -> None:
    """The per-row cost that favours gathering is measured over TCP and shared memory; device
    paths (CUDA IPC here) keep their bandwidth ranking."""
    h = host("box", gpus=2, gdr=True, rdma=True)
    d = decide(
        hello(h, "cuda:0", endpoint="p", layout=sliced_layout("cuda:0", tp_size=2)),
        hello(h, "cuda:1", endpoint="d", layout=sliced_layout("cuda:1", tp_size=1)),
    )
    assert d.driver == "cuda-local", d.reason


def test_ucx_tls_restricted_to_tcp_is_reported_as_tcp() -> None:
    h = host("box")
    d = decide(hello(h, endpoint="p", ucx_tls="tcp,self"), hello(h, endpoint="d"))
    assert (d.driver, d.path) == ("nixl-ucx", TransferPath.TCP)


def test_forced_driver_that_cannot_serve_raises_with_its_reason() -> None:
    h = host("box")
    with pytest.raises(DriverUnavailable, match=r"KVTRANSPORT_DRIVER=cuda-local.*no CUDA device"):
        decide(hello(h, policy=Policy(force="cuda-local")), hello(h))


def test_forced_driver_wins_over_a_faster_one() -> None:
    h = host("box")
    d = decide(hello(h, policy=Policy(force="mooncake-gdr")), hello(h))
    assert d.driver == "mooncake-gdr" and "forced" in d.reason


def test_policies_of_both_sides_apply() -> None:
    h = host("box")
    d = decide(hello(h), hello(h, policy=Policy(exclude=("nixl-ucx", "nixl-staged"))))
    assert d.driver == "mooncake-gdr"
    nixl = next(c for c in d.candidates if c.driver == "nixl-ucx")
    assert "excluded by KVTRANSPORT_EXCLUDE on acceptor" in nixl.reason


def test_preference_order_beats_bandwidth() -> None:
    h = host("box")
    d = decide(hello(h, policy=Policy(allow=("mooncake-gdr", "nixl-ucx"))), hello(h))
    assert d.driver == "mooncake-gdr"


def test_conflicting_forced_drivers_fail() -> None:
    h = host("box")
    with pytest.raises(ConfigError, match="differs between the peers"):
        decide(hello(h, policy=Policy(force="nixl-ucx")), hello(h, policy=Policy(force="mooncake-gdr")))


def test_everything_excluded_lists_each_reason() -> None:
    h = host("box")
    policy = Policy(exclude=tuple(FIRST_PARTY))
    with pytest.raises(NoUsableDriver) as info:
        decide(hello(h, policy=policy), hello(h))
    for name in FIRST_PARTY:
        assert f"{name}: excluded by KVTRANSPORT_EXCLUDE" in str(info.value)


def test_layout_mismatch_names_both_layouts() -> None:
    h = host("box")
    other = KVLayout(page_size=64, dtype="bfloat16", num_layers=61, kv_item_lens=(73728,) * 61, kv_split="mla")
    with pytest.raises(LayoutMismatch) as info:
        decide(hello(h), hello(h, layout=other))
    text = str(info.value)
    assert "page_size: 16 on initiator ep@box, 64 on acceptor ep@box" in text and "'kv_split': 'mla'" in text


def test_mooncake_protocol_mismatch_is_rejected_with_the_fix() -> None:
    a, b = host("a", rdma=True), host("b")
    d = decide(hello(a, mooncake=True), hello(b))
    gdr = next(c for c in d.candidates if c.driver == "mooncake-gdr")
    assert gdr.outcome == "rejected" and "KVTRANSPORT_MOONCAKE_PROTOCOL=tcp" in gdr.reason


# --- properties -----------------------------------------------------------------------------

NAMES = sorted(FIRST_PARTY)


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    kind = draw(st.sampled_from(["none", "force", "allow", "exclude"]))
    failover = draw(st.sampled_from(FAILOVER_SETTINGS))
    if kind == "force":
        return Policy(force=draw(st.sampled_from(NAMES)), failover=failover)
    if kind == "allow":
        return Policy(allow=tuple(draw(st.permutations(NAMES))[: draw(st.integers(1, len(NAMES)))]), failover=failover)
    if kind == "exclude":
        return Policy(exclude=tuple(draw(st.lists(st.sampled_from(NAMES), unique=True))), failover=failover)
    return Policy(failover=failover)


@st.composite
def pairs(draw: st.DrawFn) -> tuple[Hello, Hello]:
    def one(host_id: str, endpoint: str) -> Hello:
        tp = tps.pop()
        gpus = draw(st.integers(0, 2))
        h = host(host_id, gpus=gpus, gdr=draw(st.booleans()), rdma=draw(st.booleans()))
        memory = "host" if not gpus or draw(st.booleans()) else f"cuda:{draw(st.integers(0, gpus - 1))}"
        return hello(
            h,
            memory,
            endpoint=endpoint,
            policy=draw(policies()),
            mooncake=draw(st.booleans()),
            nixl=draw(st.booleans()),
            ucx_tls=draw(st.sampled_from(["", "tcp,self", "shm,self", "^tcp", "rc,cuda_copy"])),
            layout=sliced_layout(memory, tp) if tp else None,
        )

    # Whole pages (TP unstated), or an MHA model on TP sizes that may differ (sliced pages).
    tps = [0, 0] if draw(st.booleans()) else [draw(st.sampled_from([1, 2, 4])) for _ in range(2)]
    same_host = draw(st.booleans())
    return one("h1", "initiator"), one("h1" if same_host else "h2", "acceptor")


def _outcome(a: Hello, b: Hello) -> object:
    try:
        return decide(a, b)
    except NegotiationError as exc:
        return (type(exc), str(exc))
    except (ConfigError, DriverUnavailable) as exc:
        return (type(exc), str(exc))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(pairs())
def test_decision_is_deterministic_and_both_sides_agree(pair: tuple[Hello, Hello]) -> None:
    a, b = pair
    first = _outcome(a, b)
    assert _outcome(a, b) == first
    # The acceptor sees both hellos only after a JSON round trip, and must compute the same.
    a2 = Hello.from_dict(json.loads(json.dumps(a.to_dict())))
    b2 = Hello.from_dict(json.loads(json.dumps(b.to_dict())))
    assert _outcome(a2, b2) == first


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(pairs())
def test_chosen_driver_is_offered_by_both_and_respects_both_policies(pair: tuple[Hello, Hello]) -> None:
    a, b = pair
    try:
        d = decide(a, b)
    except (NegotiationError, ConfigError, DriverUnavailable):
        # Nothing chosen: then no driver may be usable under both policies with an offer.
        return
    for side in (a, b):
        entry = side.drivers[d.driver]
        assert entry.status is not None and entry.status.available
        assert entry.status.serves(side.layout.memory if side.layout else MemoryKind())
        allowed, why = side.policy.permits(d.driver)
        assert allowed, why
        if side.policy.force:
            assert d.driver == side.policy.force
    chosen = [c for c in d.candidates if c.outcome == "chosen"]
    assert [c.driver for c in chosen] == [d.driver]
    assert {c.driver for c in d.candidates} == set(FIRST_PARTY)
    # No driver that lost offers more bandwidth unless a preference list or force put it lower,
    # or the pages are sliced by head and it does not gather them while the chosen one does.
    gathers = {n: bool(c and c.gathers) for n, c in ((n, e.capabilities) for n, e in a.drivers.items())}
    if not any(s.policy.allow or s.policy.force for s in (a, b)):
        sliced = bool(sliced_pages(a, b))
        for c in d.candidates:
            per_row = not gathers[c.driver] and c.path in ("tcp", "shm")
            if c.outcome == "lost" and not (sliced and per_row):
                assert c.gbps <= d.gbps, (c, d.reason)


@settings(max_examples=200)
@given(pairs())
def test_failure_explains_every_driver(pair: tuple[Hello, Hello]) -> None:
    a, b = pair
    try:
        decide(a, b)
    except NoUsableDriver as exc:
        for name in FIRST_PARTY:
            assert f"{name}: " in str(exc)
    except (NegotiationError, ConfigError, DriverUnavailable):
        pass


@given(
    heads=st.tuples(st.integers(0, 16), st.integers(0, 16)),
    dims=st.tuples(st.sampled_from([0, 64, 128]), st.sampled_from([0, 64, 128])),
    pages=st.tuples(st.sampled_from([1, 16, 64]), st.sampled_from([1, 16, 64])),
)
def test_layouts_differ_exactly_where_a_stated_field_differs(
    heads: tuple[int, int], dims: tuple[int, int], pages: tuple[int, int]
) -> None:
    """Heads and head size of 0 are "not stated" (SGLang's decode side never sets
    ``kv_head_num``) and match anything; any other difference is reported by name."""
    a, b = (
        KVLayout(page_size=p, dtype="bfloat16", num_layers=2, kv_item_lens=(4096,), num_kv_heads=h, head_dim=d)
        for p, h, d in zip(pages, heads, dims, strict=True)
    )
    problems = a.incompatibilities(b)
    named = {p.split(":")[0] for p in problems}
    expected = set()
    if heads[0] != heads[1] and 0 not in heads:
        expected.add("num_kv_heads")
    if dims[0] != dims[1] and 0 not in dims:
        expected.add("head_dim")
    if pages[0] != pages[1]:
        expected.add("page_size")
    assert named == expected, problems


# --- learning across hosts ---------------------------------------------------------------------


def test_uncalibrated_peers_on_two_hosts_keep_the_best_ranked_drivers_as_lanes_to_learn_from() -> None:
    d = decide(hello(host("a")), hello(host("b")))
    ranked = [c.driver for c in d.candidates if c.outcome in ("chosen", "lost")]
    assert d.lanes == tuple(ranked[:LEARNING_LANES]) and d.lanes[0] == d.driver and len(d.lanes) > 1
    offered = {c.driver: c.gbps for c in d.candidates}
    for name in d.lanes:
        (model,) = d.models_of(name)
        assert model.version == NOMINAL and model.gbps == offered[name] and model.peer_host == "b"
    assert "learning on this connection" in d.basis_note
    # On one host (loopback figures describe it) and under a user's policy: the chosen driver alone.
    assert decide(hello(host("a")), hello(host("a"))).lanes == (decide(hello(host("a")), hello(host("a"))).driver,)
    bound = decide(hello(host("a"), policy=Policy(allow=("nixl-ucx", "mooncake-gdr"))), hello(host("b")))
    # (a user's list of drivers does not learn; across hosts it keeps a standby to fail over to)
    assert bound.lanes == (bound.driver, *bound.standby) and bound.standby == ("mooncake-gdr",)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(pairs())
def test_lanes_are_the_chosen_driver_first_then_ranked_and_only_across_hosts_learn(pair: tuple[Hello, Hello]) -> None:
    a, b = pair
    try:
        d = decide(a, b)
    except (NegotiationError, ConfigError, DriverUnavailable):
        return
    ranked = [c.driver for c in d.candidates if c.outcome in ("chosen", "lost")]
    assert d.lanes[0] == d.driver and len(set(d.lanes)) == len(d.lanes) and set(d.lanes) <= set(ranked)
    nominal = [n for n in d.lanes if any(m.version == NOMINAL for m in d.models_of(n))]
    policy_bound = any(s.policy.allow or s.policy.force for s in (a, b))
    if a.host.host_id == b.host.host_id or policy_bound:
        assert nominal == [], "only a connection between two hosts learns"
    elif d.basis == "nominal" and len(ranked) > 1 and not any(c.predicted_s for c in d.candidates):
        assert d.lanes == tuple(ranked[:LEARNING_LANES])
    if len(d.lanes) == 1:
        assert d.lanes == (d.driver,)
    # A standby: the last lane, never the chosen driver, only where a single lane would carry
    # the connection, neither side forces a driver nor turned failover off, and the hosts differ
    # unless a side asked for it everywhere; another engine's driver when one is usable.
    settings = {a.policy.failover, b.policy.failover}
    across = a.host.host_id != b.host.host_id
    may = "off" not in settings and (across or "on" in settings) and not (a.policy.force or b.policy.force)

    # One-sided when the chosen driver is: a two-sided lane would put every transfer of the
    # connection in ordered mode.
    def two_sided(name: str) -> bool:
        return any(
            (caps := h.drivers[name].capabilities) is not None and caps.two_sided for h in (a, b) if name in h.drivers
        )

    eligible = [n for n in ranked if n != d.driver and (two_sided(d.driver) or not two_sided(n))]
    if d.standby:
        (standby,) = d.standby
        assert may and d.lanes[-1] == standby != d.driver and len(d.lanes) == 2, d
        assert standby in eligible, (standby, eligible)
        engine = d.driver.split("-")[0]
        if standby.split("-")[0] == engine:
            assert all(n.split("-")[0] == engine for n in eligible), (eligible, standby)
    elif may and len(d.lanes) == 1:
        assert not eligible, f"no standby among {eligible}"
