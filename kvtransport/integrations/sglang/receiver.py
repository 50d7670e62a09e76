"""The decode side of one request (:class:`KVTransportKVReceiver`): it connects to the prefill
ranks this rank receives from without blocking the scheduler loop, announces the room's pages
to them, and tells them when the room is given up, holding its pages for SGLang's deferred
release until they confirm that none of their writes can land any more."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtransport.integrations.pairing import tp_pairing_problem
from kvtransport.integrations.sglang.common import (
    BaseKVReceiver,
    KVPoll,
    _Failure,
    _poll_of,
    _raise,
    _stop,
    room_tag,
)
from kvtransport.integrations.sglang.manager import KVTransportKVManager
from kvtransport.runtime.endpoint import Connection, Transfer
from kvtransport.runtime.fanin import FanIn, PartialAnnouncement, expect_from
from kvtransport.spi.errors import (
    ConnectError,
    KVTransportError,
    LayoutMismatch,
    MemoryLayoutError,
    TransferAborted,
)

log = logging.getLogger(__name__)


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

    def fail(self, error: KVTransportError) -> None:
        """The backend gives this room up for ``error`` (poll says Failed, with it): its
        transfer is aborted, or prefill is told before the pages were announced."""
        self.failure.set(error)
        self._give_up(str(error))

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
