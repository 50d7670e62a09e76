"""The worker side of vLLM's connector, without vLLM: one TP rank's endpoint and the requests
it holds for decode (prefill) or loads from prefill (decode), polled once per engine step.

Prefill: a finished request's blocks are held (:meth:`WorkerSide.hold`) until every decode rank
this rank feeds has announced where they go and the writes completed, or until the lease runs
out with no announcement (a decode that never comes: the blocks go back, the tags are refused,
so a late decode hears at once that nothing comes). Decode: :meth:`WorkerSide.load` connects to
the prefill ranks the TP map names (on a thread: an engine step never waits for a handshake),
announces the request's new blocks with the blocks it holds already as the prefix, and reports
the request done when the writes landed, or failed, with its blocks, once no write of it can
land any more. A request that ends before it announced (:meth:`WorkerSide.cancel`), or never
loads at all (:meth:`WorkerSide.decline`), tells those prefill ranks that nothing of it is
wanted, and they give its blocks back at once.

Every table here is bounded by the engine's requests in flight; every wait has a deadline;
nothing a peer or a client sends raises out of :meth:`WorkerSide.poll`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtransport.integrations.pairing import pairing_problem, request_tag, tp_pairing_problem
from kvtransport.integrations.vllm.params import RemotePrefill
from kvtransport.integrations.vllm.scheduler_side import FirstToken
from kvtransport.runtime.endpoint import Connection, Endpoint, State, Transfer
from kvtransport.runtime.fanin import FanIn, PartialAnnouncement, expect_from
from kvtransport.spi.errors import (
    ConfigError,
    ConnectError,
    InvalidPages,
    KVTransportError,
    LayoutMismatch,
    TransferTimeout,
)
from kvtransport.spi.handoff import handoff_between, slot_content
from kvtransport.spi.page_geometry import different_engines
from kvtransport.spi.tp_map import sources, targets

log = logging.getLogger(__name__)

__all__ = ["StepResults", "WorkerSide"]

#: Prefill ranks a decode rank keeps connections to; beyond it, the least recently used idle
#: one is closed (a decode instance fed by many prefill instances in turn stays bounded).
MAX_PEERS = 256
#: How long an address whose connect failed is failed at once (a client naming a dead or
#: blackholed prefill again and again costs one connect timeout, not one per request).
FAILED_CONNECT_S = 5.0
#: A failed load whose prefill rank never confirmed its writes stopped: released after this
#: long once the rank's connection is gone (a dead process writes nothing), or after the
#: transfer timeout if it is still up (a write already posted completes or fails by then).
GONE_GRACE_S = 2.0
#: Declines a rank may have waiting for a connection at once (each at most the connect
#: timeout); past it a decline is not sent, and its prefill's lease returns the blocks.
MAX_DECLINING = 1024


@dataclass
class StepResults:
    """What one engine step reports to vLLM's scheduler (``KVConnectorTransferResults`` and
    ``get_block_ids_with_load_errors``)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    failed_blocks: set[int] = field(default_factory=set)


@dataclass
class _Held:
    """Prefill: one finished request's blocks, held for the decode ranks this rank feeds
    (which announce them as ``name``; an SGLang decode's also take ``first_token`` in their aux
    slot, written from this rank's handoff slot ``slot``)."""

    request: str
    blocks: npt.NDArray[np.int64]
    deadline: float
    name: str = ""
    first_token: FirstToken | None = None
    parts: dict[str, Transfer] = field(default_factory=dict)
    targets: list[str] = field(default_factory=list)
    sent: bool = False
    #: The decode ranks are SGLang's (pages named by token prefix, the aux slot written).
    sglang: bool = False
    slot: int = -1


