"""The hello document: what each side tells the other at handshake, and what ``doctor`` prints.

A hello is a versioned, JSON-serialisable document with four sections: ``protocol`` (version
and endpoint label), ``host`` (see :class:`~kvtransport.spi.probe.HostInfo`), ``drivers`` (each
installed driver's probe result, capabilities and, once an endpoint has opened it, its
connection info) and ``layout`` (the KV layout, absent for a bare host report). ``policy``
carries the sender's env-var policy, so both sides can respect both policies. The schema is
documented in docs/hello.md; :meth:`Hello.from_dict` validates strictly and raises
:class:`~kvtransport.spi.errors.ProtocolError` on anything else.
"""

from __future__ import annotations

import base64
import logging
import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvtransport.negotiation.cost_model import CostModel, models_from_list
from kvtransport.negotiation.registry import DriverEntry, Policy, duplicates, list_drivers, load_driver
from kvtransport.spi.driver import Capabilities, DriverStatus, KVTransport, declared_capabilities
from kvtransport.spi.errors import KVTransportError, MemoryLayoutError, ProtocolError
from kvtransport.spi.memory import KVLayout
from kvtransport.spi.probe import HostInfo, probe_host

log = logging.getLogger(__name__)

#: Version of the hello document and of the control protocol carrying it.
#: 11: the hello and the welcome carry each side's per-connection receive infos (``lanes``).
PROTOCOL_VERSION = 11
PROTOCOL_NAME = "kvtransport"


@dataclass(frozen=True)
class DriverHello:
    """One driver as a side reports it: loaded or not, its status, and its connection info."""

    name: str
    distribution: str = ""
    api_version: int = 0
    capabilities: Capabilities | None = None
    status: DriverStatus | None = None  # None: the driver failed to load here
    load_error: str = ""
    conn: bytes = b""  # the driver's open() result; empty in a bare host report
    #: Measured cost models (``kvtransport calibrate``), one per path and far host; empty when
    #: this host was not calibrated for the driver, and the negotiation uses nominal figures.
    costs: tuple[CostModel, ...] = ()

    @property
    def usable(self) -> bool:
        return self.status is not None and self.status.available

    def to_dict(self) -> dict[str, Any]:
        return {
            "distribution": self.distribution,
            "api_version": self.api_version,
            "capabilities": self.capabilities.to_dict() if self.capabilities else None,
            "status": self.status.to_dict() if self.status else None,
            "load_error": self.load_error,
            "conn": base64.b64encode(self.conn).decode() if self.conn else "",
            "costs": [m.to_dict() for m in self.costs],
        }

    @classmethod
    def from_dict(cls, name: str, data: Mapping[str, Any]) -> DriverHello:
        caps = data.get("capabilities")
        status = data.get("status")
        conn = data.get("conn", "")
        return cls(
            name=name,
            distribution=str(data.get("distribution", "")),
            api_version=int(data.get("api_version", 0)),
            capabilities=(
                Capabilities(
                    reads=frozenset(str(x) for x in caps["reads"]),
                    writes=frozenset(str(x) for x in caps["writes"]),
                    same_host_only=bool(caps.get("same_host_only", False)),
                    two_sided=bool(caps.get("two_sided", False)),
                    gathers=bool(caps.get("gathers", False)),
                )
                if caps
                else None
            ),
            status=DriverStatus.from_dict(status) if status else None,
            load_error=str(data.get("load_error", "")),
            conn=_conn_bytes(conn),
            costs=models_from_list(data.get("costs")),
        )


def _conn_bytes(conn: Any) -> bytes:
    """A driver's connection info: bytes, or base64 text (the JSON form of a hello)."""
    if isinstance(conn, bytes):
        return conn
    if isinstance(conn, str):
        return base64.b64decode(conn, validate=True) if conn else b""
    if conn is None:
        return b""
    # Never bytes(n) of a peer's integer: that allocates n bytes.
    raise TypeError(f"driver connection info must be bytes or base64 text, got {type(conn).__name__}")


