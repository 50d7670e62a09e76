"""What the session's protocol machine (``runtime.peer_protocol``) asks its session to do.

Each action is a plain value; the machine returns them in order from every event, and the
session (``runtime.session``) carries them out on the endpoint's I/O thread. An action that
waits for something (a timer, the drivers' answer) names the event to feed back when it comes:
a method of the machine, bound to its arguments. The vocabulary is the whole interface between
the machine and the world: a test can read it (tests/test_peer_protocol.py) instead of
watching sockets and threads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtransport.runtime.handles import Transfer
from kvtransport.spi.errors import KVTransportError

if TYPE_CHECKING:
    from kvtransport.runtime.lane import Lane

#: An event fed back later (a timer's, or the continuation of one that needed a driver's answer).
Event = Callable[[], "list[Action]"]


@dataclass(frozen=True, slots=True)
class Send:
    """Send the peer message ``kind`` with ``fields``."""

    kind: str
    fields: dict[str, Any]


@dataclass(frozen=True, slots=True)
class FlushNotices:
    """Send the driver notices queued for any peer first (they go before "done" and "drained")."""


@dataclass(frozen=True, slots=True)
class SetTimer:
    """Cancel ``transfer``'s timer; then, unless ``seconds`` is ``None``, feed ``then`` back after
    ``seconds`` (a transfer has one timer: its state's timeout, or when it is forgotten)."""

    transfer: Transfer
    seconds: float | None = None
    then: Event | None = None


@dataclass(frozen=True, slots=True)
class Later:
    """Feed ``then`` back after ``seconds`` (never cancelled)."""

    seconds: float
    then: Event


@dataclass(frozen=True, slots=True)
class Observe:
    """Count ``transfer``, final now, in the metrics as moved by ``driver``."""

    transfer: Transfer
    driver: str


@dataclass(frozen=True, slots=True)
class Publish:
    """Wake whoever waits for ``transfer``'s final state (after the actions before this one)."""

    transfer: Transfer


@dataclass(frozen=True, slots=True)
class Arriving:
    """One receive transfer more (+1) or fewer (-1) whose bytes may arrive: the endpoint drives
    its drivers' inbound work while any does."""

    delta: int


@dataclass(frozen=True, slots=True)
class Announce:
    """Tell the two-sided drivers ``transfer`` is coming; then feed back
    :meth:`PeerProtocol.arrivals_begin` and, when they heard (or a short wait passed),
    :meth:`PeerProtocol.announcement_due` with ``fields``."""

    transfer: Transfer
    fields: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StopWrites:
    """Stop every batch of sending ``transfer`` on its lane (every lane before it picked one),
    and feed back :meth:`PeerProtocol.writes_stopped` once none of them can write any more."""

    transfer: Transfer


@dataclass(frozen=True, slots=True)
class CheckInbound:
    """Ask every two-sided lane whether its inbound work from the peer is idle, and feed back
    :meth:`PeerProtocol.inbound_checked` with the first error (``kind``: "inbound" before a
    receive transfer's Success, "drained" after its failure)."""

    transfer: Transfer
    kind: str


@dataclass(frozen=True, slots=True)
class Calibrate:
    """A one-chunk transfer of ``runs`` descriptors and ``nbytes`` on ``lane`` took
    ``measured_s`` against ``raw_s`` predicted."""

    lane: Lane
    raw_s: float
    measured_s: float
    runs: int = 0
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class EndSession:
    """End the whole session with ``error`` (nothing from the peer can be trusted any more)."""

    error: KVTransportError
    notify: bool


@dataclass(frozen=True, slots=True)
class Fence:
    """The session ended: have every lane's driver fence the peer (``KVTransport.fence``), then
    mark ``transfers`` drained once every lane fenced it: receive transfers whose pages were
    announced to the peer and that it never confirmed (``drained``). A lane that cannot fence
    leaves their pages held (logged)."""

    transfers: tuple[Transfer, ...]
    #: Whether this side ever announced pages to the peer: if not, nothing of this endpoint was
    #: ever the peer's to write, and no fence is needed (the drivers reuse its receive sides).
    announced: bool = True


@dataclass(frozen=True, slots=True)
class FailOver:
    """Sending ``transfer``'s batch on lane ``old`` failed with ``error`` (a data-path failure,
    the control channel alive): send it again over ``new`` (``runtime.failover``)."""

    transfer: Transfer
    old: Lane
    new: Lane
    error: KVTransportError


@dataclass(frozen=True, slots=True)
class Next:
    """Feed ``then`` back once the actions before this one ran."""

    then: Event


Action = (
    Send
    | FlushNotices
    | SetTimer
    | Later
    | Observe
    | Publish
    | Arriving
    | Announce
    | StopWrites
    | CheckInbound
    | Calibrate
    | EndSession
    | Fence
    | FailOver
    | Next
)
