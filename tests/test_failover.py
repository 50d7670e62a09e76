"""Failover that keeps the request (issue 46, item 3): a transfer whose driver fails on its data
path, while the control channel lives, goes again over another lane of its connection and
succeeds byte-exact; the failed lane is quarantined (the receiver fenced it before the
transfer's Success) and comes back after its back-off, with new receive sides on both ends,
once a transfer probed it; the decision, the logs and the metrics say so.

Here on one host through the fault-injecting wrapper (``kvtransport.testing.faults``): with the
fakes in one process (the core's logic, every case, and the races of the way back), and on the
real engines between two processes (mooncake-gdr failing over to nixl-ucx and back). Across
simulated hosts with a rail cut: tests/test_cluster_failover.py.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvtransport.negotiation.negotiate import standby_lane
from kvtransport.negotiation.registry import Policy
from kvtransport.runtime import failover
from kvtransport.runtime.config import Limits
from kvtransport.runtime.endpoint import Endpoint, State, Timeouts
from kvtransport.runtime.handles import Transfer
from kvtransport.spi.driver import Capabilities
from kvtransport.spi.errors import KVTransportError
from kvtransport.testing.fake import FakeDriver, FakeTwoSided
from kvtransport.testing.faults import faulty
from kvtransport.tools.kv_pool import KVPool
from kvtransport.tools.peer_process import PeerProcess

from .conftest import require_engines

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0, "drain": 2.0, "stall": 0.3}


class FakeOther(FakeDriver):
    """A second one-sided fake (the standby of a one-sided chosen driver is one-sided too)."""

    name: ClassVar[str] = "fake-other"
    api_version: ClassVar[int] = FakeDriver.api_version
    capabilities: ClassVar[Capabilities] = FakeDriver.capabilities


#: (the chosen driver, wrapped to fail on command; its standby), by the chosen driver's kind.
SCENARIOS = {
    "one-sided": (FakeDriver, FakeOther),
    # a two-sided chosen driver: the session is in ordered mode, "lane_down" goes on its stream
    "two-sided": (FakeTwoSided, FakeDriver),
}


class Pair:
    def __init__(
        self,
        tmp: Path,
        scenario: str = "one-sided",
        *,
        receiver_options: dict[str, str] | None = None,
        quarantine: float = 1.0,
        limits: Limits | None = None,
        driver_options: dict[str, str] | None = None,
    ) -> None:
        timeouts = Timeouts(**FAST, quarantine=quarantine)
        self.fault, self.standby_fault = tmp / "fault", tmp / "standby-fault"
        chosen, standby = SCENARIOS[scenario]
        self.chosen, self.standby = chosen.name, standby.name
        drivers = {chosen.name: faulty(chosen), standby.name: faulty(standby)}
        common = {"fake.fence": "1", "fake.inbound_delay": "0.01", **(driver_options or {})}
        self.pools = [KVPool(32, 2, 4096, 0) for _ in range(2)]
        self.pools[0].fill(5)
        self.prefill = Endpoint(
            self.pools[0].regions,
            self.pools[0].layout,
            drivers=drivers,
            driver_options={
                f"faults.{chosen.name}": str(self.fault),
                f"faults.{standby.name}": str(self.standby_fault),
                **common,
            },
            name="prefill",
            timeouts=timeouts,
            limits=limits,
            policy=Policy(allow=(chosen.name, standby.name), failover="on"),
        )
        self.decode = Endpoint(
            self.pools[1].regions,
            self.pools[1].layout,
            drivers=drivers,
            driver_options=receiver_options if receiver_options is not None else common,
            name="decode",
            timeouts=timeouts,
            limits=limits,
            policy=Policy(allow=(chosen.name, standby.name), failover=os.environ.get("KVTRANSPORT_FAILOVER", "on")),
        )
        self.recv = self.decode.connect(self.prefill.address, 10)
        self.send = self.prefill.accept(10)

    def start(self, tag: str, src: list[int] | None, dst: list[int]) -> tuple[Transfer, Transfer]:
        """Decode announces ``dst`` under ``tag``; prefill's sender sees it and, given ``src``,
        sends it in one part. (sender, receiver)."""
        r = self.recv.expect(tag, dst)
        t = self.send.sender(tag)
        deadline = time.monotonic() + 10
        while t.state is State.BOOTSTRAPPING and time.monotonic() < deadline:
            time.sleep(0.002)
        if src is not None:
            t.send(src, last=True)
        return t, r

    def fails(self, tag: str, src: list[int], dst: list[int]) -> None:
        """One transfer that fails on both sides, the sender's with the injected fault."""
        t, r = self.start(tag, src, dst)
        with pytest.raises(KVTransportError, match="injected fault"):
            t.wait(10)
        with pytest.raises(KVTransportError):
            r.wait(10)

    def round(self, tag: str, src: list[int], dst: list[int]) -> str:
        """One verified transfer; the driver that moved it."""
        t, r = self.start(tag, src, dst)
        assert t.wait(10) is State.SUCCESS and r.wait(10) is State.SUCCESS, tag
        assert self.pools[1].page_digests(dst) == self.pools[0].page_digests(src), tag
        assert r.driver == t.driver, (r.driver, t.driver)
        return t.driver

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()
        for p in self.pools:
            p.close()


