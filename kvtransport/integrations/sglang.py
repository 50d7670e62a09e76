"""SGLang transfer backend: the four classes SGLang's disaggregation scheduler drives, built on
kvtransport's endpoint, so that any kvtransport driver (negotiated per peer pair) moves SGLang's
KV cache.

Written against SGLang 0.5.23's ``sglang.srt.disaggregation.base.conn``. SGLang finds these
classes through kvtransport's plugin (:mod:`kvtransport.integrations.sglang_plugin`): no patch.
What SGLang's scheduler expects of them, call by call: docs/sglang-contract.md.

How the pieces map:

- one :class:`KVTransportKVManager` per rank opens one :class:`~kvtransport.runtime.endpoint.Endpoint`
  over the rank's ``KVArgs`` (one item = one page of one buffer; aux slots; one state group
  per ``state_types`` entry: the SWA window pool, the Mamba slots);
- prefill ranks register their endpoint address with the :class:`KVTransportKVBootstrapServer`
  of their instance; a decode rank's receiver looks its prefill peer up there (same TP rank and
  the prefill DP rank it was given), connects once per peer and reuses the connection;
- a request's bootstrap room is the transfer tag: the decode receiver announces the pages
  (``send_metadata``), the prefill sender finds the connection that announced its room and
  writes each chunk as the scheduler hands it over, the aux slot and the state items (SWA
  window pages, the Mamba slot) with the last chunk;
- ``poll`` returns kvtransport's state, whose values are SGLang's ``KVPoll``; on failure
  ``failure_exception`` raises :class:`KVTransferError` with the typed reason (peer lost,
  abort, timeout, layout mismatch).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

try:
    from sglang.srt.disaggregation.base.conn import (
        BaseKVBootstrapServer,
        BaseKVManager,
        BaseKVReceiver,
        BaseKVSender,
        KVArgs,
        KVPoll,
        KVTransferMetric,
    )
except ImportError as exc:  # pragma: no cover - exercised in a process without SGLang
    raise ImportError(
        "kvtransport.integrations.sglang needs SGLang's disaggregation classes "
        f"(sglang==0.5.23: pip install 'sglang==0.5.23'); importing them failed: {exc}"
    ) from exc

from kvtransport.integrations.bootstrap import BootstrapClient, BootstrapServer
from kvtransport.integrations.sglang_topology import RankTopology, rank_topology
from kvtransport.runtime.auth import RateLimitedLog
from kvtransport.runtime.bounded import put_newest
from kvtransport.runtime.config import env_number
from kvtransport.runtime.endpoint import Connection, Endpoint, State, Timeouts, Transfer
from kvtransport.runtime.fanin import FanIn, FanOut, PartialAnnouncement, expect_from
from kvtransport.spi.errors import (
    ConnectError,
    InvalidPages,
    KVTransportError,
    LayoutMismatch,
    MemoryLayoutError,
    TransferAborted,
    TransferTimeout,
)
from kvtransport.spi.memory import HOST, KVLayout, MemoryKind, RegionSet
from kvtransport.spi.tp_map import sources, targets

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
#: SGLang's own timeout variables, honoured unless the kvtransport one is set (defaults: SGLang's).
SGLANG_TIMEOUTS = {
    "bootstrap": ("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0),
    "waiting": ("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0),
}
#: Seconds one background registry lookup of ``try_ensure_parallel_info`` may take (SGLang
#: asks again about once a second, 15 times).
PARALLEL_INFO_LOOKUP_S = 5.0
#: Seconds a receiver's registry lookup may wait for its prefill rank to appear.
ROUTE_LOOKUP_S = 30.0
#: Background connects (and registry lookups) at once, per manager.
CONNECT_WORKERS = 4
#: Threads for SGLang's own ``/query_dp_ranks`` lookups (its backends use as many).
QUERY_WORKERS = 16
#: Failed rooms a decode manager tracks for SGLang's deferred release at once (SGLang holds
#: each for at most its deferred-release timeout; the oldest beyond this count as drained).
MAX_HELD_ROOMS = 65536
#: Prefill: room publications (``/register_dp_rank``) queued at once, and how long each may try.
MAX_PENDING_PUBLISH = 4096
PUBLISH_TIMEOUT_S = 2.0
#: Prefill rank connections (instances x DP ranks x the attention-TP ranks this rank receives
#: from), routes and lookups a decode manager keeps, each table on its own.
MAX_PREFILL_PEERS = 1024


def _put(
    table: collections.OrderedDict[Any, Any], key: Any, value: Any, limit: int | None = None, drop: Any = None
) -> None:
    """``table[key] = value`` as the newest entry; the oldest beyond ``limit`` (default
    ``MAX_PREFILL_PEERS``) go (``drop`` is called on what goes, e.g. to close a connection)."""
    for _, old in put_newest(table, key, value, MAX_PREFILL_PEERS if limit is None else limit):
        if drop is not None:
            drop(old)


#: Seconds a prefill rank's constructor tries to reach its bootstrap server before it goes on
#: registering in the background (SGLang starts the server beside the ranks, not before them).
REGISTER_FIRST_WAIT_S = 5.0


def sglang_timeouts(env: Any = None) -> Timeouts:
    """kvtransport's timeouts, with SGLang's ``SGLANG_DISAGGREGATION_*`` ones where the
    kvtransport variable is not set: a deployment tuned for SGLang's backends keeps its settings."""
    env = os.environ if env is None else env
    timeouts = Timeouts.from_env(env)
    changes = {
        field: env_number(theirs, default, env=env)
        for field, (theirs, default) in SGLANG_TIMEOUTS.items()
        if not env.get(Timeouts.ENV[field], "").strip()
    }
    return dataclasses.replace(timeouts, **changes)


@dataclasses.dataclass(frozen=True)
class PrefillInfo:
    """What SGLang's decode scheduler reads from ``kv_manager.prefill_info_table[addr]``: how
    many prefill DP ranks there are and whether a room picks its rank (``room % dp_size``)."""

    dp_size: int
    follow_bootstrap_room: bool
    tp_size: int


__all__ = [
    "KVTransferError",
    "KVTransportKVBootstrapServer",
    "KVTransportKVManager",
    "KVTransportKVReceiver",
    "KVTransportKVSender",
]


