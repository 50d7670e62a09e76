"""The session's protocol machine (runtime/peer_protocol.py) driven with no endpoint, no socket,
no driver and no thread: examples of each rule, then hypothesis playing any sequence of caller
requests, peer messages (well-formed or not), driver outcomes and timers against it, with the
safety rules checked after every step."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtransport.negotiation.hello import PROTOCOL_VERSION
from kvtransport.runtime.actions import (
    Action,
    Announce,
    Arriving,
    Calibrate,
    CheckInbound,
    EndSession,
    Fence,
    FlushNotices,
    Later,
    Next,
    Observe,
    Publish,
    Send,
    SetTimer,
    StopWrites,
)
from kvtransport.runtime.config import Limits, Timeouts
from kvtransport.runtime.handles import RECV, SEND, State, Transfer
from kvtransport.runtime.peer_protocol import (
    PeerProtocol,
    Phase,
    done_notices,
)
from kvtransport.runtime.planning import PairPlan
from kvtransport.runtime.tags import TagBook
from kvtransport.runtime.wire import MAX_DONE_NOTICES, Message, decode, encode, message
from kvtransport.spi.errors import KVTransportError, PeerLost, ProtocolError, TransferAborted, TransferTimeout
from kvtransport.spi.inbound import Claim
from kvtransport.tools.kv_pool import KVPool

PAGES = 16


class Harness:
    """Carries out the machine's actions the way the session does, but into tables a test reads:
    what was sent, the timers armed, the driver calls asked for and not yet answered."""

    def __init__(self, *, lanes: int = 1, two_sided: bool = False, limits: Limits | None = None) -> None:
        pool, peer = KVPool(PAGES, 2, 64, 2), KVPool(PAGES, 2, 64, 2)
        self.pool = pool
        names = ["fake", "other"][:lanes]
        self.facts = SimpleNamespace(
            decision=SimpleNamespace(driver="fake"),
            peer_regions=peer.regions,
            lanes={n: SimpleNamespace(name=n, two_sided=two_sided) for n in names},
            plan=PairPlan(pool.regions, pool.layout, peer.regions, peer.layout, None),
        )
        self.tags: TagBook[Any] = TagBook("ep", limits or Limits())
        self.timeouts = Timeouts()
        self.p = PeerProtocol(
            self.facts,  # type: ignore[arg-type]
            "session",
            "peer",
            regions=pool.regions,
            limits=limits or Limits(),
            timeouts=self.timeouts,
            tags=self.tags,
        )
        self.p.phase = Phase.READY
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.timers: dict[Transfer, tuple[float, Callable[[], list[Action]]]] = {}
        self.later: list[Callable[[], list[Action]]] = []
        self.stops: dict[str, int] = {}  # tag -> StopWrites not yet answered
        self.checks: list[tuple[Transfer, str]] = []
        self.announces: list[tuple[Transfer, dict[str, Any]]] = []
        self.published: list[Transfer] = []
        self.observed: list[Transfer] = []
        self.arriving = 0
        self.ended: list[KVTransportError] = []
        self.fences: list[tuple[Transfer, ...]] = []
        self.flushes = 0
        self.idle_answers: set[int] = set()  # ids of receive transfers whose "inbound" check came back idle

    def run(self, actions: list[Action]) -> None:
        for a in actions:
            match a:
                case Send(kind, fields):
                    if kind == "drained":
                        assert not self.stops.get(fields["tag"]), "drained while aborted writes may still land"
                    self.sent.append((kind, fields))
                case SetTimer(t, seconds, then):
                    self.timers.pop(t, None)
                    if seconds is not None and then is not None:
                        self.timers[t] = (seconds, then)
                case Later(_, then):
                    self.later.append(then)
                case Publish(t):
                    assert t.state.final and t not in self.published, "published twice, or before it was final"
                    if t.role == RECV and t.state is State.SUCCESS:
                        assert id(t) in self.idle_answers, "receive Success before its drivers were idle"
                    self.published.append(t)
                case Observe(t, _):
                    assert t.state.final and t not in self.observed
                    self.observed.append(t)
                case Arriving(delta):
                    self.arriving += delta
                    assert self.arriving >= 0
                case Announce(t, fields):
                    self.announces.append((t, fields))
                case StopWrites(t):
                    self.stops[t.tag] = self.stops.get(t.tag, 0) + 1
                case CheckInbound(t, kind):
                    self.checks.append((t, kind))
                case EndSession(error, _):
                    self.ended.append(error)
                case Fence(transfers):
                    self.fences.append(transfers)
                case Next(then):
                    self.run(then())
                case FlushNotices():
                    self.flushes += 1
                case Calibrate():
                    pass

    # -- what the session's callers and drivers do -----------------------------------------

    def receiver(self, tag: str, pages: list[int]) -> Transfer:
        t = Transfer(SimpleNamespace(), tag, RECV, State.WAITING_FOR_INPUT)  # type: ignore[arg-type]
        claim = Claim(np.array(pages, dtype=np.int64), -1, ())
        fields = {"tag": tag, "pages": claim.pages.tobytes(), "aux": -1, "prefix": 0, "state": []}
        self.run(self.p.announce_receiver(t, claim, fields))
        return t

    def hear_and_announce(self) -> None:
        """The drivers heard of every pending announcement: they go out."""
        while self.announces:
            t, fields = self.announces.pop(0)
            self.run(self.p.arrivals_begin(t))
            self.run(self.p.announcement_due(t, fields))

    def sender(self, tag: str) -> Transfer:
        t = Transfer(SimpleNamespace(), tag, SEND, State.BOOTSTRAPPING)  # type: ignore[arg-type]
        self.run(self.p.register_sender(t))
        return t

    def answer_stop(self, tag: str, error: KVTransportError | None = None) -> None:
        self.stops[tag] -= 1
        self.run(self.p.writes_stopped(tag, error))

    def answer_check(self, idle_error: KVTransportError | None = None) -> None:
        t, kind = self.checks.pop(0)
        if kind == "inbound" and idle_error is None:
            self.idle_answers.add(id(t))
        self.run(self.p.inbound_checked(t, kind, idle_error))

    def fire(self, t: Transfer) -> None:
        _, then = self.timers.pop(t)
        self.run(then())

    def kinds(self) -> list[str]:
        return [k for k, _ in self.sent]


def expect_msg(tag: str, pages: list[int], aux: int = -1) -> Message:
    return message("expect", tag=tag, pages=np.array(pages, dtype=np.int64).tobytes(), aux=aux, prefix=0, state=[])


def done_msg(tag: str, nbytes: int, lane: str = "", notices: list[Any] | None = None) -> Message:
    return message("done", tag=tag, bytes=nbytes, lane=lane, notices=notices or [])


def test_a_sender_goes_from_bootstrapping_to_success_and_says_done() -> None:
    h = Harness()
    t = h.sender("r1")
    assert t.state is State.BOOTSTRAPPING and h.timers[t][0] == h.timeouts.bootstrap
    h.run(h.p.on_expect(expect_msg("r1", [1, 2])))
    assert t.state is State.WAITING_FOR_INPUT and t.dst_page_list == [1, 2]
    h.run(h.p.chunk_submitted(t, 7, 4096, last=True))
    assert t.state is State.TRANSFERRING and h.timers[t][0] == h.timeouts.transfer and not h.sent
    h.run(h.p.batch_finished(t, 7, None))
    assert t.state is State.SUCCESS and h.kinds() == ["done"] and h.sent[0][1]["bytes"] == 4096
    assert h.flushes == 1, "the drivers' notices go out before the done"
    assert h.published == [t] and h.observed == [t]
    assert h.timers[t][0] == h.timeouts.retain_finished
    h.fire(t)  # forgotten after retain_finished, with its tag
    assert "r1" not in h.p.transfers and h.tags.stats()["tag_owners"] == 0


def test_an_announcement_that_came_first_is_taken_by_the_sender() -> None:
    h = Harness()
    h.run(h.p.on_expect(expect_msg("r1", [3])))
    assert h.tags.has_announcement("session", "r1") and not h.sent
    t = h.sender("r1")
    assert t.state is State.WAITING_FOR_INPUT and t.dst_page_list == [3]


def test_a_receiver_succeeds_only_once_its_two_sided_drivers_are_idle() -> None:
    h = Harness(two_sided=True)
    t = h.receiver("r1", [1, 2])
    assert h.kinds() == [] and h.announces, "announced only once the drivers heard"
    h.hear_and_announce()
    assert h.kinds() == ["expect"] and h.arriving == 1
    expected = h.p.expected_bytes(t)
    with pytest.raises(ProtocolError, match="bytes were written"):
        h.run(h.p.on_done(done_msg("r1", expected + 1)))
    h.run(h.p.on_done(done_msg("r1", expected)))
    assert t.state is State.TRANSFERRING and t.peer_done, "not answered in this pass: Transferring meanwhile"
    assert h.checks == [(t, "inbound")]
    h.answer_check()
    assert t.state is State.SUCCESS and h.published == [t] and h.arriving == 0


def test_a_receivers_driver_that_finds_the_data_unusable_ends_the_session() -> None:
    h = Harness(two_sided=True)
    t = h.receiver("r1", [1])
    h.hear_and_announce()
    h.run(h.p.on_done(done_msg("r1", h.p.expected_bytes(t))))
    h.answer_check(ProtocolError("a chunk outside the announced pages"))
    assert len(h.ended) == 1 and t.state is State.TRANSFERRING


def test_drained_waits_until_the_aborted_writes_stopped() -> None:
    h = Harness()
    t = h.sender("r1")
    h.run(h.p.on_expect(expect_msg("r1", [1])))
    h.run(h.p.chunk_submitted(t, 1, 4096, last=True))
    h.run(h.p.abort(t, "caller gave up", notify=True, local=True))
    assert t.state is State.FAILED and h.kinds() == ["abort"] and h.stops == {"r1": 1}
    assert "r1" in h.p.settling
    h.run(h.p.on_abort(message("abort", tag="r1", reason="ok")))  # the peer's answer
    assert h.kinds() == ["abort"], "no drained while the writes may still land"
    h.answer_stop("r1")
    assert h.kinds() == ["abort", "drained"] and not h.p.settling


def test_an_abort_whose_writes_cannot_be_confirmed_says_no_drained() -> None:
    h = Harness()
    t = h.sender("r1")
    h.run(h.p.abort(t, "x", notify=True))
    h.answer_stop("r1", KVTransportError("the driver could not say"))
    assert h.kinds() == ["abort"], "the receiver falls back on its own timeout"


def test_a_receivers_failed_transfer_waits_for_drained_and_its_drivers() -> None:
    h = Harness(two_sided=True)
    t = h.receiver("r1", [1, 2])
    h.hear_and_announce()
    h.run(h.p.abort(t, "decode gave up", notify=True, local=True))
    assert t.state is State.FAILED and not t.drained.is_set() and "r1" in h.p.awaiting_drain
    assert h.arriving == 1, "its drivers are still driven: a posted write may need them"
    h.fire(t)  # forgotten from the transfers: still awaiting the sender's word
    assert "r1" not in h.p.transfers and "r1" in h.p.awaiting_drain
    h.run(h.p.on_drained(message("drained", tag="r1")))
    assert h.checks == [(t, "drained")]
    h.answer_check()
    assert t.drained.is_set() and h.arriving == 0


def test_a_refused_announcement_does_not_say_drained_while_writes_of_its_tag_settle() -> None:
    """Found by the machine below: a sending transfer aborted with its writes still settling is
    forgotten after retain_finished; the peer then announces the tag twice. The second is
    refused; its "drained" must wait for the old writes, or the peer frees pages they may hit."""
    h = Harness()
    t = h.sender("a")
    h.run(h.p.abort(t, "caller", notify=True, local=True))
    h.fire(t)  # forgotten; its writes still settling
    h.run(h.p.on_expect(expect_msg("a", [1])))
    h.run(h.p.on_expect(expect_msg("a", [1])))
    assert h.kinds() == ["abort", "abort"] and h.stops == {"a": 1}
    h.answer_stop("a")
    assert h.kinds() == ["abort", "abort", "drained"]


def test_an_applications_refusal_does_not_say_drained_while_writes_of_its_tag_settle() -> None:
    """Found by review: ``Endpoint.refuse`` of a re-announced tag must wait for the aborted
    writes of an earlier transfer under it, as the peer's own refusal does."""
    h = Harness()
    t = h.sender("a")
    h.run(h.p.abort(t, "caller", notify=True, local=True))
    h.fire(t)
    h.run(h.p.on_expect(expect_msg("a", [1])))
    assert h.tags.refuse("a", "no") == "session"
    h.run(h.p.confirm_drained("a"))
    assert h.kinds() == ["abort"] and h.stops == {"a": 1}
    h.answer_stop("a")
    assert h.kinds() == ["abort", "drained"]


