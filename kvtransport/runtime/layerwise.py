"""A layer-wise send: one chunk of a sending transfer's pages, posted layer group by layer group
as prefill computes the layers (``Transfer.send_layerwise``; docs/layerwise.md).

The caller marks each layer ready with :meth:`LayerStream.layer_ready`: at once (host KV, or a
layer whose kernels already finished), or once a readiness signal fires (``after``: a CUDA
event recorded after the layer's last kernel, or any ``() -> bool``), which the endpoint's
readiness watcher (``runtime.readiness``) waits for off the caller's thread. The stream's
:class:`~kvtransport.runtime.layer_groups.Grouper` decides when the ready layers go out as a
group; each group is planned over its layers' KV regions only and handed to the transfer's
driver as a batch of its own, so every driver (one-sided, staged, local) takes part with no
change: a group is just a batch.

The receiver sees nothing new: its Success still comes once every byte of every group (and
the aux slot and state items, which ride with the stream's last group) is in its pool. Aborts
and timeouts are the transfer's: a group marked after the transfer failed raises its error and
posts nothing; the Transferring timeout restarts at each group, so a sender that never marks
its last layer fails after ``Timeouts.transfer``; an abort stops the groups already posted
before the receiver hears "drained", as for any chunk.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvtransport.runtime.layer_groups import Grouper
from kvtransport.spi.errors import KVTransportError

if TYPE_CHECKING:
    from kvtransport.runtime.chunk import Chunk
    from kvtransport.runtime.readiness import ReadinessWatcher

log = logging.getLogger(__name__)

#: Weight of the newest sample in the stream's running averages (mark interval, post time).
EWMA = 0.5


class StreamTransfer(Protocol):
    """What the stream reads of its transfer (``runtime.handles.Transfer``)."""

    tag: str
    batches: set[int]
    paced: set[int]
    handed: set[int]
    failovers: int
    aborted_by_caller: str

    @property
    def state(self) -> Any: ...
    def abort(self, reason: str = ...) -> None: ...


class StreamOwner(Protocol):
    """What the stream needs of its session (``runtime.session.Session``)."""

    def send_group(
        self, transfer: Any, chunk: Chunk, kv: Sequence[int] | None, tail: bool, closes: bool, *, whole: bool = False
    ) -> int: ...
    def readiness(self) -> ReadinessWatcher: ...
    def check_sendable(self, transfer: Any) -> None:
        """Raise why nothing more of ``transfer`` may be sent (it failed, or was aborted)."""


@dataclass(frozen=True)
class PostedGroup:
    """A group the stream handed to the driver: its layers, batch id (0: nothing of it was this
    side's to write), and when it was posted (``time.perf_counter``)."""

    layers: tuple[int, ...]
    batch: int
    posted_at: float


class LayerStream:
    """One chunk of a sending transfer, layer by layer (module docstring). Any thread may mark
    layers; marks are taken one at a time."""

    def __init__(
        self,
        owner: StreamOwner,
        transfer: StreamTransfer,
        chunk: Chunk,
        last: bool,
        regions_of: Sequence[Sequence[int]],
        grouper: Grouper,
    ) -> None:
        self._owner = owner
        self._transfer = transfer
        self._chunk = chunk
        self._last = last
        #: The KV regions of each layer (``layer_groups.regions_by_layer``).
        self._regions_of = regions_of
        self._grouper = grouper
        self._lock = threading.Lock()
        self._last_mark = 0.0
        self._interval = 0.0
        self._post_s = 0.0
        self.groups: list[PostedGroup] = []

    @property
    def num_layers(self) -> int:
        return self._grouper.num_layers

    @property
    def whole(self) -> bool:
        """Below the policy's minimum length: one batch, once every layer is ready."""
        return self._grouper.whole

    @property
    def complete(self) -> bool:
        """Every layer was posted."""
        return self._grouper.complete

    @property
    def settled(self) -> bool:
        """Every layer was posted and no group is in the driver or on its way there any more
        (each landed, or the transfer failed), nor sent again after a failover: nothing of the
        chunk's source pages is still being read."""
        t = self._transfer
        with self._lock:  # (a group being posted is appended under it)
            if not self.complete:
                return False
            if t.failovers and not t.state.final:
                return False  # moved: its parts are sent again, from the same source pages
            busy = (t.batches, t.paced, t.handed)
            return not any(g.batch and any(g.batch in b for b in busy) for g in self.groups)

    def layer_ready(self, layer: int, after: Any = None) -> None:
        """Layer ``layer``'s KV of this chunk is in place: now, or (``after``) once that signal
        fires: an object with ``query() -> bool`` (a CUDA event recorded after the layer's last
        kernel) or a ``() -> bool``. Raises the transfer's error once it failed (nothing more
        is posted then), and :class:`~kvtransport.spi.errors.ConfigError` for a layer that is
        not one of the layout's or was marked before."""
        self._ready((layer,), after)

    def layers_ready(self, layers: Iterable[int], after: Any = None) -> None:
        """:meth:`layer_ready` for each of ``layers``, taken as one mark (``after``: one signal
        for all of them): cheaper than a call per layer when several are ready at once."""
        self._ready(tuple(layers), after)

    def _ready(self, layers: tuple[int, ...], after: Any) -> None:
        if after is None:
            self._mark(layers)
            return
        ready = _signal(after)
        self._check(layers)
        transfer = self._transfer

        def fired() -> None:
            try:
                self._mark(layers)
            except KVTransportError as exc:
                if not transfer.state.final:
                    transfer.abort(f"layers {list(layers)[:8]} could not be sent: {exc}")

        self._owner.readiness().watch(ready, fired, lambda: bool(transfer.state.final or transfer.aborted_by_caller))

    def _check(self, layers: tuple[int, ...]) -> None:
        self._owner.check_sendable(self._transfer)  # failed, or aborted by the caller: raises why
        for layer in layers:
            self._grouper.check_layer(layer)

    def _mark(self, layers: tuple[int, ...]) -> None:
        self._check(layers)
        transfer = self._transfer
        grouper = self._grouper
        with self._lock:
            now = time.perf_counter()
            if self._last_mark:
                gap = now - self._last_mark
                self._interval = gap if not self._interval else EWMA * gap + (1 - EWMA) * self._interval
            self._last_mark = now
            due: list[int] = []
            for layer in layers:
                if grouper.whole:
                    group = grouper.mark(layer)  # one batch at the end: nothing to measure
                else:
                    in_flight, paced = transfer.batches, transfer.paced
                    backlog = sum(1 for g in self.groups if g.batch and (g.batch in in_flight or g.batch in paced))
                    share = self._post_s / self._interval if self._interval > 0 else 0.0
                    group = grouper.mark(layer, backlog=backlog, post_share=share)
                if group is not None:
                    due.extend(group)
            if due:
                # Layers marked together leave together: the groups that fell due in one
                # call are ready at the same moment, and one batch carries less overhead.
                self._post(tuple(due))

    def _post(self, group: tuple[int, ...]) -> None:
        grouper, transfer = self._grouper, self._transfer
        # Every layer at once (a short request): the session's plan of all regions.
        every = len(group) == grouper.num_layers
        kv = None if every else sorted(i for x in group for i in self._regions_of[x])
        closes = grouper.complete
        start = time.perf_counter()
        bid = self._owner.send_group(transfer, self._chunk, kv, closes and self._last, closes, whole=grouper.whole)
        took = time.perf_counter() - start
        self._post_s = took if not self._post_s else EWMA * took + (1 - EWMA) * self._post_s
        self.groups.append(PostedGroup(group, bid, start))
        log.debug("transfer %r: layers %s posted (batch %d, %.3g ms to post)", transfer.tag, group, bid, took * 1e3)


class StreamGroup:
    """Several layer-wise streams of one chunk marked together: a prefill rank's chunk to each
    decode rank of a wider decode TP (``FanOut.send_layerwise``). Each mark reaches every
    stream; a stream whose transfer failed raises after the others were marked (the fan-out
    fails as one)."""

    def __init__(self, streams: Sequence[LayerStream]) -> None:
        self.streams = list(streams)

    @property
    def num_layers(self) -> int:
        return self.streams[0].num_layers

    @property
    def complete(self) -> bool:
        return all(s.complete for s in self.streams)

    @property
    def settled(self) -> bool:
        return all(s.settled for s in self.streams)

    def layer_ready(self, layer: int, after: Any = None) -> None:
        self.layers_ready((layer,), after)

    def layers_ready(self, layers: Iterable[int], after: Any = None) -> None:
        marked = tuple(layers)
        error: KVTransportError | None = None
        for s in self.streams:
            try:
                s.layers_ready(marked, after)
            except KVTransportError as exc:
                error = error or exc
        if error is not None:
            raise error


def _signal(after: Any) -> Callable[[], bool]:
    query = getattr(after, "query", None)
    if callable(query):
        return lambda: bool(query())
    if callable(after):
        return lambda: bool(after())
    raise KVTransportError(
        f"after={after!r}: give a CUDA event (anything with query()) or a callable returning True once ready"
    )
