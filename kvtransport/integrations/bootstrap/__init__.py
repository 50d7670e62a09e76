"""Where a prefill rank's endpoint can be reached: a small HTTP registry and its client.

Serving engines start one bootstrap server per prefill instance (SGLang: on the prefill host,
``--disaggregation-bootstrap-port``). Each prefill rank ``PUT``s its endpoint address and
parallel layout under its (dp, tp) rank and keeps refreshing it; a decode rank ``GET``s the
entry it needs, retrying until it appears or a timeout passes. JSON over stdlib HTTP, so
``curl`` can inspect it: ``curl http://prefill:8998/route`` lists every live rank. No engine is
imported here.

This module owns the registry's whole contract:

- **Who may write.** With a deployment secret (:func:`~kvtransport.runtime.auth.load_secret`) every
  ``PUT`` and ``DELETE`` carries ``Authorization: KVT1 ts=<unix s>,nonce=<32 hex>,mac=<hex>``
  where ``mac = secret.derive(b"bootstrap request", method, target, ts, nonce, sha256(body))``
  (each part as bytes: the request target is the path with its query as sent). A request whose
  MAC does not verify, whose timestamp is more than :data:`CLOCK_SKEW` seconds off, or whose
  nonce was already seen, is refused with 401 and the words "authentication failed" (the
  details go to this process's log, rate-limited). Without a secret the server may only bind
  loopback (:func:`~kvtransport.runtime.auth.control_plane_policy`) and writes are unsigned.
- **Who may replace a rank.** A client sends a random owner token with each registration; the
  first one binds the (dp, tp) key until the entry expires, and another owner gets 409.
- **How long a route lives.** ``ttl`` seconds after its last ``PUT`` (``KVTRANSPORT_BOOTSTRAP_
  ROUTE_TTL``, default 600); :meth:`BootstrapClient.keep_registered` refreshes it. At most
  ``max_routes`` live routes (507 beyond).
- **What a connection may cost.** Each must deliver its request within ``request_timeout``
  seconds, bodies are at most :data:`MAX_BODY` bytes, and at most ``max_connections`` are open
  at once (``max_connections_per_client`` from one address); excess ones are closed at once.

Reads stay open to anyone who reaches the port: an address alone is useless without the
control-plane secret, which every endpoint's handshake demands before it reveals or moves KV.
"""

from kvtransport.integrations.bootstrap.client import BootstrapClient
from kvtransport.integrations.bootstrap.routes import (
    DEFAULT_MAX_ROUTES,
    DEFAULT_TTL,
    ENV_ROUTE_TTL,
    RouteTable,
    route_ttl,
)
from kvtransport.integrations.bootstrap.server import MAX_BODY, BootstrapServer
from kvtransport.integrations.bootstrap.signing import CLOCK_SKEW, RequestVerifier, request_mac, sign_request

__all__ = [
    "CLOCK_SKEW",
    "DEFAULT_MAX_ROUTES",
    "DEFAULT_TTL",
    "ENV_ROUTE_TTL",
    "MAX_BODY",
    "BootstrapClient",
    "BootstrapServer",
    "RequestVerifier",
    "RouteTable",
    "request_mac",
    "route_ttl",
    "sign_request",
]