def test_a_timeout_fails_the_transfer_with_transfer_timeout() -> None:
    h = Harness()
    t = h.sender("r1")
    h.fire(t)
    assert t.state is State.FAILED and isinstance(t.error, TransferTimeout)
    assert h.kinds() == ["abort"] and h.stops == {"r1": 1}


def test_a_peers_abort_before_the_transfer_exists_fails_it_when_created() -> None:
    h = Harness()
    h.run(h.p.on_abort(message("abort", tag="r1", reason="no")))
    assert h.kinds() == ["drained"], "nothing of it was written here"
    t = h.sender("r1")
    assert t.state is State.FAILED and isinstance(t.error, TransferAborted)


def test_close_fails_everything_and_sends_nothing_after() -> None:
    h = Harness()
    a, b = h.sender("a"), h.receiver("b", [1])
    h.hear_and_announce()
    h.sent.clear()
    h.run(h.p.close(KVTransportError("peer gone"), notify=True))
    assert a.state is State.FAILED and b.state is State.FAILED and h.p.phase is Phase.CLOSED
    assert sorted(f["tag"] for k, f in h.sent if k == "abort") == ["a", "b"]
    assert not h.p.transfers and not h.p.awaiting_drain and h.arriving == 0 and not h.timers
    assert h.tags.stats()["tag_owners"] == 0
    h.sent.clear()
    h.answer_stop("a")
    late = h.sender("c")
    assert late.state is State.FAILED and not h.sent, "no drained, no message once closed"


