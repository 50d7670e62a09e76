"""The hello document: what each side tells the other at handshake, and what ``doctor`` prints.

A hello is a versioned, JSON-serialisable document with four sections: ``protocol`` (version
and endpoint label), ``host`` (see :class:`~kvtransport.spi.probe.HostInfo`), ``drivers`` (each
installed driver's probe result, capabilities and, once an endpoint has opened it, its
connection info) and ``layout`` (the KV layout, absent for a bare host report). ``policy``
carries the sender's env-var policy, so both sides can respect both policies. The schema is
:mod:`kvtransport.negotiation.schema`'s (docs/hello.md is rendered from it): :meth:`Hello.to_dict`
builds the document through it, and :meth:`Hello.from_dict` reads one strictly, raising
:class:`~kvtransport.spi.errors.ProtocolError` naming the field on anything else.
"""

from __future__ import annotations

import base64
import logging
import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final

import msgspec

from kvtransport.negotiation.cost_model import CostModel
from kvtransport.negotiation.registry import DriverEntry, Policy, duplicates, list_drivers, load_driver
from kvtransport.negotiation.schema import (
    MAX_ENDPOINT_LABEL,
    CapabilitiesDoc,
    CudaDeviceDoc,
    DriverDoc,
    HelloDoc,
    HostDoc,
    LayoutDoc,
    PolicyDoc,
    ProtocolDoc,
    StatusDoc,
    cut,
    parse,
)
from kvtransport.spi.driver import Capabilities, DriverStatus, KVTransport, declared_capabilities
from kvtransport.spi.errors import ConfigError, KVTransportError, ProtocolError, VersionMismatch
from kvtransport.spi.memory import KVLayout, MemoryKind
from kvtransport.spi.probe import CudaDevice, HostInfo, probe_host

log = logging.getLogger(__name__)

