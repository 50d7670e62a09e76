"""The prefill side of one request (:class:`KVTransportKVSender`): it waits for the
announcements of the decode ranks this rank feeds (failing early, with the reason, when
connections to this rank failed authentication around its arrival and none came), checks they
are paired with it, writes each chunk SGLang hands over (the aux slot and the state items with
the last), and refuses the room to every decode rank it feeds when it fails."""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import numpy as np

from kvtransport.integrations.pairing import tp_pairing_problem
from kvtransport.integrations.sglang.common import (
    BaseKVSender,
    KVPoll,
    KVTransferMetric,
    _env_flag,
    _Failure,
    _poll_of,
    _raise,
    _stop,
    room_tag,
)
from kvtransport.integrations.sglang.layerwise import OpenStream
from kvtransport.integrations.sglang.manager import KVTransportKVManager
from kvtransport.runtime.endpoint import State, Transfer
from kvtransport.runtime.fanin import FanOut
from kvtransport.runtime.layer_groups import LayerwisePolicy
from kvtransport.spi.errors import (
    AuthenticationFailed,
    ConnectError,
    InvalidPages,
    KVTransportError,
    TransferAborted,
    TransferTimeout,
)
from kvtransport.spi.page_geometry import different_engines
from kvtransport.spi.tp_map import targets