def room_tag(room: int, prefill_tp: int, decode_tp: int, decode_rank: int) -> str:
    """The transfer tag decode rank ``decode_rank`` announces ``room`` under. The room number,
    except when decode runs the wider TP: a prefill rank then hears from several decode ranks
    for one room, and each but the first of them (the one whose announcement tells the prefill
    rank decode's TP size) adds its rank, ``room@rank`` (a tag names one announcer per endpoint)."""
    fed = targets(prefill_tp, sources(prefill_tp, decode_tp, decode_rank)[0], decode_tp)
    return str(room) if decode_rank == fed[0] else f"{room}@{decode_rank}"


def tp_pairing_problem(prefill_tp: int, decode_tp: int) -> str:
    """Why prefill and decode ranks of these attention-TP sizes cannot pair ('' when they can)."""
    if prefill_tp <= 0 or decode_tp <= 0 or (prefill_tp % decode_tp and decode_tp % prefill_tp):
        return (
            f"prefill runs attention TP={prefill_tp}, this decode rank TP={decode_tp}: kvtransport pairs TP sizes "
            "of which one divides the other"
        )
    return ""


class KVTransferError(KVTransportError):
    """What ``failure_exception`` raises: SGLang's fields (room, reason) over a kvtransport error."""

    def __init__(self, bootstrap_room: int, failure_reason: str, cause: BaseException | None = None) -> None:
        super().__init__(f"KV transfer of room {bootstrap_room} failed: {failure_reason}")
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason
        self.cause = cause


def _mode(disaggregation_mode: Any) -> str:
    value = str(getattr(disaggregation_mode, "value", disaggregation_mode)).lower()
    if value not in ("prefill", "decode"):
        raise KVTransportError(f"kvtransport serves prefill and decode ranks, not {disaggregation_mode!r}")
    return value


def kv_memory(args: KVArgs, server_args: Any) -> MemoryKind:
    """Where the KV buffers live: ``cuda:<gpu_id>`` when the pointers are device memory."""
    if getattr(server_args, "device", "cuda") == "cpu" or not args.kv_data_ptrs:
        return HOST
    from kvtransport.staging.cuda_copy import is_device_pointer

    return MemoryKind(int(args.gpu_id)) if is_device_pointer(int(args.kv_data_ptrs[0])) else HOST


#: State types (SGLang's ``StateType`` values) moved by kvtransport: each is a set of buffers
#: addressed by one index list that prefill and decode pair one to one (the SWA sub-pool's
#: window pages; a request's Mamba slot in every state tensor), between equal attention TP.
#: Pools with any other state type are refused when the manager starts (state_types_of).
SERVED_STATE_TYPES = ("swa", "mamba")


def state_types_of(args: KVArgs) -> tuple[str, ...]:
    """The rank's state groups by SGLang type name; :class:`KVTransportError` at start-up for a
    pool kvtransport cannot serve (rather than failing every request of that model)."""
    types = tuple(str(getattr(t, "value", t)) for t in (getattr(args, "state_types", None) or []))
    groups = list(getattr(args, "state_data_ptrs", None) or [])
    unserved = sorted({t for t in types if t not in SERVED_STATE_TYPES})
    if unserved:
        raise KVTransportError(
            f"this model's KV pool has state buffers of type {', '.join(unserved)}, which kvtransport does not "
            f"transfer (it serves {', '.join(SERVED_STATE_TYPES)}); run it with another "
            "--disaggregation-transfer-backend (mooncake serves it)"
        )
    if len(groups) != len(types):
        raise KVTransportError(f"KVArgs lists {len(types)} state types but {len(groups)} groups of state buffers")
    empty = [t for t, g in zip(types, groups, strict=True) if not g]
    if empty:
        raise KVTransportError(f"KVArgs has no buffers for state type {empty[0]}")
    return types


def unserved_parallelism(topology: RankTopology) -> str:
    """What of this rank's parallel layout the backend cannot serve ('' when it serves all)."""
    parts = []
    if topology.pp_size > 1:
        parts.append(f"pipeline parallelism (pp_size {topology.pp_size})")
    if topology.attn_cp_size > 1:
        parts.append(f"attention context parallelism (attn_cp_size {topology.attn_cp_size})")
    return " and ".join(parts)


def regions_of(args: KVArgs, kind: MemoryKind) -> RegionSet:
    """``KVArgs`` as regions: KV (one item = one page), aux slots (host), and one state group
    per state type (its buffers, one item = one window page or one slot)."""

    def flat(name: str) -> list[int]:
        value = getattr(args, name, None) or []
        return [int(x) for group in value for x in (group if isinstance(group, list | tuple) else [group])]

    groups = [len(g) if isinstance(g, list | tuple) else 1 for g in getattr(args, "state_data_ptrs", None) or []]

    return RegionSet.from_kv_args(
        [int(p) for p in args.kv_data_ptrs],
        [int(n) for n in args.kv_data_lens],
        [int(n) for n in args.kv_item_lens],
        kind=kind,
        aux_data_ptrs=[int(p) for p in getattr(args, "aux_data_ptrs", [])],
        aux_data_lens=[int(n) for n in getattr(args, "aux_data_lens", [])],
        aux_item_lens=[int(n) for n in getattr(args, "aux_item_lens", [])],
        state_data_ptrs=flat("state_data_ptrs"),
        state_data_lens=flat("state_data_lens"),
        state_item_lens=flat("state_item_lens"),
        state_groups=groups,
    )


