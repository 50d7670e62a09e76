"""The user API: :class:`Endpoint`, :class:`Connection`, :class:`Transfer`.

One endpoint per serving-engine rank: it registers the KV regions with every usable driver
once, listens on a control address, and connects to peers. A connection's ``decision`` says
which driver moves its bytes and why. A transfer is one request's pages under a tag: the
receiver announces destination pages (:meth:`Connection.expect`), the sender writes source
pages (:meth:`Transfer.send`, in chunks, the last one marked), and both poll a
:class:`State` that maps one-to-one onto SGLang's ``KVPoll``.

Threading: caller threads validate and plan (bad page indices raise there, synchronously);
every socket and driver call happens on the endpoint's one I/O thread, which also runs the
heartbeats and the per-state timeouts.
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .control import ControlChannel, Route, advertised_host
from .driver import KVTransport
from .errors import (
    ConnectError,
    DecisionMismatch,
    InvalidPages,
    KVTransportError,
    MemoryLayoutError,
    NegotiationError,
    PeerLost,
    ProtocolError,
    TransferAborted,
    TransferTimeout,
)
from .hello import DriverHello, Hello, build_hello, describe_driver, load_drivers
from .memory import KVLayout, Region, RegionSet
from .negotiate import Decision, negotiate
from .plan import Runs, as_pages, check_pages, check_unique, plan
from .registry import Policy, warn_unknown_env_vars
from .wire import Message, decode, encode

log = logging.getLogger(__name__)

#: Early aborts remembered per connection (oldest forgotten first).
MAX_EARLY_ABORTS = 4096
#: Announcements kept per connection for transfers the sender has not created yet.
MAX_EARLY_EXPECTS = 65536


class State(enum.IntEnum):
    """Transfer states; the values equal SGLang's ``KVPoll``."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def final(self) -> bool:
        return self in (State.FAILED, State.SUCCESS)


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw else default
    except ValueError:
        log.warning("ignoring %s=%r: not a number of seconds", name, raw)
        return default


@dataclass(frozen=True)
class Timeouts:
    """Seconds each state may last, and the heartbeat settings (env vars override defaults)."""

    connect: float = 10.0
    bootstrap: float = 30.0
    waiting: float = 300.0
    transfer: float = 60.0
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 3.0
    #: How long a finished transfer stays filed under its tag (so late messages about it are
    #: recognised) before the endpoint forgets it; the caller's reference stays valid.
    retain_finished: float = 5.0

    @classmethod
    def from_env(cls) -> Timeouts:
        d = cls()
        return cls(
            connect=d.connect,
            bootstrap=_env_seconds("KVTRANSPORT_BOOTSTRAP_TIMEOUT", d.bootstrap),
            waiting=_env_seconds("KVTRANSPORT_WAITING_TIMEOUT", d.waiting),
            transfer=_env_seconds("KVTRANSPORT_TRANSFER_TIMEOUT", d.transfer),
            heartbeat_interval=_env_seconds("KVTRANSPORT_HEARTBEAT_INTERVAL", d.heartbeat_interval),
            heartbeat_timeout=_env_seconds("KVTRANSPORT_HEARTBEAT_TIMEOUT", d.heartbeat_timeout),
        )


def regions_to_dict(regions: RegionSet) -> dict[str, Any]:
    return {k: [r.to_dict() for r in getattr(regions, k)] for k in ("kv", "aux", "state")}


def regions_from_dict(data: Mapping[str, Any]) -> RegionSet:
    try:
        return RegionSet(
            kv=tuple(Region.from_dict(r) for r in data["kv"]),
            aux=tuple(Region.from_dict(r) for r in data.get("aux", ())),
            state=tuple(Region.from_dict(r) for r in data.get("state", ())),
        )
    except (KeyError, TypeError, MemoryLayoutError) as exc:
        raise ProtocolError(f"invalid region description from peer: {exc}") from exc


