"""One destination filled by several senders: a decode rank fed by several prefill ranks when the
two sides run different TP sizes (each writes its slice of every page, ``tp_map``).

:func:`expect_from` announces the same pages on every source connection (the first source, by
the peers' TP rank, also gets the aux slot and the state items: it is the one that sends them)
and returns a :class:`FanIn`, which reads like one :class:`~kvtransport.runtime.handles.Transfer`:
Success once every part succeeded, Failed as soon as one failed. The first failure aborts the
other parts (so their senders stop too and confirm their drain); the caller's ``poll``/``wait``
carries it out, as SGLang polls its receivers every scheduler loop.

:class:`FanOut` is the other direction: one source feeding several receivers (decode wider).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvtransport.runtime.handles import Connection, State, Transfer
from kvtransport.runtime.layerwise import StreamGroup
from kvtransport.spi.errors import KVTransportError, TransferError, TransferTimeout
from kvtransport.spi.tp_map import sources

if TYPE_CHECKING:
    from kvtransport.runtime.layer_groups import LayerwisePolicy


class PartialAnnouncement(TransferError):
    """Announcing to one source failed after others were announced to: those are aborted, and
    ``parts`` (failed) says when none of them can write into the pages any more (``drained``)."""

    def __init__(self, message: str, parts: FanIn) -> None:
        super().__init__(message)
        self.parts = parts


class FanIn:
    """The parts of one request's destination, one receive transfer per source connection."""

    def __init__(self, tag: str, parts: Sequence[Transfer]) -> None:
        if not parts:
            raise KVTransportError(f"transfer {tag!r}: no source to receive from")
        self.tag = tag
        self.parts = tuple(parts)
        self._lock = threading.Lock()
        self._failed: Transfer | None = None

    @property
    def state(self) -> State:
        """Failed if any part failed (the others are aborted), Success when all succeeded,
        otherwise the least advanced part's state."""
        states = [p.state for p in self.parts]
        if State.FAILED in states:
            self._spread_failure()
            return State.FAILED
        return min(states)

    def poll(self) -> State:
        return self.state

    @property
    def error(self) -> KVTransportError | None:
        failed = self._failed or next((p for p in self.parts if p.state is State.FAILED), None)
        return None if failed is None else failed.error

    @property
    def drained(self) -> _AllSet:
        """Set once no part can write into the pages any more (each part's ``drained``)."""
        return _AllSet([p.drained for p in self.parts])

    @property
    def started(self) -> float:
        return min((p.started for p in self.parts if p.started), default=0.0)

    @property
    def finished(self) -> float:
        return max(p.finished for p in self.parts) if all(p.state.final for p in self.parts) else 0.0

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.parts)

    def wait(self, timeout: float | None = None) -> State:
        """Block until every part succeeded (Success) or one failed (its error is raised);
        :class:`TransferTimeout` when ``timeout`` passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for part in self.parts:
            while not part.state.final:
                if self.state is State.FAILED:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransferTimeout(f"transfer {self.tag!r} still {self.state.name} after {timeout} s")
                try:
                    part.wait(0.05 if left is None else min(0.05, left))
                except TransferTimeout:
                    continue  # still running: look at the others' failures, then wait on
                except KVTransportError:
                    break
            if self.state is State.FAILED:
                error = self.error
                assert error is not None
                raise error
        return self.state

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Fail every part here and at its sender (each one tried, even if one cannot be:
        its endpoint closing fails it anyway)."""
        for part in self.parts:
            if not part.state.final:
                try:
                    part.abort(reason)
                except KVTransportError:
                    continue

    def _spread_failure(self) -> None:
        with self._lock:
            if self._failed is not None:
                return
            self._failed = next(p for p in self.parts if p.state is State.FAILED)
        reason = f"another source of {self.tag!r} failed: {self._failed.error}"
        self.abort(reason[:1000])


