"""Negotiation: from the two hellos, pick the driver for a pair of peers and say why.

:func:`negotiate` is a pure, deterministic function of (initiator hello, acceptor hello, the
driver classes known here). Both policies travel inside the hellos, so the initiator and the
acceptor compute the same :class:`Decision`; the acceptor recomputes and compares, and a
difference is a handshake error, never a silent pick.

Ranking among the drivers both sides can use: the users' ``KVTRANSPORT_DRIVERS`` preference
order first (initiator's list, then acceptor's); then, for pages sliced by KV head (the two
sides run different TP sizes, MHA), the drivers that gather runs into large chunks
(``Capabilities.gathers``) over direct drivers on TCP or shared memory: each page is 16 short
runs, which a direct driver pays per descriptor (0.18x of its own equal-TP bandwidth for
nixl-ucx, 0.06x for mooncake-gdr, against 0.57-0.86x for the staged drivers,
docs/performance.md); then the highest estimated bandwidth,
then the fixed :data:`BUILTIN_PREFERENCE` list, then the name.

When every candidate has a measured cost model for its path between these two hosts (``kvtransport
calibrate``; the hellos carry them), the sliced-pages rule and the nominal bandwidths give way to
the lowest predicted time of a reference request (:func:`reference_transfer`), each driver's
prediction the slower of the two sides' models. Otherwise the decision says it rests on nominal
figures, and which drivers lack a model.

Between two hosts with no measured model for the pair, nominal figures (or models measured on
loopback) do not describe the link, so the connection learns: it keeps the
:data:`LEARNING_LANES` best-ranked drivers as lanes, each with a nominal model from its offer
(:func:`nominal_model`), and its lanes learn their real cost from the connection's transfers
(:mod:`kvtransport.runtime.lane`), which then go to the lane that measures fastest.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtransport.negotiation.cost_model import NOMINAL, CostModel, slowest_prediction
from kvtransport.negotiation.hello import Hello, layout_to_dict
from kvtransport.negotiation.registry import ENV_DRIVER
from kvtransport.spi.driver import KVTransport, Offer, PeerView, Rejection, TransferPath
from kvtransport.spi.errors import ConfigError, DriverUnavailable, KVTransportError, LayoutMismatch, NoUsableDriver
from kvtransport.spi.memory import HOST, MemoryKind
from kvtransport.spi.page_geometry import different_engines, engine_of, geometry_of
from kvtransport.spi.tp_map import held_heads, pair_shape, total_heads_of

log = logging.getLogger(__name__)

#: The connection-level choice predicts for a request of this many tokens, its pages scattered
#: (one descriptor per page and KV region; per token and region when pages move sliced).
REFERENCE_TOKENS = 4096
#: The longest driver name that can be a lane besides the chosen driver (wire.py's ``lane``).
MAX_LANE_NAME = 64

#: Lanes an uncalibrated connection between two hosts keeps, to learn which is fastest there.
LEARNING_LANES = 3
#: A nominal model's fixed costs: a batch's latency and a descriptor's cost (the offers give
#: a bandwidth only; these are typical of TCP engines here, docs/performance.md).
NOMINAL_LATENCY_S = 0.5e-3
NOMINAL_PER_RUN_S = 1e-6

#: Tie-break order when two drivers offer the same bandwidth; unknown names come after.
BUILTIN_PREFERENCE = ("cuda-local", "mooncake-gdr", "nixl-ucx", "mooncake-staged", "nixl-staged")


@dataclass(frozen=True)
class Candidate:
    """One driver's fate in a decision."""

    driver: str
    outcome: str  # "chosen", "lost" or "rejected"
    reason: str
    path: str = ""
    gbps: float = 0.0
    #: Predicted seconds for the reference request (0: no measured model for this pair).
    predicted_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "driver": self.driver,
            "outcome": self.outcome,
            "reason": self.reason,
            "path": self.path,
            "gbps": self.gbps,
            "predicted_s": self.predicted_s,
        }


