"""Who owns each transfer tag at an endpoint, and what peers said about tags before a transfer
existed for them: a state machine that does no I/O.

A tag (a request's id) belongs to one connection at a time: the one whose receiver announced
it, or whose sender sends under it. Announcements and aborts may arrive before this side has
created the transfer they are about; they are kept here, bounded per connection and in all,
until the transfer is created or the connection ends. The application may also refuse a tag
before anyone announced it (``Endpoint.refuse``).

Events come in as method calls (an announcement arrived, an early abort arrived, a sending
transfer was filed or forgotten, the application refused a tag, a connection ended); what the
caller must do comes back as a value (:class:`Kept`, :class:`Refused`, an owner to tell). The
book sends nothing, arms no timer and takes no lock: the endpoint's I/O thread is its only
caller (other threads read only :meth:`TagBook.stats`, made of counters), and a test can drive
it with any sequence of events (tests/test_tags.py). Its limits are read once, when the endpoint
that owns it starts.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvtransport.runtime.bounded import put_newest
from kvtransport.runtime.config import Limits
from kvtransport.runtime.wire import Message

#: A connection, as the book knows it: anything hashable (the endpoint passes its sessions).
Owner = TypeVar("Owner", bound=Hashable)


def announcement_bytes(msg: Message) -> int:
    """What keeping an announcement costs, counted against the early-announcement limits (each
    state entry at least as much as a small object, whatever it holds)."""
    state: list[Any] = msg["state"]
    return len(msg["pages"]) + sum(64 + (len(x) if isinstance(x, bytes) else 0) for x in state)


@dataclass(frozen=True)
class Kept:
    """The announcement is kept until its sender exists. ``dropped``: the tag of this
    connection's oldest kept announcement, forgotten to stay within its count limit."""

    dropped: str | None = None


@dataclass(frozen=True)
class Refused:
    """The announcement is not kept: the peer is told ``abort`` with ``reason``, then
    ``drained`` (nothing of it was ever written)."""

    reason: str


@dataclass
class _Early:
    """One connection's early tables (made only when a peer says something early: a sending
    transfer's tag, the common case, costs two dictionary entries and no table)."""

    expects: collections.OrderedDict[str, tuple[Message, int]] = field(default_factory=collections.OrderedDict)
    expect_bytes: int = 0
    aborts: collections.OrderedDict[str, str] = field(default_factory=collections.OrderedDict)
    #: Every tag these tables made this connection own (what they hold, and what a taken
    #: early abort left until its transfer is forgotten).
    owned: set[str] = field(default_factory=set)