class KVTransportKVManager(BaseKVManager):
    """One rank's endpoint, its bootstrap registration (prefill) and its peer connections
    (decode)."""

    #: Decode holds the pages of a failed request until the prefill rank confirmed that none of
    #: its writes can land any more (kvtransport's ``drained``; SGLang's deferred KV release).
    supports_deferred_decode_kv_release = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        self.kv_args = args
        self.mode = _mode(disaggregation_mode)
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        #: Where this rank stands in SGLang's resolved configuration (attention-TP and DP ranks,
        #: DP routing, bootstrap and listen hosts): see docs/sglang-contract.md section 7.
        self.topology: RankTopology = rank_topology(args, server_args)
        unserved = unserved_parallelism(self.topology)
        if unserved:
            # Refused here, when the scheduler starts, with the reason: at request time each
            # would be an AttributeError (PP's poll_pp_consensus) or requests nobody announces
            # to (CP ranks other than 0).
            raise KVTransportError(
                f"kvtransport's SGLang backend does not serve {unserved} yet; run this deployment with another "
                "--disaggregation-transfer-backend (mooncake serves it)"
            )
        self.tp_rank, self.tp_size = self.topology.attn_tp_rank, self.topology.attn_tp_size
        self.dp_rank = self.topology.dp_rank
        self.bootstrap_host, self.bootstrap_port = self.topology.bootstrap_host, self.topology.bootstrap_port
        host = self.topology.listen_host
        state_types = state_types_of(args)
        memory = kv_memory(args, server_args)
        regions = regions_of(args, memory)
        layout = KVLayout(
            page_size=int(args.page_size),
            dtype=str(getattr(args, "kv_cache_dtype_str", "") or "unknown"),
            num_layers=len(args.kv_data_ptrs) // (1 if is_mla_backend else 2) or 1,
            kv_item_lens=tuple(int(n) for n in args.kv_item_lens),
            memory=memory,
            kv_split="mla" if is_mla_backend else "kv",
            num_kv_heads=int(getattr(args, "kv_head_num", 0) or 0),
            # Prefill's KVArgs carry the model's KV heads (decode's only with SGLang's staging):
            # what unequal TP shards by, and either side stating it is enough.
            total_kv_heads=int(getattr(args, "total_kv_head_num", 0) or 0),
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            aux_item_lens=tuple(int(n) for n in getattr(args, "aux_item_lens", [])),
            state_types=state_types,
            state_item_lens=regions.state_item_lens,
        )
        self.timeouts = sglang_timeouts()
        self.enable_deferred_decode_kv_release = _env_flag("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", True)
        #: Decode: rooms SGLang holds for a drain confirmation (bounded: SGLang releases each
        #: within its deferred-release timeout, 30 s by default, and clears it here).
        self._aborted_rooms: collections.OrderedDict[int, Transfer | FanIn] = collections.OrderedDict()
        self.endpoint = Endpoint(
            regions,
            layout,
            listen=f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0",
            # The rank, and a part of its own: another instance's rank 0 (or this rank restarted)
            # is another endpoint, which the decode side's check of the registry tells apart.
            name=f"sglang-{self.mode}-dp{self.dp_rank}-tp{self.tp_rank}-{uuid.uuid4().hex[:8]}",
            timeouts=self.timeouts,
        )
        # Keyed by prefill instance (bootstrap address), DP rank and attention-TP rank: as many as
        # the deployment has, bounded (MAX_PREFILL_PEERS, oldest first) against a router that
        # names endless ones.
        self._peers: collections.OrderedDict[tuple[str, int, int], Connection] = collections.OrderedDict()
        self._peers_lock = threading.Lock()
        #: Decode: bootstrap address -> what the prefill instance there looks like (filled in
        #: the background by :meth:`try_ensure_parallel_info`; SGLang reads it every loop).
        self.prefill_info_table: collections.OrderedDict[str, PrefillInfo] = collections.OrderedDict()
        self._routes: collections.OrderedDict[tuple[str, int, int], dict[str, Any]] = collections.OrderedDict()
        self._lookups: collections.OrderedDict[str, concurrent.futures.Future[None]] = collections.OrderedDict()
        self._connects: collections.OrderedDict[tuple[str, int], concurrent.futures.Future[tuple[Connection, ...]]] = (
            collections.OrderedDict()
        )
        self._publishing = 0  # prefill: room publications queued or running
        self._queries: concurrent.futures.ThreadPoolExecutor | None = None
        self._warnings = RateLimitedLog(log)
        self._closing = threading.Event()  # stops the workers' registry lookups at teardown
        self._workers = concurrent.futures.ThreadPoolExecutor(CONNECT_WORKERS, thread_name_prefix="kvtransport-sglang")
        self._bootstrap: BootstrapClient | None = None
        log.info(
            "SGLang %s rank dp=%d/%d attn_tp=%d/%d (%s), DP routing %s, bootstrap %s:%d, endpoint %s",
            self.mode,
            self.dp_rank,
            self.topology.dp_size,
            self.tp_rank,
            self.tp_size,
            "resolved config" if self.topology.resolved else "KVArgs and server args",
            self.topology.dp_routing,
            self.bootstrap_host,
            self.bootstrap_port,
            self.endpoint.address,
        )
        if self.mode == "prefill":
            try:
                self.register_to_bootstrap()
            except BaseException:
                self.endpoint.close()
                raise

    def register_to_bootstrap(self) -> None:
        """Prefill: publish this rank's endpoint under (dp, tp) at the instance's bootstrap server
        and keep refreshing it (the registry forgets a route its owner stopped refreshing)."""
        # One client for the rank's life: its owner token is what lets it refresh the route.
        client = self._bootstrap or BootstrapClient(f"{self.bootstrap_host}:{self.bootstrap_port}")
        self._bootstrap = client
        client.keep_registered(
            {
                "address": self.endpoint.address,
                "tp_rank": self.tp_rank,
                "tp_size": self.tp_size,
                "dp_rank": self.dp_rank,
                "dp_size": self.topology.dp_size,
                "follow_bootstrap_room": self.topology.follow_bootstrap_room,
                "page_size": int(self.kv_args.page_size),
                "kv_cache_dtype": str(getattr(self.kv_args, "kv_cache_dtype_str", "") or ""),
                "endpoint": self.endpoint.name,
            },
            first_wait=REGISTER_FIRST_WAIT_S,
        )

    def sources_of(self, bootstrap_addr: str, prefill_dp_rank: int) -> tuple[Connection, ...]:
        """Decode: the connections to every prefill rank this rank receives from (one with
        equal TP; with prefill TP P and decode TP D, ``tp_map.sources(P, D, rank)``), each made
        once and reused."""
        info = self.prefill_info_table.get(bootstrap_addr)
        if info is not None:
            prefill_tp = info.tp_size
        else:
            prefill_tp = int(self._route(bootstrap_addr, prefill_dp_rank, 0)["tp_size"])
        problem = tp_pairing_problem(prefill_tp, self.tp_size)
        if problem:
            raise LayoutMismatch(problem)
        return tuple(
            self.connection_to(bootstrap_addr, prefill_dp_rank, p, prefill_tp)
            for p in sources(prefill_tp, self.tp_size, self.tp_rank)
        )

    def _route(self, bootstrap_addr: str, prefill_dp_rank: int, prefill_tp_rank: int) -> dict[str, Any]:
        """Decode: where prefill rank (dp, tp) of the instance at ``bootstrap_addr`` listens."""
        key = (bootstrap_addr, prefill_dp_rank, prefill_tp_rank)
        with self._peers_lock:  # held for table look-ups only, never across the network
            route = self._routes.get(key)
        if route is None:
            # Bounded well below the bootstrap timeout: a dead registry must not hold one of the
            # few workers for minutes (the receiver fails, SGLang may retry the request).
            route = BootstrapClient(bootstrap_addr).lookup(
                prefill_dp_rank, prefill_tp_rank, min(self.timeouts.bootstrap, ROUTE_LOOKUP_S), stop=self._closing
            )
            with self._peers_lock:
                _put(self._routes, key, route)
        return route

    def connection_to(
        self, bootstrap_addr: str, prefill_dp_rank: int, prefill_tp_rank: int, prefill_tp: int
    ) -> Connection:
        """Decode: the connection to prefill rank (dp, tp) at ``bootstrap_addr``."""
        key = (bootstrap_addr, prefill_dp_rank, prefill_tp_rank)
        with self._peers_lock:
            conn = self._peers.get(key)
            if conn is not None and not conn.alive:
                # The rank went away: it may come back elsewhere (a restart registers anew).
                self._routes.pop(key, None)
        if conn is not None and conn.alive:
            return conn
        route = self._route(*key)
        if int(route["tp_size"]) != prefill_tp:
            with self._peers_lock:
                # The instance restarted with another TP size: learn its layout again.
                self._routes.pop(key, None)
                self._routes.pop((bootstrap_addr, 0, 0), None)
                self.prefill_info_table.pop(bootstrap_addr, None)
                self._lookups.pop(bootstrap_addr, None)
            raise LayoutMismatch(
                f"prefill rank dp={prefill_dp_rank} tp={prefill_tp_rank} at {bootstrap_addr} registers TP="
                f"{route['tp_size']}, its instance TP={prefill_tp}: a prefill instance restarted with another TP size?"
            )
        try:
            conn = self.endpoint.connect(route["address"], self.timeouts.connect)
        except KVTransportError:
            with self._peers_lock:  # a restarted rank registers anew: look it up next time
                self._routes.pop(key, None)
            raise
        if conn.peer_endpoint != route["endpoint"]:
            with self._peers_lock:
                self._routes.pop(key, None)
            # The address answered, with the secret, but it is not the rank the registry
            # paired with this one: nothing of this rank's requests goes there.
            conn.close("not the registered prefill rank")
            raise ConnectError(
                f"the endpoint at {route['address']} is {conn.peer_endpoint!r}; the bootstrap server at "
                f"{bootstrap_addr} registers {route['endpoint']!r} for prefill rank dp={prefill_dp_rank} "
                f"tp={prefill_tp_rank}"
            )
        with self._peers_lock:
            old = self._peers.get(key)
            if old is not None and old.alive:  # another thread got there first: keep one
                conn.close("a second connection to the same prefill rank")
                return old
            _put(self._peers, key, conn, drop=lambda c: c.close("too many prefill peers; the oldest goes"))
        return conn

    def connect_soon(
        self, bootstrap_addr: str, prefill_dp_rank: int
    ) -> concurrent.futures.Future[tuple[Connection, ...]]:
        """Decode: :meth:`sources_of` on a worker thread (a receiver's ``init`` must not block
        the scheduler loop); one connect per prefill DP rank at a time, its result shared."""
        key = (bootstrap_addr, prefill_dp_rank)
        with self._peers_lock:
            pending = self._connects.get(key)
            if pending is not None and pending.done() and pending.exception() is None:
                if all(c.alive for c in pending.result()):
                    return pending
            if pending is None or pending.done():
                pending = self._workers.submit(self.sources_of, *key)
                _put(self._connects, key, pending)
            return pending

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode (SGLang calls it about once a second while requests wait): whether
        ``prefill_info_table[bootstrap_addr]`` is filled; never blocks (the registry lookup runs
        on a worker). A prefill whose layout cannot serve this rank still gets an entry: each
        request then fails with the reason, instead of SGLang's generic "could not fetch"."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        with self._peers_lock:
            lookup = self._lookups.get(bootstrap_addr)
            if lookup is None or (lookup.done() and lookup.exception() is not None):
                if lookup is not None:
                    log.debug("bootstrap lookup at %s failed: %s", bootstrap_addr, lookup.exception())
                _put(self._lookups, bootstrap_addr, self._workers.submit(self._fetch_prefill_info, bootstrap_addr))
        return bootstrap_addr in self.prefill_info_table

    def _fetch_prefill_info(self, bootstrap_addr: str) -> None:
        # Every prefill rank publishes its instance's DP and TP layout; rank (0, 0) always exists.
        route = BootstrapClient(bootstrap_addr).lookup(0, 0, PARALLEL_INFO_LOOKUP_S, stop=self._closing)
        with self._peers_lock:
            _put(self._routes, (bootstrap_addr, 0, 0), route)
        info = PrefillInfo(int(route["dp_size"]), bool(route["follow_bootstrap_room"]), int(route["tp_size"]))
        log.info(
            "prefill instance at %s: %d DP rank(s), attn_tp=%d, DP routing %s",
            bootstrap_addr,
            info.dp_size,
            info.tp_size,
            "follow_bootstrap_room" if info.follow_bootstrap_room else "registered per room",
        )
        with self._peers_lock:
            _put(self.prefill_info_table, bootstrap_addr, info)

    def _ensure_prefill_recompute_executor(self) -> concurrent.futures.Executor:
        """Decode: where SGLang runs its ``/query_dp_ranks`` lookups (a prefill instance that does
        not route by room number). Its own pool: SGLang waits for their results on the scheduler
        thread, which must never queue behind this manager's connects and lookups."""
        with self._peers_lock:
            if self._queries is None:
                self._queries = concurrent.futures.ThreadPoolExecutor(
                    QUERY_WORKERS, thread_name_prefix="kvtransport-sglang-query"
                )
            return self._queries

    def publish_room(self, room: int) -> None:
        """Prefill: tell the registry this DP rank took ``room`` (attention-TP rank 0 speaks for
        its group), in the background: the scheduler loop never waits for HTTP."""
        client = self._bootstrap
        if client is None or self.tp_rank != 0:
            return
        with self._peers_lock:
            if self._publishing >= MAX_PENDING_PUBLISH:
                # The registry is not keeping up (or gone): decode cannot find these rooms and
                # fails them at its own timeout; queueing more would only grow without bound.
                self._warnings.warning(
                    "room %d: %d room publications already wait for the bootstrap server; not publishing",
                    room,
                    self._publishing,
                )
                return
            self._publishing += 1

        def publish() -> None:
            try:
                client.register_room(room, self.dp_rank, timeout=PUBLISH_TIMEOUT_S)
            except KVTransportError as exc:
                self._warnings.warning("room %d: publishing DP rank %d failed: %s", room, self.dp_rank, exc)
            finally:
                with self._peers_lock:
                    self._publishing -= 1

        try:
            self._workers.submit(publish)
        except RuntimeError:  # shut down: the rank is going away
            with self._peers_lock:
                self._publishing -= 1

    def paired_with(self, conn: Connection, tag: str) -> str:
        """Prefill: "" when ``conn``'s peer is a decode rank this rank feeds (``tp_map.targets``)
        and ``tag`` is the tag that rank announces this room under, else why not. A room is
        sent only to the decode ranks the registry pairs with this rank, whoever announced it."""
        layout = conn.peer_layout
        if layout is None:
            return f"{conn.peer_label} sent no KV layout"
        problem = tp_pairing_problem(self.tp_size, layout.tp_size)
        if problem or not 0 <= layout.tp_rank < layout.tp_size:
            return f"{conn.peer_label} is decode rank tp={layout.tp_rank}/{layout.tp_size}: {problem or 'no such rank'}"
        fed = targets(self.tp_size, self.tp_rank, layout.tp_size)
        if layout.tp_rank not in fed:
            return (
                f"{conn.peer_label} is decode rank tp={layout.tp_rank}/{layout.tp_size}; this prefill rank is "
                f"tp={self.tp_rank}/{self.tp_size}, which feeds decode rank(s) tp={list(fed)} only"
            )
        room = tag.split("@", 1)[0]
        want = room_tag(int(room), self.tp_size, layout.tp_size, layout.tp_rank) if room.isdigit() else ""
        if tag != want:
            return f"{conn.peer_label} (decode rank tp={layout.tp_rank}) announced tag {tag!r}, not {want!r}"
        return ""

    def live_sources(self, bootstrap_addr: str, prefill_dp_rank: int) -> list[Connection]:
        """Decode: the live connections to this rank's sources at ``bootstrap_addr`` that are up
        now (a receiver whose connect failed part way tells these that its room is gone)."""
        info = self.prefill_info_table.get(bootstrap_addr)
        if info is None or tp_pairing_problem(info.tp_size, self.tp_size):
            return []
        with self._peers_lock:
            found = [
                self._peers.get((bootstrap_addr, prefill_dp_rank, p))
                for p in sources(info.tp_size, self.tp_size, self.tp_rank)
            ]
        return [c for c in found if c is not None and c.alive]

    def decode_tp_sizes(self) -> set[int]:
        """Prefill: the attention-TP sizes of the decode ranks connected now."""
        return {c.peer_layout.tp_size for c in self.endpoint.connections.values() if c.peer_layout is not None}

    def note_aborted(self, room: int, transfer: Transfer | FanIn) -> None:
        """Decode: SGLang will hold ``room``'s pages until :meth:`is_abort_release_safe`."""
        _put(self._aborted_rooms, room, transfer, MAX_HELD_ROOMS)

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """Decode (SGLang asks every loop for the rooms it holds): whether no write of the
        failed room can land in its pages any more. A room this manager does not hold (none
        was announced) has nothing in flight."""
        transfer = self._aborted_rooms.get(int(bootstrap_room))
        if required_acks <= 0:
            return True
        # A room SGLang holds but this manager no longer tracks (more than MAX_HELD_ROOMS held)
        # is not known to be drained: SGLang's own timeout releases it.
        return transfer is not None and transfer.drained.is_set()

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        self._aborted_rooms.pop(int(bootstrap_room), None)

    def teardown(self) -> None:
        self._unregister()
        self._closing.set()
        self._workers.shutdown(wait=False, cancel_futures=True)
        if self._queries is not None:
            self._queries.shutdown(wait=False, cancel_futures=True)
        self.endpoint.close()

    def _unregister(self) -> None:
        """Prefill: stop refreshing and remove this rank's route, best effort: the bootstrap
        server may be gone already, and an unremoved route expires by itself."""
        client, self._bootstrap = self._bootstrap, None
        if client is None:
            return
        try:
            client.unregister(timeout=1.0)
        except Exception as exc:  # noqa: BLE001 - teardown never raises
            log.debug(
                "rank dp=%d tp=%d: unregistering from the bootstrap server failed: %s", self.dp_rank, self.tp_rank, exc
            )

    close = teardown


