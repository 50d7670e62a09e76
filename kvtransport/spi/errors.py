"""The one exception hierarchy of kvtransport.

Everything the library raises on purpose derives from :class:`KVTransportError`. Drivers map
their engine's native failures into these types (chained with ``from``) so that a serving engine
catches one family, and every message says what happened and what the user can do about it.
"""

from __future__ import annotations


class KVTransportError(Exception):
    """Root of every error kvtransport raises on purpose."""


# --- configuration and drivers -------------------------------------------------------------


class ConfigError(KVTransportError):
    """A setting (environment variable, argument) is invalid."""


class NoSuchDriver(ConfigError):
    """A driver name that no installed distribution registers."""


class DriverError(KVTransportError):
    """A driver could not be discovered, loaded or used."""


class DriverLoadError(DriverError):
    """An entry point failed to import or does not name a valid driver class."""


class DuplicateDriver(DriverError):
    """Two distributions register the same driver name."""


class DriverAPIMismatch(DriverLoadError):
    """A driver was built for another ``DRIVER_API_VERSION``."""


class DriverUnavailable(DriverError):
    """A driver is installed but cannot be used here (or with this peer)."""


class EngineError(DriverError):
    """The transfer engine under a driver failed; the message carries the engine's own words."""


# --- negotiation ---------------------------------------------------------------------------


class NegotiationError(KVTransportError):
    """The two peers cannot agree on a way to move KV cache."""


class NoUsableDriver(NegotiationError):
    """Every driver was rejected; the message lists each one's reason."""


class LayoutMismatch(NegotiationError):
    """The two KV layouts cannot be bridged."""


class DecisionMismatch(NegotiationError):
    """Both sides computed a different decision from the same pair of hellos."""


# --- wire and control ----------------------------------------------------------------------


class ProtocolError(KVTransportError):
    """A control message is malformed, oversized, of an unknown type or another version."""


class MessageTooLarge(ProtocolError):
    """A control message exceeds the size limit."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version."""


class ChannelDown(KVTransportError):
    """The endpoint's I/O thread is not taking work (closed, stopped by a fault, or backed up
    for longer than a caller may wait)."""


class EndpointDown(ChannelDown):
    """The endpoint's I/O thread stopped; every transfer on it failed."""


# --- memory and planning -------------------------------------------------------------------


class MemoryLayoutError(KVTransportError):
    """A region or KV layout description is invalid."""


class InvalidPages(KVTransportError):
    """Page indices do not fit the registered regions; nothing was submitted."""


# --- transfers -----------------------------------------------------------------------------


class TransferError(KVTransportError):
    """A transfer failed."""


class TransferTimeout(TransferError):
    """A transfer stayed too long in one state."""


class TransferAborted(TransferError):
    """A transfer was aborted by this side or by the peer."""


class PeerLost(TransferError):
    """The peer stopped answering heartbeats or closed its endpoint."""


class ConnectError(TransferError):
    """The control connection to a peer could not be established."""


class AuthenticationFailed(ConnectError):
    """The peer did not prove it holds this deployment's secret (or this side does not hold
    the peer's). Deliberately vague towards the peer; the local log has the details."""