@dataclass(frozen=True)
class Decision:
    """The chosen driver, its path and estimated bandwidth, and every other driver's reason."""

    driver: str
    path: TransferPath
    gbps: float
    reason: str
    candidates: tuple[Candidate, ...]
    initiator: str = ""
    acceptor: str = ""
    #: ``"calibrated"``: ranked by measured cost models; ``"nominal"``: by the drivers' estimates.
    basis: str = "nominal"
    #: Why the basis is what it is ("nixl-ucx has no cost model for shm ...").
    basis_note: str = ""
    #: The drivers a transfer of this connection may take, ``driver`` first: with measured
    #: models and no env-var policy, every driver that is the fastest for some transfer shape
    #: (:func:`lane_drivers`); otherwise ``driver`` alone.
    lanes: tuple[str, ...] = ()
    #: Per lane, both sides' models of it on its path (a transfer's prediction is the slower).
    lane_models: tuple[tuple[CostModel, ...], ...] = ()
    #: The lanes kept only to fail over to (:func:`standby_lane`): no transfer is sent on one
    #: while another lane works.
    standby: tuple[str, ...] = ()

    @property
    def learning(self) -> bool:
        """Whether the connection learns its lanes' costs from its transfers (an uncalibrated
        pair of hosts: :func:`learning_lanes`)."""
        return any(m.version == NOMINAL for models in self.lane_models for m in models)

    def models_of(self, driver: str) -> tuple[CostModel, ...]:
        for name, models in zip(self.lanes, self.lane_models, strict=False):
            if name == driver:
                return models
        return ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "driver": self.driver,
            "path": self.path.value,
            "gbps": self.gbps,
            "reason": self.reason,
            "basis": self.basis,
            "basis_note": self.basis_note,
            "lanes": list(self.lanes),
            "standby": list(self.standby),
            "initiator": self.initiator,
            "acceptor": self.acceptor,
            "candidates": [c.to_dict() for c in self.candidates],
        }

    def summary(self) -> str:
        others = "; ".join(f"{c.driver}: {c.reason}" for c in self.candidates if c.outcome != "chosen")
        return f"chose {self.driver} ({self.path.value}, ~{self.gbps:g} GB/s): {self.reason}" + (
            f" | others: {others}" if others else ""
        )


def _kv_memory(hello: Hello) -> MemoryKind:
    return hello.layout.memory if hello.layout else HOST


def _preference_index(name: str) -> int:
    return BUILTIN_PREFERENCE.index(name) if name in BUILTIN_PREFERENCE else len(BUILTIN_PREFERENCE)


def _side(role: str, hello: Hello) -> str:
    return f"{role} {hello.label()}"


def check_layouts(initiator: Hello, acceptor: Hello) -> None:
    """Raise :class:`LayoutMismatch`, with both layouts, when pages cannot move between them."""
    if initiator.layout is None or acceptor.layout is None:
        return
    problems = initiator.layout.incompatibilities(
        acceptor.layout, f"on {_side('initiator', initiator)}", f"on {_side('acceptor', acceptor)}"
    )
    if problems:
        raise LayoutMismatch(
            "KV layouts cannot be bridged: "
            + "; ".join(problems)
            + f". {_side('initiator', initiator)} layout: {layout_to_dict(initiator.layout)}; "
            + f"{_side('acceptor', acceptor)} layout: {layout_to_dict(acceptor.layout)}"
        )


#: Paths on which a direct driver pays per descriptor enough for sliced pages to favour a
#: gathering one (measured over TCP and shared memory between processes, docs/performance.md).
#: Device paths (NVLink, PCIe peer copies, RDMA) are left to the bandwidth estimates.
PER_DESCRIPTOR_PATHS = frozenset({TransferPath.TCP, TransferPath.SHM})


