"""Pacing (issue 47, item 3): a large part goes to its lane's driver in slices, so that small
transfers on the same connection pass between them instead of waiting for its last byte.

The slicing (hypothesis: every byte mapped once, in order, within the bound), the pacer's
choices (its budget, a transfer's order, shortest remaining first with aging, forgetting a
transfer), a sliced transfer end to end under the fakes (bytes verified, also when its lane
fails half-way and it moves), and the head-of-line property on real engines between two
processes: twenty small requests issued right after a large one on the same connection finish
long before it does, compared within the run.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.runtime import pacing
from kvtransport.runtime.config import Limits
from kvtransport.runtime.pacing import Pacer, cut, slice_size
from kvtransport.spi.plan import Runs
from kvtransport.tools.peer_process import PeerProcess

from .conftest import require_engines
from .test_failover import Pair

# -- cutting ------------------------------------------------------------------------------------


def _bytes_of(runs: Runs) -> list[tuple[int, int]]:
    """Every byte's (source, destination) address, in order."""
    out: list[tuple[int, int]] = []
    for s, d, n in zip(*runs.lists(), strict=True):
        out.extend((s + i, d + i) for i in range(n))
    return out


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    gaps=st.lists(st.integers(0, 50), min_size=40, max_size=40),
    limit=st.integers(1, 400),
    as_lists=st.booleans(),
)
def test_slices_map_every_byte_once_in_order_each_under_twice_the_limit(
    lengths: list[int], gaps: list[int], limit: int, as_lists: bool
) -> None:
    src, dst, at_s, at_d = [], [], 1000, 50_000
    for n, gap in zip(lengths, gaps, strict=False):
        src.append(at_s)
        dst.append(at_d)
        at_s += n + gap
        at_d += n + 3 * gap
    if as_lists:
        runs = Runs.of_lists(src, dst, list(lengths))
    else:
        runs = Runs(np.array(src, np.uint64), np.array(dst, np.uint64), np.array(lengths, np.uint64))
    slices = cut(runs, limit)
    assert [b for s in slices for b in _bytes_of(s)] == _bytes_of(runs)
    assert sum(s.total_bytes for s in slices) == runs.total_bytes
    if runs.total_bytes <= limit:
        assert slices == [runs]
    else:
        assert all(0 < s.total_bytes < 2 * limit for s in slices), [s.total_bytes for s in slices]
        assert all(int(n) <= limit for s in slices for n in s.length)


def test_slice_size_follows_the_lanes_rate_within_its_bounds() -> None:
    floor = 8 << 20
    assert slice_size(floor, 0.004, 0.0) == 2 * floor  # no rate yet
    assert slice_size(floor, 0.004, 1e9) == floor  # 4 MB in 4 ms: the floor
    assert slice_size(floor, 0.004, 10e9) == 40_000_000
    assert slice_size(floor, 0.004, 1e12) == pacing.MAX_SLICE_FACTOR * floor
    assert slice_size(floor, 0.0, 10e9) == floor  # KVTRANSPORT_SLICE_MS=0


# -- the pacer's choices ----------------------------------------------------------------------------


class _Lane:
    """What a pacer drives: submissions recorded, transfers live until said otherwise."""

    def __init__(self, in_flight: int = 2, limit: int = 100) -> None:
        self.sent: list[tuple[str, int, bool, int]] = []
        self.dead: set[str] = set()
        self.ids = iter(range(1, 1 << 30))
        self.pending: set[tuple[object, int]] = set()  # parts with a slice waiting or in the driver
        self.pacer = Pacer(
            self.submit,
            lambda t: t not in self.dead,
            lambda: next(self.ids),
            lambda: limit,
            in_flight,
            lambda t, token: self.pending.discard((t, token)),
        )

    def add(self, t: str, runs: Runs, last: bool) -> int:
        token = next(self.ids)
        self.pending.add((t, token))
        self.pacer.add(t, runs, last, token)
        return token

    def submit(self, t: object, runs: Runs, last: bool, bid: int) -> bool:
        self.sent.append((str(t), runs.total_bytes, last, bid))
        return True