#: Version of the hello document and of the control protocol carrying it.
#: 11: the hello and the welcome carry each side's per-connection receive infos (``lanes``).
#: 12: a decision between two hosts with no measured model keeps several lanes to learn from
#: (negotiate.learning_lanes): an 11 peer would compute other lanes and refuse the decision.
#: 13: "lane_down" (runtime.failover), the decision's ``standby``, the policy's ``failover``.
#: 14: a failed lane comes back from quarantine ("lane_reopen", "lane_reopened"; "lane_down"
#: names the lane's generation), connection ids never hold "~".
PROTOCOL_VERSION = 14
PROTOCOL_NAME: Final = "kvtransport"


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

    def document(self) -> DriverDoc:
        caps, status = self.capabilities, self.status
        return DriverDoc(
            distribution=self.distribution,
            api_version=self.api_version,
            capabilities=None
            if caps is None
            else CapabilitiesDoc(
                reads=sorted(caps.reads),
                writes=sorted(caps.writes),
                same_host_only=caps.same_host_only,
                two_sided=caps.two_sided,
                gathers=caps.gathers,
            ),
            status=None
            if status is None
            else StatusDoc(
                available=status.available,
                reason=cut(status.reason),
                fix=cut(status.fix),
                version=status.version,
                memory=list(status.memory),
                memory_notes={k: cut(v) for k, v in status.memory_notes.items()},
                info=dict(status.info),
            ),
            load_error=cut(self.load_error),
            conn=base64.b64encode(self.conn).decode() if self.conn else "",
            costs=[m.document() for m in self.costs],
        )

    @classmethod
    def from_document(cls, name: str, doc: DriverDoc) -> DriverHello:
        caps, status = doc.capabilities, doc.status
        return cls(
            name=name,
            distribution=doc.distribution,
            api_version=doc.api_version,
            capabilities=None
            if caps is None
            else Capabilities(
                reads=frozenset(caps.reads),
                writes=frozenset(caps.writes),
                same_host_only=caps.same_host_only,
                two_sided=caps.two_sided,
                gathers=caps.gathers,
            ),
            status=None
            if status is None
            else DriverStatus(
                available=status.available,
                reason=status.reason,
                fix=status.fix,
                version=status.version,
                memory=tuple(status.memory),
                memory_notes=status.memory_notes,
                info=status.info,
            ),
            load_error=doc.load_error,
            # The schema's pattern admits only valid base64.
            conn=base64.b64decode(doc.conn) if doc.conn else b"",
            costs=tuple(map(CostModel.from_document, doc.costs)),
        )


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

    def document(self) -> HelloDoc:
        """This hello as the schema lays it out (this side's free texts cut to their bounds)."""
        return HelloDoc(
            protocol=ProtocolDoc(name=PROTOCOL_NAME, version=self.protocol, endpoint=self.endpoint),
            host=_host_document(self.host),
            drivers={name: self.drivers[name].document() for name in sorted(self.drivers)},
            layout=None if self.layout is None else _layout_document(self.layout),
            policy=PolicyDoc(
                force=self.policy.force,
                allow=list(self.policy.allow),
                exclude=list(self.policy.exclude),
                failover=self.policy.failover,  # type: ignore[arg-type]  # checked by Policy.from_env
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``doctor --json``, the handshake's ``hello`` field)."""
        doc: dict[str, Any] = msgspec.to_builtins(self.document())
        return doc

    @classmethod
    def from_dict(cls, data: Any) -> Hello:
        """Validate and parse a hello document; :class:`ProtocolError` on anything malformed,
        :class:`VersionMismatch` for another version's (whatever else its schema holds)."""
        try:
            doc = parse(data, HelloDoc, "hello")
        except ProtocolError:
            proto = data.get("protocol") if isinstance(data, Mapping) else None
            version = proto.get("version") if isinstance(proto, Mapping) else None
            if isinstance(version, int) and not isinstance(version, bool):
                _check_version(version)
            raise
        return cls.from_document(doc)

    @classmethod
    def from_document(cls, doc: HelloDoc) -> Hello:
        proto = doc.protocol
        _check_version(proto.version)
        policy = doc.policy
        return cls(
            endpoint=proto.endpoint,
            host=_host(doc.host),
            drivers={name: DriverHello.from_document(name, d) for name, d in doc.drivers.items()},
            layout=None if doc.layout is None else layout_from_document(doc.layout),
            policy=Policy(
                force=policy.force or None,
                allow=tuple(policy.allow),
                exclude=tuple(policy.exclude),
                failover=policy.failover,
            ),
            protocol=proto.version,
        )

    def with_policy(self, policy: Policy) -> Hello:
        return replace(self, policy=policy)


def _check_version(version: int) -> None:
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"hello protocol version {version}, this kvtransport speaks {PROTOCOL_VERSION}; upgrade the older side"
        )


def _host_document(host: HostInfo) -> HostDoc:
    return HostDoc(
        host_id=host.host_id,
        hostname=host.hostname,
        cuda_devices=[
            CudaDeviceDoc(
                index=d.index,
                uuid=d.uuid,
                pci_bus_id=d.pci_bus_id,
                name=d.name,
                gdr=d.gdr,
                gdr_reason=cut(d.gdr_reason),
            )
            for d in host.cuda_devices
        ],
        cuda_note=cut(host.cuda_note),
        rdma_devices=list(host.rdma_devices),
        rdma_note=cut(host.rdma_note),
        peermem=host.peermem,
        versions=dict(host.versions),
    )


def _host(doc: HostDoc) -> HostInfo:
    return HostInfo(
        host_id=doc.host_id,
        hostname=doc.hostname,
        cuda_devices=tuple(
            CudaDevice(d.index, d.uuid, d.pci_bus_id, d.name, d.gdr, d.gdr_reason) for d in doc.cuda_devices
        ),
        cuda_note=doc.cuda_note,
        rdma_devices=tuple(doc.rdma_devices),
        rdma_note=doc.rdma_note,
        peermem=doc.peermem,
        versions=doc.versions,
    )


def _layout_document(layout: KVLayout) -> LayoutDoc:
    return LayoutDoc(
        page_size=layout.page_size,
        dtype=layout.dtype,
        num_layers=layout.num_layers,
        kv_item_lens=list(layout.kv_item_lens),
        memory=str(layout.memory),
        kv_split=layout.kv_split,  # type: ignore[arg-type]  # "kv" or "mla"; the reader checks
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        tp_rank=layout.tp_rank,
        tp_size=layout.tp_size,
        total_kv_heads=layout.total_kv_heads,
        aux_item_lens=list(layout.aux_item_lens),
        state_types=list(layout.state_types),
        state_item_lens=[list(g) for g in layout.state_item_lens],
        extra=dict(layout.extra),
    )


def layout_from_document(doc: LayoutDoc) -> KVLayout:
    return KVLayout(
        page_size=doc.page_size,
        dtype=doc.dtype,
        num_layers=doc.num_layers,
        kv_item_lens=tuple(doc.kv_item_lens),
        memory=MemoryKind.parse(doc.memory),
        kv_split=doc.kv_split,
        num_kv_heads=doc.num_kv_heads,
        head_dim=doc.head_dim,
        tp_rank=doc.tp_rank,
        tp_size=doc.tp_size,
        total_kv_heads=doc.total_kv_heads,
        aux_item_lens=tuple(doc.aux_item_lens),
        state_types=tuple(doc.state_types),
        state_item_lens=tuple(tuple(g) for g in doc.state_item_lens),
        extra=doc.extra,
    )


def layout_to_dict(layout: KVLayout) -> dict[str, Any]:
    """A KV layout as a hello carries it (what error messages quote)."""
    doc: dict[str, Any] = msgspec.to_builtins(_layout_document(layout))
    return doc


def layout_from_dict(data: Any) -> KVLayout:
    """A KV layout document (a hello's ``layout``), read strictly; :class:`ProtocolError`."""
    return layout_from_document(parse(data, LayoutDoc, "layout"))


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
    endpoint = endpoint if endpoint is not None else default_endpoint_label()
    if len(endpoint) > MAX_ENDPOINT_LABEL:
        # Peers refuse a longer label (docs/hello.md): say so here, where it was chosen.
        raise ConfigError(f"endpoint name of {len(endpoint)} characters; at most {MAX_ENDPOINT_LABEL}")
    hello = Hello(
        endpoint=endpoint,
        host=host or probe_host(),
        drivers=dict(drivers),
        layout=layout,
        policy=policy or Policy(),
    )
    # Read back as a peer would read it: a layout or a driver this side describes out of the
    # schema's bounds fails here, at start, with the field named, not at every peer.
    try:
        parse(msgspec.to_builtins(hello.document()), HelloDoc, "hello")
    except (ValueError, ProtocolError) as exc:
        raise ConfigError(f"this side's hello would be refused by its peers: {exc}") from exc
    return hello