def sliced_pages(initiator: Hello, acceptor: Hello) -> str:
    """Why the pair's pages move as slices of KV heads ('' when they move whole): the two
    layouts shard an MHA model's heads over different TP sizes, to different head counts a rank
    (heads replicated to as many on each side move as whole pages), or are two engines' pools,
    whose pages are regrouped a head's K or V at a time."""
    a, b = initiator.layout, acceptor.layout
    if a is not None and b is not None and different_engines(a, b) and a.kv_split == "kv":
        # Another engine's pool: a run per head's K or V of every token (spi.page_geometry).
        return f"pages regrouped per head between {engine_of(a)} and {engine_of(b)} pools"
    if a is None or b is None or a.tp_size == b.tp_size or a.kv_split == "mla":
        return ""
    total = total_heads_of(a, b)
    if 0 < total <= 1 << 16 and 0 < a.tp_size <= 1 << 16 and 0 < b.tp_size <= 1 << 16:
        if len(held_heads(total, a.tp_size, 0)) == len(held_heads(total, b.tp_size, 0)):
            return ""
    small, large = sorted((a.tp_size, b.tp_size))
    return f"pages sliced by KV head (TP {small} and {large})"


def _gathers(hello: Hello, name: str) -> bool:
    entry = hello.drivers.get(name)
    return bool(entry is not None and entry.capabilities is not None and entry.capabilities.gathers)


def _pays_per_row(initiator: Hello, acceptor: Hello, name: str, offer: Offer) -> bool:
    """Whether ``name`` would move sliced pages one descriptor per row where a gathering
    driver packs them (both hellos carry the capabilities: each side ranks by the same facts)."""
    gathers = _gathers(initiator, name) and _gathers(acceptor, name)
    return not gathers and offer.path in PER_DESCRIPTOR_PATHS


def _screen(
    name: str,
    initiator: Hello,
    acceptor: Hello,
    classes: Mapping[str, type[KVTransport]],
) -> Offer | Rejection:
    """Everything the core checks before asking a driver's own ``offer``."""
    for role, hello in (("initiator", initiator), ("acceptor", acceptor)):
        allowed, why = hello.policy.permits(name)
        if not allowed:
            return Rejection(f"{why} on {_side(role, hello)}")
    for role, hello in (("initiator", initiator), ("acceptor", acceptor)):
        entry = hello.drivers.get(name)
        if entry is None:
            return Rejection(f"not installed on {_side(role, hello)}")
        if entry.status is None:
            return Rejection(f"failed to load on {_side(role, hello)}: {entry.load_error}")
        why_not = entry.status.why_not(_kv_memory(hello))
        if why_not:
            return Rejection(f"unusable on {_side(role, hello)}: {why_not}")
    cls = classes.get(name)
    if cls is None:
        return Rejection("driver class not loaded on the side computing the decision")
    caps = initiator.drivers[name].capabilities
    if caps and caps.same_host_only and initiator.host.host_id != acceptor.host.host_id:
        return Rejection(
            f"needs both peers on one host; {initiator.label()} is on host "
            f"{initiator.host.hostname or initiator.host.host_id} and {acceptor.label()} on "
            f"{acceptor.host.hostname or acceptor.host.host_id}"
        )
    local = PeerView(initiator.host, initiator.drivers[name].status, _kv_memory(initiator))
    remote = PeerView(acceptor.host, acceptor.drivers[name].status, _kv_memory(acceptor))
    try:
        result = cls.offer(local, remote)
    except Exception as exc:  # noqa: BLE001 - a buggy offer() rejects, it does not crash
        return Rejection(f"offer() raised {type(exc).__name__}: {exc} (driver bug)")
    if not isinstance(result, (Offer, Rejection)):
        return Rejection(f"offer() returned {result!r}, not an Offer or Rejection (driver bug)")
    return result


