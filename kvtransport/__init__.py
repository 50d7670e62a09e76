"""kvtransport: move LLM KV cache between prefill and decode instances over the best transfer
engine each pair of peers can use.

Importing this package imports no transfer engine and scans no entry points; drivers are
discovered when asked for (:func:`kvtransport.registry.list_drivers`).
"""

from __future__ import annotations

import logging

from .driver import (
    DRIVER_API_VERSION,
    Capabilities,
    DriverStatus,
    KVTransport,
    Offer,
    PeerView,
    Rejection,
    TransferPath,
)
from .errors import KVTransportError
from .memory import HOST, KVLayout, MemoryKind, Region, RegionSet

__version__ = "0.1.0"

__all__ = [
    "DRIVER_API_VERSION",
    "HOST",
    "Capabilities",
    "DriverStatus",
    "KVLayout",
    "KVTransport",
    "KVTransportError",
    "MemoryKind",
    "Offer",
    "PeerView",
    "Region",
    "RegionSet",
    "Rejection",
    "TransferPath",
    "__version__",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())
