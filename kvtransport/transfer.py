"""One request's pages over one connection: the :class:`Transfer` handle and its state machine.

States map one-to-one onto SGLang's ``KVPoll``. A sender goes Bootstrapping (waiting for the
receiver's announcement) -> WaitingForInput (announced, nothing sent yet) -> Transferring ->
Success; a receiver starts in WaitingForInput and reaches Success only once the bytes are in its
pool. Any state can go to Failed, and a final state never changes again.

Ownership: the caller's thread reads ``state`` and calls :meth:`Transfer.send`, :meth:`wait`
and :meth:`abort`; every change of state happens on the endpoint's I/O thread, through the
transfer's :class:`~kvtransport.session.Session`.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .errors import KVTransportError, TransferTimeout

if TYPE_CHECKING:
    from .inbound import Claim
    from .lane import Lane
    from .session import Connection, Session
    from .timers import Timer


class State(enum.IntEnum):
    """Transfer states; the values equal SGLang's ``KVPoll``."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def final(self) -> bool:
        return self in (State.FAILED, State.SUCCESS)


SEND, RECV = "send", "recv"


class Transfer:
    """One request's pages over one connection, as the sender or the receiver sees it."""

    def __init__(self, session: Session, tag: str, role: str, state: State) -> None:
        self._session = session
        self.tag = tag
        self.role = role  # SEND or RECV
        self._state = state
        self._since = time.monotonic()
        self.created = self._since
        self.counted = False  # I/O thread: counted in the endpoint's metrics (once, when final)
        self.error: KVTransportError | None = None
        self._final = threading.Event()
        # sender side
        self.dst_pages: npt.NDArray[np.int64] | None = None
        #: The same, as a list, when they are few (a small request plans from lists).
        self.dst_page_list: list[int] | None = None
        self.dst_aux = -1
        self.dst_state: tuple[npt.NDArray[np.int64], ...] = ()  # per state group
        self.sent_pages = 0  # caller thread: pages planned so far
        self.last_planned = False  # caller thread: the last chunk was planned
        # I/O thread
        self.last_sent = False  # the last chunk was handed to the driver
        self.batches: set[int] = set()  # batch ids in the driver, not finished yet
        self.bytes = 0
        self.peer_done = False  # receiver: the sender said every byte was written
        self.peer_prefix = 0  # sender: how much the receiver holds already (its announcement)
        self.driver_stopped = False  # sender, driver thread only: aborted there, submit nothing more
        #: Sender: the one-batch transfer's "done" went out on the express stream (set by the
        #: thread that saw the batch finish), and the I/O thread started failing it (``stopping``);
        #: whichever comes first under ``express_lock`` wins.
        self.express_lock = threading.Lock()
        self.done_sent = False
        self.stopping = False
        #: Receiver: set once nothing of this transfer can be written into the announced pages
        #: any more: it succeeded, or it failed and the sender confirmed its writes settled
        #: (``drained``). A serving engine frees the pages of a failed request only then.
        self.drained = threading.Event()
        self.announced: Claim | None = None  # receiver: what it announced, until it ends
        #: Receiver, I/O thread: counted among the endpoint's arriving transfers (its drivers
        #: are driven while any is), from its announcement until nothing more of it can arrive.
        self.arriving = False
        self.filed = False  # filed under its tag in the session
        self.timer: Timer | None = None  # its state's timeout, or when it is forgotten
        self.started = 0.0
        self.finished = 0.0
        #: Sender: the driver the transfer takes (picked at its first chunk by predicted time
        #: among the connection's lanes); receiver: the driver its "done" named.
        self.driver = ""
        #: Sender: what the lane's cost models predicted for its first chunk (0: no model), and
        #: the seconds from that chunk's submission to Success (0 until then).
        self.predicted_s = 0.0
        self.raw_predicted_s = 0.0  # uncorrected, for a one-chunk transfer: what the lane checks
        self.measured_s = 0.0
        self.submitted_at = 0.0
        self.lane: Lane | None = None

    @property
    def connection(self) -> Connection:
        return self._session.handle

    @property
    def state(self) -> State:
        return self._state

    def poll(self) -> State:
        return self._state

    def __repr__(self) -> str:
        return f"<Transfer {self.role} {self.tag!r} {self._state.name}>"

    def wait(self, timeout: float | None = None) -> State:
        """Block until Success or Failed. Raises the transfer's error on failure, and
        :class:`TransferTimeout` if ``timeout`` passes first (the transfer goes on)."""
        if not self._final.wait(timeout):
            raise TransferTimeout(f"transfer {self.tag!r} still {self._state.name} after {timeout} s")
        if self._state is State.FAILED:
            assert self.error is not None
            raise self.error
        return self._state

    def send(
        self, src_pages: Any, *, last: bool = True, aux: int | None = None, state: Sequence[Any] | None = None
    ) -> None:
        """Write the next chunk of source pages (sender). They land on the destination pages
        the receiver announced, in order. The last chunk also carries the aux slot and, per
        state group, the source items (``state[g]``: as many as the receiver announced for
        group ``g``). Bad indices raise here; nothing is submitted."""
        if self.role != SEND:
            raise KVTransportError("send() on a receiving transfer")
        self._session.send_chunk(self, src_pages, last, aux, state)

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Fail this transfer here and at the peer."""
        self._session.abort_from_caller(self, reason)

    # -- I/O thread ------------------------------------------------------------------------

    def _set(self, state: State, error: KVTransportError | None = None) -> bool:
        """Move to ``state``; ``False`` (and nothing changes) once the transfer is final."""
        if self._state.final:
            return False  # a failed transfer is never reported as a success later
        if error is not None:
            self.error = error  # before the state: a caller that sees Failed finds its error
        self._state = state
        self._since = time.monotonic()
        if state is State.TRANSFERRING and not self.started:
            self.started = self._since
        if state.final:
            self.finished = self._since
        self._session.state_changed(self)
        if state is State.SUCCESS and self.role == RECV:
            self.drained.set()  # every write of it completed
        if state.final:
            self._final.set()
        return True