def negotiate(
    initiator: Hello,
    acceptor: Hello,
    classes: Mapping[str, type[KVTransport]],
) -> Decision:
    """Pick the driver for this pair. Raises a :class:`NegotiationError` when none can serve,
    and :class:`DriverUnavailable` when a forced driver cannot (with its reason)."""
    check_layouts(initiator, acceptor)
    forced = {h.policy.force for h in (initiator, acceptor) if h.policy.force}
    if len(forced) > 1:
        raise ConfigError(
            f"{ENV_DRIVER} differs between the peers: {initiator.policy.force} on "
            f"{initiator.label()}, {acceptor.policy.force} on {acceptor.label()}"
        )
    names = sorted(set(initiator.drivers) | set(acceptor.drivers) | set(classes))
    offers: dict[str, Offer] = {}
    rejected: dict[str, str] = {}
    for name in names:
        result = _screen(name, initiator, acceptor, classes)
        if isinstance(result, Offer):
            offers[name] = result
        else:
            rejected[name] = result.reason

    if forced:
        (force,) = forced
        if force not in offers:
            reason = rejected.get(force, "not installed on either side")
            raise DriverUnavailable(
                f"{ENV_DRIVER}={force} cannot be used between {initiator.label()} and {acceptor.label()}: {reason}"
            )

    sliced = sliced_pages(initiator, acceptor)
    runs, nbytes = reference_transfer(initiator, acceptor)
    models = {name: pair_models(initiator, acceptor, name, offer.path) for name, offer in offers.items()}
    predicted = {name: slowest_prediction(ms, runs, nbytes) for name, ms in models.items() if ms}
    uncalibrated = sorted(n for n in offers if n not in predicted)
    calibrated = bool(offers) and not uncalibrated

    def key(name: str) -> tuple[int, int, int, float, int, str]:
        if calibrated:
            rule, figure = 0, predicted[name]
        else:
            rule = 1 if sliced and _pays_per_row(initiator, acceptor, name, offers[name]) else 0
            figure = -offers[name].gbps
        return (initiator.policy.rank(name), acceptor.policy.rank(name), rule, figure, _preference_index(name), name)

    ranked = sorted(offers, key=key)
    if not ranked:
        detail = "; ".join(f"{n}: {r}" for n, r in sorted(rejected.items())) or "no driver installed"
        raise NoUsableDriver(f"no driver can move KV between {initiator.label()} and {acceptor.label()}: {detail}")
    best = ranked[0]
    chosen = offers[best]
    if calibrated:
        basis_note = f"measured cost models, predicting a {REFERENCE_TOKENS}-token request ({runs} descriptors)"
        why = _why_chosen_calibrated(best, chosen, ranked, predicted, models[best], initiator, acceptor)
    else:
        basis_note = (
            "nominal estimates: no driver has a measured cost model between these hosts (kvtransport calibrate)"
            if not predicted
            else f"nominal estimates: {', '.join(uncalibrated)} not calibrated between these hosts "
            "(kvtransport calibrate)"
        )
        why = _why_chosen(best, chosen, ranked, offers, initiator, acceptor, sliced) + f"; {basis_note}"
    candidates = [Candidate(best, "chosen", why, chosen.path.value, chosen.gbps, predicted.get(best, 0.0))]
    for name in ranked[1:]:
        offer = offers[name]
        if calibrated:
            lost = (
                f"offers {offer.path.value}, predicted {predicted[name] * 1e3:.3g} ms against "
                f"{predicted[best] * 1e3:.3g} ms for {best}"
            )
        else:
            lost = f"offers {offer.path.value} at ~{offer.gbps:g} GB/s; {best} ranks higher" + (
                f" ({sliced}: {best} gathers them)" if sliced and key(name)[2] > key(best)[2] else ""
            )
        candidates.append(Candidate(name, "lost", lost, offer.path.value, offer.gbps, predicted.get(name, 0.0)))
    candidates += [Candidate(n, "rejected", r) for n, r in sorted(rejected.items())]
    policy_bound = any(h.policy.force or h.policy.allow for h in (initiator, acceptor))
    across = initiator.host.host_id != acceptor.host.host_id
    lane_models: dict[str, tuple[CostModel, ...]] = {n: tuple(ms) for n, ms in models.items()}
    if calibrated and not policy_bound:
        lanes = lane_drivers(ranked, models, initiator)
    elif across and not policy_bound and len(ranked) > 1 and not predicted:
        # Nothing measured between these hosts (a partly calibrated pair ranks as before).
        lanes = learning_lanes(ranked)
        lane_models = {n: (nominal_model(offers[n], acceptor.host.host_id),) for n in lanes}
        basis_note += f"; learning on this connection which of {', '.join(lanes)} is fastest across the link"
    else:
        lanes = (best,)
    standby = standby_lane(ranked, lanes, initiator, acceptor, across)
    if standby:
        lanes += (standby,)
        lane_models[standby] = tuple(models.get(standby, ()))
        basis_note += f"; {standby} on standby to fail over to"
    return Decision(
        driver=best,
        path=chosen.path,
        gbps=chosen.gbps,
        reason=candidates[0].reason,
        candidates=tuple(candidates),
        initiator=initiator.label(),
        acceptor=acceptor.label(),
        basis="calibrated" if calibrated else "nominal",
        basis_note=basis_note,
        lanes=lanes,
        lane_models=tuple(lane_models.get(n, ()) for n in lanes),
        standby=(standby,) if standby else (),
    )


