"""The handshake's pure half: read a peer's hello and regions, compute and cross-check the decision.

Nothing here touches a socket or a driver, so every function can be fed anything a stranger
sends: whatever the input, the only exceptions that leave are
:class:`~kvtransport.spi.errors.KVTransportError` subclasses with a message a user can act on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtransport.negotiation.hello import Hello
from kvtransport.negotiation.negotiate import Decision, negotiate
from kvtransport.spi.driver import KVTransport
from kvtransport.spi.errors import (
    DecisionMismatch,
    KVTransportError,
    MemoryLayoutError,
    NegotiationError,
    ProtocolError,
)
from kvtransport.spi.memory import MAX_STATE_GROUPS, Region, RegionSet

#: Longest peer label kept (it ends up in logs and error messages).
MAX_LABEL = 128
#: Most regions a peer may describe (a 128-layer model with K and V, aux and state buffers).
MAX_REGIONS = 4096
#: Most drivers a hello may list (parsing is linear in it, on the I/O thread).
MAX_DRIVERS = 64


def regions_to_dict(regions: RegionSet) -> dict[str, Any]:
    doc: dict[str, Any] = {k: [r.to_dict() for r in getattr(regions, k)] for k in ("kv", "aux", "state")}
    doc["state_groups"] = list(regions.state_groups)
    return doc


def regions_from_dict(data: Mapping[str, Any]) -> RegionSet:
    """A peer's region description, validated; :class:`ProtocolError` on anything malformed."""
    try:
        if not isinstance(data, Mapping):
            raise TypeError(f"regions must be a mapping, got {type(data).__name__}")
        groups = {}
        for key in ("kv", "aux", "state"):
            raw = data["kv"] if key == "kv" else data.get(key, ())
            if not isinstance(raw, list | tuple):
                raise TypeError(f"regions.{key} must be a list, got {type(raw).__name__}")
            groups[key] = raw
        if sum(len(g) for g in groups.values()) > MAX_REGIONS:
            raise ValueError(f"more than {MAX_REGIONS} regions")
        state_groups = data.get("state_groups", ())
        if not isinstance(state_groups, list | tuple) or len(state_groups) > MAX_STATE_GROUPS:
            raise TypeError(f"regions.state_groups must be a list of at most {MAX_STATE_GROUPS} counts")
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in state_groups):
            raise TypeError("regions.state_groups must hold integers")
        return RegionSet(
            kv=tuple(Region.from_dict(r) for r in groups["kv"]),
            aux=tuple(Region.from_dict(r) for r in groups["aux"]),
            state=tuple(Region.from_dict(r) for r in groups["state"]),
            state_groups=tuple(state_groups),
        )
    except (KeyError, TypeError, ValueError, MemoryLayoutError) as exc:
        raise ProtocolError(f"invalid region description from peer: {str(exc)[:300]}") from exc


def read_peer(msg_hello: Any, msg_regions: Any) -> tuple[Hello, RegionSet]:
    """The peer's hello and regions, or :class:`ProtocolError`."""
    drivers = msg_hello.get("drivers") if isinstance(msg_hello, Mapping) else None
    if isinstance(drivers, Mapping) and len(drivers) > MAX_DRIVERS:
        raise ProtocolError(f"the hello lists {len(drivers)} drivers; at most {MAX_DRIVERS}")
    try:
        hello = Hello.from_dict(msg_hello)
        regions = regions_from_dict(msg_regions)
    except KVTransportError:
        raise
    except Exception as exc:
        raise ProtocolError(f"malformed handshake: {type(exc).__name__}: {str(exc)[:300]}") from exc
    if hello.layout is not None and hello.layout.kv_item_lens != regions.kv_item_lens:
        raise ProtocolError(
            f"the peer's layout says KV pages of {hello.layout.kv_item_lens[:4]}... bytes, its regions hold "
            f"{regions.kv_item_lens[:4]}..."
        )
    if hello.layout is not None and hello.layout.state_item_lens not in ((), regions.state_item_lens):
        raise ProtocolError("the peer's layout describes other state buffers than its regions hold")
    # A first-token handoff into an SGLang decode writes rows of the lengths its layout states
    # (spi.handoff): they must be the registered aux regions' own.
    aux_lens = tuple(r.item_len for r in regions.aux)
    if hello.layout is not None and hello.layout.aux_item_lens not in ((), aux_lens):
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


def check_agreement(theirs: Any, mine: Decision, peer: str) -> None:
    """The acceptor's decision (``theirs``, from its welcome) must equal this side's."""
    if not isinstance(theirs, Mapping):
        raise ProtocolError("the welcome's decision is not a mapping")
    if (theirs.get("driver"), theirs.get("path")) != (mine.driver, mine.path.value) or theirs.get("lanes") != list(
        mine.lanes
    ):
        raise DecisionMismatch(
            f"{peer} chose {str(theirs.get('driver'))[:64]} ({str(theirs.get('path'))[:32]}), this side computes "
            f"{mine.driver} ({mine.path.value}), lanes {str(theirs.get('lanes'))[:128]} against {list(mine.lanes)}; "
            "are both sides running the same kvtransport and driver versions?"
        )