@pytest.fixture(params=sorted(SCENARIOS))
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Pair]:
    p = Pair(tmp_path, request.param)
    yield p
    p.close()


def test_a_failed_lane_hands_its_transfer_to_the_standby_and_stays_out_during_its_quarantine(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    decision = pair.send.decision
    assert decision is not None
    assert decision.lanes == (decision.driver, *decision.standby) and len(decision.standby) == 1, decision
    assert pair.round("before", [1, 2, 3], [4, 5, 6]) == pair.chosen  # the standby carries nothing meanwhile
    pair.fault.write_text("cut")
    with caplog.at_level(logging.INFO, logger="kvtransport"):
        assert pair.round("during", [7, 8, 9, 10], [11, 12, 13, 14]) == pair.standby
    text = caplog.text
    assert f"{pair.chosen} failed for" in text and "fenced" in text, text
    # The failed lane stays out during its quarantine (1 s), also once the fault is gone.
    pair.fault.unlink()
    assert pair.round("after", [15, 16], [17, 18]) == pair.standby
    failovers = pair.prefill.metrics.snapshot()["failovers"]
    assert failovers == [{"from": pair.chosen, "to": pair.standby, "count": 1}], failovers
    fenced = pair.decode.drivers[pair.chosen]
    assert isinstance(fenced, FakeDriver) and fenced.fence_calls, "the receiver never fenced the failed lane"


def _lane(connection: object, name: str) -> Any:
    return connection._session.lanes[name]  # type: ignore[attr-defined]


def _until(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_failed_lane_comes_back_from_quarantine_once_its_probe_passes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After its back-off the failed lane is offered back with new receive sides on both
    ends (the failed generation's stay fenced); the first transfer on it is its probe: while
    the fault lasts, the probe fails over too (the request is kept) and the back-off doubles;
    once the fault is gone the probe passes and the lane carries every transfer again."""
    pair = Pair(tmp_path, "one-sided", quarantine=0.3)
    try:
        chosen = _lane(pair.send, pair.chosen)
        assert pair.round("before", [1, 2], [3, 4]) == pair.chosen
        pair.fault.write_text("cut")
        with caplog.at_level(logging.INFO, logger="kvtransport"):
            assert pair.round("cut", [5, 6], [7, 8]) == pair.standby
            assert chosen.broken and chosen.failures == 1
            _until(lambda: not chosen.broken)  # back, on probation, the fault still there
            assert chosen.probation and chosen.gen == 1 and chosen.key != pair.send.id
            # its probe fails over as well: the request is kept, the lane quarantined again
            assert pair.round("probe1", [9, 10], [11, 12]) == pair.standby
            assert chosen.broken and chosen.failures == 2
            pair.fault.unlink()
            _until(lambda: not chosen.broken)
            assert chosen.gen == 2
            assert pair.round("probe2", [13, 14], [15, 16]) == pair.chosen  # the probe passes
            assert not chosen.probation
            assert [pair.round(f"after{i}", [17 + i], [20 + i]) for i in range(3)] == [pair.chosen] * 3
        text = caplog.text
        assert "is back for" in text and "passed its probe" in text and "quarantined" in text, text
        metrics = pair.prefill.metrics.snapshot()
        assert metrics["failovers"] == [{"from": pair.chosen, "to": pair.standby, "count": 2}], metrics
        assert metrics["lanes_back"] == [{"driver": pair.chosen, "count": 1}], metrics
        # the receiver fenced each failed generation under its own key
        fenced = pair.decode.drivers[pair.chosen]
        assert isinstance(fenced, FakeDriver)
        keys = set(fenced.fence_calls)
        assert pair.recv.id in keys and any("~" in k for k in keys), keys
    finally:
        pair.close()


def test_a_lane_that_flaps_comes_back_each_time_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight failures and returns of one lane on one connection: every request succeeds,
    byte-exact; each return is a new generation; nothing of the earlier ones stays known to
    either side's driver (each knows the peer by the live keys of its lanes alone) and the
    failover tables are empty between failures."""
    # each failure comes after a proven return: its back-off is the first one (here, at once)
    monkeypatch.setattr(failover, "FORGIVE_S", 0.0)
    monkeypatch.setattr(failover, "REOPEN_MIN_INTERVAL_S", 0.0)
    pair = Pair(tmp_path, "one-sided", quarantine=0.02)
    try:
        sender, receiver = _lane(pair.send, pair.chosen), _lane(pair.recv, pair.chosen)
        for cycle in range(8):
            pair.fault.write_text("cut")
            assert pair.round(f"cut{cycle}", [1 + cycle], [9 + cycle]) == pair.standby
            pair.fault.unlink()
            _until(lambda: not sender.broken)
            assert pair.round(f"back{cycle}", [2 + cycle], [10 + cycle]) == pair.chosen
            assert sender.gen == receiver.gen == cycle + 1 and not sender.probation
        for side, lane in ((pair.prefill, sender), (pair.decode, receiver)):
            driver = side.drivers[pair.chosen]
            assert isinstance(driver, FakeDriver)
            assert set(driver.peers) == {lane.key}, (side.name, set(driver.peers), lane.key)
            conn = pair.send if side is pair.prefill else pair.recv
            tables = conn._session.failover  # type: ignore[attr-defined]
            assert not tables.reopening and not tables.fencing and not tables._reopen_timers
        back = pair.prefill.metrics.snapshot()["lanes_back"]
        assert back == [{"driver": pair.chosen, "count": 8}], back
    finally:
        pair.close()


@pytest.mark.parametrize(("scenario", "quarantine"), [("two-sided", 0.05), ("one-sided", 0)])
def test_a_lane_that_is_not_taken_back_stays_out_of_its_connection(
    tmp_path: Path, scenario: str, quarantine: float
) -> None:
    """A two-sided lane is not taken back (its notices name no generation), nor any lane under
    ``KVTRANSPORT_QUARANTINE=0``."""
    pair = Pair(tmp_path, scenario, quarantine=quarantine)
    try:
        pair.fault.write_text("cut")
        assert pair.round("cut", [5, 6], [7, 8]) == pair.standby
        pair.fault.unlink()
        time.sleep(0.3)
        assert _lane(pair.send, pair.chosen).broken
        assert pair.round("later", [9, 10], [11, 12]) == pair.standby
    finally:
        pair.close()


def test_a_receiver_that_cannot_fence_the_failed_lane_ends_the_connection(tmp_path: Path) -> None:
    """The one-sided fake cannot promise that nothing of a live peer lands any more: the moved
    transfer does not succeed; the connection ends within the drain timeout (its pages are
    then held as for any peer lost)."""
    pair = Pair(tmp_path, receiver_options={})
    try:
        pair.fault.write_text("cut")
        t0 = time.monotonic()
        _, r = pair.start("t", [3, 4], [1, 2])
        with pytest.raises(KVTransportError, match="could not fence"):
            r.wait(10)
        assert time.monotonic() - t0 < FAST["drain"] + 2
    finally:
        pair.close()


def test_many_transfers_in_flight_all_move_once(pair: Pair) -> None:
    """Transfers in flight on the failing lane move together; each succeeds once."""
    pair.fault.write_text("cut")
    receivers = [pair.recv.expect(f"m{i}", [i]) for i in range(16)]
    senders = [pair.send.sender(f"m{i}") for i in range(16)]
    for i, t in enumerate(senders):
        while t.state is State.BOOTSTRAPPING:
            time.sleep(0.002)
        t.send([16 + i], last=True)
    assert [r.wait(10) for r in receivers] == [State.SUCCESS] * 16
    assert pair.pools[1].page_digests(list(range(16))) == pair.pools[0].page_digests(list(range(16, 32)))
    assert pair.prefill.metrics.snapshot()["failovers"][0]["count"] == 1  # one lane failed, once


def test_when_the_last_lane_fails_too_the_transfer_fails_and_the_lane_stays(pair: Pair) -> None:
    """After a failover the standby is the connection's last usable lane: a failure on it
    fails its transfer (nothing left to move to) but does not take it out, so the connection
    goes on over it once it works again (it never falls back on the fenced lane)."""
    pair.fault.write_text("cut")
    assert pair.round("moved", [1], [2]) == pair.standby
    pair.standby_fault.write_text("cut")
    pair.fails("lost", [4], [3])
    pair.standby_fault.unlink()
    pair.fault.unlink()
    assert pair.round("after", [5], [6]) == pair.standby


@pytest.mark.parametrize("armed", ["before-the-first-chunk", "between-the-chunks"])
def test_a_chunked_send_moves_every_chunk_sent_so_far_and_its_later_ones_follow(pair: Pair, armed: str) -> None:
    """A transfer sent in parts (SGLang's chunked prefill): the parts sent before the failure
    go again, in order, over the standby, and the parts sent after it go there too."""
    t, r = pair.start("c", None, [10, 11, 12, 13, 14, 15])
    if armed == "before-the-first-chunk":
        pair.fault.write_text("cut")
    t.send([1, 2], last=False)
    time.sleep(0.1)
    pair.fault.write_text("cut")
    t.send([3, 4], last=False)
    time.sleep(0.1)
    t.send([5, 6], last=True)
    assert t.wait(10) is State.SUCCESS and r.wait(10) is State.SUCCESS
    assert t.driver == r.driver == pair.standby
    assert pair.pools[1].page_digests([10, 11, 12, 13, 14, 15]) == pair.pools[0].page_digests([1, 2, 3, 4, 5, 6])
    assert t.sent_parts == [], "a final transfer keeps nothing to send again"


def test_a_lane_whose_completions_stop_fails_over_after_the_stall_timeout(pair: Pair) -> None:
    """No error, only silence (a black-holed rail): the transfer's lane finishes nothing for
    longer than the stall limit, so the transfer goes over the standby."""
    assert pair.round("before", [1], [2]) == pair.chosen
    pair.fault.write_text("stall")
    t0 = time.monotonic()
    assert pair.round("stalled", [3, 4], [5, 6]) == pair.standby
    assert time.monotonic() - t0 >= FAST["stall"]
    failovers = [{"from": pair.chosen, "to": pair.standby, "count": 1}]
    assert pair.prefill.metrics.snapshot()["failovers"] == failovers


def test_a_stall_without_a_lane_to_go_to_waits_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a standby the stall check does nothing: the transfer waits (for the transfer
    timeout, as ever), and completes when its completions come back."""
    monkeypatch.setenv("KVTRANSPORT_FAILOVER", "off")
    pair = Pair(tmp_path)
    try:
        pair.fault.write_text("stall")
        t, r = pair.start("t", [1], [2])
        time.sleep(5 * FAST["stall"])
        assert t.state is State.TRANSFERRING and r.state is not State.FAILED, (t.state, r.state)
        pair.fault.unlink()
        assert t.wait(10) is State.SUCCESS and r.wait(10) is State.SUCCESS
    finally:
        pair.close()


def test_without_a_standby_lane_the_transfer_fails_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTRANSPORT_FAILOVER", "off")
    pair = Pair(tmp_path)
    try:
        assert pair.send.decision is not None and pair.send.decision.standby == ()
        pair.fault.write_text("cut")
        pair.fails("t", [1], [2])
    finally:
        pair.close()


def test_a_forced_driver_has_no_standby() -> None:
    """KVTRANSPORT_DRIVER forces one driver: nothing else may carry the connection's bytes."""
    from kvtransport.negotiation.registry import Policy

    from .hellos import hello, host

    a = hello(host("a"), policy=Policy(failover="on"))
    b = hello(host("b"), policy=Policy(force="nixl-ucx", failover="on"))
    assert standby_lane(["nixl-ucx", "mooncake-gdr"], ("nixl-ucx",), a, b, across=True) == ""
    assert standby_lane(["nixl-ucx", "nixl-staged", "mooncake-gdr"], ("nixl-ucx",), a, a, across=True) == (
        "mooncake-gdr"  # another engine first
    )
    off = hello(host("a"), policy=Policy(failover="off"))
    assert standby_lane(["nixl-ucx", "mooncake-gdr"], ("nixl-ucx",), a, off, across=True) == ""
    auto = hello(host("a"))
    assert standby_lane(["nixl-ucx", "mooncake-gdr"], ("nixl-ucx",), auto, auto, across=False) == ""
    assert standby_lane(["nixl-ucx", "mooncake-gdr"], ("nixl-ucx",), auto, auto, across=True) == "mooncake-gdr"


# -- the real engines, between two processes ----------------------------------------------------

ENGINES = "mooncake-gdr+nixl-ucx"


@pytest.mark.parametrize("fault", ["error", "stall", "error-then-back"])
def test_real_engines_fail_over_between_processes_byte_exact(tmp_path: Path, fault: str) -> None:
    """mooncake-gdr and nixl-ucx between two processes (UCX over TCP, so that nixl-ucx's
    receive side can be fenced while the writer lives: docs/network.md): the driver carrying
    the connection fails (its batches raise, or their completions stop) in the middle of a
    batch of transfers; every one of them succeeds, byte-exact, over the other engine, and
    later ones too; once the failed one works again, it comes back from quarantine."""
    require_engines()
    faults = {name: tmp_path / f"{name}.fault" for name in ENGINES.split("+")}
    env = {**os.environ, "KVTRANSPORT_FAILOVER": "on", "UCX_TLS": "tcp,self"}
    options = json.dumps({f"faults.{n}": str(p) for n, p in faults.items()})
    args = ("--driver", ENGINES, "--pages", "72", "--layers", "4", "--item", "65536", "--aux-slots", "0")
    args += ("--private", "--options", options, "--timeouts", json.dumps(FAST))
    prefill = PeerProcess(*args, "--seed", "3", "--name", "prefill", env=env)
    decode = PeerProcess(*args, "--name", "decode", env=env)
    try:
        accepted: list[dict[str, object]] = []
        t = threading.Thread(target=lambda: accepted.append(prefill.call("accept", timeout=20)))
        t.start()
        decision = decode.call("connect", address=prefill.address, timeout=20)["decision"]
        t.join(20)
        assert accepted and "error" not in accepted[0], accepted
        chosen, standby = decision["driver"], decision["standby"]
        assert standby and decision["lanes"] == [chosen, *standby], decision

        def batch(name: str, pages: range) -> dict[str, list[str]]:
            tags = {f"{name}{i}": [p] for i, p in enumerate(pages)}
            decode.call("expect", transfers={t: [p + 36 - pages.start] for t, (p,) in tags.items()})
            prefill.call("send", transfers={t: [pp] for t, pp in tags.items()})
            states = decode.call("wait", tags=list(tags), timeout=30)["states"]
            return states

        states = batch("warm", range(0, 4))
        assert all(s[0] == "SUCCESS" for s in states.values()), states
        faults[chosen].write_text("stall" if fault == "stall" else "cut")  # from now on
        states = batch("cut", range(4, 36))
        assert all(s[0] == "SUCCESS" for s in states.values()), states
        assert (
            decode.call("digests", pages=list(range(36, 68)))["digests"]
            == prefill.call("digests", pages=list(range(4, 36)))["digests"]
        )
        taken = prefill.call("taken", tags=[f"cut{i}" for i in range(32)])["taken"]
        assert {d for d, *_ in taken.values()} == set(standby), taken
        if fault == "error-then-back":
            # back: after its quarantine the lane is offered back (new receive sides on both
            # ends), probed by a transfer, and carries the connection's transfers again
            faults[chosen].unlink()
            deadline, rounds = time.monotonic() + 20, 0
            while True:
                rounds += 1
                states = batch(f"later{rounds}-", range(36, 38))
                assert all(s[0] == "SUCCESS" for s in states.values()), states
                taken = prefill.call("taken", tags=[f"later{rounds}-{i}" for i in range(2)])["taken"]
                if {d for d, *_ in taken.values()} == {chosen}:
                    break
                assert time.monotonic() < deadline, f"{chosen} never came back: {taken}"
                time.sleep(0.2)
            assert (
                decode.call("digests", pages=list(range(36, 38)))["digests"]
                == prefill.call("digests", pages=list(range(36, 38)))["digests"]
            )
            back = prefill.call("metrics")["metrics"]["lanes_back"]
            assert back == [{"driver": chosen, "count": 1}], back
        metrics = prefill.call("metrics")["metrics"]["failovers"]
        assert metrics == [{"from": chosen, "to": standby[0], "count": 1}], metrics
    finally:
        prefill.close()
        decode.close()


# -- quarantine: the races an independent review found --------------------------------------------


def _on_io(conn: object, fn: Callable[[], object]) -> object:
    """``fn`` on the connection's I/O thread; its result (or its exception, raised here)."""
    session = conn._session  # type: ignore[attr-defined]
    done = threading.Event()
    box: list[object] = []

    def go() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            box.append(exc)
        finally:
            done.set()

    session.post(go)
    assert done.wait(5)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _message(kind: str, **fields: Any) -> Any:
    from kvtransport.runtime.wire import decode, encode

    return decode(encode(kind, None, **fields))


def _declare_down(conn: object, name: str) -> None:
    """What a failing transfer of that side does to the lane ``name`` (``Failover.transfer_failed``)."""
    session = conn._session  # type: ignore[attr-defined]
    lane = session.lanes[name]

    def down() -> None:
        session.failover.failed_lanes.append(name)
        session.failover._count_failure(lane)
        lane.fail_over()
        session.send("lane_down", lane="", gen=lane.gen, reason="this side's own failure")
        session.failover._quarantine(lane)

    _on_io(conn, down)


def test_a_lane_both_sides_saw_fail_comes_back_once_offered_by_the_initiator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both sides declared the lane down (each sends on the connection): only the initiator
    offers it back, so no two offers cross; it comes back on both sides, each side's driver
    knowing the peer by the lane's key alone."""
    monkeypatch.setattr(failover, "REOPEN_MIN_INTERVAL_S", 0.0)
    pair = Pair(tmp_path, "one-sided", quarantine=0.3)
    try:
        assert pair.recv._session.initiator and not pair.send._session.initiator  # type: ignore[attr-defined]
        pair.fault.write_text("cut")
        assert pair.round("cut", [5, 6], [7, 8]) == pair.standby
        pair.fault.unlink()
        _declare_down(pair.recv, pair.chosen)
        sender, receiver = _lane(pair.send, pair.chosen), _lane(pair.recv, pair.chosen)
        assert not pair.send._session.failover._reopen_timers  # type: ignore[attr-defined]
        _until(lambda: not sender.broken and not receiver.broken)
        assert pair.round("back", [1, 2], [3, 4]) == pair.chosen
        for side, lane in ((pair.prefill, sender), (pair.decode, receiver)):
            driver = side.drivers[pair.chosen]
            assert isinstance(driver, FakeDriver) and set(driver.peers) == {lane.key}, (side.name, driver.peers)
    finally:
        pair.close()


def test_a_second_offer_while_one_is_answered_is_a_violation(tmp_path: Path) -> None:
    from kvtransport.spi.errors import ProtocolError

    pair = Pair(tmp_path, "one-sided", quarantine=30)  # the initiator's own offer comes much later
    try:
        pair.fault.write_text("cut")
        assert pair.round("cut", [5, 6], [7, 8]) == pair.standby
        sender = _lane(pair.send, pair.chosen)
        accepting = pair.send._session.failover  # type: ignore[attr-defined]
        first, second = (_message("lane_reopen", lane="", gen=g, info=b"") for g in (1, 2))
        time.sleep(failover.REOPEN_MIN_INTERVAL_S)
        with pytest.raises(ProtocolError, match="previous offer"):
            _on_io(pair.send, lambda: (accepting.on_lane_reopen(first), accepting.on_lane_reopen(second)))
        _until(lambda: not sender.broken)  # the first one answered
        driver = pair.prefill.drivers[pair.chosen]
        assert isinstance(driver, FakeDriver) and set(driver.peers) == {sender.key}, driver.peers
        with pytest.raises(ProtocolError, match="only the connection's initiator"):
            _on_io(pair.recv, lambda: pair.recv._session.failover.on_lane_reopen(second))  # type: ignore[attr-defined]
    finally:
        pair.close()


def test_the_peers_lane_down_during_an_offer_is_fenced_with_its_done_held(tmp_path: Path) -> None:
    """The initiator declared the lane down and its offer's steps are fencing its receive side
    when the peer's own "lane_down" comes: the offer is void, and the peer's word goes through
    the fence as ever (its "done"s held until it is done), not dropped."""
    pair = Pair(tmp_path, "one-sided", quarantine=30)
    try:
        _declare_down(pair.recv, pair.chosen)
        receiver = _lane(pair.recv, pair.chosen)
        tables = pair.recv._session.failover  # type: ignore[attr-defined]
        driver = pair.decode.drivers[pair.chosen]
        assert isinstance(driver, FakeDriver)
        slow = threading.Event()
        fence = driver.fence

        def slow_fence(peer: str) -> bool:
            slow.wait(0.3)
            return fence(peer)

        driver.fence = slow_fence  # type: ignore[method-assign]
        _on_io(pair.recv, lambda: tables._reopen(receiver))
        _on_io(pair.recv, lambda: tables.on_lane_down(_message("lane_down", lane="", gen=0, reason="peer's")))
        assert pair.chosen in tables.fencing and pair.chosen not in tables.reopening
        slow.set()
        _until(lambda: pair.chosen in tables.fenced and not tables.fencing)
    finally:
        pair.close()