def standby_lane(ranked: list[str], lanes: tuple[str, ...], initiator: Hello, acceptor: Hello, across: bool) -> str:
    """The driver a connection with a single lane keeps connected to fail over to ("": none):
    the best-ranked other driver, of another engine where there is one (a failure of the
    engine, or of the rail it was bound to, may well take its sibling down too), and one-sided
    when the chosen driver is (a two-sided lane makes the whole connection send its messages
    in order with its notices: a cost to every transfer for a lane that carries none). Only
    where neither side forces a driver nor turned failover off, and between two hosts unless a
    side asks for it everywhere (``KVTRANSPORT_FAILOVER``)."""
    settings = (initiator.policy.failover, acceptor.policy.failover)
    if len(lanes) != 1 or "off" in settings or not (across or "on" in settings):
        return ""
    if initiator.policy.force or acceptor.policy.force:
        return ""

    def two_sided(name: str) -> bool:
        return any(
            (caps := hello.drivers[name].capabilities) is not None and caps.two_sided
            for hello in (initiator, acceptor)
            if name in hello.drivers
        )

    chosen_two_sided = two_sided(lanes[0])
    others = [
        n for n in ranked if n not in lanes and len(n) <= MAX_LANE_NAME and (chosen_two_sided or not two_sided(n))
    ]
    engine = lanes[0].split("-")[0]
    return next((n for n in others if n.split("-")[0] != engine), others[0] if others else "")


def learning_lanes(ranked: list[str]) -> tuple[str, ...]:
    """The lanes of an uncalibrated connection between two hosts: the chosen driver and the
    next best-ranked ones, up to :data:`LEARNING_LANES` (names the wire can carry)."""
    eligible = [n for n in ranked[1:] if len(n) <= MAX_LANE_NAME]
    return (ranked[0], *eligible[: LEARNING_LANES - 1])


def nominal_model(offer: Offer, peer_host: str) -> CostModel:
    """A model from an offer's estimated bandwidth, for a lane to learn from (never saved)."""
    return CostModel(
        path=offer.path.value,
        latency_s=NOMINAL_LATENCY_S,
        per_run_s=NOMINAL_PER_RUN_S,
        gbps=max(offer.gbps, 1e-3),
        peer_host=peer_host,
        version=NOMINAL,
    )


def lane_drivers(ranked: list[str], models: Mapping[str, list[CostModel]], initiator: Hello) -> tuple[str, ...]:
    """The drivers that are the fastest, by their models, for at least one transfer shape of a
    grid (one page to a 32k-token request, in as few descriptors as its regions allow up to one
    per page and region), in rank order, the connection's chosen driver first. A connection
    connects each of them, so one that never wins costs nothing."""
    layout = initiator.layout
    regions = len(layout.kv_item_lens) if layout and layout.kv_item_lens else 64
    page = sum(layout.kv_item_lens) if layout and layout.kv_item_lens else 1 << 20
    winners = {ranked[0]}
    # The wire names a lane other than the chosen driver in a bounded text field.
    eligible = [n for n in ranked if n == ranked[0] or len(n) <= MAX_LANE_NAME]
    for pages in (1, 16, 256, 2048):
        for per_page in (False, True):
            runs, nbytes = (pages * regions if per_page else regions), pages * page
            winners.add(min(eligible, key=lambda n: (slowest_prediction(models[n], runs, nbytes), ranked.index(n))))
    return tuple(n for n in ranked if n in winners)