class _Failure:
    """A transfer's first error, kept for ``failure_exception``."""

    def __init__(self) -> None:
        self.error: KVTransportError | None = None

    def set(self, error: KVTransportError) -> None:
        self.error = self.error or error


def _env_flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value in ("1", "true", "yes", "on")


def _poll_of(transfer: Transfer | FanIn | None, failure: _Failure, before: int) -> int:
    if failure.error is not None:
        return int(KVPoll.Failed)
    if transfer is None:
        return before
    if transfer.state is State.FAILED:
        failure.set(transfer.error or KVTransportError("transfer failed"))
    return int(transfer.state)


def _stop(transfer: Transfer | FanIn | None, reason: str) -> None:
    """Abort ``transfer`` if it still runs (the peer hears of it)."""
    if transfer is not None and not transfer.state.final:
        transfer.abort(reason)


def _raise(room: int, failure: _Failure, transfer: Transfer | FanIn | None) -> None:
    error = failure.error or (transfer.error if transfer is not None else None)
    reason = f"{type(error).__name__}: {error}" if error else "the transfer failed"
    raise KVTransferError(room, reason, error)


class KVTransportKVSender(BaseKVSender):
    """Prefill side of one request (bootstrap room)."""

    def __init__(
        self,
        mgr: KVTransportKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        self.mgr = self.kv_mgr = mgr  # SGLang reads ``kv_mgr`` (prefill.py metrics)
        self.bootstrap_addr = bootstrap_addr
        self.room = int(bootstrap_room)
        self.tag = str(self.room)
        #: The room's transfer once every decode rank this rank feeds announced it: one
        #: Transfer, or a FanOut over several when decode runs the wider TP.
        self.transfer: Transfer | FanOut | None = None
        #: Announced so far, by tag: this rank's room tag first (its announcer's layout says
        #: which decode ranks to wait for, ``_targets``), then each ``room@rank``.
        self._parts: dict[str, Transfer] = {}
        self._targets: list[str] = []
        self.failure = _Failure()
        self.num_kv_indices: int | None = None
        self.aux_index: int | None = None
        self.sent = 0
        self._queued: list[tuple[np.ndarray[Any, Any], bool, int | None, list[Any] | None]] = []
        self._created = time.monotonic()
        #: Set by SGLang's prefill (prefill.py, maybe_send_cached_prefix_chunk) under overlap
        #: scheduling: a CUDA event the previous forward records while it may still be writing
        #: the prefix pages handed to ``send``. Chunks wait in the queue until it completed.
        self._early_send_wait_event: Any = None
        self._waiting_on: Any = None
        self._prefix_read = False
        self._route_room(bool(req_has_disagg_prefill_dp_rank))

    def _route_room(self, has_dp_rank: bool) -> None:
        """With several prefill DP ranks, make sure decode finds this one for the room: by the
        room number (``follow_bootstrap_room``: a request dispatched elsewhere fails here with
        the reason, as SGLang's own backends do) or by publishing it at the registry."""
        topo = self.mgr.topology
        if topo.dp_size <= 1 or has_dp_rank:
            return
        if topo.follow_bootstrap_room and not _env_flag("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK"):
            implied = self.room % topo.dp_size
            if implied != topo.dp_rank:
                self.failure.set(
                    ConnectError(
                        f"follow_bootstrap_room conflict: room {self.room} was dispatched to prefill DP rank "
                        f"{topo.dp_rank}, but decode routes it to DP rank {implied} (room % {topo.dp_size}). Route "
                        "requests by room, or set SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 on both sides"
                    )
                )
            return
        self.mgr.publish_room(self.room)

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """A final chunk without pages still goes out: it carries the aux row and ends the
        transfer (SGLang's base class would skip it, and decode would wait for it forever)."""
        return num_pages > 0 or bool(last_chunk)

    def pop_decode_prefix_len(self) -> int:
        """The tokens decode holds already (its radix cache), read by SGLang's prefill once this
        room is WaitingForInput: it then sends only the pages after them (prefill.py,
        finalize_bootstrap). 0 before the announcement, and once read."""
        t = self.transfer
        if t is None or self._prefix_read:
            return 0
        self._prefix_read = True
        prefixes = {p.peer_prefix for p in self._parts.values()}
        if len(prefixes) > 1:
            self.failure.set(
                InvalidPages(
                    f"room {self.room}: the decode ranks announced different cached prefixes {sorted(prefixes)}"
                )
            )
            self._refuse(f"room {self.room}: decode ranks disagree on the cached prefix")
        return int(t.peer_prefix)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = None if aux_index is None else int(aux_index)
        announced = sorted({int(p.dst_pages.size) for p in self._parts.values() if p.dst_pages is not None})
        prefix = max((p.peer_prefix for p in self._parts.values()), default=0)
        if self.num_kv_indices < 0 or any(n != self.num_kv_indices for n in announced):
            # A prefix longer than the prompt, or decode and prefill disagreeing on the page
            # count: SGLang would send nothing (or too much); fail now, with both numbers.
            self.failure.set(
                InvalidPages(
                    f"room {self.room}: prefill has {self.num_kv_indices} pages to send after decode's prefix of "
                    f"{prefix} tokens, decode announced {announced[0] if len(announced) == 1 else announced}"
                )
            )
            self._refuse(f"room {self.room}: prefill and decode disagree on the pages to send")

    def _bind(self) -> None:
        """Take the announcements of the decode ranks this rank feeds, as they arrive: the
        room is sent once all are in (a bootstrap timeout for any that never comes)."""
        if self.transfer is not None or self.failure.error is not None:
            return
        ep = self.mgr.endpoint
        for tag in self._targets or [self.tag]:
            if tag in self._parts:
                continue
            conn = ep.announced(tag)
            if conn is None:
                continue
            unpaired = self.mgr.paired_with(conn, tag)
            if unpaired:
                self.failure.set(ConnectError(f"room {self.room} was announced by the wrong rank: {unpaired}"))
                # Its announcer learns at once that nothing comes (not at its timeout).
                conn.sender(tag).abort(f"room {self.room} is not paired with this rank: {unpaired}")
                self._refuse(f"room {self.room} failed on the prefill side: {unpaired}")
                return
            self._parts[tag] = conn.sender(tag)
            if not self._targets:
                layout = conn.peer_layout
                assert layout is not None  # paired_with checked it
                decode_tp = layout.tp_size
                self._targets = [
                    room_tag(self.room, self.tp_size, decode_tp, d)
                    for d in targets(self.tp_size, self.tp_rank, decode_tp)
                ]
        failed = next((p for p in self._parts.values() if p.state is State.FAILED), None)
        if failed is not None:
            self.failure.set(failed.error or KVTransportError(f"room {self.room}: a decode rank's transfer failed"))
            self._refuse(f"room {self.room}: another decode rank's transfer failed")
        elif self._targets and len(self._parts) == len(self._targets):
            parts = [self._parts[t] for t in self._targets]
            self.transfer = parts[0] if len(parts) == 1 else FanOut(self.tag, parts)
        elif time.monotonic() - self._created > self.mgr.timeouts.bootstrap:
            missing = [t for t in self._targets or [self.tag] if t not in self._parts]
            self.failure.set(
                TransferTimeout(
                    f"no decode rank announced room {self.room} (tags {missing}) within "
                    f"{self.mgr.timeouts.bootstrap:g} s"
                )
            )
            # An announcement still on its way hears at once that nothing comes.
            self._refuse(f"room {self.room} timed out on the prefill side")

    @property
    def tp_rank(self) -> int:
        return self.mgr.tp_rank

    @property
    def tp_size(self) -> int:
        return self.mgr.tp_size

    def _refuse(self, reason: str) -> None:
        """Nothing of this room will be sent: each decode rank it feeds learns so now (its
        transfer is aborted) or when its announcement arrives (its tag is refused)."""
        if self.transfer is not None:
            _stop(self.transfer, reason)
            return
        for part in self._parts.values():
            _stop(part, reason)
        if self._targets:
            unbound = [t for t in self._targets if t not in self._parts]
        else:
            # Decode's TP size is not known before its first announcement: every tag a decode
            # rank of a TP size connected now would use. (A decode rank that connects later
            # hears of the failure through its side's all-reduce of polls; the refusals are
            # bounded, oldest first, so spare ones cost nothing but a slot.)
            unbound = [self.tag]
            for decode_tp in sorted(self.mgr.decode_tp_sizes()):
                if decode_tp > self.tp_size and not tp_pairing_problem(self.tp_size, decode_tp):
                    fed = targets(self.tp_size, self.tp_rank, decode_tp)
                    unbound += [room_tag(self.room, self.tp_size, decode_tp, d) for d in fed[1:]]
        for tag in unbound:
            try:
                self.mgr.endpoint.refuse(tag, reason)
            except KVTransportError as exc:  # the endpoint is closing: its peers hear "bye"
                log.debug("room %d: refusing tag %s failed: %s", self.room, tag, exc)

    def _prefix_written(self) -> bool:
        """Whether the forward SGLang asked this sender to wait for (see ``__init__``) is done."""
        event = self._waiting_on
        if event is None:
            return True
        try:
            done = bool(event.query())
        except Exception as exc:  # noqa: BLE001 - a broken event must fail the room, not the loop
            self.failure.set(KVTransportError(f"room {self.room}: waiting for the prefix forward failed: {exc}"))
            return False
        if done:
            self._waiting_on = None
        return done

    def _flush(self) -> None:
        if self.transfer is None or self.transfer.state is State.BOOTSTRAPPING or not self._prefix_written():
            return
        while self._queued and self.failure.error is None:
            pages, last, aux, state = self._queued.pop(0)
            try:
                self.transfer.send(pages, last=last, aux=aux, state=state)
            except KVTransportError as exc:
                self.failure.set(exc)
                self.transfer.abort(f"prefill could not send: {exc}")

    def send(self, kv_indices: Any, state_indices: list[Any] | None = None, num_kv_tokens: int | None = None) -> None:
        if self.failure.error is not None:
            return
        pages = np.asarray(kv_indices, dtype=np.int64)
        if self.num_kv_indices is None:
            self.failure.set(KVTransportError(f"send() on room {self.room} before init()"))
            return
        # SGLang passes a state list (empty for a model without state buffers) with the last
        # segment of the last chunk only (prefill.py, _send_kv_chunk), and writes the aux row
        # just before that send: the aux row goes with it, even when earlier chunks already
        # carried every page. The state items (one list per state type) go with it too.
        last = state_indices is not None
        total = self.sent + int(pages.size)
        if total > self.num_kv_indices or (last and total != self.num_kv_indices):
            self.failure.set(
                InvalidPages(
                    f"room {self.room}: {'the last chunk brings' if last else 'chunks bring'} the pages sent to "
                    f"{total}, but init() announced {self.num_kv_indices}"
                )
            )
            self._refuse(f"room {self.room}: prefill sent the wrong number of pages")
            return
        if not last and pages.size == 0:
            return
        event, self._early_send_wait_event = self._early_send_wait_event, None
        if event is not None:
            self._waiting_on = event  # holds this chunk and every later one (they stay in order)
        self.sent = total
        self._queued.append((pages, last, self.aux_index if last else None, state_indices if last else None))
        self._bind()
        self._flush()

    def poll(self) -> int:
        self._bind()
        self._flush()
        state = _poll_of(self.transfer, self.failure, int(KVPoll.Bootstrapping))
        if state == int(KVPoll.Failed) and self.transfer is not None and not self.transfer.state.final:
            self.transfer.abort(str(self.failure.error))
        return state

    def failure_exception(self) -> None:
        # SGLang frees the pages once it has the exception (also when another rank failed and
        # the all-reduce made this one Failed): nothing of this room may still be moving.
        self._refuse(f"room {self.room} failed on the prefill side")
        _raise(self.room, self.failure, self.transfer)

    def abort(self) -> None:
        self.failure.set(TransferAborted(f"room {self.room} aborted by the prefill scheduler"))
        self._refuse("aborted by the prefill scheduler")

    def clear(self) -> None:
        self._queued.clear()
        if self.transfer is not None:
            _stop(self.transfer, f"room {self.room} released by the prefill scheduler")
        elif self.failure.error is not None:
            self._refuse(f"room {self.room} released by the prefill scheduler")

    def get_transfer_metric(self) -> KVTransferMetric:
        t = self.transfer
        if t is None:
            return KVTransferMetric()
        latency = t.finished - t.started if t.state is State.SUCCESS and t.started else None
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=t.bytes or None)