class FanOut(FanIn):
    """One request sent to several receivers: a prefill rank feeding every decode rank of a
    wider decode TP (each gets its slice of this rank's heads). Each chunk goes to every part;
    it reads like one sending :class:`~kvtransport.runtime.handles.Transfer` (and fails as one)."""

    def send(
        self, src_pages: Any, *, last: bool = True, aux: int | None = None, state: Sequence[Any] | None = None
    ) -> None:
        """:meth:`Transfer.send <kvtransport.runtime.handles.Transfer.send>` on every part (the core
        drops the aux slot and state items for a part whose receiver gets them elsewhere)."""
        for part in self.parts:
            part.send(src_pages, last=last, aux=aux, state=state)

    def send_layerwise(
        self,
        src_pages: Any,
        *,
        last: bool = True,
        aux: int | None = None,
        state: Sequence[Any] | None = None,
        policy: LayerwisePolicy | None = None,
        region_layers: Sequence[int] | None = None,
    ) -> StreamGroup:
        """:meth:`Transfer.send_layerwise <kvtransport.runtime.handles.Transfer.send_layerwise>`
        on every part: one stream per receiver, marked together."""
        return StreamGroup(
            [
                part.send_layerwise(
                    src_pages, last=last, aux=aux, state=state, policy=policy, region_layers=region_layers
                )
                for part in self.parts
            ]
        )

    @property
    def peer_prefix(self) -> int:
        """The tokens the receivers hold already (each announced the same)."""
        return max(p.peer_prefix for p in self.parts)


class _AllSet:
    """``is_set``/``wait`` over several events, like one ``threading.Event``."""

    def __init__(self, events: Sequence[threading.Event]) -> None:
        self._events = events

    def is_set(self) -> bool:
        return all(e.is_set() for e in self._events)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for e in self._events:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not e.wait(left):
                return False
        return True


def expect_from(
    conns: Sequence[Connection],
    tag: str,
    dst_pages: Any,
    *,
    aux: int | None = None,
    prefix: int = 0,
    state: Sequence[Any] | None = None,
) -> FanIn:
    """Announce ``dst_pages`` for ``tag`` on every connection in ``conns``, which must be
    exactly this rank's sources (``tp_map.sources``, one connection each); the first source
    gets the aux slot and the state items. :class:`KVTransportError` otherwise, before anything
    is announced; :class:`PartialAnnouncement` if a later source fails after earlier ones were
    announced to (the endpoint going down between them)."""
    if not conns:
        raise KVTransportError(f"transfer {tag!r}: no source to receive from")
    mine = conns[0].layout
    theirs = [c.peer_layout for c in conns]
    if len(conns) > 1 or any(t is not None and t.tp_size != mine.tp_size for t in theirs):
        sizes = {t.tp_size if t is not None else mine.tp_size for t in theirs}
        if len(sizes) != 1:
            raise KVTransportError(f"transfer {tag!r}: the connections run different TP sizes {sorted(sizes)}")
        want = set(sources(sizes.pop(), mine.tp_size, mine.tp_rank))
        have = [t.tp_rank if t is not None else -1 for t in theirs]
        if sorted(have) != sorted(want):
            raise KVTransportError(
                f"transfer {tag!r}: this rank (TP {mine.tp_rank} of {mine.tp_size}) receives from prefill ranks "
                f"{sorted(want)}, the connections given lead to {sorted(have)}"
            )
    primary = [c for c in conns if c.pair_shape(sending=False).primary]
    if len(primary) != 1:
        raise KVTransportError(f"transfer {tag!r}: {len(primary)} of the sources would send the aux slot, not one")
    ordered = primary + [c for c in conns if c is not primary[0]]
    parts: list[Transfer] = []
    for i, c in enumerate(ordered):
        try:
            parts.append(
                c.expect(tag, dst_pages, aux=aux if i == 0 else None, prefix=prefix, state=state if i == 0 else None)
            )
        except KVTransportError as exc:
            if not parts:
                raise
            # The sources announced to already may be writing: they are aborted, and the
            # caller holds the pages until they drained.
            announced = FanIn(tag, parts)
            announced.abort(f"announcing {tag!r} to another source failed: {exc}"[:1000])
            raise PartialAnnouncement(
                f"transfer {tag!r}: announcing to {c.peer_label} failed: {exc}", announced
            ) from exc
    return FanIn(tag, parts)