class TagBook(Generic[Owner]):
    """An endpoint's tags: owners, early announcements and aborts, refusals; all bounded."""

    def __init__(self, name: str, limits: Limits) -> None:
        self.name = name
        self.limits = limits
        #: Which connection owns a tag.
        self.owners: dict[str, Owner] = {}
        #: Tags the application refused before any peer announced them, with the reason.
        self.refused: collections.OrderedDict[str, str] = collections.OrderedDict()
        #: Tags under which a filed transfer of their owner sends.
        self._sending: dict[str, Owner] = {}
        self._early: dict[Owner, _Early] = {}
        self.early_expects_total = 0
        self.early_expect_bytes_total = 0
        self.early_aborts_total = 0

    # -- queries ---------------------------------------------------------------------------

    def owner(self, tag: str) -> Owner | None:
        return self.owners.get(tag)

    def owned_elsewhere(self, owner: Owner, tag: str) -> Owner | None:
        """The other connection that owns ``tag``, if one does."""
        other = self.owners.get(tag)
        return None if other is None or other == owner else other

    def has_announcement(self, owner: Owner, tag: str) -> bool:
        early = self._early.get(owner)
        return early is not None and tag in early.expects

    def early_aborts(self, owner: Owner) -> int:
        early = self._early.get(owner)
        return 0 if early is None else len(early.aborts)

    def stats(self) -> dict[str, int]:
        """What the book holds; any thread (counters and lengths, no iteration)."""
        return {
            "early_expects": self.early_expects_total,
            "early_expect_bytes": self.early_expect_bytes_total,
            "early_aborts": self.early_aborts_total,
            "refused": len(self.refused),
            "tag_owners": len(self.owners),
        }

    # -- events ----------------------------------------------------------------------------

    def announcement(self, owner: Owner, tag: str, msg: Message) -> Kept | Refused:
        """A peer announced ``tag`` on ``owner`` before this side created its transfer."""
        limits = self.limits
        early = self._tables(owner)
        size = announcement_bytes(msg)
        refusal: str | None = None
        if tag in self.refused:
            # Whatever reason the application gave, even none: a refusal is a refusal.
            refusal = self.refused.pop(tag) or "refused by the sending side"
        elif self.owned_elsewhere(owner, tag) is not None:
            # One tag, one receiver: a second announcement, from whoever, changes nothing.
            refusal = "this tag was announced by another connection"
        elif tag in early.expects:
            refusal = "duplicate announcement"
        elif self.early_expects_total >= limits.max_early_expects_total:
            refusal = f"{self.name} holds {limits.max_early_expects_total} announcements nobody sends for yet"
        elif early.expect_bytes + size > limits.max_early_expect_bytes:
            refusal = (
                f"this connection's announcements for transfers nobody sends yet would exceed "
                f"{limits.max_early_expect_bytes} bytes (KVTRANSPORT_MAX_EARLY_EXPECT_BYTES)"
            )
        elif self.early_expect_bytes_total + size > limits.max_early_expect_bytes_total:
            refusal = f"{self.name} holds {self.early_expect_bytes_total} bytes of announcements nobody sends for yet"
        if refusal is not None:
            self._tidy(owner)
            return Refused(refusal)
        self._own(owner, early, tag)
        early.expects[tag] = (msg, size)
        early.expect_bytes += size
        self.early_expects_total += 1
        self.early_expect_bytes_total += size
        dropped = None
        if len(early.expects) > limits.max_early_expects:
            dropped = next(iter(early.expects))
            self.take_announcement(owner, dropped)
        return Kept(dropped)

    def take_announcement(self, owner: Owner, tag: str) -> Message | None:
        """The announcement of ``tag`` kept for ``owner``, now handed over (its sender exists)
        or dropped; ``None`` if there is none."""
        early = self._early.get(owner)
        entry = early.expects.pop(tag, None) if early is not None else None
        if entry is None:
            return None
        assert early is not None
        msg, size = entry
        early.expect_bytes -= size
        self.early_expects_total -= 1
        self.early_expect_bytes_total -= size
        self._release(owner, tag)
        return msg

    def early_abort(self, owner: Owner, tag: str, reason: str) -> bool:
        """A peer aborted ``tag`` on ``owner`` before this side created its transfer: kept (the
        newest ``max_early_aborts``), so the transfer fails the moment it is created; a kept
        announcement of it is dropped. ``False``: another connection owns the tag, and only
        that one may abort it (nothing changes)."""
        if self.owned_elsewhere(owner, tag) is not None:
            return False
        early = self._tables(owner)
        self._own(owner, early, tag)
        before = len(early.aborts)
        dropped = put_newest(early.aborts, tag, reason, self.limits.max_early_aborts)
        self.early_aborts_total += len(early.aborts) - before
        # After the abort is recorded: dropping the announcement must not release the tag,
        # which the abort holds (Endpoint.announced finds the connection by it).
        self.take_announcement(owner, tag)
        for old, _ in dropped:
            self._release(owner, old)
        return True

    def take_early_abort(self, owner: Owner, tag: str) -> str | None:
        """The reason ``owner``'s peer gave for aborting ``tag`` early, once (its transfer is
        being created now); the tag stays owned until that transfer is forgotten."""
        early = self._early.get(owner)
        reason = early.aborts.pop(tag, None) if early is not None else None
        if reason is not None:
            self.early_aborts_total -= 1
        return reason

    def claim_sending(self, owner: Owner, tag: str) -> None:
        """A transfer that ``owner`` sends was filed under ``tag`` (the caller checked
        :meth:`owned_elsewhere` first)."""
        self._sending[tag] = owner
        self.owners[tag] = owner

    def forget_transfer(self, owner: Owner, tag: str) -> None:
        """``owner``'s transfer filed under ``tag`` is forgotten: the tag goes unless an early
        announcement or abort of it still holds it."""
        if self._sending.get(tag) == owner:
            del self._sending[tag]
        self._release(owner, tag)

    def refuse(self, tag: str, reason: str) -> Owner | None:
        """The application will never send ``tag``. Returns the connection whose kept
        announcement of it was just dropped (its peer must be told ``abort`` and ``drained``);
        ``None`` when nobody announced it yet (remembered for the announcement to come, the
        newest ``max_early_aborts``) or a live transfer has it (its sender aborts it)."""
        owner = self.owners.get(tag)
        if owner is not None:
            return owner if self.take_announcement(owner, tag) is not None else None
        put_newest(self.refused, tag, reason, self.limits.max_early_aborts)
        return None

    def forget(self, owner: Owner, transfer_tags: Iterable[str] = ()) -> None:
        """``owner`` ended, with transfers filed under ``transfer_tags``: everything it held
        goes, and every tag it owned."""
        owners, sending = self.owners, self._sending
        for tag in transfer_tags:
            if sending.get(tag) == owner:
                del sending[tag]
            if owners.get(tag) == owner:
                del owners[tag]
        early = self._early.pop(owner, None)
        if early is None:
            return
        self.early_expects_total -= len(early.expects)
        self.early_expect_bytes_total -= early.expect_bytes
        self.early_aborts_total -= len(early.aborts)
        for tag in early.owned:
            if owners.get(tag) == owner:
                del owners[tag]

    # -- inside ----------------------------------------------------------------------------

    def _tables(self, owner: Owner) -> _Early:
        early = self._early.get(owner)
        if early is None:
            early = self._early[owner] = _Early()
        return early

    def _own(self, owner: Owner, early: _Early, tag: str) -> None:
        self.owners[tag] = owner
        early.owned.add(tag)

    def _holds(self, owner: Owner, tag: str) -> bool:
        if self._sending.get(tag) == owner:
            return True
        early = self._early.get(owner)
        return early is not None and (tag in early.expects or tag in early.aborts)

    def _release(self, owner: Owner, tag: str) -> None:
        if self._holds(owner, tag):
            return
        if self.owners.get(tag) == owner:
            del self.owners[tag]
        early = self._early.get(owner)
        if early is not None:
            early.owned.discard(tag)
            self._tidy(owner)

    def _tidy(self, owner: Owner) -> None:
        """An owner that holds nothing keeps no tables (a peer's every announcement refused
        leaves nothing behind)."""
        early = self._early.get(owner)
        if early is not None and not (early.expects or early.aborts or early.owned):
            del self._early[owner]