def _runs(nbytes: int, at: int = 0) -> Runs:
    return Runs.of_lists([at], [at + (1 << 20)], [nbytes])


def test_the_pacer_keeps_its_budget_and_each_transfers_order() -> None:
    lane = _Lane(in_flight=2, limit=100)
    p = lane.pacer
    assert p.takes("big", 450) and not p.takes("small", 100)
    first = lane.add("big", _runs(450), last=False)
    assert [s[:3] for s in lane.sent] == [("big", 100, False), ("big", 100, False)]
    # a small part of the same transfer queues behind its slices, and alone carries "last"
    assert p.takes("big", 10)
    second = lane.add("big", _runs(10, 5000), last=True)
    assert lane.pending == {("big", first), ("big", second)}
    assert p.waiting == 4 and p.in_flight == 2
    for _ in range(10):
        if not lane.sent or p.in_flight == 0:
            break
        p.finished(lane.sent[-2][3] if p.in_flight == 2 else lane.sent[-1][3])
    sent = [s[:3] for s in lane.sent]
    assert sent == [("big", 100, False)] * 4 + [("big", 50, False), ("big", 10, True)], sent
    p.finished(lane.sent[-1][3])
    p.finished(lane.sent[-2][3])
    assert p.in_flight == 0 and p.waiting == 0 and not p.takes("big", 10)
    assert not lane.pending, "a part all of whose slices finished is still pending"