@dataclass(frozen=True)
class Hello:
    """Everything one side says about itself at handshake."""

    endpoint: str
    host: HostInfo
    drivers: Mapping[str, DriverHello]
    layout: KVLayout | None = None
    policy: Policy = field(default_factory=Policy)
    protocol: int = PROTOCOL_VERSION

    def label(self) -> str:
        return self.endpoint or self.host.hostname or self.host.host_id

    def to_dict(self) -> dict[str, Any]:
        return {
            "protocol": {"name": PROTOCOL_NAME, "version": self.protocol, "endpoint": self.endpoint},
            "host": self.host.to_dict(),
            "drivers": {name: self.drivers[name].to_dict() for name in sorted(self.drivers)},
            "layout": self.layout.to_dict() if self.layout else None,
            "policy": self.policy.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Hello:
        """Validate and parse a hello document; :class:`ProtocolError` on anything malformed."""
        if not isinstance(data, Mapping):
            raise ProtocolError(f"hello must be a mapping, got {type(data).__name__}")
        try:
            proto = data["protocol"]
            if proto.get("name") != PROTOCOL_NAME:
                raise ProtocolError(f"not a kvtransport hello (protocol name {proto.get('name')!r})")
            version = int(proto["version"])
            if version != PROTOCOL_VERSION:
                raise ProtocolError(
                    f"hello protocol version {version}, this kvtransport speaks {PROTOCOL_VERSION}; "
                    "upgrade the older side"
                )
            drivers_raw = data["drivers"]
            if not isinstance(drivers_raw, Mapping):
                raise ProtocolError("hello 'drivers' must be a mapping of name -> driver")
            layout_raw = data.get("layout")
            return cls(
                endpoint=str(proto.get("endpoint", "")),
                host=HostInfo.from_dict(data["host"]),
                drivers={str(n): DriverHello.from_dict(str(n), d) for n, d in drivers_raw.items()},
                layout=KVLayout.from_dict(layout_raw) if layout_raw else None,
                policy=Policy.from_dict(data.get("policy")),
                protocol=version,
            )
        except ProtocolError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, MemoryLayoutError) as exc:
            raise ProtocolError(f"malformed hello: {type(exc).__name__}: {exc}") from exc

    def with_policy(self, policy: Policy) -> Hello:
        return replace(self, policy=policy)


def default_endpoint_label() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class LoadedDrivers:
    """Drivers loaded on this side: classes that loaded, and the entries that failed."""

    classes: dict[str, type[KVTransport]]
    hellos: dict[str, DriverHello]


def load_drivers(
    names: Iterable[str] | None = None,
    entries: list[DriverEntry] | None = None,
) -> LoadedDrivers:
    """Load and probe installed drivers (``names`` limits which). Never raises for one driver:
    a broken plugin is recorded with its error and logged at DEBUG."""
    entries = list_drivers() if entries is None else entries
    wanted = None if names is None else set(names)
    dupes = duplicates(entries)
    classes: dict[str, type[KVTransport]] = {}
    hellos: dict[str, DriverHello] = {}
    for name in sorted({e.name for e in entries}):
        if wanted is not None and name not in wanted:
            continue
        entry = next(e for e in entries if e.name == name)
        dist = " + ".join(e.distribution for e in dupes[name]) if name in dupes else entry.distribution
        try:
            cls = load_driver(name, entries)
        except KVTransportError as exc:
            log.debug("driver %s unusable: %s", name, exc)
            hellos[name] = DriverHello(name, distribution=dist, load_error=str(exc))
            continue
        hellos[name] = describe_driver(cls, dist)
        classes[name] = cls
    return LoadedDrivers(classes, hellos)


def describe_driver(cls: type[KVTransport], distribution: str = "") -> DriverHello:
    """Probe ``cls`` and describe it for a hello (a raising probe is reported, not raised)."""
    try:
        status = cls.probe()
    except Exception as exc:  # noqa: BLE001 - a buggy probe must not break discovery
        status = DriverStatus(False, f"probe() raised {type(exc).__name__}: {exc} (driver bug)")
    return DriverHello(
        name=cls.name,
        distribution=distribution,
        api_version=cls.api_version,
        capabilities=declared_capabilities(cls),
        status=status,
    )


def build_hello(
    drivers: Mapping[str, DriverHello],
    *,
    layout: KVLayout | None = None,
    policy: Policy | None = None,
    endpoint: str | None = None,
    host: HostInfo | None = None,
) -> Hello:
    return Hello(
        endpoint=endpoint if endpoint is not None else default_endpoint_label(),
        host=host or probe_host(),
        drivers=dict(drivers),
        layout=layout,
        policy=policy or Policy(),
    )