def pair_models(initiator: Hello, acceptor: Hello, name: str, path: TransferPath) -> list[CostModel]:
    """Each side's measured model of ``name`` on ``path`` towards the other side's host."""
    out: list[CostModel] = []
    for hello, other in ((initiator, acceptor), (acceptor, initiator)):
        entry = hello.drivers.get(name)
        if entry is not None:
            family = _kv_memory(hello).family
            out += [
                m
                for m in entry.costs
                if m.path == path.value and m.peer_host == other.host.host_id and m.memory == family
            ]
    return out


def reference_transfer(initiator: Hello, acceptor: Hello) -> tuple[int, int]:
    """(descriptors, bytes) of the request a connection's driver is chosen for: ``REFERENCE_TOKENS``
    tokens of the initiator's layout, one descriptor per page and KV region (per token and region
    when the two sides' TP sizes slice pages by head)."""
    layout = initiator.layout or acceptor.layout
    if layout is None or not layout.kv_item_lens:
        return REFERENCE_TOKENS // 16, REFERENCE_TOKENS * 4096
    page = max(1, layout.page_size)
    pages = -(-REFERENCE_TOKENS // page)
    regions = len(layout.kv_item_lens)
    other = acceptor.layout if layout is initiator.layout else initiator.layout
    if other is not None and sliced_pages(initiator, acceptor):
        try:
            shape = pair_shape(layout, other)
            if shape.regroup is not None:  # across engines: the connection's table of runs a page
                pages = -(-REFERENCE_TOKENS // geometry_of(layout).tokens)
                return pages * len(shape.regroup), pages * shape.regroup.bytes_per_page
            return pages * regions * page, pages * shape.kv_bytes_per_page(other.kv_item_lens)
        except (ValueError, ZeroDivisionError, KVTransportError):
            pass  # the layouts' check reports what is wrong with them
    return pages * regions, pages * sum(layout.kv_item_lens)


def _why_chosen(
    best: str,
    offer: Offer,
    ranked: list[str],
    offers: Mapping[str, Offer],
    initiator: Hello,
    acceptor: Hello,
    sliced: str = "",
) -> str:
    parts = [f"{offer.path.value} at ~{offer.gbps:g} GB/s"]
    if offer.note:
        parts.append(offer.note)
    if initiator.policy.force or acceptor.policy.force:
        parts.append(f"forced by {ENV_DRIVER}")
    elif initiator.policy.allow or acceptor.policy.allow:
        parts.append("first allowed driver in KVTRANSPORT_DRIVERS order")
    elif sliced and any(offers[n].gbps > offer.gbps for n in ranked[1:]) and _gathers(initiator, best):
        parts.append(f"{sliced}: a driver that gathers them into large chunks first")
    elif len(ranked) > 1 and offers[ranked[1]].gbps == offer.gbps:
        parts.append(f"ties with {ranked[1]} on bandwidth; preferred by the built-in order")
    elif len(ranked) > 1:
        parts.append("highest estimated bandwidth")
    else:
        parts.append("the only driver both sides can use")
    return "; ".join(parts)


def _why_chosen_calibrated(
    best: str,
    offer: Offer,
    ranked: list[str],
    predicted: Mapping[str, float],
    models: list[CostModel],
    initiator: Hello,
    acceptor: Hello,
) -> str:
    slowest = max(models, key=lambda m: m.predict(1, 1 << 30))
    parts = [
        f"{offer.path.value}, predicted {predicted[best] * 1e3:.3g} ms for a {REFERENCE_TOKENS}-token request "
        f"(measured: {slowest.describe()})"
    ]
    if initiator.policy.force or acceptor.policy.force:
        parts.append(f"forced by {ENV_DRIVER}")
    elif initiator.policy.allow or acceptor.policy.allow:
        parts.append("first allowed driver in KVTRANSPORT_DRIVERS order")
    elif len(ranked) > 1:
        parts.append("lowest predicted time")
    else:
        parts.append("the only driver both sides can use")
    return "; ".join(parts)