class Transfer:
    """One request's pages over one connection, as the sender or the receiver sees it."""

    def __init__(self, conn: Connection, tag: str, role: str, state: State) -> None:
        self.connection = conn
        self.tag = tag
        self.role = role  # "send" or "recv"
        self._state = state
        self._since = time.monotonic()
        self.error: KVTransportError | None = None
        self._final = threading.Event()
        # sender side
        self.dst_pages: npt.NDArray[np.int64] | None = None
        self.dst_aux = -1
        self.sent_pages = 0  # caller thread: pages planned so far
        self.last_planned = False  # caller thread: the last chunk was planned
        self.last_sent = False  # I/O thread: the last chunk was submitted
        self.handles: set[int] = set()
        self.bytes = 0
        self.peer_done = False  # receiver: the sender said every byte was written
        self.started = 0.0
        self.finished = 0.0

    @property
    def state(self) -> State:
        return self._state

    def poll(self) -> State:
        return self._state

    def __repr__(self) -> str:
        return f"<Transfer {self.role} {self.tag!r} {self._state.name}>"

    def wait(self, timeout: float | None = None) -> State:
        """Block until Success or Failed. Raises the transfer's error on failure, and
        :class:`TransferTimeout` if ``timeout`` passes first (the transfer goes on)."""
        if not self._final.wait(timeout):
            raise TransferTimeout(f"transfer {self.tag!r} still {self._state.name} after {timeout} s")
        if self._state is State.FAILED:
            assert self.error is not None
            raise self.error
        return self._state

    def send(self, src_pages: Any, *, last: bool = True, aux: int | None = None) -> None:
        """Write the next chunk of source pages (sender). They land on the destination pages
        the receiver announced, in order. Bad indices raise here; nothing is submitted."""
        if self.role != "send":
            raise KVTransportError("send() on a receiving transfer")
        self.connection.endpoint._send_chunk(self, src_pages, last, aux)

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Fail this transfer here and at the peer (within the heartbeat tick)."""
        self.connection.endpoint._call(lambda: self.connection.endpoint._abort(self, reason, notify=True, local=True))

    # -- I/O thread ------------------------------------------------------------------------

    def _set(self, state: State, error: KVTransportError | None = None) -> bool:
        if self._state.final:
            return False  # a failed transfer is never reported as a success later
        self._state = state
        self._since = time.monotonic()
        if state is State.TRANSFERRING and not self.started:
            self.started = self._since
        if error is not None:
            self.error = error
        if state.final:
            self.finished = self._since
            self._final.set()
            endpoint = self.connection.endpoint
            endpoint._finished.append((self._since + endpoint.timeouts.retain_finished, self))
        return True


@dataclass
class Connection:
    """A negotiated link to one peer."""

    endpoint: Endpoint
    id: str
    route: Route
    peer_label: str
    peer_address: str
    initiator: bool
    decision: Decision | None = None
    peer_regions: RegionSet | None = None
    driver: KVTransport | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    error: KVTransportError | None = None
    alive: bool = True
    last_seen: float = field(default_factory=time.monotonic)
    transfers: dict[str, Transfer] = field(default_factory=dict)
    early_expects: dict[str, Message] = field(default_factory=dict)
    #: Tags the peer aborted before this side created their transfer (tag -> reason), so a
    #: transfer created afterwards fails at once instead of waiting for its timeout.
    early_aborts: dict[str, str] = field(default_factory=dict)

    def expect(self, tag: str, dst_pages: Any, *, aux: int | None = None) -> Transfer:
        """Receiver: pages of transfer ``tag`` go to ``dst_pages`` (and aux slot ``aux``)."""
        return self.endpoint._expect(self, tag, dst_pages, aux)

    def sender(self, tag: str) -> Transfer:
        """Sender: the transfer ``tag``; it waits for the receiver's announcement."""
        return self.endpoint._sender(self, tag)

    def transfer(self, tag: str) -> Transfer | None:
        return self.transfers.get(tag)

    def __repr__(self) -> str:
        driver = self.decision.driver if self.decision else "?"
        return f"<Connection {self.id} to {self.peer_label} via {driver}>"


