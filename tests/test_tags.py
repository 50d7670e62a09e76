"""The tag book (runtime/tags.py) driven with no endpoint, no socket and no thread: examples of
each rule, and hypothesis driving it with any sequence of events from several connections."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtransport.runtime.config import Limits
from kvtransport.runtime.tags import Kept, Refused, TagBook, announcement_bytes
from kvtransport.runtime.wire import Message, message

SMALL = Limits(
    max_early_expects=3,
    max_early_expects_total=5,
    max_early_expect_bytes=1000,
    max_early_expect_bytes_total=1500,
    max_early_aborts=2,
)


def expect(pages: int = 1, state: list[bytes] | None = None) -> Message:
    return message("expect", tag="t", pages=b"\0" * 8 * pages, aux=-1, prefix=0, state=state or [])


def test_an_announcement_is_kept_until_its_sender_takes_it() -> None:
    book: TagBook[str] = TagBook("ep", SMALL)
    msg = expect(2)
    assert book.announcement("a", "r1", msg) == Kept()
    assert book.owner("r1") == "a" and book.stats()["early_expects"] == 1
    assert book.stats()["early_expect_bytes"] == announcement_bytes(msg) == 16
    assert book.take_announcement("a", "r1") is msg
    assert book.take_announcement("a", "r1") is None
    assert book.stats() == {
        "early_expects": 0,
        "early_expect_bytes": 0,
        "early_aborts": 0,
        "refused": 0,
        "tag_owners": 0,
    }


def test_one_tag_one_receiver() -> None:
    book: TagBook[str] = TagBook("ep", SMALL)
    book.announcement("a", "r1", expect())
    assert book.announcement("b", "r1", expect()) == Refused("this tag was announced by another connection")
    assert book.announcement("a", "r1", expect()) == Refused("duplicate announcement")
    assert book.early_abort("b", "r1", "no") is False  # only the announcer may abort it
    assert book.owner("r1") == "a" and book.has_announcement("a", "r1")


def test_the_oldest_announcement_goes_past_the_count_limit() -> None:
    book: TagBook[str] = TagBook("ep", SMALL)
    for i in range(3):
        assert book.announcement("a", f"r{i}", expect()) == Kept()
    assert book.announcement("a", "r3", expect()) == Kept(dropped="r0")
    assert book.owner("r0") is None and book.stats()["early_expects"] == 3


def test_byte_and_total_limits_refuse_with_the_setting_to_change() -> None:
    book: TagBook[str] = TagBook("ep", SMALL)
    big = expect(100)  # 800 bytes
    assert book.announcement("a", "big", big) == Kept()
    refused = book.announcement("a", "big2", big)
    assert isinstance(refused, Refused) and "KVTRANSPORT_MAX_EARLY_EXPECT_BYTES" in refused.reason
    assert book.announcement("b", "big3", expect(80)) == Kept()  # 640: the endpoint holds 1440
    refused = book.announcement("c", "big4", expect(10))
    assert refused == Refused("ep holds 1440 bytes of announcements nobody sends for yet")
    for i in range(3):
        book.announcement("d", f"s{i}", expect())
    assert book.announcement("e", "one-more", expect()) == Refused("ep holds 5 announcements nobody sends for yet")
    assert book.owner("one-more") is None


def test_a_refused_tag_refuses_the_announcement_to_come_once() -> None:
    book: TagBook[str] = TagBook("ep", SMALL)
    assert book.refuse("r1", "request cancelled") is None
    assert book.announcement("a", "r1", expect()) == Refused("request cancelled")
    assert book.announcement("a", "r1", expect()) == Kept()  # the refusal was used up
    assert book.refuse("r1", "cancelled again") == "a"  # its announcement was waiting: tell "a"
    assert book.owner("r1") is None and book.stats()["refused"] == 0


def test_a_refusal_without_a_reason_still_refuses() -> None:
    """Found by the state machine below: an empty reason read as "not refused", and the
    announcement was kept past every limit, taking the tag from the connection that owned it."""
    book: TagBook[str] = TagBook("ep", SMALL)
    book.early_abort("a", "r1", "gone")
    book.refuse("r1", "")  # a live owner: not remembered
    book.refuse("r2", "")
    assert book.announcement("b", "r2", expect()) == Refused("refused by the sending side")
    assert book.announcement("b", "r1", expect()) == Refused("this tag was announced by another connection")
    assert book.owner("r1") == "a" and book.owner("r2") is None


def test_refusals_are_bounded() -> None:
    book: TagBook[str] = TagBook("ep", SMALL)
    for i in range(10):
        book.refuse(f"r{i}", "no")
    assert list(book.refused) == ["r8", "r9"]


def test_an_early_abort_holds_the_tag_until_its_transfer_is_forgotten() -> None:
    book: TagBook[str] = TagBook("ep", SMALL)
    book.announcement("a", "r1", expect())
    assert book.early_abort("a", "r1", "gave up")
    assert not book.has_announcement("a", "r1") and book.owner("r1") == "a"
    assert book.take_early_abort("a", "r1") == "gave up"
    assert book.owner("r1") == "a"  # until the transfer created under it is forgotten
    book.forget_transfer("a", "r1")
    assert book.owner("r1") is None and book.stats()["tag_owners"] == 0


def test_early_aborts_are_bounded_and_release_what_they_drop() -> None:
    book: TagBook[str] = TagBook("ep", SMALL)
    for i in range(4):
        book.early_abort("a", f"r{i}", "x")
    assert book.early_aborts("a") == 2 and sorted(book.owners) == ["r2", "r3"]


def test_a_sending_transfer_holds_its_tag() -> None:
    book: TagBook[str] = TagBook("ep", SMALL)
    book.announcement("a", "r1", expect())
    book.claim_sending("a", "r1")
    book.take_announcement("a", "r1")
    assert book.owner("r1") == "a"
    book.forget_transfer("a", "r1")
    assert book.owner("r1") is None


def test_forgetting_a_connection_releases_everything_it_held() -> None:
    book: TagBook[str] = TagBook("ep", SMALL)
    book.announcement("a", "r1", expect())
    book.early_abort("a", "r2", "x")
    book.claim_sending("a", "r3")
    book.announcement("b", "r4", expect())
    book.forget("a", ["r3"])
    assert book.owners == {"r4": "b"}
    assert book.stats()["early_expects"] == 1 and book.stats()["early_aborts"] == 0
    book.forget("a", ["r3"])  # twice: nothing left to forget
    assert book.owners == {"r4": "b"}


OWNERS = st.sampled_from(["a", "b", "c"])
TAGS = st.sampled_from([f"r{i}" for i in range(6)])


class AnyEvents(RuleBasedStateMachine):
    """Whatever the peers and the application do, in any order: the limits hold, every count
    matches the tables, and a tag has one owner, who holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.book: TagBook[str] = TagBook("ep", SMALL)
        self.sending: set[tuple[str, str]] = set()

    @rule(owner=OWNERS, tag=TAGS, pages=st.integers(0, 70), state=st.lists(st.binary(max_size=24), max_size=3))
    def announce(self, owner: str, tag: str, pages: int, state: list[bytes]) -> None:
        before = self.book.owner(tag)
        outcome = self.book.announcement(owner, tag, expect(pages, state))
        if before not in (None, owner):
            assert isinstance(outcome, Refused)
        if isinstance(outcome, Kept):
            assert self.book.owner(tag) == owner

    @rule(owner=OWNERS, tag=TAGS)
    def sender_created(self, owner: str, tag: str) -> None:
        if self.book.owned_elsewhere(owner, tag) is None and (owner, tag) not in self.sending:
            self.book.claim_sending(owner, tag)
            self.sending.add((owner, tag))
            self.book.take_announcement(owner, tag)
            self.book.take_early_abort(owner, tag)

    @rule(owner=OWNERS, tag=TAGS)
    def transfer_forgotten(self, owner: str, tag: str) -> None:
        self.sending.discard((owner, tag))
        self.book.forget_transfer(owner, tag)

    @rule(owner=OWNERS, tag=TAGS, reason=st.text(max_size=8))
    def peer_aborts_early(self, owner: str, tag: str, reason: str) -> None:
        before = self.book.owner(tag)
        assert self.book.early_abort(owner, tag, reason) == (before in (None, owner))

    @rule(tag=TAGS, reason=st.text(max_size=8))
    def application_refuses(self, tag: str, reason: str) -> None:
        owner = self.book.owner(tag)
        told = self.book.refuse(tag, reason)
        assert told is None or told == owner

    @rule(owner=OWNERS)
    def connection_ends(self, owner: str) -> None:
        self.book.forget(owner, [t for o, t in self.sending if o == owner])
        self.sending = {(o, t) for o, t in self.sending if o != owner}
        assert owner not in self.book.owners.values()

    @invariant()
    def bounded_and_consistent(self) -> None:
        book, limits = self.book, SMALL
        tables = book._early
        assert (
            book.early_expects_total == sum(len(e.expects) for e in tables.values()) <= limits.max_early_expects_total
        )
        assert book.early_expect_bytes_total == sum(e.expect_bytes for e in tables.values())
        assert book.early_expect_bytes_total <= limits.max_early_expect_bytes_total
        assert book.early_aborts_total == sum(len(e.aborts) for e in tables.values())
        assert book._sending == {tag: owner for owner, tag in self.sending}
        assert len(book.refused) <= limits.max_early_aborts
        for owner, early in tables.items():
            assert len(early.expects) <= limits.max_early_expects
            assert (
                early.expect_bytes == sum(size for _, size in early.expects.values()) <= limits.max_early_expect_bytes
            )
            assert len(early.aborts) <= limits.max_early_aborts
            held = set(early.expects) | set(early.aborts)
            assert held <= early.owned
            assert all(book.owners.get(tag) == owner for tag in early.owned)
            assert early.owned or held, "an owner that holds nothing keeps no tables"
        for tag, owner in book.owners.items():
            assert (owner, tag) in self.sending or tag in tables[owner].owned, (tag, owner)


AnyEvents.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestAnyEvents = AnyEvents.TestCase


def test_stats_can_be_read_from_another_thread_while_the_book_changes() -> None:
    """Endpoint.stats() runs on callers' threads while the I/O thread changes the book (it once
    iterated the book's tables: 'dictionary changed size during iteration')."""
    import threading
    import time

    book: TagBook[str] = TagBook("ep", Limits())
    stop = time.monotonic() + 0.5
    errors: list[BaseException] = []

    def read() -> None:
        try:
            while time.monotonic() < stop:
                book.stats()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    i = 0
    while time.monotonic() < stop:
        owner, tag = f"o{i % 50}", f"t{i}"
        book.early_abort(owner, tag, "x")
        book.claim_sending(owner, f"s{i}")
        book.take_early_abort(owner, tag)
        book.forget_transfer(owner, tag)
        book.forget_transfer(owner, f"s{i}")
        i += 1
    reader.join()
    assert errors == [] and i > 100
    assert set(book.stats().values()) == {0}
