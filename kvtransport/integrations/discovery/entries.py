"""A discovery entry's value: a prefill rank's route and generation, signed with the deployment
secret, so that a reader tells its owner's entry from one written by anyone else who can reach
the store (etcd's own access control is not assumed).

The value is JSON: ``{"v": 1, "body": "<JSON of route, generation and lease>", "sig": "<hex>"}``,
with ``sig = secret.derive(b"kvtransport discovery entry", key, body)``: bound to the key, so an
entry copied under another rank's key does not verify, and to the etcd lease its owner put it
on, so a reader tells an entry on its owner's lease from the same bytes put back without it or
on another lease (which would outlive the owner): :attr:`Entry.lease`, checked by the reader
against the lease etcd reports for the key. An entry of a writer that signed no lease (before
the lease was signed) reads with ``lease`` ``None``. The body travels as the exact string
that was signed (no re-encoding on the reader's side). A process without a secret signs with the
well-known key of :meth:`~kvtransport.runtime.auth.Secret.none` and accepts only such entries;
one with a secret accepts only entries its secret signed. Pure functions: no I/O.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtransport.integrations.bootstrap.routes import validated
from kvtransport.runtime.auth import Secret
from kvtransport.spi.errors import ProtocolError

ENTRY_VERSION = 1
#: Largest value a reader parses (a route is a few hundred bytes).
MAX_ENTRY_BYTES = 8192
_LABEL = b"kvtransport discovery entry"


@dataclass(frozen=True)
class Entry:
    """A verified entry: the rank's route (``bootstrap.routes.validated``), its generation (a
    later start of the rank writes a larger one) and the lease its owner put it on (``None``:
    not signed)."""

    route: dict[str, Any]
    generation: int
    lease: int | None = None


class ForgedEntry(ProtocolError):
    """An entry whose signature does not verify with this process's secret (written without the
    secret, with another one, or moved from another key)."""


def encode_entry(
    secret: Secret, key: str, route: Mapping[str, Any], generation: int, lease: int | None = None
) -> bytes:
    """The value of ``key``: the same bytes for the same arguments (an owner compares what etcd
    holds with what it would write)."""
    doc: dict[str, Any] = {"route": validated(dict(route)), "generation": generation}
    if lease is not None:
        doc["lease"] = lease
    body = json.dumps(doc, sort_keys=True)
    sig = secret.derive(_LABEL, key.encode(), body.encode()).hex()
    return json.dumps({"v": ENTRY_VERSION, "body": body, "sig": sig}).encode()


def decode_entry(secret: Secret, key: str, raw: bytes) -> Entry:
    """The entry stored under ``key``, verified; :class:`ForgedEntry` when its signature is not
    this secret's, ``ProtocolError`` when it is not an entry at all."""
    if len(raw) > MAX_ENTRY_BYTES:
        raise ProtocolError(f"entry {key!r} is {len(raw)} bytes (at most {MAX_ENTRY_BYTES})")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ProtocolError(f"entry {key!r} is not JSON") from exc
    if not isinstance(doc, dict) or doc.get("v") != ENTRY_VERSION:
        raise ProtocolError(f"entry {key!r} is not a version {ENTRY_VERSION} entry")
    body, sig = doc.get("body"), doc.get("sig")
    if not isinstance(body, str) or not isinstance(sig, str):
        raise ProtocolError(f"entry {key!r} has no body or signature")
    want = secret.derive(_LABEL, key.encode(), body.encode()).hex()
    if not hmac.compare_digest(want, sig):
        raise ForgedEntry(
            f"entry {key!r} is not signed with this process's deployment secret ({secret.source}); ignored"
        )
    try:
        inner = json.loads(body)
    except ValueError as exc:
        raise ProtocolError(f"entry {key!r}: its body is not JSON") from exc
    if not isinstance(inner, dict):
        raise ProtocolError(f"entry {key!r}: its body is not an object")
    generation = inner.get("generation")
    if isinstance(generation, bool) or not isinstance(generation, int) or not 0 < generation < 2**63:
        raise ProtocolError(f"entry {key!r}: generation {generation!r} is not a positive whole number")
    lease = inner.get("lease")
    if lease is not None and (isinstance(lease, bool) or not isinstance(lease, int) or not 0 < lease < 2**63):
        raise ProtocolError(f"entry {key!r}: lease {lease!r} is not a positive whole number")
    return Entry(validated(inner.get("route")), generation, lease)