log = logging.getLogger(__name__)


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
        #: Whether this room was checked against the failed authentications around its arrival
        #: (once, when it has waited ``auth_grace``: see ``_failing_authentication``).
        self._auth_checked = False
        #: Set by SGLang's prefill (prefill.py, maybe_send_cached_prefix_chunk) under overlap
        #: scheduling: a CUDA event the previous forward records while it may still be writing
        #: the prefix pages handed to ``send``. Chunks wait in the queue until it completed.
        self._early_send_wait_event: Any = None
        self._waiting_on: Any = None
        self._prefix_read = False
        #: The decode ranks are another engine's (vLLM): they announce no aux slot.
        self._skip_aux = False
        #: Chunks going layer by layer (``KVTRANSPORT_LAYERWISE``), oldest first: their pages
        #: are reserved; SGLang's ``send`` of the same pages confirms them.
        self._streams: collections.deque[OpenStream] = collections.deque()
        #: Chunks of this room that went layer by layer, and the layer groups they took.
        self.layerwise_chunks = 0
        self.layerwise_groups = 0
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
                # A vLLM decode recomputes the last prompt token itself and has no aux slot: the
                # first output token SGLang writes there stays here (spi.cross_engine).
                self._skip_aux = different_engines(layout, ep.layout)
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
        elif reason := self._failing_authentication():
            self.failure.set(AuthenticationFailed(f"room {self.room}: {reason}"))
            self.mgr.failing_authentication(self.room, reason)
            # A decode rank that was only slow (and announces later) hears at once that nothing comes.
            self._refuse(f"room {self.room} failed on the prefill side: {reason}")
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

    def _failing_authentication(self) -> str:
        """Why this room should fail now, or "": it has waited ``auth_grace`` seconds without
        every decode rank's announcement, and connections to this rank failed authentication
        within ``auth_grace`` of its arrival. No failed attempt says which room it was for (a
        party that fails authentication is told nothing and believed in nothing), but a decode
        rank dials its prefill ranks when a request arrives, so a decode on another secret fails
        right around the arrival of the requests it was given (docs/security.md)."""
        if self._auth_checked:
            return ""
        grace = self.mgr.timeouts.auth_grace
        if grace >= self.mgr.timeouts.bootstrap or time.monotonic() - self._created < grace:
            return ""  # (a grace at or above the bootstrap timeout turns this off)
        self._auth_checked = True  # once: failures long after its arrival are other requests'
        failures = self.mgr.endpoint.auth_failures
        if not failures.seen_around(self._created, grace):
            return ""
        return (
            f"connections to this prefill rank are failing authentication ({failures.describe_recent()}): a decode "
            f"may run with another secret (KVTRANSPORT_SECRET / KVTRANSPORT_SECRET_FILE); no decode rank announced "
            f"room {self.room} within {grace:g} s"
        )

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
            if self._skip_aux:
                aux = None
            try:
                self.transfer.send(pages, last=last, aux=aux, state=state)
            except KVTransportError as exc:
                self.failure.set(exc)
                self.transfer.abort(f"prefill could not send: {exc}")

    def next_send_token(self, start_send_idx: int) -> int:
        """The token this room's next send starts at: SGLang's ``start_send_idx``, or the end of
        the chunks still going layer by layer (SGLang has not handed them over yet)."""
        return self._streams[-1].end_token if self._streams else start_send_idx

    def open_layer_stream(
        self, pages: np.ndarray[Any, Any], end_token: int, policy: LayerwisePolicy
    ) -> OpenStream | None:
        """Reserve ``pages`` (the chunk the forward computes, up to ``end_token``) to go layer by
        layer (:mod:`~kvtransport.integrations.sglang.layerwise`); None where the chunk goes whole
        when SGLang hands it over: the room is not bound yet, has chunks queued or waiting, or
        failed."""
        t = self.transfer
        if (
            t is None
            or self.failure.error is not None
            or self._queued
            or self._waiting_on is not None
            or self._early_send_wait_event is not None
            or t.state is State.BOOTSTRAPPING
            or self.num_kv_indices is None
            or self.sent + int(pages.size) > self.num_kv_indices
        ):
            return None
        try:
            stream = t.send_layerwise(pages, last=False, policy=policy)
        except KVTransportError as exc:
            self.failure.set(exc)
            t.abort(f"prefill could not send layer-wise: {exc}")
            return None
        self.sent += int(pages.size)
        self.layerwise_chunks += 1
        opened = OpenStream(stream, pages, int(end_token))
        self._streams.append(opened)
        return opened

    def layerwise_failed(self, error: BaseException) -> None:
        """A layer-wise stream of this room could not go on (its marks failed): the room fails
        with the reason, and its decode ranks hear of it."""
        if self.failure.error is None:
            wrapped = (
                error if isinstance(error, KVTransportError) else KVTransportError(f"{type(error).__name__}: {error}")
            )
            self.failure.set(wrapped)
            log.warning("room %d: layer-wise send failed: %s", self.room, wrapped)
        self._refuse(f"room {self.room}: its layer-wise send failed")

    def _confirm(self, pages: np.ndarray[Any, Any], last: bool) -> np.ndarray[Any, Any]:
        """Match the pages SGLang hands over against the layer-wise streams, oldest first: a
        stream whose pages all came is complete (its forward has run: any layer not marked yet
        is). Returns the pages past the streams (sent as a plain chunk); raises
        :class:`InvalidPages` where SGLang names other pages than the streams reserved (streams
        are opened only where SGLang's prefill cannot move a chunk's tokens to other pages
        between the forward and the send: see ``layerwise._forward_of``)."""
        rest = pages
        while self._streams and rest.size:
            s = self._streams[0]
            want = s.pages[s.confirmed :]
            n = min(int(want.size), int(rest.size))
            if not np.array_equal(want[:n], rest[:n]):
                raise InvalidPages(
                    f"room {self.room}: SGLang sent pages {rest[:8].tolist()} where the layer-wise stream reserved "
                    f"{want[:8].tolist()} (its prediction of SGLang's _send_kv_chunk no longer holds; unset "
                    "KVTRANSPORT_LAYERWISE)"
                )
            s.confirmed += n
            rest = rest[n:]
            if s.confirmed == s.pages.size:
                self._streams.popleft()
                try:
                    s.mark_rest()
                except KVTransportError as exc:  # the transfer failed: poll reports it
                    log.debug("room %d: marking the rest of a stream: %s", self.room, exc)
                self.layerwise_groups += s.posted_groups
        if last and self._streams:
            left = sum(int(s.pages.size) - s.confirmed for s in self._streams)
            raise InvalidPages(
                f"room {self.room}: the last chunk came with {left} pages of layer-wise streams not handed over"
            )
        return rest

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
        event, self._early_send_wait_event = self._early_send_wait_event, None
        if self._streams:
            try:
                pages = self._confirm(pages, last)
            except KVTransportError as exc:
                self.failure.set(exc)
                self._refuse(str(exc))
                return
            # Pages the streams carried need no wait: their layers' marks came after the forward
            # SGLang's event stands for (on its stream).
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
        self._streams.clear()
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
