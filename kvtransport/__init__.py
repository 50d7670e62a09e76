"""kvtransport: move LLM KV cache between prefill and decode instances over the best transfer
engine each pair of peers can use.

This module is the public API: what a serving engine needs (:class:`Endpoint`, the
:class:`Connection` and :class:`Transfer` handles and their :class:`State`, the KV description
:class:`KVLayout` / :class:`RegionSet`, expect-from-many :func:`expect_from`), the error
hierarchy rooted at :class:`KVTransportError`, and the driver SPI (:class:`KVTransport` and the
types its methods take). Everything else lives in sub-packages named for what they own
(``spi``, ``negotiation``, ``runtime``, ``staging``, ``tools``, ``testing``, ``integrations``;
docs/architecture.md has the map).

Importing this package imports no transfer engine, scans no entry points and starts no thread;
the runtime (zmq and the endpoint's modules) loads on the first use of one of its names.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from kvtransport.spi.driver import (
    DRIVER_API_VERSION,
    Capabilities,
    DriverContext,
    DriverStatus,
    KVTransport,
    Offer,
    PeerView,
    Rejection,
    TransferPath,
)
from kvtransport.spi.errors import (
    AuthenticationFailed,
    ChannelDown,
    ConfigError,
    ConnectError,
    DecisionMismatch,
    DriverAPIMismatch,
    DriverError,
    DriverLoadError,
    DriverUnavailable,
    DuplicateDriver,
    EndpointDown,
    EngineError,
    InvalidPages,
    KVTransportError,
    LayoutMismatch,
    MemoryLayoutError,
    MessageTooLarge,
    NegotiationError,
    NoSuchDriver,
    NoUsableDriver,
    PeerLost,
    ProtocolError,
    TransferAborted,
    TransferError,
    TransferTimeout,
    VersionMismatch,
)
from kvtransport.spi.memory import HOST, KVLayout, MemoryKind, Region, RegionSet, cuda
from kvtransport.spi.plan import Runs

if TYPE_CHECKING:
    from kvtransport.negotiation.negotiate import Decision
    from kvtransport.negotiation.registry import DriverEntry, Policy, list_drivers
    from kvtransport.runtime.auth import Secret
    from kvtransport.runtime.config import Limits, Timeouts
    from kvtransport.runtime.endpoint import Endpoint
    from kvtransport.runtime.fanin import FanIn, FanOut, PartialAnnouncement, expect_from
    from kvtransport.runtime.handles import Connection, State, Transfer
    from kvtransport.runtime.layer_groups import LayerwisePolicy
    from kvtransport.runtime.layerwise import LayerStream

__version__ = "0.8.0"

#: Names loaded on first use, and the module each comes from.
_LAZY = {
    "Endpoint": "kvtransport.runtime.endpoint",
    "Connection": "kvtransport.runtime.handles",
    "Transfer": "kvtransport.runtime.handles",
    "State": "kvtransport.runtime.handles",
    "Timeouts": "kvtransport.runtime.config",
    "LayerStream": "kvtransport.runtime.layerwise",
    "LayerwisePolicy": "kvtransport.runtime.layer_groups",
    "Limits": "kvtransport.runtime.config",
    "FanIn": "kvtransport.runtime.fanin",
    "FanOut": "kvtransport.runtime.fanin",
    "PartialAnnouncement": "kvtransport.runtime.fanin",
    "expect_from": "kvtransport.runtime.fanin",
    "Secret": "kvtransport.runtime.auth",
    "Policy": "kvtransport.negotiation.registry",
    "Decision": "kvtransport.negotiation.negotiate",
    "DriverEntry": "kvtransport.negotiation.registry",
    "list_drivers": "kvtransport.negotiation.registry",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtransport' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later reads are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    # the user API
    "Connection",
    "Decision",
    "Endpoint",
    "FanIn",
    "FanOut",
    "LayerStream",
    "LayerwisePolicy",
    "Limits",
    "Policy",
    "Secret",
    "State",
    "Timeouts",
    "Transfer",
    "expect_from",
    # the KV description
    "HOST",
    "KVLayout",
    "MemoryKind",
    "Region",
    "RegionSet",
    "cuda",
    # the driver SPI
    "DRIVER_API_VERSION",
    "Capabilities",
    "DriverContext",
    "DriverEntry",
    "DriverStatus",
    "KVTransport",
    "Offer",
    "PeerView",
    "Rejection",
    "Runs",
    "TransferPath",
    "list_drivers",
    # errors
    "AuthenticationFailed",
    "ChannelDown",
    "ConfigError",
    "ConnectError",
    "DecisionMismatch",
    "DriverAPIMismatch",
    "DriverError",
    "DriverLoadError",
    "DriverUnavailable",
    "DuplicateDriver",
    "EndpointDown",
    "EngineError",
    "InvalidPages",
    "KVTransportError",
    "LayoutMismatch",
    "MemoryLayoutError",
    "MessageTooLarge",
    "NegotiationError",
    "NoSuchDriver",
    "NoUsableDriver",
    "PartialAnnouncement",
    "PeerLost",
    "ProtocolError",
    "TransferAborted",
    "TransferError",
    "TransferTimeout",
    "VersionMismatch",
    "__version__",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())
