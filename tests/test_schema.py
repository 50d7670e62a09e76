"""The schemas (control messages, the hello, the handshake's regions and decision, the staged
notices): a document that differs from its schema at any field path is refused with
ProtocolError, one that conforms round-trips, and the docs' tables are what the code renders."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any, Union

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from kvtransport.negotiation.handshake import (
    check_agreement,
    decision_to_dict,
    read_peer,
    regions_from_dict,
    regions_to_dict,
)
from kvtransport.negotiation.hello import PROTOCOL_VERSION, Hello, build_hello
from kvtransport.negotiation.negotiate import Candidate, Decision
from kvtransport.negotiation.schema import DecisionDoc, HelloDoc, RegionsDoc, parse
from kvtransport.runtime.wire import TYPES, decode
from kvtransport.spi.driver import TransferPath
from kvtransport.spi.errors import ConfigError, DecisionMismatch, ProtocolError
from kvtransport.staging.config import MAX_SLOTS
from kvtransport.staging.notices import KINDS, ChunkNotice, decode_notice
from kvtransport.tools.kv_pool import KVPool
from kvtransport.tools.schema_doc import stale

from .hellos import hello, host
from .schema_strategies import FIXED, FIXUPS, Schema, one_wrong, valid


def _chunk_fixup(d: dict[str, Any]) -> dict[str, Any]:
    n = max(1, len(d["dst"]) // 8)
    return {**d, **{k: (d[k] + bytes(8 * n))[: 8 * n] for k in ("dst", "len", "off")}}


def _driver_fixup(d: dict[str, Any]) -> dict[str, Any]:
    both = d["capabilities"] is not None and d["status"] is not None
    return d if both else {**d, "capabilities": None, "status": None}


FIXUPS.update(
    LayoutDoc=lambda d: {**d, "tp_rank": d["tp_rank"] % d["tp_size"]},
    DriverDoc=_driver_fixup,
    Chunk=_chunk_fixup,
)
FIXED.update(ProtocolDoc={"version": PROTOCOL_VERSION})


def _message(doc: Any) -> Any:
    return decode(msgpack.packb(doc, use_bin_type=True))


def _notice(doc: Any) -> Any:
    return decode_notice(msgpack.packb(doc, use_bin_type=True), MAX_SLOTS)


#: name -> (the schema, what reads a document of it as a peer's: raises ProtocolError or returns).
TARGETS: dict[str, tuple[Schema, Callable[[Any], Any]]] = {
    "message": (Schema("message", Union[tuple(TYPES.values())]), _message),  # noqa: UP007
    "hello": (Schema("hello", HelloDoc), Hello.from_dict),
    "regions": (Schema("regions", RegionsDoc), regions_from_dict),
    "decision": (Schema("decision", DecisionDoc), lambda d: parse(d, DecisionDoc, "decision")),
    "notice": (Schema("notice", Union[KINDS]), _notice),  # noqa: UP007
}
SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]


@pytest.mark.parametrize("target", sorted(TARGETS))
@settings(max_examples=80, deadline=None, suppress_health_check=SLOW)
@given(data=st.data())
def test_a_document_that_differs_from_its_schema_is_refused(target: str, data: st.DataObject) -> None:
    """One thing wrong anywhere (a wrong type at any field path, a string or float for an
    integer, ``null`` for a map, an integer out of range, a text or list too long, a required
    field missing, an unknown one where forbidden) and the reader raises ProtocolError."""
    schema, read = TARGETS[target]
    doc, what = data.draw(one_wrong(schema))
    note(what)
    with pytest.raises(ProtocolError):
        read(doc)


@pytest.mark.parametrize("target", sorted(TARGETS))
@settings(max_examples=40, deadline=None, suppress_health_check=SLOW)
@given(data=st.data())
def test_a_document_that_conforms_round_trips(target: str, data: st.DataObject) -> None:
    schema, read = TARGETS[target]
    doc = data.draw(valid(schema.type))
    if target == "hello":
        h = read(doc)
        assert msgspec.to_builtins(parse(doc, HelloDoc, "hello")) == doc
        assert Hello.from_dict(h.to_dict()) == h
    elif target == "regions":
        assert msgspec.to_builtins(parse(doc, RegionsDoc, "regions")) == doc  # the schema; overlaps are the model's
    elif target == "notice" and doc["op"] == "chunk":
        got = read(doc)
        assert isinstance(got, ChunkNotice) and got.slot == doc["slot"]
        assert [list(got.dst), list(got.length), list(got.offset)] == [
            memoryview(doc[k]).cast("Q").tolist() for k in ("dst", "len", "off")
        ]
    else:
        # What the reader made of it encodes back to the same document.
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(read(doc))) == msgspec.msgpack.decode(
            msgpack.packb(doc, use_bin_type=True)
        )


# --- the six leniencies of issue 45, item 6 -------------------------------------------------------


def _peer_documents() -> tuple[dict[str, Any], dict[str, Any]]:
    pool = KVPool(4, 2, 512)
    return hello(host("peer"), layout=pool.layout).to_dict(), regions_to_dict(pool.regions)


def _with(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "words"),
    [
        (("protocol", "version"), "10", "hello.protocol.version must be an integer, got a string"),
        (("protocol", "version"), 10.0, "hello.protocol.version must be an integer, got a number"),
        (("layout", "tp_rank"), -1, "hello.layout.tp_rank is outside its range"),
        (("protocol", "endpoint"), "x" * (1 << 20), "hello.protocol.endpoint is too long"),
        (("drivers", "nixl-ucx", "api_version"), 2**64 - 1, r"api_version is outside its range"),
        (("drivers", "nixl-ucx", "capabilities"), None, "capabilities and status must both be null"),
        (("layout",), None, "hello.layout is null"),
    ],
)
def test_the_hellos_that_were_accepted_against_the_schema_are_refused(
    path: tuple[str, ...], value: Any, words: str
) -> None:
    """Each was accepted before the schema: a version as text or a float, a TP rank of -1, a
    1 MiB label, an API version of 2**64-1, a loaded driver without capabilities, a handshake
    without a layout (which skipped the layout check)."""
    doc, regions = _peer_documents()
    assert read_peer(doc, regions)[0].endpoint == "ep@peer"  # the unchanged document is fine
    with pytest.raises(ProtocolError, match=words):
        read_peer(_with(doc, path, value), regions)


def test_a_bare_host_report_may_go_without_a_layout_and_unknown_top_level_keys_are_ignored() -> None:
    doc = {**hello(host("h")).to_dict(), "layout": None, "diagnostics": {"anything": [1, 2]}}
    assert Hello.from_dict(doc).layout is None
    with pytest.raises(ProtocolError, match=r"hello\.host fields do not match its schema: 'diagnostics'"):
        Hello.from_dict(_with(doc, ("host", "diagnostics"), {}))


def test_another_protocol_version_is_refused_with_advice() -> None:
    doc, _ = _peer_documents()
    with pytest.raises(ProtocolError, match="upgrade the older side"):
        Hello.from_dict(_with(doc, ("protocol", "version"), PROTOCOL_VERSION - 1))


def test_a_side_whose_own_hello_breaks_the_schema_is_told_at_start() -> None:
    """Not by every peer at handshake: a layout out of bounds, a name over 256 characters."""
    layout = dataclasses.replace(KVPool(4, 2, 512).layout, tp_rank=2, tp_size=2)
    with pytest.raises(ConfigError, match="refused by its peers: tp_rank 2 is not below tp_size 2"):
        build_hello({}, layout=layout, host=host("a"))
    with pytest.raises(ConfigError, match="endpoint name of 300 characters"):
        build_hello({}, endpoint="e" * 300, host=host("a"))


def test_a_welcome_carries_this_sides_decision_within_the_schema() -> None:
    """A driver's offer may state any figure and any reason: the welcome puts them within the
    bounds, and the initiator, which checks driver, path and lanes, agrees."""
    odd = Candidate("nixl-ucx", "lost", "r" * 10_000, "shm", math.nan, math.inf)
    decision = Decision("fake", TransferPath.SHM, math.inf, "x" * 10_000, (odd,), lanes=("fake",))
    doc = decision_to_dict(decision)
    check_agreement(doc, decision, "peer")
    assert doc["gbps"] == 1e9 and doc["candidates"][0]["gbps"] == 0.0 and len(doc["reason"]) == 4096
    with pytest.raises(DecisionMismatch):
        check_agreement({**doc, "lanes": ["fake", "nixl-ucx"]}, decision, "peer")


# --- the docs -------------------------------------------------------------------------------------


def test_the_docs_schema_tables_are_what_the_code_renders() -> None:
    """docs/hello.md and docs/wire.md carry the tables ``python -m kvtransport.tools.schema_doc``
    writes from the Structs: a field changed in the code and not in the docs fails here."""
    assert stale() == [], "run: python -m kvtransport.tools.schema_doc"
