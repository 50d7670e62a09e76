"""The handshake's pure half: read a peer's hello and regions, compute and cross-check the decision.

Nothing here touches a socket or a driver, so every function can be fed anything a stranger
sends: whatever the input, the only exceptions that leave are
:class:`~kvtransport.spi.errors.KVTransportError` subclasses with a message a user can act on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from kvtransport.negotiation.hello import Hello
from kvtransport.negotiation.negotiate import Decision, negotiate
from kvtransport.negotiation.schema import MAX_FIGURE, CandidateDoc, DecisionDoc, RegionDoc, RegionsDoc, cut, parse
from kvtransport.spi.driver import KVTransport
from kvtransport.spi.errors import (
    DecisionMismatch,
    KVTransportError,
    MemoryLayoutError,
    NegotiationError,
    ProtocolError,
)
from kvtransport.spi.memory import MemoryKind, Region, RegionSet

#: Longest peer label kept (it ends up in logs and error messages).
MAX_LABEL = 128


def regions_to_dict(regions: RegionSet) -> dict[str, Any]:
    doc = RegionsDoc(
        kv=[_region_document(r) for r in regions.kv],
        aux=[_region_document(r) for r in regions.aux],
        state=[_region_document(r) for r in regions.state],
        state_groups=list(regions.state_groups),
    )
    out: dict[str, Any] = msgspec.to_builtins(doc)
    return out


def _region_document(region: Region) -> RegionDoc:
    return RegionDoc(
        ptr=region.ptr, length=region.length, kind=str(region.kind), item_len=region.item_len, name=region.name
    )


def regions_from_dict(data: Any) -> RegionSet:
    """A peer's region description, validated; :class:`ProtocolError` on anything malformed."""
    doc = parse(data, RegionsDoc, "regions")
    try:
        return RegionSet(
            kv=tuple(map(_region, doc.kv)),
            aux=tuple(map(_region, doc.aux)),
            state=tuple(map(_region, doc.state)),
            state_groups=tuple(doc.state_groups),
        )
    except MemoryLayoutError as exc:
        # What the schema cannot say: overlaps, items that do not divide a region, groups.
        raise ProtocolError(f"invalid region description from peer: {str(exc)[:300]}") from exc


def _region(doc: RegionDoc) -> Region:
    return Region(doc.ptr, doc.length, MemoryKind.parse(doc.kind), doc.item_len, doc.name)


def read_peer(msg_hello: Any, msg_regions: Any) -> tuple[Hello, RegionSet]:
    """The peer's hello and regions, or :class:`ProtocolError`."""
    try:
        hello = Hello.from_dict(msg_hello)
        regions = regions_from_dict(msg_regions)
    except KVTransportError:
        raise
    except Exception as exc:  # a bug of ours on a stranger's input: still only a refusal
        raise ProtocolError(f"malformed handshake: {type(exc).__name__}: {str(exc)[:300]}") from exc
    if hello.layout is None:
        # Only a bare host report (doctor) goes without one: without it nothing would compare
        # the pages the peer's regions hold with this side's.
        raise ProtocolError("hello.layout is null; a peer opening a connection must state its KV layout")
    if hello.layout.kv_item_lens != regions.kv_item_lens:
        raise ProtocolError(
            f"the peer's layout says KV pages of {hello.layout.kv_item_lens[:4]}... bytes, its regions hold "
            f"{regions.kv_item_lens[:4]}..."
        )
    if hello.layout.state_item_lens not in ((), regions.state_item_lens):
        raise ProtocolError("the peer's layout describes other state buffers than its regions hold")
    # A first-token handoff into an SGLang decode writes rows of the lengths its layout states
    # (spi.handoff): they must be the registered aux regions' own.
    aux_lens = tuple(r.item_len for r in regions.aux)
    if hello.layout.aux_item_lens not in ((), aux_lens):
        raise ProtocolError(
            f"the peer's layout says aux items of {list(hello.layout.aux_item_lens)[:4]}... bytes, its regions hold "
            f"{list(aux_lens)[:4]}..."
        )
    return hello, regions


def label_of(hello: Hello) -> str:
    return hello.label()[:MAX_LABEL]


def decide(initiator: Hello, acceptor: Hello, classes: Mapping[str, type[KVTransport]]) -> Decision:
    """:func:`~kvtransport.negotiation.negotiate.negotiate`, with a driver's buggy ``offer`` reported as a
    negotiation error instead of escaping."""
    try:
        return negotiate(initiator, acceptor, classes)
    except KVTransportError:
        raise
    except Exception as exc:
        raise NegotiationError(f"negotiation failed: {type(exc).__name__}: {str(exc)[:300]}") from exc


def decision_to_dict(decision: Decision) -> dict[str, Any]:
    """The decision as a welcome carries it (reasons cut to the schema's bounds)."""
    doc = DecisionDoc(
        driver=decision.driver,
        path=decision.path.value,
        gbps=_figure(decision.gbps),
        reason=cut(decision.reason),
        basis=decision.basis,
        basis_note=cut(decision.basis_note),
        lanes=list(decision.lanes),
        standby=list(decision.standby),
        initiator=decision.initiator,
        acceptor=decision.acceptor,
        candidates=[
            CandidateDoc(
                driver=c.driver,
                outcome=c.outcome,
                reason=cut(c.reason),
                path=c.path,
                gbps=_figure(c.gbps),
                predicted_s=_figure(c.predicted_s),
            )
            for c in decision.candidates
        ],
    )
    out: dict[str, Any] = msgspec.to_builtins(doc)
    return out


def _figure(x: float) -> float:
    """A figure of this side's within the schema's bounds (a driver's offer may say anything:
    the figures are for reading, the initiator checks only driver, path and lanes)."""
    return min(max(x, 0.0), MAX_FIGURE) if x == x else 0.0


def check_agreement(theirs: Any, mine: Decision, peer: str) -> None:
    """The acceptor's decision (``theirs``, from its welcome) must equal this side's."""
    doc = parse(theirs, DecisionDoc, "decision")
    if (doc.driver, doc.path, doc.lanes, doc.standby) != (
        mine.driver,
        mine.path.value,
        list(mine.lanes),
        list(mine.standby),
    ):
        raise DecisionMismatch(
            f"{peer} chose {doc.driver} ({doc.path}), this side computes {mine.driver} ({mine.path.value}), lanes "
            f"{doc.lanes} (standby {doc.standby}) against {list(mine.lanes)} (standby {list(mine.standby)}); are "
            "both sides running the same kvtransport and driver versions?"
        )