def test_close_has_the_drivers_fence_exactly_the_pages_the_peer_never_confirmed() -> None:
    """The session ends: the receive transfers whose pages were announced and that the peer
    never confirmed (``drained``) wait for the fence (one whose announcement was still on its
    way too: the peer may have it); a sender's transfer and one the peer confirmed do not."""
    h = Harness()
    h.sender("s")
    confirmed, held = h.receiver("ok", [1]), h.receiver("held", [2])
    h.hear_and_announce()
    on_its_way = h.receiver("late", [3])  # its drivers have not heard of it yet
    h.run(h.p.abort(confirmed, "gave up", notify=True, local=True))
    h.run(h.p.on_drained(message("drained", tag="ok")))
    h.answer_check()
    assert confirmed.drained.is_set()
    h.run(h.p.close(PeerLost("gone"), notify=False))
    assert h.fences == [(held, on_its_way)]
    assert not held.drained.is_set() and held.state is State.FAILED


def test_a_peer_that_does_not_confirm_in_time_is_cut_off_so_that_it_can_be_fenced() -> None:
    h = Harness()
    late, prompt = h.receiver("late", [1]), h.receiver("prompt", [2])
    h.hear_and_announce()
    h.run(h.p.abort(late, "decode gave up", notify=True, local=True))
    h.run(h.p.abort(prompt, "decode gave up", notify=True, local=True))
    overdue = list(h.later)
    h.run(h.p.on_drained(message("drained", tag="prompt")))
    h.answer_check()
    for then in overdue:  # KVTRANSPORT_DRAIN_TIMEOUT passed for both
        h.run(then())
    assert len(h.ended) == 1 and isinstance(h.ended[0], PeerLost)
    assert "'late'" in str(h.ended[0]) and "KVTRANSPORT_DRAIN_TIMEOUT" in str(h.ended[0])