class _Context:
    """What a driver instance gets from its endpoint."""

    def __init__(self, endpoint: Endpoint, options: Mapping[str, str]) -> None:
        self._endpoint = endpoint
        self._options = dict(options)

    @property
    def endpoint_id(self) -> str:
        return self._endpoint.name

    @property
    def options(self) -> Mapping[str, str]:
        return self._options

    @property
    def host(self) -> str:
        return self._endpoint.host

    def send_notice(self, peer: str, payload: bytes) -> None:
        ep = self._endpoint
        data = encode("notice", payload=payload)
        if ep._channel.in_io_thread():
            ep._flush_notices()
            ep._send_to_conn_id(peer, data)
        else:
            # Queued in order; the I/O thread flushes the queue before it sends any "done", so
            # a notice a driver's worker sent before reporting a batch complete always reaches
            # the peer before the "done" that follows that batch.
            ep._notices.append((peer, data))
            ep._call(ep._flush_notices)


class Endpoint:
    """A rank's KV regions, registered once, reachable at a control address."""

    def __init__(
        self,
        regions: RegionSet,
        layout: KVLayout,
        *,
        listen: str = "tcp://127.0.0.1:0",
        drivers: Mapping[str, type[KVTransport]] | None = None,
        policy: Policy | None = None,
        name: str | None = None,
        timeouts: Timeouts | None = None,
        driver_options: Mapping[str, str] | None = None,
        max_run_bytes: int | None = None,
    ) -> None:
        if layout.kv_item_lens != regions.kv_item_lens:
            raise MemoryLayoutError(
                f"layout says KV pages of {layout.kv_item_lens[:4]}... bytes, the regions hold "
                f"{regions.kv_item_lens[:4]}...; they must match region by region"
            )
        if layout.memory != regions.kv_kind:
            raise MemoryLayoutError(f"layout says KV in {layout.memory}, regions are in {regions.kv_kind}")
        self.regions = regions
        self.layout = layout
        self.name = name or f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.timeouts = timeouts or Timeouts.from_env()
        self.max_run_bytes = max_run_bytes
        self.host = advertised_host(listen)
        if drivers is None:
            loaded = load_drivers()
            classes, hellos = loaded.classes, dict(loaded.hellos)
        else:
            classes = dict(drivers)
            hellos = {n: describe_driver(c) for n, c in classes.items()}
        warn_unknown_env_vars(driver_vars=[v for c in classes.values() for v in c.env_vars])
        self.policy = policy if policy is not None else Policy.from_env(known=hellos)
        self.classes = classes
        self.drivers: dict[str, KVTransport] = {}
        self._open_drivers(hellos, driver_options or {})
        self.hello: Hello = build_hello(self._hellos, layout=layout, policy=self.policy, endpoint=self.name)
        self._regions_doc = regions_to_dict(regions)
        self.connections: dict[str, Connection] = {}
        self._incoming: list[Connection] = []
        self._incoming_cv = threading.Condition()
        self._by_route: dict[Route, Connection] = {}
        self._warned_routes: set[Route] = set()
        self._last_ping = 0.0
        self._notices: collections.deque[tuple[str, bytes]] = collections.deque()
        self._finished: collections.deque[tuple[float, Transfer]] = collections.deque()
        self._closed = False
        self._channel = ControlChannel(listen, self._on_frame, self._on_tick)
        self.address = self._channel.address
        log.debug("endpoint %s listening on %s", self.name, self.address)

    # -- set-up ----------------------------------------------------------------------------

    def _open_drivers(self, hellos: dict[str, DriverHello], options: Mapping[str, str]) -> None:
        """Register the regions with every driver that can serve them, once each."""
        self._hellos: dict[str, DriverHello] = {}
        memory = self.regions.kv_kind
        for name, entry in hellos.items():
            cls = self.classes.get(name)
            allowed, _ = self.policy.permits(name)
            if cls is None or entry.status is None or not entry.status.serves(memory) or not allowed:
                self._hellos[name] = entry
                continue
            try:
                driver = cls(_Context(self, options))
                conn = driver.open(self.regions)
            except KVTransportError as exc:
                log.warning("driver %s could not open this endpoint's regions: %s", name, exc)
                self._hellos[name] = _unavailable(entry, f"open() failed: {exc}")
                continue
            except Exception as exc:
                log.exception("driver %s crashed in open()", name)
                self._hellos[name] = _unavailable(entry, f"open() raised {type(exc).__name__}: {exc}")
                continue
            self.drivers[name] = driver
            self._hellos[name] = DriverHello(
                name, entry.distribution, entry.api_version, entry.capabilities, entry.status, "", conn
            )

    # -- public API --------------------------------------------------------------------------

    def connect(self, address: str, timeout: float | None = None) -> Connection:
        """Handshake with the endpoint at ``address``; the connection's ``decision`` says
        which driver was chosen and why. Raises on refusal, mismatch or timeout."""
        timeout = self.timeouts.connect if timeout is None else timeout
        conn_id = uuid.uuid4().hex
        holder: list[Connection] = []

        def start() -> None:
            route = self._channel.connect(address)
            conn = Connection(self, conn_id, route, address, address, initiator=True)
            self.connections[conn_id] = conn
            self._by_route[route] = conn
            holder.append(conn)
            self._channel.send(
                route, encode("hello", conn=conn_id, hello=self.hello.to_dict(), regions=self._regions_doc)
            )

        self._call(start)
        deadline = time.monotonic() + timeout
        while not holder and time.monotonic() < deadline:
            time.sleep(0.001)
        if not holder:
            raise ConnectError(f"could not start connecting to {address}")
        conn = holder[0]
        if not conn.ready.wait(max(0.0, deadline - time.monotonic())):
            self._call(lambda: self._drop(conn))
            raise ConnectError(f"no handshake answer from {address} within {timeout} s (is an endpoint listening?)")
        if conn.error is not None:
            raise conn.error
        return conn

    def accept(self, timeout: float | None = None) -> Connection:
        """The next connection a peer opened to this endpoint."""
        with self._incoming_cv:
            if not self._incoming_cv.wait_for(lambda: bool(self._incoming), timeout):
                raise ConnectError(f"no peer connected within {timeout} s")
            return self._incoming.pop(0)

    def announced(self, tag: str) -> Connection | None:
        """The live connection whose receiver announced pages for ``tag`` (a sender that
        serves many receivers learns here which one a request belongs to), or ``None`` yet."""
        for conn in list(self.connections.values()):
            if conn.alive and conn.decision is not None and (tag in conn.early_expects or tag in conn.early_aborts):
                return conn
        return None

    def close(self) -> None:
        """Tell peers, fail what is in flight, release every driver. Idempotent."""
        if self._closed:
            return
        self._closed = True

        def final() -> None:
            for conn in list(self.connections.values()):
                if conn.alive:
                    self._channel.send(conn.route, encode("bye", reason="endpoint closed"))
                self._fail_connection(conn, TransferAborted(f"endpoint {self.name} closed"), notify=False)

        self._channel.close(final)
        for name, driver in self.drivers.items():
            try:
                driver.close()
            except Exception:
                log.exception("driver %s failed to close", name)

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- caller-thread halves of the transfer API --------------------------------------------

    def _call(self, fn: Any) -> None:
        if self._closed:
            raise KVTransportError(f"endpoint {self.name} is closed")
        self._channel.call_soon(fn)

    def _expect(self, conn: Connection, tag: str, dst_pages: Any, aux: int | None) -> Transfer:
        pages = as_pages(dst_pages, f"transfer {tag!r} destination")
        check_pages(pages, self.regions.num_pages, f"transfer {tag!r} destination")
        check_unique(pages, f"transfer {tag!r} destination")
        if aux is not None:
            self._check_aux(aux, self.regions, f"transfer {tag!r} destination aux")
        transfer = Transfer(conn, tag, "recv", State.WAITING_FOR_INPUT)

        def announce() -> None:
            if not self._register(conn, transfer):
                return
            self._channel.send(
                conn.route, encode("expect", tag=tag, pages=pages.tobytes(), aux=-1 if aux is None else int(aux))
            )

        self._call(announce)
        return transfer

    def _sender(self, conn: Connection, tag: str) -> Transfer:
        transfer = Transfer(conn, tag, "send", State.BOOTSTRAPPING)

        def register() -> None:
            if not self._register(conn, transfer):
                return
            early = conn.early_expects.pop(tag, None)
            if early is not None:
                self._on_expect(conn, early)

        self._call(register)
        return transfer

    def _register(self, conn: Connection, transfer: Transfer) -> bool:
        """I/O thread: file ``transfer`` under its tag; fail it at once if it cannot proceed."""
        if transfer.tag in conn.transfers:
            transfer._set(State.FAILED, KVTransportError(f"tag {transfer.tag!r} is already in use on this connection"))
            return False
        conn.transfers[transfer.tag] = transfer
        if not conn.alive:
            transfer._set(State.FAILED, conn.error or PeerLost(f"peer {conn.peer_label} is gone"))
            return False
        reason = conn.early_aborts.pop(transfer.tag, None)
        if reason is not None:
            transfer._set(
                State.FAILED,
                TransferAborted(f"transfer {transfer.tag!r} aborted by peer {conn.peer_label}: {reason}"),
            )
            return False
        return True

    def _check_aux(self, index: int, regions: RegionSet, what: str) -> None:
        if not regions.aux:
            raise InvalidPages(f"{what}: no aux regions are registered")
        check_pages(np.array([index], dtype=np.int64), min(r.num_items for r in regions.aux), what)

    def _send_chunk(self, transfer: Transfer, src_pages: Any, last: bool, aux: int | None) -> None:
        conn = transfer.connection
        if transfer.state.final:
            raise transfer.error or KVTransportError(f"transfer {transfer.tag!r} already finished")
        if transfer.dst_pages is None:
            raise KVTransportError(
                f"transfer {transfer.tag!r} is {transfer.state.name}: the receiver has not announced "
                "its pages yet; poll until WAITING_FOR_INPUT"
            )
        if transfer.last_planned:
            raise KVTransportError(f"transfer {transfer.tag!r}: the last chunk was already sent")
        assert conn.peer_regions is not None
        src = as_pages(src_pages, f"transfer {transfer.tag!r} source")
        start, stop = transfer.sent_pages, transfer.sent_pages + src.size
        announced = transfer.dst_pages.size
        if stop > announced or (last and stop != announced):
            raise InvalidPages(
                f"transfer {transfer.tag!r}: the receiver announced {announced} pages; this chunk "
                f"would make {stop}{' (the last chunk must complete them)' if last else ''}"
            )
        runs = plan(
            self.regions.kv, conn.peer_regions.kv, src, transfer.dst_pages[start:stop], max_run_bytes=self.max_run_bytes
        )
        if last and aux is not None:
            if transfer.dst_aux < 0:
                raise InvalidPages(f"transfer {transfer.tag!r}: aux sent but the receiver announced no aux slot")
            self._check_aux(aux, self.regions, f"transfer {transfer.tag!r} source aux")
            runs = Runs.concat([runs, plan(self.regions.aux, conn.peer_regions.aux, [aux], [transfer.dst_aux])])
        transfer.sent_pages = stop
        transfer.last_planned = last
        self._call(lambda: self._submit(transfer, runs, last))

    # -- I/O thread ----------------------------------------------------------------------------

    def _submit(self, transfer: Transfer, runs: Runs, last: bool) -> None:
        conn = transfer.connection
        if transfer.state.final:
            return
        transfer._set(State.TRANSFERRING)
        transfer.last_sent = last
        assert conn.driver is not None
        if len(runs):
            try:
                transfer.handles.add(conn.driver.submit(conn.id, runs))
            except KVTransportError as exc:
                self._abort(
                    transfer, f"{conn.decision.driver if conn.decision else 'driver'}: {exc}", notify=True, error=exc
                )
                return
            transfer.bytes += runs.total_bytes
        self._progress(transfer)

    def _progress(self, transfer: Transfer) -> None:
        conn = transfer.connection
        assert conn.driver is not None
        for handle in list(transfer.handles):
            try:
                done = conn.driver.poll(handle)
            except KVTransportError as exc:
                transfer.handles.discard(handle)
                self._abort(
                    transfer, f"{conn.decision.driver if conn.decision else 'driver'}: {exc}", notify=True, error=exc
                )
                return
            if done:
                transfer.handles.discard(handle)
        if transfer.last_sent and not transfer.handles and transfer.state is State.TRANSFERRING:
            self._flush_notices()
            self._channel.send(conn.route, encode("done", tag=transfer.tag, bytes=transfer.bytes))
            transfer._set(State.SUCCESS)

    def _abort(
        self,
        transfer: Transfer,
        reason: str,
        *,
        notify: bool,
        local: bool = False,
        error: KVTransportError | None = None,
    ) -> None:
        if transfer.state.final:
            return
        conn = transfer.connection
        for handle in transfer.handles:
            if conn.driver is not None:
                try:
                    conn.driver.abort(handle)
                except Exception:
                    log.exception("driver abort failed")
        transfer.handles.clear()
        if error is None:
            error = TransferAborted(f"transfer {transfer.tag!r} aborted {'locally' if local else ''}: {reason}")
        transfer._set(State.FAILED, error)
        if notify and conn.alive:
            self._channel.send(conn.route, encode("abort", tag=transfer.tag, reason=reason))

    def _flush_notices(self) -> None:
        while self._notices:
            peer, data = self._notices.popleft()
            self._send_to_conn_id(peer, data)

    def _send_to_conn_id(self, conn_id: str, data: bytes) -> None:
        conn = self.connections.get(conn_id)
        if conn is not None and conn.alive:
            self._channel.send(conn.route, data)

    def _on_frame(self, route: Route, frame: bytes) -> None:
        conn = self._by_route.get(route)
        if conn is not None:
            conn.last_seen = time.monotonic()
        try:
            msg = decode(frame)
        except ProtocolError as exc:
            self._warn_once(route, f"bad control message from {self._describe(route)}: {exc}")
            return
        try:
            if msg.type == "hello":
                self._on_hello(route, msg)
            elif conn is None:
                self._warn_once(route, f"{msg.type} message from {self._describe(route)} before any handshake")
            else:
                self._dispatch(conn, msg)
        except ProtocolError as exc:
            self._warn_once(route, f"invalid {msg.type} message from {self._describe(route)}: {exc}")

    def _dispatch(self, conn: Connection, msg: Message) -> None:
        kind = msg.type
        if kind == "welcome":
            self._on_welcome(conn, msg)
        elif kind == "refuse":
            conn.error = NegotiationError(f"{conn.peer_address} refused the connection: {msg['reason']}")
            conn.alive = False
            conn.ready.set()
        elif kind == "expect":
            self._on_expect(conn, msg)
        elif kind == "done":
            t = conn.transfers.get(msg["tag"])
            if t is None:
                # A transfer this side already failed and forgot (timeout, abort): a benign race.
                log.debug("done for %r from %s, which is no longer tracked", msg["tag"], conn.peer_label)
                return
            if t.role != "recv":
                raise ProtocolError(f"done for transfer {msg['tag']!r}, which this side sends")
            t.bytes = int(msg["bytes"])
            t.peer_done = True
            self._finish_receive(conn, t)
        elif kind == "abort":
            t = conn.transfers.get(msg["tag"])
            if t is not None:
                self._abort(
                    t,
                    f"aborted by peer {conn.peer_label}: {msg['reason']}",
                    notify=False,
                    error=TransferAborted(f"transfer {t.tag!r} aborted by peer {conn.peer_label}: {msg['reason']}"),
                )
            else:
                conn.early_expects.pop(msg["tag"], None)
                conn.early_aborts[msg["tag"]] = str(msg["reason"])
                while len(conn.early_aborts) > MAX_EARLY_ABORTS:
                    conn.early_aborts.pop(next(iter(conn.early_aborts)))
        elif kind == "notice":
            if conn.driver is None:
                raise ProtocolError("notice before the driver was connected")
            conn.driver.on_notice(conn.id, msg["payload"])
        elif kind == "bye":
            self._fail_connection(
                conn, PeerLost(f"peer {conn.peer_label} closed its endpoint ({msg['reason']})"), notify=False
            )
        # "ping" needs nothing beyond last_seen

    def _finish_receive(self, conn: Connection, t: Transfer) -> None:
        """Success once the bytes are in this KV pool: for a two-sided driver, only after its
        inbound work (e.g. the copy-in from a staging ring) has drained."""
        assert conn.driver is not None
        try:
            idle = conn.driver.inbound_idle(conn.id)
        except KVTransportError as exc:
            # The driver found the peer's inbound data unusable (e.g. a chunk notice pointing
            # outside this pool): nothing from that peer can be trusted to be in place.
            self._fail_connection(conn, exc, notify=True)
            return
        if idle:
            t._set(State.SUCCESS)
        elif t.state is State.WAITING_FOR_INPUT:
            t._set(State.TRANSFERRING)

    def _on_hello(self, route: Route, msg: Message) -> None:
        conn_id = msg["conn"]
        try:
            peer_hello = Hello.from_dict(msg["hello"])
            peer_regions = regions_from_dict(msg["regions"])
            decision = negotiate(peer_hello, self.hello, self.classes)
            driver = self.drivers.get(decision.driver)
            if driver is None:
                raise NegotiationError(f"{decision.driver} was chosen but is not open on {self.name}")
            peer_info = peer_hello.drivers[decision.driver].conn
            driver.connect(conn_id, peer_info, peer_regions)
        except KVTransportError as exc:
            log.warning("refusing connection from %s: %s", self._describe(route), exc)
            self._channel.send(route, encode("refuse", conn=conn_id, reason=f"{type(exc).__name__}: {exc}"))
            return
        conn = Connection(
            self,
            conn_id,
            route,
            peer_hello.label(),
            "",
            initiator=False,
            decision=decision,
            peer_regions=peer_regions,
            driver=driver,
        )
        self.connections[conn_id] = conn
        self._by_route[route] = conn
        log.info("accepted %s from %s: %s", conn_id[:8], conn.peer_label, decision.summary())
        self._channel.send(
            route,
            encode(
                "welcome",
                conn=conn_id,
                hello=self.hello.to_dict(),
                regions=self._regions_doc,
                decision=decision.to_dict(),
            ),
        )
        conn.ready.set()
        with self._incoming_cv:
            self._incoming.append(conn)
            self._incoming_cv.notify_all()

    def _on_welcome(self, conn: Connection, msg: Message) -> None:
        try:
            peer_hello = Hello.from_dict(msg["hello"])
            conn.peer_label = peer_hello.label()
            conn.peer_regions = regions_from_dict(msg["regions"])
            decision = negotiate(self.hello, peer_hello, self.classes)
            theirs = msg["decision"]
            if (theirs.get("driver"), theirs.get("path")) != (decision.driver, decision.path.value):
                raise DecisionMismatch(
                    f"{conn.peer_label} chose {theirs.get('driver')} ({theirs.get('path')}), this side "
                    f"computes {decision.driver} ({decision.path.value}); are both sides running the same "
                    "kvtransport and driver versions?"
                )
            driver = self.drivers[decision.driver]
            driver.connect(conn.id, peer_hello.drivers[decision.driver].conn, conn.peer_regions)
        except KVTransportError as exc:
            conn.error = exc
            conn.alive = False
            self._channel.send(conn.route, encode("bye", reason=f"handshake failed: {exc}"))
        except KeyError as exc:
            conn.error = NegotiationError(f"handshake with {conn.peer_label} failed: missing {exc}")
            conn.alive = False
        else:
            conn.decision, conn.driver = decision, driver
            log.info("connected %s to %s: %s", conn.id[:8], conn.peer_label, decision.summary())
        conn.ready.set()

    def _on_expect(self, conn: Connection, msg: Message) -> None:
        tag = msg["tag"]
        t = conn.transfers.get(tag)
        if t is None:
            conn.early_expects[tag] = msg
            if len(conn.early_expects) > MAX_EARLY_EXPECTS:
                dropped = next(iter(conn.early_expects))
                conn.early_expects.pop(dropped)
                log.warning(
                    "%s announced more than %d transfers nobody sends; forgetting the oldest (%r)",
                    conn.peer_label,
                    MAX_EARLY_EXPECTS,
                    dropped,
                )
            return
        if t.role != "send" or t.dst_pages is not None:
            self._channel.send(conn.route, encode("abort", tag=tag, reason="duplicate announcement"))
            return
        raw = msg["pages"]
        assert conn.peer_regions is not None
        try:
            if len(raw) % 8:
                raise InvalidPages(f"page list of {len(raw)} bytes is not a whole number of int64")
            pages = np.frombuffer(raw, dtype=np.int64).copy()
            check_pages(pages, conn.peer_regions.num_pages, f"pages announced by {conn.peer_label}")
            check_unique(pages, f"pages announced by {conn.peer_label}")
            if msg["aux"] >= 0:
                self._check_aux(msg["aux"], conn.peer_regions, f"aux slot announced by {conn.peer_label}")
        except InvalidPages as exc:
            self._abort(t, str(exc), notify=True, error=exc)
            return
        t.dst_pages, t.dst_aux = pages, int(msg["aux"])
        t._set(State.WAITING_FOR_INPUT)

    def _fail_connection(self, conn: Connection, error: KVTransportError, *, notify: bool) -> None:
        was_alive = conn.alive
        for t in list(conn.transfers.values()):
            self._abort(t, str(error), notify=notify, error=error)
        conn.alive = False
        conn.error = conn.error or error
        if was_alive and conn.driver is not None:
            try:
                conn.driver.disconnect(conn.id)
            except Exception:
                log.exception("driver disconnect failed")
        conn.ready.set()

    def _drop(self, conn: Connection) -> None:
        self._fail_connection(conn, ConnectError(f"gave up connecting to {conn.peer_address}"), notify=False)
        self._by_route.pop(conn.route, None)
        self._channel.disconnect(conn.route)

    def _forget_finished(self, now: float) -> None:
        """Drop transfers that finished ``retain_finished`` ago, so a long-running endpoint does
        not grow with every request it ever served."""
        while self._finished and self._finished[0][0] <= now:
            _, t = self._finished.popleft()
            conn = t.connection
            if conn.transfers.get(t.tag) is t:
                del conn.transfers[t.tag]

    def _on_tick(self) -> None:
        now = time.monotonic()
        self._forget_finished(now)
        ping_due = now - self._last_ping >= self.timeouts.heartbeat_interval
        if ping_due:
            self._last_ping = now
        for conn in list(self.connections.values()):
            if not conn.alive or conn.decision is None:
                continue
            if now - conn.last_seen > self.timeouts.heartbeat_timeout:
                self._fail_connection(
                    conn,
                    PeerLost(
                        f"peer {conn.peer_label} stopped answering: no message for "
                        f"{now - conn.last_seen:.1f} s (heartbeat timeout {self.timeouts.heartbeat_timeout} s)"
                    ),
                    notify=False,
                )
                continue
            if ping_due:
                self._channel.send(conn.route, encode("ping", seq=int(now * 1000)))
            for t in list(conn.transfers.values()):
                if t.role == "recv" and t.peer_done and not t.state.final:
                    self._finish_receive(conn, t)
                elif t.state is State.TRANSFERRING:
                    self._progress(t)
                self._check_timeout(t, now)

    def _check_timeout(self, t: Transfer, now: float) -> None:
        limits = {
            State.BOOTSTRAPPING: self.timeouts.bootstrap,
            State.WAITING_FOR_INPUT: self.timeouts.waiting + (self.timeouts.transfer if t.role == "recv" else 0.0),
            State.TRANSFERRING: self.timeouts.transfer,
        }
        limit = limits.get(t.state)
        if limit is not None and now - t._since > limit:
            state = t.state.name
            self._abort(
                t,
                f"timed out in {state} after {limit:g} s",
                notify=True,
                error=TransferTimeout(f"transfer {t.tag!r} spent more than {limit:g} s in {state}"),
            )

    def _warn_once(self, route: Route, text: str) -> None:
        if route not in self._warned_routes:
            self._warned_routes.add(route)
            log.warning("%s (further problems from this peer are logged at DEBUG)", text)
        else:
            log.debug("%s", text)

    def _describe(self, route: Route) -> str:
        conn = self._by_route.get(route)
        if conn is not None:
            return f"{conn.peer_label}"
        return route[1] if route[0] == "out" else f"peer {bytes(route[1]).hex()}"


def _unavailable(entry: DriverHello, reason: str) -> DriverHello:
    from .driver import DriverStatus

    status = DriverStatus(False, reason)
    return DriverHello(entry.name, entry.distribution, entry.api_version, entry.capabilities, status)
