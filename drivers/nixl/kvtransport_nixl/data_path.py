"""The NIXL data path of ``nixl-ucx``: one agent per endpoint, regions registered once, WRITE
transfers built from the planner's runs, completion read from NIXL's transfer state.

The connection info carried in the hello is the agent's own metadata blob (what
``add_remote_agent`` takes), so no side channel or metadata server is involved.

Receiving, each peer writes into an agent of its own (``receive_info``: a NIXL agent with this
endpoint's regions registered, made for that connection alone), so that ``fence`` can cut one
peer off: it severs that agent's UCX connections (``process_sockets``: UCX then fails the
peer's endpoint and never reconnects it, so nothing the peer still holds can follow) and
withdraws its registrations. Between processes of one host UCX writes by cross-memory attach
(``process_vm_writev``), which no receiver can stop: a peer there is fenced only once its
process has ended (checked by pid and start time); until then the pages it was announced stay
held (docs/drivers/nixl-ucx.md). Every NIXL
call that can fail is wrapped: NIXL raises its own exception types (``nixlBackendError``,
``nixlInvalidParamError``...) or reports ``"ERR"``; both become kvtransport errors naming the
driver, the backend and what NIXL said.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgpack
import numpy as np

from kvtransport.spi import process_sockets
from kvtransport.spi.driver import MAX_RECEIVE_SIDES, DriverContext, KVTransport
from kvtransport.spi.errors import DriverError, DriverUnavailable, EngineError
from kvtransport.spi.memory import MemoryKind, RegionSet
from kvtransport.spi.plan import Runs
from kvtransport.spi.probe import probe_host
from kvtransport.spi.spares import Spares

from .engine_probe import RDMA_TLS, WRITER_COPIES_TLS, allows, probe_nixl, quiet_nixl_logging
from .posters import Part, Posters, posters_from_env, split_points
from .rails import DEVICE_LIST, net_devices

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How many times ``close`` retries releasing a handle NIXL could not cancel at once.
_RELEASE_RETRIES = 50
#: How long ``disconnect`` waits for the helpers' parts of that peer's batches to stop.
DISCONNECT_GRACE_S = 5.0
#: How long a receive agent handed to a peer is driven by the warm-up thread, and how often.
WARM_S = 3.0
WARM_STEP_S = 0.002
#: Fenced peers remembered (``fence`` is asked again while a peer's pages are held): at most
#: this many, each for at most this long; their receive agents go with them.
MAX_FENCED = 16
#: Progress calls of the endpoint's agent at each connect and disconnect (``_tidy``).
TIDY_PASSES = 4
FENCED_KEEP_S = 600.0


#: Batches of at most this many descriptors are handed to NIXL as lists of tuples, larger
#: ones as arrays (built in a few vectorised calls, where a list costs a tuple each). Measured
#: in a loop, one list: 2 descriptors 3.0 us as tuples, 4.3 as an array; they cross at 9-10;
#: 64: 14.2 against 4.8.
TUPLE_DESCRIPTORS_MAX = 8


def _mem_type(kind: MemoryKind) -> str:
    return "VRAM" if kind.is_cuda else "DRAM"


def _device_id(kind: MemoryKind) -> int:
    return kind.device if kind.device is not None else 0


def _keep_exit_safe() -> None:
    """Load the system's libnl-route before UCX does.

    The NIXL wheel bundles its own libibverbs/libnl; when the host also has rdma-core
    installed, UCX's verbs providers pull in the system copies as well, and the bundled
    libnl-route then crashes in its destructor at process exit (SIGSEGV after a clean run).
    Loading the system libnl-route first (privately, RTLD_LOCAL) gives the libraries a
    destruction order that works. Where the library is absent there is no second copy and
    nothing to do.
    """
    try:
        ctypes.CDLL("libnl-route-3.so.200")
    except OSError:
        pass


@dataclass
class _Peer:
    agent: str
    mem_type: str
    device: int
    #: The agent of the peer's endpoint, when its info names it (its receive agent is ``agent``).
    main: str = ""


@dataclass
class _Receiver:
    """The agent one peer writes into: made for it alone, fenced when it goes."""

    agent: Any
    registered: Any
    name: str
    #: Its UCX listening ports (the peer's connections arrive on them).
    ports: set[int]
    #: Its metadata (what the peer's ``add_remote_agent`` takes).
    meta: bytes = b""
    #: Calls into the agent, from the runner, the warm-up thread and the spares' thread.
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Driven by the warm-up thread until then (the peer's connect waits for its answer).
    warm_until: float = 0.0
    #: Its peer's connection ended (fenced, or forgotten): never driven again, even by a
    #: thread that listed it just before (set under ``lock``).
    retired: bool = False


@dataclass
class _Fenced:
    """What ``fence`` still answers about a peer after its connection ended."""

    receiver: _Receiver | None
    #: The peer process its connection info named (``process_sockets.identity``).
    process: process_sockets.Identity | None
    since: float


def _rdma_possible(ucx_tls: str) -> bool:
    """Whether UCX may move bytes here over RDMA (a NIC writes registered memory by itself)."""
    return bool(probe_host().rdma_devices) and allows(ucx_tls, RDMA_TLS)


@dataclass
class _Batch:
    handle: Any  # nixl_xfer_handle of the part this driver posted (and polls)
    peer: str
    bytes: int
    #: The parts helper threads post and drive themselves (large host batches only).
    parts: list[Part] = field(default_factory=list)
    #: The driver's own part ended, in this state ("DONE"/"ERR"); its handle is released.
    own_state: str = ""
    own_error: EngineError | None = None


class NixlDataPath(KVTransport):
    """Moves bytes with a NIXL agent; subclasses declare the name, capabilities and offer.

    The agent runs without NIXL's progress thread (the Python API starts it with no delay, so
    it spins a core even when nothing moves); the initiator drives UCX in ``poll``, and the
    core calls ``progress`` on the receiving side while transfers are arriving."""

    progress_while_receiving: ClassVar[bool] = True
    #: Posting a WRITE never blocks, and the agent takes calls (one at a time) from any thread.
    thread_agnostic: ClassVar[bool] = True
    #: Large host batches are cut into parts posted by several threads (``posters.py``).
    parallel_posts: ClassVar[bool] = False

    def __init__(self, context: DriverContext) -> None:
        super().__init__(context)
        self._nixl: Any = None
        self._agent: Any = None
        self._backend = ""
        self._name = ""
        self._registered: Any = None
        self._params: dict[str, str] = {}
        self._regions: RegionSet | None = None
        self._peers: dict[str, _Peer] = {}
        self._batches: dict[int, _Batch] = {}
        self._unreleased: list[Any] = []
        #: Aborted batches still able to write: the handle NIXL could not release yet (or
        #: ``None``) and the helpers' parts still running.
        self._unsettled: dict[int, tuple[Any, list[Part]]] = {}
        self._next = 0
        self._posters: Posters | None = None
        self._split_bytes = 0
        self._receivers: dict[str, _Receiver] = {}
        #: Receive agents made ahead and closed behind a handshake (started on first use).
        self._spares: Spares[_Receiver] | None = None
        #: The warm-up thread (``_warm``), started on first use, and what wakes it.
        self._warmer: threading.Thread | None = None
        self._warm_cv = threading.Condition()
        self._closing = False
        #: peer -> the process its connection info names (kernel and PID namespace, pid, start)
        self._processes: dict[str, process_sockets.Identity] = {}
        self._fenced: collections.OrderedDict[str, _Fenced] = collections.OrderedDict()

    # -- helpers -------------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], T], error: type[DriverError] = EngineError) -> T:
        try:
            return fn()
        except DriverError:
            raise
        except Exception as exc:
            raise error(f"{self.name}: NIXL {self._backend or ''} {what} failed: {type(exc).__name__}: {exc}") from exc

    def _release(self, handle: Any) -> bool:
        """Release a NIXL transfer handle (cancelling it if active); ``False`` if NIXL could not
        yet: the transfer may still be writing, and close() tries again."""
        try:
            self._agent.release_xfer_handle(handle)
            return True
        except Exception as exc:  # noqa: BLE001 - an active transfer NIXL could not cancel yet
            log.debug("%s: NIXL could not release a transfer handle yet (%s); retrying at close", self.name, exc)
            self._unreleased.append(handle)
            return False

    # -- data path -----------------------------------------------------------------------------

    def _start_agent(self, gpu: int | None = None) -> str:
        """Create this endpoint's agent and backend (on ``gpu``'s rails, ``None``: host-memory
        KV); returns the agent's name."""
        if self._agent is not None:
            raise DriverError(f"{self.name}: open() called twice")
        facts = probe_nixl()
        if not facts.status.available:
            raise DriverUnavailable(f"{self.name}: {facts.status.reason}")
        import importlib

        self._nixl = importlib.import_module(facts.module)
        quiet_nixl_logging()
        _keep_exit_safe()
        self._backend = facts.backend
        name = f"kvt-{self.context.endpoint_id}-{uuid.uuid4().hex[:8]}"
        self._name = name
        params = dict(facts.backend_params)
        posters, self._split_bytes = posters_from_env(self.context.options) if self.parallel_posts else (1, 0)
        if posters > 1:
            # Threads posting at once need a thread-safe agent, and a UCX worker each: NIXL
            # binds each calling thread to the next worker (the caller's, the runner's and
            # the helpers' threads, hence twice as many workers as posting threads).
            sync = self._nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
            config = self._nixl.nixl_agent_config(enable_prog_thread=False, backends=[], sync_mode=sync)
            params.setdefault("num_workers", str(2 * posters))
        else:
            config = self._nixl.nixl_agent_config(enable_prog_thread=False, backends=[])
        self._params = dict(facts.backend_params)
        # Forced rails (rails.py): for this agent and, through _params, every receive agent.
        devices, why = net_devices(gpu, os.environ) if facts.backend == "UCX" else ("", "")
        if devices:
            log.info("%s: UCX on devices %s (%s)", self.name, devices, why)
            params[DEVICE_LIST] = self._params[DEVICE_LIST] = devices
        elif why:
            log.debug("%s: %s", self.name, why)
        self._agent = self._call("agent creation", lambda: self._nixl.nixl_agent(name, config), DriverUnavailable)
        self._call(
            "backend creation",
            lambda: self._agent.create_backend(facts.backend, params),
            DriverUnavailable,
        )
        if posters > 1:
            self._posters = Posters(posters - 1, self._agent, self.name)
        return name

    def _known_agents(self) -> set[str]:
        """This endpoint's agents (its own, every peer's receive agent, fenced ones too) and
        every peer agent loaded now."""
        receivers = [*self._receivers.values(), *(f.receiver for f in self._fenced.values() if f.receiver)]
        peers = [name for p in self._peers.values() for name in (p.agent, p.main) if name]
        return {self._name, *(r.name for r in receivers), *peers}

    def _add_remote(self, meta: Any) -> str:
        """Load a peer agent's metadata; returns the peer agent's name."""
        if not isinstance(meta, bytes):
            raise DriverError(f"{self.name}: the peer's connection info carries no NIXL agent metadata")
        # Checked before NIXL sees it: loading (or failing to load) metadata that carries the name
        # of an agent already known replaces that agent's entry, and the writes of the connection
        # it belongs to start failing. Agent names are unique (kvt-<endpoint>-<random>).
        taken = [a for a in self._known_agents() if a and a.encode() in meta]
        if taken:
            raise DriverError(f"{self.name}: the peer's NIXL metadata names agent {taken[0]!r}, which is known here")
        agent = self._call("loading the peer's agent metadata", lambda: self._agent.add_remote_agent(meta), DriverError)
        return agent.decode() if isinstance(agent, bytes) else str(agent)

    def open(self, regions: RegionSet) -> bytes:
        name = self._start_agent(regions.kv_kind.device)
        kind = regions.kv_kind
        descs = [(r.ptr, r.length, _device_id(r.kind), "") for r in regions.all()]
        self._registered = self._call(
            f"registration of {len(descs)} {_mem_type(kind)} regions",
            lambda: self._agent.register_memory(descs, _mem_type(kind)),
        )
        self._regions = regions
        meta = self._call("metadata export", self._agent.get_agent_metadata)
        return _info(name, meta, kind, name)

    def receive_info(self, peer: str) -> bytes:
        if self._agent is None or self._regions is None:
            raise DriverError(f"{self.name}: receive_info() before open()")
        receiver = self._take_receiver(peer)
        return _info(receiver.name, receiver.meta, self._regions.kv_kind, self._name)

    def _receiving_memory(self) -> tuple[list[tuple[int, int, int, str]], str]:
        """What a receive agent registers (descriptors, memory type): every KV, aux and state
        region; the staged variant registers its ring instead."""
        assert self._regions is not None
        descs = [(r.ptr, r.length, _device_id(r.kind), "") for r in self._regions.all()]
        return descs, _mem_type(self._regions.kv_kind)

    def _new_receiver(self) -> _Receiver:
        """A NIXL agent of its own for one peer to write into, this endpoint's receiving memory
        registered (made ahead on the spares' thread: ``spi.spares``)."""
        name = f"kvt-{self.context.endpoint_id}-r{uuid.uuid4().hex[:8]}"
        config = self._nixl.nixl_agent_config(enable_prog_thread=False, backends=[])
        with process_sockets.new_listeners() as opened:
            agent = self._call("receive agent creation", lambda: self._nixl.nixl_agent(name, config))
            self._call("receive backend creation", lambda: agent.create_backend(self._backend, self._params))
        descs, mem_type = self._receiving_memory()
        registered = self._call("receive registration", lambda: agent.register_memory(descs, mem_type))
        meta = self._call("receive metadata export", agent.get_agent_metadata)
        ports = {p for p in opened if process_sockets.port_in_blob(p, meta)}
        return _Receiver(agent, registered, name, ports, meta)

    def _take_receiver(self, peer: str) -> _Receiver:
        self._prune_fenced()
        if len(self._receivers) >= MAX_RECEIVE_SIDES and peer not in self._receivers:
            raise DriverError(f"{self.name}: {MAX_RECEIVE_SIDES} peers already have a receive agent of their own")
        if self._spares is None:
            self._spares = Spares(f"{self.name}-receive", self._new_receiver, self._drop_receiver)
        receiver = self._spares.take()
        old = self._receivers.pop(peer, None)
        if old is not None:
            _retire(old)
            self._spares.release(old)
        self._receivers[peer] = receiver
        self._warm(receiver)
        return receiver

    def _warm(self, receiver: _Receiver) -> None:
        """Drive ``receiver`` for ``WARM_S``: the peer's NIXL connects to it during the
        handshake and waits for its answer, which it gives only when driven (the core drives a
        driver's agents only while bytes arrive)."""
        with self._warm_cv:
            receiver.warm_until = time.monotonic() + WARM_S
            if self._warmer is None:
                self._warmer = threading.Thread(target=self._warm_loop, name=f"{self.name}-warm", daemon=True)
                self._warmer.start()
            self._warm_cv.notify()

    def _warm_loop(self) -> None:
        while True:
            with self._warm_cv:
                while not self._closing:
                    now = time.monotonic()
                    warm = [r for r in list(self._receivers.values()) if r.warm_until > now]
                    if warm:
                        break
                    self._warm_cv.wait()
                if self._closing:
                    return
            for receiver in warm:
                _drive(receiver)
            time.sleep(WARM_STEP_S)

    def _note_process(self, peer: str, doc: Mapping[str, Any]) -> None:
        """The peer process a connection info names (``process_sockets.identity``)."""
        process = process_sockets.identity_in(doc)
        if process is not None:
            self._processes[peer] = process

    def fence(self, peer: str) -> bool:
        return self.fence_receiver(peer)

    def fence_receiver(self, peer: str) -> bool:
        """Cut ``peer`` off its receive agent. That agent is never driven again (``progress``
        drives live ones only), and UCX reads TCP and shared-memory messages only while its
        worker is driven; its UCX connections are severed too (UCX fails the peer's endpoint and
        never reconnects it) and its registrations withdrawn. Two paths write without the
        receiver's worker: RDMA (the NIC writes registered memory: fenced once the registrations
        are withdrawn) and, between processes of one kernel and PID namespace, cross-memory
        attach and CUDA IPC (the writer copies into this process: fenced once that process
        has ended)."""
        fenced = self._fenced.get(peer)
        if fenced is None:
            receiver = self._receivers.pop(peer, None)
            if receiver is None:
                return False  # it wrote into the endpoint-wide agent
            _retire(receiver)
            fenced = _Fenced(receiver, self._processes.pop(peer, None), time.monotonic())
            self._fenced[peer] = fenced
            self._prune_fenced()
            process_sockets.sever(receiver.ports, 0.0)
        receiver = fenced.receiver
        if receiver is not None:
            with receiver.lock:
                if receiver.registered is not None and receiver.agent is not None:
                    try:
                        receiver.agent.deregister_memory(receiver.registered)
                        receiver.registered = None
                    except Exception as exc:  # noqa: BLE001 - asked again later
                        log.debug("%s: deregistering the receive agent of %s: %s", self.name, peer, exc)
        tls = os.environ.get("UCX_TLS", "")
        if receiver is None or (receiver.registered is not None and _rdma_possible(tls)):
            return False  # pruned from memory, or RDMA may still write what is registered
        process = fenced.process
        if process is not None and process_sockets.may_copy_into_us(process) and allows(tls, WRITER_COPIES_TLS):
            return process_sockets.ended(process)
        return True

    def _stop_warming(self) -> None:
        with self._warm_cv:
            self._closing = True
            self._warm_cv.notify()
            warmer, self._warmer = self._warmer, None
        if warmer is not None:
            warmer.join(timeout=5.0)

    def closing(self) -> None:
        """The endpoint closes: from here no agent is driven (no warm-up, no ``_tidy``, no
        ``progress``): the peers are closing too, as often as not, and what is left of their
        connections goes with the agents (see ``disconnect``)."""
        self._stop_warming()

    def _quiesce(self) -> None:
        """At ``close`` (also when no endpoint said ``closing``): as ``closing``, and every
        receive agent retired."""
        self._stop_warming()
        for receiver in [*self._receivers.values(), *(f.receiver for f in self._fenced.values() if f.receiver)]:
            _retire(receiver)

    def _drop_receivers(self) -> None:
        self._stop_warming()
        held = [*self._receivers.values(), *(f.receiver for f in self._fenced.values() if f.receiver)]
        self._receivers.clear()
        self._fenced.clear()
        self._processes.clear()
        if self._spares is not None:
            self._spares.stop(held)
            self._spares = None
        else:
            for receiver in held:
                self._drop_receiver(receiver)

    def _drop_receiver(self, receiver: _Receiver) -> None:
        with receiver.lock:
            if receiver.registered is not None:
                try:
                    receiver.agent.deregister_memory(receiver.registered)
                except Exception as exc:  # noqa: BLE001
                    log.debug("%s: deregistering receive agent %s: %s", self.name, receiver.name, exc)
                receiver.registered = None
            receiver.agent = None  # the agent goes with its last reference

    def _prune_fenced(self) -> None:
        now = time.monotonic()
        while self._fenced:
            peer, fenced = next(iter(self._fenced.items()))
            if len(self._fenced) <= MAX_FENCED and now - fenced.since < FENCED_KEEP_S:
                break
            del self._fenced[peer]
            if fenced.receiver is not None and self._spares is not None:
                self._spares.release(fenced.receiver)

    def connect(self, peer: str, info: bytes, peer_regions: RegionSet) -> None:
        if self._agent is None:
            raise DriverError(f"{self.name}: connect() before open()")
        try:
            doc = msgpack.unpackb(info)
            meta, mem, device = doc["meta"], str(doc["mem"]), int(doc["device"])
            if not isinstance(meta, bytes) or mem not in ("DRAM", "VRAM"):
                raise ValueError("malformed fields")
            if not 0 <= device < 1 << 31:
                # Checked here, not left to each submit (where a list of descriptors and an
                # array of them would fail differently).
                raise ValueError(f"device {device} is not a device index")
        except Exception as exc:
            raise DriverError(f"{self.name}: the peer's connection info is not NIXL agent metadata: {exc}") from exc
        if mem != _mem_type(peer_regions.kv_kind):
            raise DriverError(
                f"{self.name}: the peer registered {mem} memory but describes its KV as {peer_regions.kv_kind}"
            )
        self._note_process(peer, doc)
        self._tidy()
        main = doc.get("main")
        # Known from here on: metadata naming it (a copy of that endpoint's own agent, presented
        # by another connection) is refused by ``_add_remote``.
        main = main if isinstance(main, str) and 0 < len(main) <= 256 else ""
        self._peers[peer] = _Peer(self._add_remote(meta), mem, device, main)

    def submit(self, peer: str, runs: Runs) -> int:
        target = self._peers.get(peer)
        if target is None or self._regions is None:
            raise DriverError(f"{self.name}: submit to {peer!r} before open()/connect()")
        n = len(runs)
        kind = self._regions.kv_kind
        local_mem = _mem_type(kind)
        local: Any
        remote: Any
        if n <= TUPLE_DESCRIPTORS_MAX:
            # A few descriptors: NIXL takes a list of tuples with fewer numpy calls than an
            # array needs to be built (1.3 us less per list in a loop, several times that in
            # situ, where a small request's latency is made of such calls).
            src, dst, length = runs.lists()
            here, there = _device_id(kind), target.device
            local = [(a, b, here) for a, b in zip(src, length, strict=True)]
            remote = [(a, b, there) for a, b in zip(dst, length, strict=True)]
        else:
            local = np.empty((n, 3), dtype=np.uint64)
            local[:, 0], local[:, 1], local[:, 2] = runs.src, runs.length, _device_id(kind)
            remote = np.empty((n, 3), dtype=np.uint64)
            remote[:, 0], remote[:, 1], remote[:, 2] = runs.dst, runs.length, target.device
        agent = self._agent

        def post(lo: int, hi: int) -> Callable[[], tuple[Any, str]]:
            def start() -> tuple[Any, str]:
                src = agent.get_xfer_descs(local[lo:hi], local_mem)
                dst = agent.get_xfer_descs(remote[lo:hi], target.mem_type)
                if src is None or dst is None:
                    raise ValueError("NIXL rejected the descriptor lists")
                handle = agent.initialize_xfer("WRITE", src, dst, target.agent)
                return handle, agent.transfer(handle)

            return start

        cuts = [0, n]
        if self._posters is not None and local_mem == "DRAM" and runs.total_bytes >= self._split_bytes:
            cuts = split_points(runs.length, self._posters.threads)
        # The helpers' parts first, so that they copy while this thread posts its own.
        parts = [
            self._posters.start(post(lo, hi), f"a WRITE of {hi - lo} descriptors to {target.agent}")
            for lo, hi in itertools.pairwise(cuts[1:])
            if self._posters is not None
        ]
        try:
            handle, state = self._call(f"WRITE of {cuts[1]} descriptors to {target.agent}", post(0, cuts[1]))
        except BaseException:
            self._stop_parts(parts)
            raise
        if state == "ERR":
            self._release(handle)
            self._stop_parts(parts)
            raise EngineError(f"{self.name}: NIXL {self._backend} refused to post a WRITE of {n} descriptors")
        self._next += 1
        self._batches[self._next] = _Batch(handle, peer, runs.total_bytes, parts)
        return self._next

    def _stop_parts(self, parts: list[Part], timeout: float | None = None) -> bool:
        """Stop helper parts and wait for them (a failed ``submit`` leaves nothing writing);
        ``True`` once none can write."""
        for part in parts:
            part.stop()
        deadline = None if timeout is None else time.monotonic() + timeout
        for part in parts:
            try:
                part.future.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except BaseException:  # noqa: BLE001 - cancelled, failed, or still running (timeout)
                pass
        return all(part.settled() for part in parts)

    def poll(self, handle: int) -> bool:
        batch = self._batches.get(handle)
        if batch is None:
            raise DriverError(f"{self.name}: unknown handle {handle}")
        if not batch.own_state:
            try:
                state = self._call("transfer state query", lambda: self._agent.check_xfer_state(batch.handle))
            except EngineError as exc:
                state, batch.own_error = "ERR", exc
            if state == "PROC":
                return False
            batch.own_state = state
            self._release(batch.handle)
            if state != "DONE":
                for part in batch.parts:
                    part.stop()  # the batch failed: its other parts need not finish
        # Never raise while a part may still write: the core then counts the batch as over.
        if not all(part.done() for part in batch.parts):
            return False
        del self._batches[handle]
        kept = [part for part in batch.parts if part.kept]
        if kept:
            self._unsettled[handle] = (None, kept)  # ``settled`` stays False for it
        errors = [e for e in (part.error() for part in batch.parts) if e is not None]
        if batch.own_state == "DONE" and not errors:
            return True
        if batch.own_error is not None:
            raise batch.own_error
        if errors and isinstance(errors[0], EngineError):
            raise errors[0]
        where = self._peers[batch.peer].agent if batch.peer in self._peers else batch.peer
        raise EngineError(
            f"{self.name}: NIXL {self._backend} reported an error for a WRITE of {batch.bytes} bytes to {where}"
        )

    def abort(self, handle: int) -> None:
        batch = self._batches.pop(handle, None)
        if batch is None:
            return
        for part in batch.parts:
            part.stop()  # its helper releases (cancels) it and stops driving it
        # NIXL cancels an active transfer on release; one it could not release may still write.
        own = None if batch.own_state or self._release(batch.handle) else batch.handle
        running = [part for part in batch.parts if not part.settled()]
        if own is not None or running:
            self._unsettled[handle] = (own, running)

    def settled(self, handle: int) -> bool:
        entry = self._unsettled.get(handle)
        if entry is None:
            return True
        own, parts = entry
        if own is not None:
            try:
                self._agent.release_xfer_handle(own)
            except Exception:  # noqa: BLE001 - still active: ask again later
                return False
            self._unreleased = [h for h in self._unreleased if h is not own]
            self._unsettled[handle] = (None, parts)
        if not all(part.settled() for part in parts):
            return False
        del self._unsettled[handle]
        return True

    def pending(self) -> int:
        return len(self._batches)

    def progress(self) -> None:
        agent = self._agent
        if self._closing:
            return  # (``closing``)
        if agent is not None:
            self._call("progress", agent.get_new_notifs)
        for receiver in list(self._receivers.values()):
            # Each peer's bytes arrive through its own agent, which moves only when driven.
            _drive(receiver)

    def disconnect(self, peer: str) -> None:
        target = self._peers.pop(peer, None)
        # Before anything of the peer's is removed: the peer's receive agent is no longer
        # driven, its batches are aborted, and then the agent sees the connections peers
        # closed since (``_tidy``; not once the endpoint is closing). Driving
        # an agent while a peer's engine tears its side down is what UCX cannot always take:
        # UCX 1.23's TCP transport reconnects an endpoint whose connection the departing peer
        # reset, is refused, and destroys the failed endpoint from inside the next progress
        # call with a request still queued on it, an assertion that aborts the process
        # (``stubs.c:107``, seen at endpoint close in the SGLang scheduler tests).
        self._forget_receiver(peer, connected=target is not None)
        parts: list[Part] = []
        for handle, batch in list(self._batches.items()):
            if batch.peer == peer:
                parts.extend(batch.parts)
                self.abort(handle)
        # Helpers let go of their parts before the peer's agent goes: a handle of a removed
        # agent is not one NIXL documents releasing.
        if parts and not self._stop_parts(parts, timeout=DISCONNECT_GRACE_S):
            log.warning("%s: parts of batches to %s still running at disconnect", self.name, peer)
        self._tidy()
        if target is not None and self._agent is not None:
            try:
                self._agent.remove_remote_agent(target.agent)
            except Exception as exc:  # noqa: BLE001 - the peer may be gone already
                log.debug("%s: removing remote agent %s: %s", self.name, target.agent, exc)

    def _tidy(self) -> None:
        """Let the endpoint's agent see the connections its peers closed. UCX closes its side
        of a connection only when its worker is driven, and nothing drives an idle endpoint's
        agent: the sockets of every peer receive agent closed since (8 a connection) stayed
        open, half closed, until the next transfer. Driven here at each connect and
        disconnect (runner thread), what is left is the last few connections'."""
        if self._agent is not None and not self._closing:
            for _ in range(TIDY_PASSES):
                try:
                    self._agent.get_new_notifs()
                except Exception as exc:  # noqa: BLE001 - a failed peer: its transfers say so
                    log.debug("%s: progress after a disconnect: %s", self.name, exc)
                    return

    def _forget_receiver(self, peer: str, connected: bool) -> None:
        """A receive agent not fenced: its driver was not chosen, or the handshake failed
        before the peer could use it. Nothing of the peer was announced into it. Where this
        side ``connected`` the peer's lane, the peer connected this agent's as well, and UCX
        keeps what that made in the agent's worker (an endpoint and its sockets back to the
        peer's agent, which nothing here can name to close): given to the next peer, an agent
        carried every earlier one's (8 descriptors a connection on each side, without bound),
        so it is closed instead; one nobody connected serves the next peer."""
        receiver = self._receivers.pop(peer, None)
        if receiver is not None and connected:
            _retire(receiver)
        if receiver is not None and self._spares is not None:
            if connected:
                self._spares.release(receiver)
            else:
                self._spares.give_back(receiver)
        self._processes.pop(peer, None)

    def close(self) -> None:
        if self._agent is None:
            return
        self._quiesce()
        for peer in list(self._peers):
            self.disconnect(peer)
        for handle in list(self._batches):
            self.abort(handle)
        self._unsettled.clear()  # their handles are in _unreleased, retried just below
        if self._posters is not None:
            self._posters.close()  # every part cancelled above: its helper lets go of it
            self._unreleased.extend(self._posters.unreleased)
            self._posters = None
        pending, self._unreleased = self._unreleased, []
        for _ in range(_RELEASE_RETRIES):
            if not pending:
                break
            retry = []
            for h in pending:
                try:
                    self._agent.release_xfer_handle(h)
                except Exception:  # noqa: BLE001
                    retry.append(h)
            pending = retry
            if pending:
                os.sched_yield()
        self._drop_receivers()
        if self._registered is not None:
            try:
                self._agent.deregister_memory(self._registered)
            except Exception as exc:  # noqa: BLE001
                log.debug("%s: deregistering memory: %s", self.name, exc)
        self._registered = None
        self._agent = None


def _info(agent: str, meta: bytes, kind: MemoryKind, main: str) -> bytes:
    """Connection info: the agent's name and metadata, the KV memory, the endpoint's own agent
    (``main``: a peer refuses another connection presenting it), and the process that writes
    and receives through it (see ``fence_receiver``)."""
    doc = {"agent": agent, "meta": meta, "mem": _mem_type(kind), "device": _device_id(kind), "main": main}
    info = msgpack.packb({**doc, **process_sockets.identity()})
    assert isinstance(info, bytes)
    return info


def _retire(receiver: _Receiver) -> None:
    """``receiver``'s connection ended: no thread drives it again (see ``NixlDataPath.close``)."""
    with receiver.lock:
        receiver.retired = True


def _drive(receiver: _Receiver) -> None:
    """One progress call of a receive agent (not one retired, fenced or closed meanwhile)."""
    with receiver.lock:
        if receiver.agent is not None and receiver.registered is not None and not receiver.retired:
            try:
                receiver.agent.get_new_notifs()
            except Exception as exc:  # noqa: BLE001 - the peer failed: its transfers say so
                log.debug("progress of receive agent %s: %s", receiver.name, exc)