def test_done_notices_are_checked_before_any_is_taken() -> None:
    """The wire's schema checks a done's notices (byte strings, at most MAX_DONE_NOTICES) when
    it decodes the message, before the session takes any of them."""
    assert done_notices(decode(encode("done", tag="t", bytes=0, lane="", notices=[b"a", b"b"]))) == [b"a", b"b"]
    for notices in ([b"a", "not bytes"], [b"x"] * (MAX_DONE_NOTICES + 1)):
        frame = msgpack.packb(
            {"v": PROTOCOL_VERSION, "t": "done", "tag": "t", "bytes": 0, "lane": "", "notices": notices},
            use_bin_type=True,
        )
        with pytest.raises(ProtocolError, match=r"done\.notices"):
            decode(frame)


# -- hypothesis: any sequence of events ----------------------------------------------------------

TAGS = st.sampled_from(["a", "b", "c", "d"])
PAGE_LISTS = st.lists(st.integers(-2, PAGES + 2), min_size=0, max_size=4)
TINY = Limits(max_transfers_per_connection=3, max_early_aborts=2, max_early_expects=2)


class ProtocolMachine(RuleBasedStateMachine):
    """Caller requests, peer messages and driver outcomes in any order; the harness checks at
    every action that no "drained" overtakes an unanswered stop, that a receive transfer
    succeeds only after its drivers were idle, that a final state is published once, and that
    the arriving count never goes negative."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(lanes=2, two_sided=True, limits=TINY)
        self.mine: dict[str, Transfer] = {}
        self.closed_at: int | None = None

    @rule(tag=TAGS)
    def create_sender(self, tag: str) -> None:
        self.mine[tag] = self.h.sender(tag)

    @rule(tag=TAGS, pages=st.lists(st.integers(0, PAGES - 1), min_size=1, max_size=3, unique=True))
    def create_receiver(self, tag: str, pages: list[int]) -> None:
        self.mine[tag] = self.h.receiver(tag, pages)

    @rule()
    def drivers_heard(self) -> None:
        self.h.hear_and_announce()

    @rule(tag=TAGS, pages=PAGE_LISTS)
    def peer_expect(self, tag: str, pages: list[int]) -> None:
        self.h.run(self.h.p.on_expect(expect_msg(tag, pages)))

    @rule(tag=TAGS, exact=st.booleans(), lane=st.sampled_from(["", "other", "nope"]))
    def peer_done(self, tag: str, exact: bool, lane: str) -> None:
        t = self.h.p.transfers.get(tag)
        nbytes = self.h.p.expected_bytes(t) if t is not None and exact else 12345
        try:
            self.h.run(self.h.p.on_done(done_msg(tag, nbytes, lane)))
        except ProtocolError:
            pass  # the endpoint counts a violation and the session goes on

    @rule(tag=TAGS)
    def peer_abort(self, tag: str) -> None:
        self.h.run(self.h.p.on_abort(message("abort", tag=tag, reason="peer")))

    @rule(tag=TAGS)
    def peer_drained(self, tag: str) -> None:
        self.h.run(self.h.p.on_drained(message("drained", tag=tag)))

    @rule(tag=TAGS, bid=st.integers(0, 3), last=st.booleans())
    def chunk_reaches_driver(self, tag: str, bid: int, last: bool) -> None:
        t = self.mine.get(tag)
        if t is not None and t.role == SEND and t.dst_pages is not None:
            self.h.run(self.h.p.chunk_submitted(t, bid, 100, last))

    @rule(tag=TAGS, bid=st.integers(1, 3), ok=st.booleans())
    def batch_ends(self, tag: str, bid: int, ok: bool) -> None:
        t = self.mine.get(tag)
        if t is not None:
            self.h.run(self.h.p.batch_finished(t, bid, None if ok else KVTransportError("engine")))

    @rule(tag=TAGS)
    def caller_aborts(self, tag: str) -> None:
        self.h.run(self.h.p.abort_tag(tag, "caller"))

    @precondition(lambda self: any(self.h.stops.values()))
    @rule(ok=st.booleans(), data=st.data())
    def writes_stop(self, ok: bool, data: st.DataObject) -> None:
        tag = data.draw(st.sampled_from(sorted(t for t, n in self.h.stops.items() if n)))
        self.h.answer_stop(tag, None if ok else KVTransportError("unsure"))

    @precondition(lambda self: bool(self.h.checks))
    @rule(idle=st.booleans())
    def drivers_answer(self, idle: bool) -> None:
        self.h.answer_check(None if idle else ProtocolError("bad chunk"))

    @precondition(lambda self: bool(self.h.timers))
    @rule(data=st.data())
    def a_timer_fires(self, data: st.DataObject) -> None:
        t = data.draw(st.sampled_from(list(self.h.timers)))
        self.h.fire(t)

    @rule()
    def session_ends(self) -> None:
        self.h.run(self.h.p.close(KVTransportError("gone"), notify=True))
        if self.closed_at is None:
            self.closed_at = len(self.h.sent)

    @invariant()
    def bounded_and_consistent(self) -> None:
        p = self.h.p
        assert len(p.transfers) <= TINY.max_transfers_per_connection
        assert len(p.awaiting_drain) <= TINY.max_early_aborts
        assert all(t.filed and t.tag == tag for tag, t in p.transfers.items())
        for t in self.mine.values():
            assert (t in self.h.published) == t.state.final, "every final state is published"
        if self.closed_at is not None:
            assert len(self.h.sent) == self.closed_at, "a message after the session closed"
            assert not p.transfers and self.h.arriving == 0


TestProtocolMachine = ProtocolMachine.TestCase
#: KVTRANSPORT_MACHINE_EXAMPLES runs a longer campaign (the fast tier's 1,000 take about 10 s here).
TestProtocolMachine.settings = settings(
    max_examples=int(os.environ.get("KVTRANSPORT_MACHINE_EXAMPLES", "1000")), stateful_step_count=50, deadline=None
)
