"""The NIXL data path of ``nixl-ucx``: one agent per endpoint, regions registered once, WRITE
transfers built from the planner's runs, completion read from NIXL's transfer state.

The connection info carried in the hello is the agent's own metadata blob (what
``add_remote_agent`` takes), so no side channel or metadata server is involved. Every NIXL
call that can fail is wrapped: NIXL raises its own exception types (``nixlBackendError``,
``nixlInvalidParamError``...) or reports ``"ERR"``; both become kvtransport errors naming the
driver, the backend and what NIXL said.
"""

from __future__ import annotations

import ctypes
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgpack
import numpy as np

from kvtransport.driver import DriverContext, KVTransport
from kvtransport.errors import DriverError, DriverUnavailable, EngineError
from kvtransport.memory import MemoryKind, RegionSet
from kvtransport.plan import Runs

from .engine_probe import probe_nixl, quiet_nixl_logging

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How many times ``close`` retries releasing a handle NIXL could not cancel at once.
_RELEASE_RETRIES = 50


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


@dataclass
class _Batch:
    handle: Any  # nixl_xfer_handle
    peer: str
    bytes: int


class NixlDataPath(KVTransport):
    """Moves bytes with a NIXL agent; subclasses declare the name, capabilities and offer.

    The agent runs without NIXL's progress thread (the Python API starts it with no delay, so
    it spins a core even when nothing moves); the initiator drives UCX in ``poll``, and the
    core calls ``progress`` on the receiving side while transfers are arriving."""

    progress_while_receiving: ClassVar[bool] = True
    #: Posting a WRITE never blocks, and the agent takes calls (one at a time) from any thread.
    thread_agnostic: ClassVar[bool] = True

    def __init__(self, context: DriverContext) -> None:
        super().__init__(context)
        self._nixl: Any = None
        self._agent: Any = None
        self._backend = ""
        self._name = ""
        self._registered: Any = None
        self._regions: RegionSet | None = None
        self._peers: dict[str, _Peer] = {}
        self._batches: dict[int, _Batch] = {}
        self._unreleased: list[Any] = []
        self._unsettled: dict[int, Any] = {}  # aborted handles NIXL could not release yet
        self._next = 0

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

    def _start_agent(self) -> str:
        """Create this endpoint's agent and backend; returns the agent's name."""
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
        config = self._nixl.nixl_agent_config(enable_prog_thread=False, backends=[])
        self._agent = self._call("agent creation", lambda: self._nixl.nixl_agent(name, config), DriverUnavailable)
        self._call(
            "backend creation",
            lambda: self._agent.create_backend(facts.backend, dict(facts.backend_params)),
            DriverUnavailable,
        )
        return name

    def _known_agents(self) -> set[str]:
        """This endpoint's agent and every peer agent loaded now."""
        return {self._name, *(p.agent for p in self._peers.values())}

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
        name = self._start_agent()
        kind = regions.kv_kind
        descs = [(r.ptr, r.length, _device_id(r.kind), "") for r in regions.all()]
        self._registered = self._call(
            f"registration of {len(descs)} {_mem_type(kind)} regions",
            lambda: self._agent.register_memory(descs, _mem_type(kind)),
        )
        self._regions = regions
        meta = self._call("metadata export", self._agent.get_agent_metadata)
        info = msgpack.packb({"agent": name, "meta": meta, "mem": _mem_type(kind), "device": _device_id(kind)})
        assert isinstance(info, bytes)
        return info

    def connect(self, peer: str, info: bytes, peer_regions: RegionSet) -> None:
        if self._agent is None:
            raise DriverError(f"{self.name}: connect() before open()")
        try:
            doc = msgpack.unpackb(info)
            meta, mem, device = doc["meta"], str(doc["mem"]), int(doc["device"])
            if not isinstance(meta, bytes) or mem not in ("DRAM", "VRAM"):
                raise ValueError("malformed fields")
        except Exception as exc:
            raise DriverError(f"{self.name}: the peer's connection info is not NIXL agent metadata: {exc}") from exc
        if mem != _mem_type(peer_regions.kv_kind):
            raise DriverError(
                f"{self.name}: the peer registered {mem} memory but describes its KV as {peer_regions.kv_kind}"
            )
        self._peers[peer] = _Peer(self._add_remote(meta), mem, device)

    def submit(self, peer: str, runs: Runs) -> int:
        target = self._peers.get(peer)
        if target is None or self._regions is None:
            raise DriverError(f"{self.name}: submit to {peer!r} before open()/connect()")
        n = len(runs)
        local_mem = _mem_type(self._regions.kv_kind)
        local = np.empty((n, 3), dtype=np.uint64)
        local[:, 0], local[:, 1], local[:, 2] = runs.src, runs.length, _device_id(self._regions.kv_kind)
        remote = np.empty((n, 3), dtype=np.uint64)
        remote[:, 0], remote[:, 1], remote[:, 2] = runs.dst, runs.length, target.device
        agent = self._agent

        def start() -> tuple[Any, str]:
            src = agent.get_xfer_descs(local, local_mem)
            dst = agent.get_xfer_descs(remote, target.mem_type)
            if src is None or dst is None:
                raise ValueError("NIXL rejected the descriptor lists")
            handle = agent.initialize_xfer("WRITE", src, dst, target.agent)
            return handle, agent.transfer(handle)

        handle, state = self._call(f"WRITE of {n} descriptors to {target.agent}", start)
        if state == "ERR":
            self._release(handle)
            raise EngineError(f"{self.name}: NIXL {self._backend} refused to post a WRITE of {n} descriptors")
        self._next += 1
        self._batches[self._next] = _Batch(handle, peer, runs.total_bytes)
        return self._next

    def poll(self, handle: int) -> bool:
        batch = self._batches.get(handle)
        if batch is None:
            raise DriverError(f"{self.name}: unknown handle {handle}")
        state = self._call("transfer state query", lambda: self._agent.check_xfer_state(batch.handle))
        if state == "PROC":
            return False
        del self._batches[handle]
        self._release(batch.handle)
        if state == "DONE":
            return True
        raise EngineError(
            f"{self.name}: NIXL {self._backend} reported an error for a WRITE of {batch.bytes} bytes "
            f"to {self._peers[batch.peer].agent if batch.peer in self._peers else batch.peer}"
        )

    def abort(self, handle: int) -> None:
        batch = self._batches.pop(handle, None)
        # NIXL cancels an active transfer on release; one it could not release may still write.
        if batch is not None and not self._release(batch.handle):
            self._unsettled[handle] = batch.handle

    def settled(self, handle: int) -> bool:
        nixl_handle = self._unsettled.get(handle)
        if nixl_handle is None:
            return True
        try:
            self._agent.release_xfer_handle(nixl_handle)
        except Exception:  # noqa: BLE001 - still active: ask again later
            return False
        del self._unsettled[handle]
        self._unreleased = [h for h in self._unreleased if h is not nixl_handle]
        return True

    def pending(self) -> int:
        return len(self._batches)

    def progress(self) -> None:
        agent = self._agent
        if agent is not None:
            self._call("progress", agent.get_new_notifs)

    def disconnect(self, peer: str) -> None:
        target = self._peers.pop(peer, None)
        for handle, batch in list(self._batches.items()):
            if batch.peer == peer:
                self.abort(handle)
        if target is not None and self._agent is not None:
            try:
                self._agent.remove_remote_agent(target.agent)
            except Exception as exc:  # noqa: BLE001 - the peer may be gone already
                log.debug("%s: removing remote agent %s: %s", self.name, target.agent, exc)

    def close(self) -> None:
        if self._agent is None:
            return
        for peer in list(self._peers):
            self.disconnect(peer)
        for handle in list(self._batches):
            self.abort(handle)
        self._unsettled.clear()  # their handles are in _unreleased, retried just below
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
        if self._registered is not None:
            try:
                self._agent.deregister_memory(self._registered)
            except Exception as exc:  # noqa: BLE001
                log.debug("%s: deregistering memory: %s", self.name, exc)
        self._registered = None
        self._agent = None
