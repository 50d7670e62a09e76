"""Connecting to a route that discovery returned, which may outlive its rank: an address that
refuses connections fails at once, and a connect that fails says which rank's route it was,
how old the lookup was, and that the route may be stale.

A directory keeps a dead rank's route for a while: etcd until its lease expires (TTL after the
last refresh, or longer after an etcd outage: docs/discovery.md), the built-in registry until its
route TTL passes. A decode rank that connects meanwhile would wait out its connect timeout (10 s
by default: the control channel reconnects quietly) and then name only an address. Before the
connect, one plain TCP connect to the address (at most :data:`PROBE_S`) tells a refused or
unreachable address apart (nothing listens there any more); only that fails at once. An address
that does not answer the probe in time is left to the connect and its own timeout: a live rank
under load may drop a SYN.
"""

from __future__ import annotations

import errno
import socket
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

from kvtransport.runtime.endpoint import Connection, Endpoint
from kvtransport.spi.errors import AuthenticationFailed, ConnectError

#: The most the probe of an address waits for its TCP handshake.
PROBE_S = 1.0
#: Errors of a TCP connect that mean nothing will answer at that address now.
_GONE = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN}


class StaleRoute(ConnectError):
    """A looked-up route led nowhere: its rank may be gone and the route stale. The route is
    worth looking up again (a restarted rank registers anew)."""


def refusal(address: str, timeout: float = PROBE_S) -> str:
    """Why nothing can answer at ``address`` (``tcp://host:port``) now: "" when a TCP connect
    succeeds, does not finish within ``timeout``, or the address is not TCP."""
    url = urllib.parse.urlsplit(address)
    try:
        host, port = url.hostname, url.port
    except ValueError:
        return ""
    if url.scheme != "tcp" or not host or port is None:
        return ""
    try:
        with socket.create_connection((host, port), timeout):
            return ""
    except TimeoutError:
        return ""
    except OSError as exc:
        if exc.errno in _GONE:
            return (exc.strerror or errno.errorcode.get(exc.errno or 0, "no connection")).lower()
        return ""


def dial(
    endpoint: Endpoint,
    route: Mapping[str, Any],
    *,
    rank: str,
    timeout: float,
    looked_up: float | None = None,
) -> Connection:
    """``endpoint.connect`` to ``route["address"]``, for ``rank`` (who the route is of: "prefill
    rank dp=0 tp=1 of instance 10.0.0.5:8998"). Raises :class:`StaleRoute` at once when the
    address refuses connections, and in place of the connect's own :class:`ConnectError`
    (authentication failures pass as they are); ``looked_up``: when the route was looked up
    (``time.monotonic()``), said in the error."""
    address = str(route["address"])
    started = time.monotonic()
    gone = refusal(address, min(PROBE_S, timeout))
    if gone:
        raise StaleRoute(_stale(rank, route, looked_up, gone))
    try:
        return endpoint.connect(address, max(timeout - (time.monotonic() - started), 0.0))
    except AuthenticationFailed:
        raise
    except ConnectError as exc:
        raise StaleRoute(_stale(rank, route, looked_up, str(exc))) from exc


def _stale(rank: str, route: Mapping[str, Any], looked_up: float | None, why: str) -> str:
    details = [f"endpoint {route.get('endpoint', '?')}"]
    if route.get("generation") is not None:
        details.append(f"generation {route['generation']}")
    if looked_up is not None:
        details.append(f"looked up {time.monotonic() - looked_up:.1f} s ago")
    return (
        f"{rank}: its route ({route['address']}; {', '.join(details)}) leads nowhere: {why}. The route may be stale, "
        "its rank gone: a directory keeps a dead rank's route until it expires (on etcd, up to the TTL after its "
        "last refresh, later after an etcd outage: docs/discovery.md). It is looked up again for the next request"
    )
