"""One SGLang rank's manager (:class:`KVTransportKVManager`): its endpoint over the rank's
``KVArgs``, its registration at the instance's bootstrap server (prefill), its connections to
the prefill ranks it receives from and what it learned of their instances (decode), the rooms
it publishes (prefill) or holds for SGLang's deferred release (decode), and the bounds on each
of its tables and worker pools."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from kvtransport.integrations.discovery import Directory, directory_for, discovery_from_env
from kvtransport.integrations.discovery.dial import dial
from kvtransport.integrations.pairing import pairing_problem, tp_pairing_problem
from kvtransport.integrations.sglang.common import (
    BaseKVManager,
    KVArgs,
    _env_flag,
    aux_rows,
    decode_allocation_policy,
    kv_dtype_name,
    kv_memory,
    model_kv_heads,
    regions_of,
    sglang_timeouts,
    speculative,
    state_types_of,
    unserved_parallelism,
)
from kvtransport.integrations.sglang.layerwise import enabled as layerwise_enabled
from kvtransport.integrations.sglang.layerwise import layer_map
from kvtransport.integrations.sglang_topology import RankTopology, discovery_instance, rank_topology
from kvtransport.runtime.auth import RateLimitedLog
from kvtransport.runtime.auth_failures import WINDOW_S
from kvtransport.runtime.bounded import put_newest
from kvtransport.runtime.endpoint import Connection, Endpoint, Transfer
from kvtransport.runtime.fanin import FanIn
from kvtransport.runtime.layer_groups import LayerwisePolicy
from kvtransport.spi.errors import ConfigError, ConnectError, KVTransportError, LayoutMismatch
from kvtransport.spi.memory import KVLayout
from kvtransport.spi.tp_map import sources

log = logging.getLogger(__name__)

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


@dataclasses.dataclass(frozen=True)
class PrefillInfo:
    """What SGLang's decode scheduler reads from ``kv_manager.prefill_info_table[addr]``: how
    many prefill DP ranks there are and whether a room picks its rank (``room % dp_size``)."""

    dp_size: int
    follow_bootstrap_room: bool
    tp_size: int


def _mode(disaggregation_mode: Any) -> str:
    value = str(getattr(disaggregation_mode, "value", disaggregation_mode)).lower()
    if value not in ("prefill", "decode"):
        raise KVTransportError(f"kvtransport serves prefill and decode ranks, not {disaggregation_mode!r}")
    return value


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
        if decode_allocation_policy(server_args) == "prefill_complete":
            # SGLang's own check refuses it for every backend but Mooncake when it parses the
            # arguments; a server-args object that skipped that check gets the same answer
            # here, not an AttributeError at the first request (decode's _init_receiver reads
            # the receiver's conclude_state, prefill calls mark_prefill_complete).
            raise KVTransportError(
                "kvtransport's SGLang backend does not serve --disaggregation-decode-allocation-policy "
                "prefill_complete yet (decode allocating only once prefill completed); use the default, early"
            )
        self.tp_rank, self.tp_size = self.topology.attn_tp_rank, self.topology.attn_tp_size
        self.dp_rank = self.topology.dp_rank
        self.bootstrap_host, self.bootstrap_port = self.topology.bootstrap_host, self.topology.bootstrap_port
        host = self.topology.listen_host
        state_types = state_types_of(args)
        memory = kv_memory(args, server_args)
        regions = regions_of(args, memory)
        heads, total_heads = int(getattr(args, "kv_head_num", 0) or 0), int(getattr(args, "total_kv_head_num", 0) or 0)
        if self.mode == "decode" and not is_mla_backend and not heads:
            # A vLLM prefill regroups its blocks into this rank's pages by head (spi.page_geometry).
            heads, total_heads = model_kv_heads(server_args, self.tp_size)
        handoff_rows = aux_rows(args, server_args) if self.mode == "decode" else None
        if self.mode == "decode" and handoff_rows is None:
            log.warning(
                "kvtransport SGLang decode: its %d aux buffers are not in the order kvtransport knows (SGLang "
                "0.5.23's MetadataBuffers); a vLLM prefill cannot feed this instance (SGLang prefills can)",
                len(getattr(args, "aux_item_lens", []) or []),
            )
        layout = KVLayout(
            page_size=int(args.page_size),
            dtype=str(getattr(args, "kv_cache_dtype_str", "") or "unknown"),
            num_layers=len(args.kv_data_ptrs) // (1 if is_mla_backend else 2) or 1,
            kv_item_lens=tuple(int(n) for n in args.kv_item_lens),
            memory=memory,
            kv_split="mla" if is_mla_backend else "kv",
            num_kv_heads=heads,
            # Prefill's KVArgs carry the model's KV heads (decode's only with SGLang's staging):
            # what unequal TP shards by, and either side stating it is enough.
            total_kv_heads=total_heads,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            aux_item_lens=tuple(int(n) for n in getattr(args, "aux_item_lens", [])),
            state_types=state_types,
            state_item_lens=regions.state_item_lens,
            # The role too: a vLLM decode may pair with an SGLang prefill (spi.cross_engine).
            # and the KV dtype by name where SGLang says ``auto`` (spi.cross_engine compares it).
            # A decode says which aux regions a vLLM prefill writes its first token's handoff
            # into (spi.handoff), and whether speculative decoding needs more than those.
            extra={
                "engine": "sglang",
                "role": self.mode,
                "kv_dtype": kv_dtype_name(args, server_args),
                **(
                    {"aux_rows": handoff_rows, "speculative": speculative(server_args)} if self.mode == "decode" else {}
                ),
            },
        )
        self.timeouts = sglang_timeouts()
        #: Prefill with ``KVTRANSPORT_LAYERWISE=1``: how chunks go layer by layer
        #: (:mod:`~kvtransport.integrations.sglang.layerwise`); None sends each chunk whole.
        self.layerwise: LayerwisePolicy | None = (
            LayerwisePolicy.from_env() if self.mode == "prefill" and layerwise_enabled() else None
        )
        self._layer_of_buffer: dict[int, int] | None = None
        self._write_layers: dict[tuple[int, int], tuple[int, ...]] = {}
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
        #: Prefill: rooms failed early because connections fail authentication, logged once a window.
        self._auth_warnings = RateLimitedLog(log, period=WINDOW_S, burst=1)
        self._closing = threading.Event()  # stops the workers' registry lookups at teardown
        self._workers = concurrent.futures.ThreadPoolExecutor(CONNECT_WORKERS, thread_name_prefix="kvtransport-sglang")
        self._bootstrap: Directory | None = None
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
        if self.layerwise is not None and int(getattr(args, "num_draft_entries", 0) or 0):
            # The draft model's buffers follow the target's K and V in kv_data_ptrs: the regions
            # no longer read as every K then every V, and the draft forward writes them apart.
            log.info(
                "SGLang prefill: layer-wise sends off: the draft model's KV goes with the target's; chunks go whole"
            )
            self.layerwise = None
        if self.layerwise is not None:
            self._layer_of_buffer = layer_map(args.kv_data_ptrs, layout, regions)
            log.info(
                "SGLang prefill: layer-wise sends on (chunks of at least %d tokens; %s)",
                self.layerwise.min_tokens,
                self.layerwise,
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
        discovery = discovery_from_env()
        if self._bootstrap is not None:
            client = self._bootstrap
        elif discovery is None:
            client = directory_for(f"{self.bootstrap_host}:{self.bootstrap_port}", None)
        else:
            # etcd: under the name the router hands decode, which may not be this rank's
            # registry address (a wildcard --host registers at loopback).
            instance = discovery_instance(self.topology)
            log.info("prefill rank dp=%d tp=%d registers as instance %s", self.dp_rank, self.tp_rank, instance)
            client = directory_for(instance, discovery)
        topo = self.topology
        by_room = topo.follow_bootstrap_room and not _env_flag("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK")
        if topo.dp_size > 1 and not by_room and not client.serves_rooms:
            raise ConfigError(
                f"{client.base} does not publish rooms: a prefill instance whose DP ranks decode must query per "
                "room (not --load-balance-method follow_bootstrap_room, or "
                "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1) needs the built-in bootstrap server "
                "(unset KVTRANSPORT_DISCOVERY)"
            )
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

    def layers_written(self, pool: Any, local: int, buffers: Callable[[Any, int], list[int]]) -> tuple[int, ...]:
        """The layers (as layer-wise streams number them) that a write to ``pool``'s layer
        ``local`` fills: those of its buffers (``buffers``: their data pointers) this rank sends
        as KV; none for another buffer (an SWA layer's). Looked up once per pool layer: the
        pools live as long as the scheduler, and so does this table."""
        key = (id(pool), local)
        layers = self._write_layers.get(key)
        if layers is None:
            table = self._layer_of_buffer or {}
            layers = self._write_layers[key] = tuple(sorted({table[p] for p in buffers(pool, local) if p in table}))
        return layers

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
            route = directory_for(bootstrap_addr).lookup(
                prefill_dp_rank, prefill_tp_rank, min(self.timeouts.bootstrap, ROUTE_LOOKUP_S), stop=self._closing
            )
            route = {**route, "looked_up": time.monotonic()}  # said when a connect to it fails
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
            # A refused address fails at once; a failure names the rank and says the route may be stale.
            conn = dial(
                self.endpoint,
                route,
                rank=f"prefill rank dp={prefill_dp_rank} tp={prefill_tp_rank} of instance {bootstrap_addr}",
                timeout=self.timeouts.connect,
                looked_up=route.get("looked_up"),
            )
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
        route = directory_for(bootstrap_addr).lookup(0, 0, PARALLEL_INFO_LOOKUP_S, stop=self._closing)
        route = {**route, "looked_up": time.monotonic()}
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

    def submit_prefill_recompute(self, kv_receiver: Any, payload: dict[str, Any]) -> None:
        """Decode, for a request SGLang retracted and bootstraps again (PD retraction:
        ``pause_generation(mode="retract")``, or pools that retract): SGLang's backends ask the
        prefill instance's HTTP server to compute the prompt again. This backend does not: the
        request fails now, with the reason, instead of waiting for KV that never comes."""
        reason = (
            f"room {payload.get('bootstrap_room', getattr(kv_receiver, 'room', '?'))}: kvtransport's SGLang backend "
            "cannot have prefill recompute a retracted request yet (PD retraction rebootstrap); the request fails"
        )
        log.warning("%s", reason)
        fail = getattr(kv_receiver, "fail", None)
        if callable(fail):
            fail(KVTransportError(reason))
        else:
            kv_receiver.abort()

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

    def failing_authentication(self, room: int, reason: str) -> None:
        """Prefill: ``room`` failed early because connections to this rank fail authentication
        while it waited for its decode (``KVTransportKVSender``); one warning per window."""
        self._auth_warnings.warning(
            "SGLang prefill rank dp=%d tp=%d: %s. Room %d fails now, not at the bootstrap timeout (%g s), and so "
            "does every request waiting in that case (logged once per %g s)",
            self.dp_rank,
            self.tp_rank,
            reason,
            room,
            self.timeouts.bootstrap,
            WINDOW_S,
        )

    def paired_with(self, conn: Connection, tag: str) -> str:
        """Prefill: "" when ``conn``'s peer is a decode rank this rank feeds (``tp_map.targets``)
        and ``tag`` is the tag that rank announces this room under, else why not
        (``pairing.pairing_problem``)."""
        room = tag.split("@", 1)[0]
        if not room.isdigit():
            return f"{conn.peer_label} announced tag {tag!r}, which names no room"
        return pairing_problem(conn.peer_layout, conn.peer_label, self.tp_rank, self.tp_size, tag)

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
