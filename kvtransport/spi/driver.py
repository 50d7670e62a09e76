"""The driver SPI: what a transfer driver implements, and the value types it exchanges.

A driver only moves bytes between registered regions. The core owns discovery, negotiation,
planning, the control channel and the user API. A driver class declares, as class attributes
readable without importing its engine:

- ``name``: the entry-point name (``nixl-ucx``);
- ``api_version``: the ``DRIVER_API_VERSION`` it was written against;
- ``capabilities``: the memory families it reads and writes, whether it needs the peer on the
  same host, whether it is two-sided (the receiver acts on each arrival).

Each concrete class must declare all three itself: a subclass of a working driver does not
inherit "supports device memory" by accident (``__init_subclass__`` enforces it).

Life of a driver instance, driven by the core:

1. ``probe()`` (class method) says whether this host can use it, and why not;
2. ``offer(local, remote)`` (class method, pure) says whether it can serve a pair of peers, by
   which path and at what estimated bandwidth;
3. ``open(regions)`` registers the endpoint's regions once and returns connection info;
4. ``connect(peer, info, peer_regions)`` once per peer;
5. ``submit(peer, runs)`` / ``poll(handle)`` for each batch of coalesced runs; a driver that
   knows when a batch finishes says so with ``context.completed(handle)`` (and declares
   ``signals_completion = True``), one that does not is polled with back-off;
6. ``on_notice(peer, payload)`` on the receiver, for two-sided drivers;
7. ``fence(peer)`` once the connection with ``peer`` ended, then ``disconnect(peer)``;
   ``abort(handle)``; ``close()``.

A driver that gives each peer a receiving side of its own (``receives_per_peer``) is asked for
it with ``receive_info(peer)`` during the handshake, before ``connect``; that info, not the
endpoint-wide one ``open`` returned, is what the peer's driver gets in its ``connect``.

Threads (API version 2): ``open`` and ``close`` run on the thread that creates / closes the
endpoint; every call in between runs on one thread per driver instance, the endpoint's runner
for it (never the I/O thread), so a driver needs no locks for the core's sake. A driver that
declares ``thread_agnostic`` gets calls on other threads too, one at a time, while its runner
is idle: ``submit``/``poll`` on the sender's thread, ``on_notice``/``inbound_idle``/``expecting``
on the I/O thread. The context's
``send_notice``, ``completed`` and ``inbound_progress`` may be called from any thread.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from kvtransport.spi.memory import MemoryKind, RegionSet

if TYPE_CHECKING:
    from kvtransport.spi.plan import Runs
    from kvtransport.spi.probe import HostInfo

#: Bumped when the SPI changes incompatibly. The registry rejects drivers built for another one.
#: 2: calls on a runner thread, completion signals, ``pending()``, handles released on abort.
DRIVER_API_VERSION = 2
#: The longest a driver's ``fence`` waits for inbound work already under way to finish.
FENCE_WAIT_S = 5.0
#: Live per-connection receive sides a ``receives_per_peer`` driver makes at most (each is an
#: engine or agent: threads, descriptors, memory); past it ``receive_info`` refuses, and the
#: connection uses the endpoint-wide info (its fence then cannot cut that peer off alone).
MAX_RECEIVE_SIDES = 128


class TransferPath(enum.StrEnum):
    """How the bytes would travel; shown to the user in every decision."""

    RDMA = "rdma"
    TCP = "tcp"
    SHM = "shm"
    NVLINK = "nvlink"
    PCIE = "pcie"
    PCIE_STAGED = "pcie-staged"
    MEMCPY = "memcpy"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Capabilities:
    """What a driver class can do, declared without importing its engine.

    ``reads`` and ``writes`` are memory families (``host``, ``cuda``) the driver can move
    bytes from and into. ``same_host_only``: the peer must share this host's host id.
    ``two_sided``: the receiver must act on each arrival (``on_notice``) before pages are in
    place, so the core waits for it before reporting success. ``gathers``: the driver moves a
    batch's runs through a staging ring as large chunks, so its cost hardly grows with the
    number of runs (pages sliced by KV head, unequal TP, are 16 short runs a page where a
    direct driver pays per descriptor); the negotiation prefers such a driver for sliced pages.
    """

    reads: frozenset[str]
    writes: frozenset[str]
    same_host_only: bool = False
    two_sided: bool = False
    gathers: bool = False


@dataclass(frozen=True)
class DriverStatus:
    """A driver's probe result: usable here or not, why, and how to fix it.

    ``memory`` lists the memory families this host can serve through the driver (``host``,
    ``cuda``); ``memory_notes`` says why a family is missing ("no GDR on cuda:0: ..."). ``info``
    holds facts the driver's ``offer`` needs from both sides (protocol, UCX transports, versions):
    flat strings so the hello stays JSON.
    """

    available: bool
    reason: str
    fix: str = ""
    version: str = ""
    memory: tuple[str, ...] = ()
    memory_notes: Mapping[str, str] = field(default_factory=dict)
    info: Mapping[str, str] = field(default_factory=dict)

    def serves(self, kind: MemoryKind) -> bool:
        return self.available and kind.family in self.memory

    def why_not(self, kind: MemoryKind) -> str:
        """Why this driver cannot serve ``kind`` here (empty if it can)."""
        if not self.available:
            return self.reason + (f" (fix: {self.fix})" if self.fix else "")
        if kind.family not in self.memory:
            note = self.memory_notes.get(kind.family, f"{kind.family} memory not supported")
            return note
        return ""


@dataclass(frozen=True)
class PeerView:
    """One side of a pair as a driver's ``offer`` sees it (built from that side's hello)."""

    host: HostInfo
    status: DriverStatus | None  # None: the driver is not installed on that side
    kv_memory: MemoryKind


@dataclass(frozen=True)
class Offer:
    """A driver can serve the pair: by ``path``, at about ``gbps`` GB/s."""

    path: TransferPath
    gbps: float
    note: str = ""


@dataclass(frozen=True)
class Rejection:
    """A driver cannot serve the pair, and why, in words a user can act on."""

    reason: str


class DriverContext(Protocol):
    """What the core gives a driver instance."""

    @property
    def endpoint_id(self) -> str: ...

    @property
    def options(self) -> Mapping[str, str]: ...

    @property
    def host(self) -> str:
        """The host name or IP the endpoint listens on; an engine with its own data port binds
        there unless the user configured it otherwise, so one setting places both."""
        ...

    def send_notice(self, peer: str, payload: bytes) -> None:
        """Deliver ``payload`` to the peer driver's ``on_notice`` over the control channel
        (in order, and before the "done" of any batch reported complete after this call)."""

    def completed(self, handle: int) -> None:
        """Batch ``handle`` has finished (succeeded or failed): the core polls it now instead
        of at its next back-off step. Any thread; a signal for an unknown handle is ignored."""

    def inbound_progress(self, peer: str) -> None:
        """Two-sided receiver: inbound work for ``peer`` moved on; ``inbound_idle`` is asked
        again now. Any thread."""

    def check_inbound(self, peer: str, dst: Any, length: Any) -> bool:
        """Two-sided receiver, before writing anything a peer asked for: ``True`` when every
        piece ``[dst[i], dst[i] + length[i])`` (uint64 arrays, or lists of ints) lies in pages
        or aux slots that a live transfer of ``peer`` announced; ``False`` when some land on
        pages of a transfer of
        ``peer`` that failed moments ago (late data: write none of it, it is not an error);
        raises :class:`~kvtransport.spi.errors.InvalidPages` for anything else."""


class KVTransport(ABC):
    """Base class of every driver. See the module docstring for the life cycle.

    Rules for implementers (MUST / MUST NOT):

    - ``probe`` and ``offer`` MUST NOT raise; they return a status / a rejection with a reason.
      ``probe`` MUST be fast (well under a second) and MAY import the engine; ``offer`` MUST be
      a pure, deterministic function of its arguments.
    - The engine MUST be imported lazily, inside ``probe`` / ``__init__`` / ``open``, never at
      module import time, so that listing drivers imports no engine.
    - ``open`` registers memory exactly once per region and MUST NOT be called twice.
    - ``submit`` MUST only touch bytes inside regions given to ``open`` (locally) and the peer
      regions given to ``connect``; the core has bounds-checked every run already.
    - ``poll`` returns ``True`` once every byte of the batch is at the destination (for a
      one-sided driver: the write completed remotely), ``False`` while in flight, and raises an
      :class:`~kvtransport.spi.errors.EngineError` (or a plain
      :class:`~kvtransport.spi.errors.TransferError`; engine errors mapped, chained with ``from``)
      when the batch failed: a failure of the data path, which the core fails over to another
      lane of the connection where it has one. A batch MUST NOT be reported done if any part of
      it failed.
    - Native engine errors MUST be mapped to kvtransport errors inside the driver.
    - Handles are owned: once ``poll`` has returned ``True`` or raised, or ``abort`` was called,
      the driver MUST hold nothing for that handle (``pending()`` no longer counts it) and the
      core never uses it again. ``disconnect(peer)`` MUST fail or release every batch to ``peer``.
    - ``pending()`` MUST return how many handles the driver still holds (in flight, or finished
      and not yet polled); the conformance suite checks it returns to zero.
    - ``abort`` and ``close`` MUST NOT block longer than the engine's own cancellation.
    - ``close`` MUST be idempotent and MUST NOT raise; it releases everything ``open`` acquired.
      ``open`` that fails MUST release what it acquired before raising.
    - A two-sided driver MUST check every inbound piece with ``context.check_inbound`` before
      writing it into KV memory.
    - ``fence(peer)`` MUST answer ``True`` only when no byte of ``peer`` can land in this
      endpoint's memory any more, whatever the peer does next (tests/test_fence.py: a stopped
      prefill resumed, and a partition healed, after the fence).
    """

    name: ClassVar[str]
    api_version: ClassVar[int]
    capabilities: ClassVar[Capabilities]
    #: Environment variables the driver reads (so the core does not warn about them).
    env_vars: ClassVar[tuple[str, ...]] = ()
    #: The driver calls ``context.completed(handle)`` when a batch finishes, so the core need
    #: not poll it often (it still polls rarely, as a safety net).
    signals_completion: ClassVar[bool] = False
    #: The engine must be driven on the receiving side too while bytes may arrive (UCX without
    #: a busy progress thread): the core calls ``progress()`` with back-off while any transfer
    #: of this driver is receiving here, and never when none is.
    progress_while_receiving: ClassVar[bool] = False
    #: ``submit`` and ``poll`` may run on the thread that calls ``Transfer.send`` and on the
    #: thread that calls ``context.completed``, when the driver's thread has nothing queued or
    #: running: a thread hop fewer each (the hops, not the engine, are most of a small
    #: request's latency). A two-sided driver's ``on_notice``, ``inbound_idle`` and
    #: ``expecting`` may run on the I/O thread likewise. Calls stay one at a time; declare it
    #: only if the engine does not care which thread calls it and none of those calls blocks.
    thread_agnostic: ClassVar[bool] = False
    #: The driver gives each peer a receiving side of its own (an engine, agent or registration
    #: that only that peer writes into), so that ``fence`` can cut one peer off without touching
    #: the others: the core asks ``receive_info(peer)`` during every handshake.
    receives_per_peer: ClassVar[bool] = False
    #: ``"module:Class"`` of a :class:`~kvtransport.tools.baseline.RawEngine` that drives the same
    #: engine directly, for ``kvtransport bench`` to compare against; empty if none.
    raw_engine: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            return  # an abstract intermediate class, not a driver
        missing = [a for a in ("api_version", "capabilities") if a not in cls.__dict__]
        if missing:
            raise TypeError(
                f"driver class {cls.__qualname__} ({cls.__dict__['name']!r}) must declare "
                f"{', '.join(missing)} itself; capability claims are never inherited"
            )
        if not isinstance(cls.__dict__["capabilities"], Capabilities):
            raise TypeError(f"{cls.__qualname__}.capabilities must be a Capabilities instance")

    def __init__(self, context: DriverContext) -> None:
        self.context = context

    # -- discovery and negotiation (class level, no instance needed) ----------------------

    @classmethod
    @abstractmethod
    def probe(cls) -> DriverStatus:
        """Whether this host can use the driver, with the precise reason and fix."""

    @classmethod
    @abstractmethod
    def offer(cls, local: PeerView, remote: PeerView) -> Offer | Rejection:
        """Whether the driver can move KV from ``local`` to ``remote``; pure."""

    # -- data path ------------------------------------------------------------------------

    @abstractmethod
    def open(self, regions: RegionSet) -> bytes:
        """Register ``regions`` with the engine (once) and return this side's connection info."""

    @abstractmethod
    def connect(self, peer: str, info: bytes, peer_regions: RegionSet) -> None:
        """Prepare to exchange bytes with ``peer``, given its connection info and regions."""

    @abstractmethod
    def submit(self, peer: str, runs: Runs) -> int:
        """Start writing ``runs`` (local src -> peer dst) and return a handle for ``poll``."""

    @abstractmethod
    def poll(self, handle: int) -> bool:
        """``True`` when the batch is complete, ``False`` while in flight; raises on failure."""

    def on_notice(self, peer: str, payload: bytes) -> None:
        """Receiver side of a two-sided driver: act on a notice the peer's driver sent."""
        raise NotImplementedError(f"{self.name} is one-sided and sends no notices")

    def inbound_idle(self, peer: str) -> bool:
        """Receiver side of a two-sided driver: ``False`` while work caused by ``peer``'s
        notices (a copy-in from a staging ring) is still running. The core reports a received
        transfer as Success only once this returns ``True``; one-sided drivers keep the default."""
        return True

    def expecting(self, peer: str, nbytes: int) -> None:  # noqa: B027 - optional hook
        """Receiver side of a two-sided driver, optional: a transfer of ``nbytes`` from ``peer``
        was just announced (called before the announcement goes out). A driver may get ready
        for it, as the staged ones lend ring slots ahead so that a small transfer needs no
        credit round trip. A hint: the transfer may never come, or come on another driver.
        Must not block; runs on the I/O thread when the driver is ``thread_agnostic`` and its
        thread is idle, else on the driver's thread, and the announcement waits for it (up to
        ``session.EXPECTING_WAIT_S``), so what it sends reaches the peer first."""

    def progress(self) -> None:  # noqa: B027 - optional hook
        """Drive the engine once (receiver side; see ``progress_while_receiving``)."""

    @abstractmethod
    def abort(self, handle: int) -> None:
        """Stop a batch and forget its handle (the core never polls it again)."""

    def settled(self, handle: int) -> bool:
        """After :meth:`abort`: ``True`` once no write of that batch can land in the peer's
        memory any more. The core tells the receiver so (a serving engine may then reuse the
        pages). The default suits engines whose abort stops the batch before it returns; one
        that cannot cancel what it posted (Mooncake) answers ``False`` until it finished.
        Never blocks; may forget the handle once it answered ``True``."""
        return True

    @abstractmethod
    def pending(self) -> int:
        """Handles this driver still holds: in flight, or finished but not yet polled."""

    def gauges(self) -> Mapping[str, float]:
        """Optional: what the driver holds now, for the endpoint's metrics (e.g. a staging
        ring's slots in use). Called from any thread; cheap; never raises."""
        return {}

    def receive_info(self, peer: str) -> bytes:
        """``receives_per_peer`` drivers: create the receiving side ``peer`` alone will write
        into, and return the connection info the peer's driver gets in its ``connect`` (the
        same shape as ``open``'s). Called on the driver's thread during the handshake, before
        ``connect(peer, ...)``; ``disconnect(peer)`` follows in every case (also when another
        driver was chosen). ``b""``: the endpoint-wide info serves this peer."""
        return b""

    def fence(self, peer: str) -> bool:
        """The connection with ``peer`` ended: make sure no byte ``peer`` sent, or its engine
        still holds, can land in this endpoint's memory any more, and say so with ``True``
        (the core then gives the pages it announced to ``peer`` back to the serving engine).
        ``False``: this driver cannot promise it; the pages stay held (a serving engine frees
        them at its own timeout). Runs on the driver's thread, before ``disconnect(peer)``; may
        block for a moment (at most ``FENCE_WAIT_S``), never raises for a peer it does not know.

        The fence must hold for as long as the peer might still write: a stopped process that
        resumes, a partition that heals and delivers what the network held, an engine that
        reconnects with writes still queued. Closing a connection is not enough for an engine
        that reconnects on its own; refusing the peer's writes (its own receive side closed or
        its memory registration revoked) is.

        The default: a two-sided driver checks every inbound piece with
        ``context.check_inbound``, which refuses a peer whose connection ended, so it is fenced
        once its inbound work already under way is done (``inbound_idle``); a one-sided driver
        cannot promise anything by default."""
        if not type(self).capabilities.two_sided:
            return False
        deadline = time.monotonic() + FENCE_WAIT_S
        while not self.inbound_idle(peer):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def disconnect(self, peer: str) -> None:  # noqa: B027 - optional hook
        """Forget ``peer``; its in-flight batches fail."""

    def closing(self) -> None:
        """The endpoint is closing: the peers' disconnects and then :meth:`close` follow on the
        driver's thread. Called once, on the thread that closes the endpoint, before any of
        them; it must not block on the driver's thread. An engine that must not be driven
        while its peers tear down (``nixl-ucx``) stops driving here. Default: nothing."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release everything the driver registered or started. Idempotent."""


def declared_capabilities(cls: type[KVTransport]) -> Capabilities:
    """The capabilities ``cls`` itself declares (never an ancestor's)."""
    caps = cls.__dict__.get("capabilities")
    if not isinstance(caps, Capabilities):
        raise TypeError(f"{cls.__qualname__} declares no capabilities of its own")
    return caps