def test_shortest_remaining_goes_first_and_waiting_makes_a_transfer_shorter(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(pacing.time, "monotonic", lambda: now[0])
    lane = _Lane(in_flight=1, limit=100)
    lane.add("long", _runs(1000), last=True)  # its first slice goes at once
    lane.add("short", _runs(300, 9000), last=True)
    lane.pacer.finished(lane.sent[-1][3])
    assert lane.sent[-1][0] == "short"  # 300 left against 900
    aged = _Lane(in_flight=1, limit=100)
    aged.add("long", _runs(1000), last=True)
    now[0] += 10.0  # "long" has waited 10 s: it counts as 10 GiB shorter than its 900 bytes
    aged.add("short", _runs(300, 9000), last=True)
    aged.pacer.finished(aged.sent[-1][3])
    assert aged.sent[-1][0] == "long", aged.sent


def test_a_forgotten_or_ended_transfer_frees_its_budget() -> None:
    lane = _Lane(in_flight=2, limit=100)
    p = lane.pacer
    lane.add("a", _runs(1000), last=True)
    lane.add("b", _runs(1000, 9000), last=True)
    assert {s[0] for s in lane.sent} == {"a"} and p.in_flight == 2
    p.forget("a")  # moved, or aborted: its batches will report nothing
    assert [s[0] for s in lane.sent[2:]] == ["b", "b"]
    lane.dead.add("b")  # ended: found at the next feed
    lane.add("c", _runs(250, 30000), last=True)
    assert [s[0] for s in lane.sent[4:]] == ["c", "c"] and p.waiting == 1
    assert {t for t, _ in lane.pending} == {"c"}  # a's and b's parts are done with


# -- end to end under the fakes -------------------------------------------------------------------

SLICED = Limits(slice_bytes=8192, slice_ms=0, slices_in_flight=2)


def test_a_sliced_transfer_arrives_whole_and_small_ones_pass_it(tmp_path: Path) -> None:
    pair = Pair(tmp_path, "one-sided", limits=SLICED, driver_options={"fake.delay": "0.01"})
    try:
        big = pair.start("big", list(range(24)), list(range(24)))  # 24 pages x 2 layers x 4 KiB
        small = [pair.start(f"s{i}", [24 + i], [24 + i]) for i in range(4)]
        for t, r in [big, *small]:
            assert t.wait(10).name == "SUCCESS" and r.wait(10).name == "SUCCESS"
        assert pair.pools[1].page_digests(list(range(28))) == pair.pools[0].page_digests(list(range(28)))
        assert max(t.finished for t, _ in small) < big[0].finished, "the small transfers waited for the big one"
        fake = pair.prefill.drivers[pair.chosen]
        assert fake.submitted >= 24 * 2 * 4096 // (2 * 8192) + 4, fake.submitted  # it went in slices
    finally:
        pair.close()


def test_a_sliced_transfer_moves_whole_when_its_lane_fails_half_way(tmp_path: Path) -> None:
    pair = Pair(tmp_path, "one-sided", limits=SLICED, driver_options={"fake.delay": "0.02"})
    try:
        t, r = pair.start("big", None, list(range(24)))

        def arm() -> None:
            time.sleep(0.05)  # a few slices in
            pair.fault.write_text("cut")

        arming = threading.Thread(target=arm)
        arming.start()
        t.send(list(range(24)), last=True)
        arming.join()
        assert t.wait(10).name == "SUCCESS" and r.wait(10).name == "SUCCESS"
        assert t.driver == pair.standby and t.failovers == 1
        assert pair.pools[1].page_digests(list(range(24))) == pair.pools[0].page_digests(list(range(24)))
    finally:
        pair.close()


# -- head-of-line blocking, on the real engines between two processes -------------------------------

BIG, SMALL, COUNT = 1024, 8, 20  # pages of 4 layers x 64 KiB: 256 MiB, then twenty of 2 MiB


@pytest.mark.parametrize("driver", ["nixl-ucx", "mooncake-gdr", "mooncake-staged"])
def test_small_requests_do_not_wait_for_a_large_one_on_the_same_connection(driver: str) -> None:
    """Twenty 2 MiB requests issued right after a 256 MiB one on the same connection: every
    byte arrives, and the small ones' median time to the decode side's Success is under a
    third of the large one's (sent whole, they all waited for its last byte)."""
    require_engines()
    pages = BIG + COUNT * SMALL
    args = ("--driver", driver, "--pages", str(pages), "--layers", "4", "--item", "65536", "--aux-slots", "0")
    prefill = PeerProcess(*args, "--private", "--seed", "5", "--name", "prefill")
    decode = PeerProcess(*args, "--private", "--name", "decode")
    try:
        accepted: list[dict[str, Any]] = []
        t = threading.Thread(target=lambda: accepted.append(prefill.call("accept", timeout=30)))
        t.start()
        decode.call("connect", address=prefill.address, timeout=30)
        t.join(30)
        assert accepted and "error" not in accepted[0], accepted
        ratios = []
        for rnd in range(2):  # the first round warms the engines up
            tags = {f"{rnd}big": list(range(BIG))}
            tags |= {f"{rnd}s{i}": list(range(BIG + i * SMALL, BIG + (i + 1) * SMALL)) for i in range(COUNT)}
            decode.call("expect", transfers=tags)
            start = time.monotonic()  # (one clock for every process of the host)
            prefill.call("send", transfers={tag: [p] for tag, p in tags.items()})
            ended = decode.call("wait", tags=list(tags), timeout=120)
            assert all(s[0] == "SUCCESS" for s in ended["states"].values()), ended["states"]
            small = statistics.median(ended["finished"][f"{rnd}s{i}"] - start for i in range(COUNT))
            ratios.append(small / (ended["finished"][f"{rnd}big"] - start))
        assert (
            decode.call("digests", pages=list(range(pages)))["digests"]
            == (prefill.call("digests", pages=list(range(pages)))["digests"])
        )
        assert ratios[-1] < 1 / 3, f"the small requests took {ratios} of the large one's time"
    finally:
        prefill.close()
        decode.close()


# -- the races an independent review found ----------------------------------------------------------


def test_two_threads_feeding_one_lane_keep_a_transfers_slices_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller thread taken off the CPU between taking a slice off the queue and handing it
    over, while another transfer's caller feeds the same lane: the first transfer's slices
    still reach the driver in order, and both arrive whole."""
    from kvtransport.runtime.session import Session

    submit = Session._submit_slice
    order: list[tuple[str, bool]] = []

    def slow(self: Session, lane: Any, transfer: Any, runs: Runs, last: bool, bid: int) -> bool:
        if threading.current_thread().name == "slow-caller" and not order:
            time.sleep(0.2)
        order.append((transfer.tag, last))
        return submit(self, lane, transfer, runs, last, bid)

    monkeypatch.setattr(Session, "_submit_slice", slow)
    pair = Pair(tmp_path, "one-sided", limits=SLICED)
    try:
        t, r = pair.start("big", None, list(range(4)))
        u, ru = pair.start("u", None, list(range(8, 20)))
        caller = threading.Thread(target=lambda: t.send(list(range(4)), last=True), name="slow-caller")
        caller.start()
        time.sleep(0.05)
        u.send(list(range(8, 20)), last=True)
        caller.join()
        for handle in (t, r, u, ru):
            assert handle.wait(10).name == "SUCCESS", (handle, handle.error)
        big = [last for tag, last in order if tag == "big"]
        assert big and big[-1] and not any(big[:-1]), order  # "last" on the last slice handed over
        assert pair.pools[1].page_digests(list(range(4)) + list(range(8, 20))) == pair.pools[0].page_digests(
            list(range(4)) + list(range(8, 20))
        )
    finally:
        pair.close()


def test_a_layerwise_stream_is_settled_only_once_its_sliced_groups_landed(tmp_path: Path) -> None:
    from kvtransport.testing.conformance import EVERY_LAYER

    pair = Pair(tmp_path, "one-sided", limits=SLICED, driver_options={"fake.delay": "0.2"})
    try:
        t, r = pair.start("lw", None, list(range(24)))
        stream = t.send_layerwise(list(range(24)), policy=EVERY_LAYER)
        for layer in range(stream.num_layers):
            stream.layer_ready(layer)
        assert all(g.batch for g in stream.groups)
        time.sleep(0.05)
        assert not stream.settled, "settled while the groups' slices are still in the driver"
        assert t.wait(10).name == "SUCCESS" and r.wait(10).name == "SUCCESS"
        assert stream.settled and not t.paced
        assert pair.pools[1].page_digests(list(range(24))) == pair.pools[0].page_digests(list(range(24)))
    finally:
        pair.close()


def test_an_empty_last_part_behind_slices_reaches_no_driver(tmp_path: Path) -> None:
    pair = Pair(tmp_path, "one-sided", limits=SLICED, driver_options={"fake.delay": "0.02"})
    try:
        driver = pair.prefill.drivers[pair.chosen]
        seen: list[int] = []
        submit = driver.submit

        def recording(peer: str, runs: Runs) -> int:
            seen.append(len(runs))
            return submit(peer, runs)

        driver.submit = recording  # type: ignore[method-assign]
        t, r = pair.start("big", None, list(range(6)))
        t.send(list(range(6)), last=False)
        t.send([], last=True)
        assert t.wait(10).name == "SUCCESS" and r.wait(10).name == "SUCCESS"
        assert seen and 0 not in seen, seen
    finally:
        pair.close()


def test_a_layerwise_stream_is_not_settled_while_a_group_waits_for_its_driver(tmp_path: Path) -> None:
    """A group handed to a busy driver's thread, not yet submitted (its source pages not yet
    read): the stream is not settled until the driver took it and it landed."""
    from kvtransport.testing.conformance import EVERY_LAYER

    pair = Pair(tmp_path, "one-sided", driver_options={"fake.delay": "0.05"})
    try:
        driver = pair.prefill.drivers[pair.chosen]
        submit, busy = driver.submit, threading.Event()

        def slow_first(peer: str, runs: Runs) -> int:
            if not busy.is_set():
                busy.set()
                time.sleep(0.3)  # the driver's thread busy: the next groups wait behind it
            return submit(peer, runs)

        driver.submit = slow_first  # type: ignore[method-assign]
        t, r = pair.start("lw", None, list(range(24)))
        stream = t.send_layerwise(list(range(24)), policy=EVERY_LAYER)
        for layer in range(stream.num_layers):
            stream.layer_ready(layer)
        assert busy.wait(5) and stream.complete
        assert not stream.settled, "settled while its groups wait for the driver's thread"
        assert t.wait(10).name == "SUCCESS" and r.wait(10).name == "SUCCESS"
        assert stream.settled
    finally:
        pair.close()