class KVTransportKVReceiver(BaseKVReceiver):
    """Decode side of one request (bootstrap room)."""

    def __init__(self, mgr: KVTransportKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        self.mgr = self.kv_mgr = mgr  # SGLang's decode reads ``kv_mgr`` on every failure
        self.bootstrap_addr = bootstrap_addr
        self.room = int(bootstrap_room or 0)
        self.tag = str(self.room)
        #: The prefill ranks this rank receives from (one with equal TP), once connected.
        self.conns: tuple[Connection, ...] = ()
        self._connecting: concurrent.futures.Future[tuple[Connection, ...]] | None = None
        #: One Transfer, or a FanIn over the sources when prefill runs the wider TP.
        self.transfer: Transfer | FanIn | None = None
        self.failure = _Failure()
        #: SGLang's deferred release (decode.py, pop_transferred): whether the prefill rank was
        #: told this room failed and the manager waits for its drain confirmation.
        self.abort_notified = False
        self._told_prefill = False
        self.prefill_dp_rank = 0

    @property
    def conn(self) -> Connection | None:
        """The (first) prefill rank's connection."""
        return self.conns[0] if self.conns else None

    @property
    def bootstrap_infos(self) -> list[Connection]:
        """The prefill ranks whose drain confirmation SGLang waits for: every source this
        room's pages were announced to, once they were."""
        return list(self.conns) if self.transfer is not None else []

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Tell the prefill ranks (once) that the room failed here, and hold the room until they
        confirm their writes stopped. Before ``send_metadata`` nothing can be written: nothing
        is held."""
        if self.abort_notified or self.transfer is None:
            return
        _stop(self.transfer, f"room {self.room} failed on the decode side")
        self.mgr.note_aborted(self.room, self.transfer)
        self.abort_notified = True

    def init(self, prefill_dp_rank: int = 0) -> None:
        """Starts the connections to the prefill ranks and returns: ``poll`` says Bootstrapping
        until they are up (the decode scheduler loop never waits for a handshake here)."""
        self.prefill_dp_rank = int(prefill_dp_rank or 0)
        self._connecting = self.mgr.connect_soon(self.bootstrap_addr, self.prefill_dp_rank)
        self._connected()

    def _connected(self) -> None:
        fut = self._connecting
        if self.conns or fut is None or not fut.done():
            return
        self._connecting = None
        try:
            conns = fut.result()
        except KVTransportError as exc:
            self.failure.set(exc)
            return
        except Exception as exc:  # noqa: BLE001 - a bug below must fail this request, not the scheduler
            self.failure.set(ConnectError(f"connecting for room {self.room} failed: {type(exc).__name__}: {exc}"))
            return
        layout = conns[0].peer_layout
        prefill_tp = layout.tp_size if layout is not None else self.mgr.tp_size
        try:
            self.tag = room_tag(self.room, prefill_tp, self.mgr.tp_size, self.mgr.tp_rank)
        except MemoryLayoutError as exc:
            self.failure.set(LayoutMismatch(str(exc)))
            return
        self.conns = conns

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: Any = None,
    ) -> None:
        if self.failure.error is not None:
            return
        self._connected()
        if not self.conns:
            self.failure.set(ConnectError(f"send_metadata() on room {self.room} before a successful init()"))
            return
        if destination is not None and str(getattr(destination, "value", destination)) == "host":
            self.failure.set(KVTransportError("kvtransport's SGLang backend does not support host KV destinations yet"))
            return
        try:
            # With decode's radix cache the pages are those after the cached prefix; prefill
            # learns its length with the announcement and sends only what follows it.
            pages = np.asarray(kv_indices, dtype=np.int64)
            prefix = int(decode_prefix_len or 0)
            if len(self.conns) == 1:
                self.transfer = self.conns[0].expect(self.tag, pages, aux=aux_index, prefix=prefix, state=state_indices)
            else:  # several prefill ranks each write their heads (the first the aux slot and state)
                self.transfer = expect_from(
                    self.conns, self.tag, pages, aux=aux_index, prefix=prefix, state=state_indices
                )
        except PartialAnnouncement as exc:
            # Some sources heard of the pages (now aborted): SGLang holds them until they drained.
            self.transfer = exc.parts
            self.failure.set(exc)
        except KVTransportError as exc:
            self.failure.set(exc)

    def poll(self) -> int:
        self._connected()
        if self.transfer is None and self.failure.error is None:
            if not self.conns:
                return int(KVPoll.Bootstrapping)
            dead = next((c for c in self.conns if not c.alive), None)
            if dead is not None:
                self.failure.set(
                    dead.error or ConnectError(f"connection to {dead.peer_label} for room {self.room} closed")
                )
            else:
                return int(KVPoll.WaitingForInput)
        return _poll_of(self.transfer, self.failure, int(KVPoll.WaitingForInput))

    def failure_exception(self) -> None:
        _stop(self.transfer, f"room {self.room} failed on the decode side")
        _raise(self.room, self.failure, self.transfer)

    def abort(self) -> None:
        self.failure.set(TransferAborted(f"room {self.room} aborted by the decode scheduler"))
        self._give_up("aborted by the decode scheduler")

    def clear(self) -> None:
        if self.transfer is None and self.failure.error is not None:
            self._give_up(f"room {self.room} released by the decode scheduler")
        _stop(self.transfer, f"room {self.room} released by the decode scheduler")
        self.transfer = None

    def _give_up(self, reason: str) -> None:
        """Nothing of this room is wanted any more: abort its transfer, or, before the pages
        were announced, tell the prefill rank's endpoint so its sender fails now (or when it is
        created), not at its bootstrap timeout. A connection still being made is told once up."""
        if self.transfer is not None:
            _stop(self.transfer, reason)
            return
        if self._told_prefill:
            return
        self._told_prefill = True

        def tell_each(conns: Sequence[Connection]) -> None:
            # Under the tag this rank announces the room with at that connection's endpoint.
            for conn in conns:
                layout = conn.peer_layout
                if layout is None or tp_pairing_problem(layout.tp_size, self.mgr.tp_size):
                    continue
                tag = room_tag(self.room, layout.tp_size, self.mgr.tp_size, self.mgr.tp_rank)
                try:
                    conn.abort(tag, reason)
                except KVTransportError as exc:
                    log.debug("room %s: telling prefill of the abort failed: %s", tag, exc)

        def live_sources() -> None:
            # The connect failed (part way, maybe): the sources that are up hear of it now, not
            # at their bootstrap timeout.
            tell_each(self.mgr.live_sources(self.bootstrap_addr, self.prefill_dp_rank))

        def tell_once_up(fut: concurrent.futures.Future[tuple[Connection, ...]]) -> None:
            if fut.cancelled():
                return
            if fut.exception() is None:
                tell_each(fut.result())
            else:
                live_sources()

        if self.conns:
            tell_each(self.conns)
        elif self._connecting is not None:
            self._connecting.add_done_callback(tell_once_up)
        else:
            live_sources()


class KVTransportKVBootstrapServer(BaseKVBootstrapServer):
    """The instance's registry of prefill rank endpoints (HTTP, see
    :mod:`kvtransport.integrations.bootstrap`).

    Binds the host SGLang gives it (``--host``, 127.0.0.1 by default). A host reachable from
    other machines (``0.0.0.0``, a NIC address) needs ``KVTRANSPORT_SECRET`` (or
    ``KVTRANSPORT_INSECURE=1``), else this raises ``ConfigError`` at start-up."""

    def __init__(self, host: str, port: int) -> None:
        self.server = BootstrapServer(host, port)
        self.host, self.port = self.server.host, self.server.port

    def close(self) -> None:
        self.server.close()