@dataclass
class _Load:
    """Decode: one request's new blocks, filled by the prefill ranks this rank reads from."""

    request: str
    blocks: npt.NDArray[np.int64]
    prefix: int
    remote: RemotePrefill | None
    connecting: concurrent.futures.Future[tuple[Connection, ...]] | None = None
    conns: tuple[Connection, ...] = ()
    transfer: Transfer | FanIn | None = None
    error: KVTransportError | None = None
    cancelled: str = ""
    #: When the load started, when it was announced, and when its transfer ended unconfirmed.
    started: float = 0.0
    announced: float = 0.0
    ended: float = 0.0


def _block_problem(theirs: Any, mine: Any) -> str:
    """Why blocks laid out as ``theirs`` (prefill's layout ``extra``) cannot land in blocks laid
    out as ``mine`` ('' when they can). The handshake compares the bytes of a page and of a row;
    two orders of the same sizes would pass it."""
    for key in ("token_layout", "packing", "block_size"):
        if theirs.get(key) != mine.get(key):
            return (
                f"prefill's KV blocks have {key}={theirs.get(key)}, decode's {key}={mine.get(key)}: run both "
                "instances with the same --block-size and VLLM_KV_CACHE_LAYOUT"
            )
    return ""


class WorkerSide:
    """One vLLM worker's transfers over ``endpoint`` (its TP rank ``tp_rank`` of ``tp_size``)."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        tp_rank: int,
        tp_size: int,
        lease_s: float,
        clock: Callable[[], float] = time.monotonic,
        handoff_arena: npt.NDArray[np.uint8] | None = None,
    ) -> None:
        self.endpoint = endpoint
        #: Prefill for SGLang decodes: the registered aux region (slots of
        #: ``HANDOFF_SLOT_BYTES``) each request's first-token handoff is written from, one slot a
        #: request being sent; ``None``: this rank feeds vLLM decodes only.
        self._arena = handoff_arena
        self._free_slots = list(range(handoff_arena.shape[0] - 1, -1, -1)) if handoff_arena is not None else []
        timeouts = endpoint.timeouts
        #: Decode: a load connects within ``connect`` (all its sources), prefill starts writing
        #: within ``bootstrap`` of the announcement (it held the request before decode heard of
        #: it, so only a prefill that holds no such request stays silent), and a failed
        #: transfer's drain is awaited for at most ``transfer``.
        self.connect_s = timeouts.connect * 2
        self.silence_s = timeouts.bootstrap
        self.drain_s = timeouts.transfer
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.lease_s = lease_s
        self._clock = clock
        self._held: dict[str, _Held] = {}
        #: The name decode announces each held request under -> the request (one each).
        self._names: dict[str, str] = {}
        self._loads: dict[str, _Load] = {}
        self._peers_lock = threading.Lock()
        self._failed_at: dict[str, float] = {}
        self._peers: collections.OrderedDict[str, concurrent.futures.Future[Connection]] = collections.OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvtransport-vllm")
        self._results = StepResults()
        #: Requests whose blocks were held and went back without reaching decode, and why.
        self.expired = 0
        #: Decode: prefill ranks told that a request is not wanted, and tellings that could not
        #: be sent (no connection: the prefill's lease returns its blocks).
        self.declined = 0
        self.untold = 0
        self._declining = 0
        self.closed = False

    @property
    def address(self) -> str:
        return str(self.endpoint.address)

    # -- prefill ------------------------------------------------------------------------------

    def hold(self, request: str, blocks: Sequence[int], name: str = "", first_token: FirstToken | None = None) -> None:
        """Hold ``blocks`` (the request's computed blocks, in order) until decode read them;
        decode announces them as ``name`` (the request's id unless said), and an SGLang decode's
        aux slot takes ``first_token``."""
        if request in self._held:
            log.warning("request %s: blocks already held for decode; the second hold is ignored", request)
            return
        held = _Held(
            request, np.asarray(blocks, dtype=np.int64), self._clock() + self.lease_s, name or request, first_token
        )
        self._held[request] = held
        if self._names.setdefault(held.name, request) != request:
            # Two requests under one SGLang room: decode's announcement could reach either. The
            # second goes back at once (its tag is the first's, which must not be refused).
            log.error(
                "kvtransport vLLM prefill: request %s is offered to decode as %r, as another held request is; its "
                "blocks are released",
                request,
                held.name,
            )
            self._release(held)

    def _bind(self, held: _Held) -> None:
        ep = self.endpoint
        for tag in held.targets or [held.name]:
            if tag in held.parts:
                continue
            conn = ep.announced(tag)
            if conn is None:
                continue
            problem = pairing_problem(conn.peer_layout, conn.peer_label, self.tp_rank, self.tp_size, tag)
            if problem:
                conn.sender(tag).abort(f"request {held.request} is not paired with this rank: {problem}")
                self._give_back(held, f"announced by the wrong rank: {problem}")
                return
            held.parts[tag] = conn.sender(tag)
            if not held.targets:
                layout = conn.peer_layout
                assert layout is not None  # pairing_problem checked it
                held.sglang = different_engines(layout, ep.layout)
                held.targets = [
                    request_tag(held.name, self.tp_size, layout.tp_size, d)
                    for d in targets(self.tp_size, self.tp_rank, layout.tp_size)
                ]

    def _send(self, held: _Held) -> None:
        parts = [held.parts[t] for t in held.targets]
        prefixes = {p.peer_prefix for p in parts}
        if len(prefixes) != 1:
            self._give_back(held, f"the decode ranks hold different prefixes {sorted(prefixes)} (blocks)")
            return
        prefix = prefixes.pop()
        if held.sglang:
            # SGLang's decode names the prefix it holds in tokens (its decode_prefix_len), of
            # whole pages as long as its pages are these blocks.
            size = int(self.endpoint.layout.extra.get("block_size", 1)) or 1
            if prefix % size:
                self._give_back(
                    held, f"decode holds a prefix of {prefix} tokens, not whole blocks of {size}", InvalidPages
                )
                return
            prefix //= size
        wanted = sorted({int(p.dst_pages.size) if p.dst_pages is not None else -1 for p in parts})
        count = wanted[0] if len(wanted) == 1 else -1
        if count < 0 or prefix < 0 or prefix + count > held.blocks.size:
            self._give_back(
                held,
                f"decode asked for {wanted[0] if len(wanted) == 1 else wanted} block(s) after a prefix of "
                f"{prefix}; prefill holds {held.blocks.size}",
                InvalidPages,
            )
            return
        src = held.blocks[prefix : prefix + count]
        aux = None
        if any(p.dst_aux >= 0 for p in parts):
            aux = self._write_handoff(held)
            if aux is None:
                return
        for part in parts:
            part.send(src, last=True, aux=aux if part.dst_aux >= 0 else None)
        held.sent = True

    def _write_handoff(self, held: _Held) -> int | None:
        """The slot of this rank's handoff arena holding ``held``'s first-token handoff for the
        SGLang decode that announced an aux slot (``None``: given back, with the reason)."""
        if held.first_token is None:
            self._give_back(
                held,
                "decode announced an aux slot for the first token, but the request was not offered to an SGLang "
                "decode (kv_transfer_params without 'sglang_room')",
            )
            return None
        # The decode ranks taking the slot (one, SGLang's first) state where its rows lie.
        mine = self.endpoint.layout
        stated = {handoff_between(mine, p.connection.peer_layout) for p in held.parts.values() if p.dst_aux >= 0}
        rows = stated.pop() if len(stated) == 1 else None
        if rows is None:
            self._give_back(held, "the decode ranks announcing an aux slot do not state one set of handoff rows")
            return None
        if self._arena is None or not self._free_slots:
            why = "has no handoff arena" if self._arena is None else "has no free handoff slot"
            self._give_back(held, f"this rank {why} for the first token SGLang's decode reads")
            return None
        slot = self._free_slots.pop()
        held.slot = slot
        content = slot_content(
            rows,
            token=held.first_token.token,
            cached_tokens=held.first_token.cached_tokens,
            room=held.first_token.room,
        )
        self._arena[slot, : len(content)] = np.frombuffer(content, dtype=np.uint8)
        return slot

    def _give_back(self, held: _Held, reason: str, kind: type[KVTransportError] = KVTransportError) -> None:
        """Nothing more of ``held`` is sent: its announcers hear so, its blocks go back."""
        message = f"request {held.request}: {reason}"
        log.warning("kvtransport vLLM prefill: %s; its blocks are released", message)
        for part in held.parts.values():
            if not part.state.final:
                part.abort(message)
        for tag in held.targets or [held.name]:
            if tag not in held.parts:
                try:
                    self.endpoint.refuse(tag, message)
                except KVTransportError as exc:  # the endpoint is closing: its peers hear "bye"
                    log.debug("refusing %s failed: %s", tag, exc)
        held.sent = True
        held.parts = {t: p for t, p in held.parts.items() if not p.state.final} or {}
        if not held.parts:
            self._release(held)
        else:
            held.deadline = -1.0  # released once the aborted parts are final

    def _release(self, held: _Held) -> None:
        if held.slot >= 0:
            self._free_slots.append(held.slot)
            held.slot = -1
        self._held.pop(held.request, None)
        if self._names.get(held.name) == held.request:
            del self._names[held.name]
        self._results.finished_sending.add(held.request)

    def _poll_held(self, held: _Held, now: float) -> None:
        try:
            if not held.sent:
                self._bind(held)
                if held.sent:  # _bind gave it back
                    return
                failed = next((p for p in held.parts.values() if p.state is State.FAILED), None)
                if failed is not None:
                    self._give_back(held, f"a decode rank's transfer failed: {failed.error}")
                elif held.targets and len(held.parts) == len(held.targets):
                    # A sender learns the announced pages once its session filed the announcement.
                    if all(p.state is not State.BOOTSTRAPPING for p in held.parts.values()):
                        self._send(held)
                elif now > held.deadline:
                    self.expired += 1
                    self._give_back(held, f"no decode rank announced it within its lease of {self.lease_s:g} s")
            elif all(p.state.final for p in held.parts.values()):
                failed = next((p for p in held.parts.values() if p.state is State.FAILED), None)
                if failed is not None and held.deadline >= 0:
                    log.warning("kvtransport vLLM prefill: request %s failed: %s", held.request, failed.error)
                self._release(held)
        except KVTransportError as exc:
            self._give_back(held, str(exc))

    # -- decode -------------------------------------------------------------------------------

    def load(self, request: str, blocks: Sequence[int], prefix: int, remote: RemotePrefill) -> None:
        """Start filling ``blocks`` with ``remote``'s KV after the first ``prefix`` blocks."""
        if request in self._loads:
            log.warning("request %s: already loading; the second load is ignored", request)
            return
        load = _Load(request, np.asarray(blocks, dtype=np.int64), int(prefix), remote, started=self._clock())
        self._loads[request] = load
        problem = tp_pairing_problem(remote.tp_size, self.tp_size)
        if problem:
            load.error = ConfigError(problem)
            return
        addresses = [remote.addresses[p] for p in sources(remote.tp_size, self.tp_size, self.tp_rank)]
        live = self._live(addresses)
        if live is None:
            load.connecting = self._pool.submit(self._connect_all, addresses)
            return
        # Every source is connected already (the common case): announce now, not a step later.
        load.connecting = concurrent.futures.Future()
        load.connecting.set_result(live)
        self._poll_load(load, self._clock())

    def _live(self, addresses: list[str]) -> tuple[Connection, ...] | None:
        """The live connections to ``addresses`` if there is one to each, else ``None``."""
        conns = []
        with self._peers_lock:
            for address in addresses:
                pending = self._peers.get(address)
                if pending is None or not pending.done() or pending.exception() is not None:
                    return None
                conn = pending.result()
                if not conn.alive:
                    return None
                self._peers.move_to_end(address)
                conns.append(conn)
        return tuple(conns)

    def fail_load(self, request: str, blocks: Sequence[int], error: KVTransportError) -> None:
        """A load that cannot start (its params were unusable): reported failed at the next poll."""
        load = _Load(request, np.asarray(blocks, dtype=np.int64), 0, None, error=error)
        self._loads[request] = load

    def _connect_all(self, addresses: list[str]) -> tuple[Connection, ...]:
        return tuple(self._connection(a).result() for a in addresses)

    def _connection(self, address: str) -> concurrent.futures.Future[Connection]:
        """The connection to ``address``: the one made before while it lives, else a new one
        (made by the first thread that asks; the others wait on its future)."""
        with self._peers_lock:
            pending = self._peers.get(address)
            if pending is not None and pending.done():
                failed = pending.exception() is not None
                if failed and self._clock() - self._failed_at.get(address, 0.0) < FAILED_CONNECT_S:
                    return pending  # failed a moment ago: fail this load at once too
                if failed or not pending.result().alive:
                    pending = None
            mine = pending is None
            if pending is None:
                pending = concurrent.futures.Future()
                self._peers[address] = pending
                self._trim_peers()
            self._peers.move_to_end(address)
        if mine:
            try:
                pending.set_result(self.endpoint.connect(address))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting loads
                with self._peers_lock:
                    self._failed_at[address] = self._clock()
                    while len(self._failed_at) > MAX_PEERS:
                        del self._failed_at[next(iter(self._failed_at))]
                pending.set_exception(exc)
        return pending

    def _trim_peers(self) -> None:
        """Past ``MAX_PEERS``, the least recently used settled entries go: a failed connect, or
        a connection with no transfer (closed). One still connecting or carrying transfers
        stays (the table then runs over until they settle)."""
        for address in list(self._peers):
            if len(self._peers) <= MAX_PEERS:
                return
            entry = self._peers[address]
            if not entry.done():
                continue
            if entry.exception() is None:
                conn = entry.result()
                if conn.alive and conn.transfers:
                    continue
                conn.close("kvtransport vLLM: too many prefill peers; the least recently used goes")
            del self._peers[address]

    def _announce(self, load: _Load) -> None:
        assert load.connecting is not None
        if not load.connecting.done():
            return
        try:
            conns = load.connecting.result()
        except KVTransportError as exc:
            load.error = exc
            return
        except Exception as exc:  # noqa: BLE001 - a bug below must fail this request, not the engine
            load.error = ConnectError(f"connecting for request {load.request} failed: {type(exc).__name__}: {exc}")
            return
        remote = load.remote
        assert remote is not None  # a load without params fails before it connects
        for conn in conns:
            peer = conn.peer_layout
            if peer is None or peer.tp_size != remote.tp_size:
                load.error = LayoutMismatch(
                    f"request {load.request}: {conn.peer_label} runs TP={getattr(peer, 'tp_size', '?')}, the request's "
                    f"kv_transfer_params say prefill TP={remote.tp_size}"
                )
                return
            # An SGLang prefill's pages are regrouped into these blocks (spi.page_geometry);
            # another vLLM's must be laid out as these are.
            problem = (
                ""
                if different_engines(peer, self.endpoint.layout)
                else _block_problem(peer.extra, self.endpoint.layout.extra)
            )
            if problem:
                load.error = LayoutMismatch(f"request {load.request}: {conn.peer_label}: {problem}")
                return
        tag = request_tag(remote.request_id, remote.tp_size, self.tp_size, self.tp_rank)
        prefix = load.prefix
        if conns and conns[0].peer_layout is not None and different_engines(conns[0].peer_layout, self.endpoint.layout):
            # SGLang's prefill reads the prefix decode holds in tokens (its decode_prefix_len).
            prefix *= int(self.endpoint.layout.extra.get("block_size", 1))
        load.conns = conns
        load.announced = self._clock()
        try:
            if len(conns) == 1:
                load.transfer = conns[0].expect(tag, load.blocks, prefix=prefix)
            else:
                load.transfer = expect_from(conns, tag, load.blocks, prefix=prefix)
        except PartialAnnouncement as exc:
            load.transfer = exc.parts
            load.error = exc
        except KVTransportError as exc:
            load.error = exc

    def cancel(self, request: str, reason: str) -> None:
        """The request ended on decode before its KV arrived: stop its transfer; it is reported
        finished once nothing of it can land any more."""
        load = self._loads.get(request)
        if load is None or load.cancelled:
            return
        load.cancelled = reason
        if load.transfer is not None and not load.transfer.state.final:
            load.transfer.abort(reason)

    def _poll_load(self, load: _Load, now: float) -> None:
        try:
            if load.transfer is None and load.error is None and not load.cancelled and load.connecting is not None:
                self._announce(load)
                if load.transfer is None and load.error is None and now - load.started > self.connect_s:
                    load.error = ConnectError(
                        f"request {load.request}: no connection to its prefill ranks within {self.connect_s:g} s"
                    )
            t = load.transfer
            if t is None:
                if load.error is not None or load.cancelled:
                    self._tell_prefill(load, load.cancelled or str(load.error))
                    self._finish(load, ok=False)  # nothing was announced: nothing can land
                return
            if load.error is None and load.cancelled == "" and t.state is State.SUCCESS:
                self._finish(load, ok=True)
                return
            if t.state is State.WAITING_FOR_INPUT and load.error is None and now - load.announced > self.silence_s:
                load.error = TransferTimeout(
                    f"request {load.request}: prefill wrote nothing within {self.silence_s:g} s of the announcement "
                    "(it holds no such request: sent before, expired, or never prefilled there)"
                )
            if load.error is not None and not t.state.final:
                t.abort(str(load.error))
            if load.cancelled and not t.state.final:
                t.abort(load.cancelled)
            if not t.state.final:
                return
            if t.state is State.FAILED and load.error is None:
                load.error = t.error
            ok = t.state is State.SUCCESS and not load.cancelled and load.error is None
            if t.drained.is_set():
                self._finish(load, ok=ok)
                return
            # Failed, and the prefill rank has not confirmed that its writes stopped.
            load.ended = load.ended or now
            gone = not all(c.alive for c in load.conns)
            if now - load.ended > (GONE_GRACE_S if gone else self.drain_s):
                log.warning(
                    "kvtransport vLLM decode: request %s: prefill %s its writes stopped; the blocks go back after "
                    "%.0f s",
                    load.request,
                    "is gone and never confirmed" if gone else "never confirmed",
                    now - load.ended,
                )
                self._finish(load, ok=False)
        except KVTransportError as exc:
            load.error = exc

    def _tell_prefill(self, load: _Load, reason: str) -> None:
        """``load`` ended before its blocks were announced: the prefill ranks it would have
        announced to hear so (now, or once the connection is up), and give back the blocks they
        hold for the request at once, not when its lease runs out."""
        remote, connecting = load.remote, load.connecting
        if remote is None or connecting is None:
            return
        tag = request_tag(remote.request_id, remote.tp_size, self.tp_size, self.tp_rank)
        self._tell(connecting, tag, f"decode request {load.request} ended before it announced its blocks: {reason}")

    def decline(self, request: str, remote: RemotePrefill, reason: str) -> None:
        """Decode: ``request`` will never load ``remote``'s KV (it ended before its load
        started, or computes its prompt itself): the prefill ranks this rank would have read
        from hear now that nothing of it is wanted, over the connections loads use (made on a
        thread if there are none: the step does not wait), and give its blocks back at once. A
        prefill that cannot be reached is not told: its lease returns the blocks."""
        if self.closed:
            return
        message = f"decode request {request} will not load its KV: {reason}"
        problem = tp_pairing_problem(remote.tp_size, self.tp_size)
        if problem:
            self._untold(request, problem)
            return
        addresses = [remote.addresses[p] for p in sources(remote.tp_size, self.tp_size, self.tp_rank)]
        tag = request_tag(remote.request_id, remote.tp_size, self.tp_size, self.tp_rank)
        live = self._live(addresses)
        if live is not None:
            self._abort_tag(live, tag, message)
            return
        with self._peers_lock:
            full = self._declining >= MAX_DECLINING
            if not full:
                self._declining += 1
        if full:
            self._untold(request, f"{MAX_DECLINING} declines are waiting for connections already")
            return
        connecting = self._pool.submit(self._connect_all, addresses)
        connecting.add_done_callback(self._decline_settled)
        self._tell(connecting, tag, message)

    def _decline_settled(self, _: concurrent.futures.Future[tuple[Connection, ...]]) -> None:
        with self._peers_lock:
            self._declining -= 1

    def _tell(self, connecting: concurrent.futures.Future[tuple[Connection, ...]], tag: str, message: str) -> None:
        """Once ``connecting`` is done, each connection's peer hears that nothing of ``tag`` is
        wanted (its sender fails at once, now or when it is created)."""

        def tell(done: concurrent.futures.Future[tuple[Connection, ...]]) -> None:
            if done.cancelled() or done.exception() is not None:
                why = "the worker closed" if done.cancelled() else str(done.exception())
                self._untold(tag, f"no connection to its prefill ({why})")
                return
            self._abort_tag(done.result(), tag, message)

        connecting.add_done_callback(tell)

    def _abort_tag(self, conns: Iterable[Connection], tag: str, message: str) -> None:
        for conn in conns:
            try:
                conn.abort(tag, message)
            except KVTransportError as exc:  # the connection closed meanwhile: its peer heard "bye"
                log.debug("%s: telling prefill that nothing is wanted failed: %s", tag, exc)
        with self._peers_lock:
            self.declined += 1

    def _untold(self, what: str, why: str) -> None:
        log.info(
            "kvtransport vLLM decode: %s: prefill is not told that nothing of it is wanted (%s); its lease returns "
            "the blocks",
            what,
            why,
        )
        with self._peers_lock:
            self.untold += 1

    def _finish(self, load: _Load, *, ok: bool) -> None:
        self._loads.pop(load.request, None)
        self._results.finished_recving.add(load.request)
        if not ok:
            self._results.failed_recving.add(load.request)
            self._results.failed_blocks.update(int(b) for b in load.blocks)
            if not load.cancelled:
                log.warning(
                    "kvtransport vLLM decode: request %s: loading its KV from prefill request %s failed: %s",
                    load.request,
                    load.remote.request_id if load.remote is not None else "?",
                    load.error,
                )

    # -- every step ---------------------------------------------------------------------------

    def poll(self, finished: Iterable[str] = ()) -> StepResults:
        """Advance every held and loading request; ``finished``: requests the engine ended
        this step (a load among them is cancelled). Returns what completed since the last call."""
        for request in finished:
            if request in self._loads:
                self.cancel(request, f"request {request} ended on decode before its KV arrived")
        now = self._clock()
        for held in list(self._held.values()):
            self._poll_held(held, now)
        for load in list(self._loads.values()):
            self._poll_load(load, now)
        results, self._results = self._results, StepResults()
        return results

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def loading(self) -> int:
        return len(self._loads)

    def stats(self) -> dict[str, Any]:
        return {
            "held": len(self._held),
            "loading": len(self._loads),
            "peers": len(self._peers),
            "expired": self.expired,
            "declined": self.declined,
            "untold": self.untold,
            "drivers": sorted({c.decision.driver for c in self.endpoint.connections.values() if c.decision}),
        }

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.endpoint.close()
