"""One driver a connection can move transfers over, and how well its cost model predicts them.

A :class:`~kvtransport.runtime.session.Session` has one lane per driver of its decision's ``lanes``
(the chosen driver alone unless the two sides' drivers carry measured cost models). Each lane
owns the open driver, its runner, the peer's connection info for it, the batches it has in the
driver (touched only on its runner's thread), and a running check of its predictions: when the
median of its recent transfers' measured over predicted times leaves [1/2, 2], its predictions
are scaled by that median for this connection (demoted when slower, promoted when faster; one
WARNING per lane and connection), and unscaled once the median is back within [2/3, 1.5]. A
demoted lane is picked less, so it may stay scaled for the rest of the connection; a new
connection, or a new calibration, starts afresh.

A lane whose model is nominal (an uncalibrated connection between two hosts, see
:func:`kvtransport.negotiation.negotiate.learning_lanes`) *learns*: until each such lane has
measured :data:`MIN_SAMPLES` whole transfers, whole transfers go to the least-measured one
(:meth:`LanePicker.explore`), and from then on its predictions are scaled by the median of its measured
over predicted times, however close to 1, so that transfers go to the lane that measures
fastest; one in :data:`REVISIT_EVERY` whole transfers goes to the lane measured longest ago,
so a lane that got faster (or a link that changed) is noticed, among the lanes not far slower
than the best. A learning lane whose connect or a transfer on it failed is not used again on
that connection (:meth:`Lane.failed`).
"""

from __future__ import annotations

import collections
import logging
import statistics
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtransport.negotiation.cost_model import NOMINAL, CostModel, slowest_prediction

if TYPE_CHECKING:
    from kvtransport.runtime.runner import DriverRunner
    from kvtransport.spi.driver import KVTransport

log = logging.getLogger(__name__)

#: Transfers whose measured/predicted ratios the check keeps, and how many it needs first.
RATIO_WINDOW = 16
MIN_SAMPLES = 4
#: How far off (as a factor either way) a median ratio may be before predictions are scaled,
#: and how close it must come back before they are unscaled (a gap, so a median hovering at
#: the edge does not flip the lane, and its log lines, at every transfer).
FAR_OFF = 2.0
BACK_IN = 1.5
#: A learning connection sends one whole transfer in this many to the lane measured longest ago
#: among those within FAR_OFF of the best, judged on a reference transfer of this shape.
REVISIT_EVERY = 32
REFERENCE_RUNS, REFERENCE_BYTES = 64, 64 << 20


#: Between a connection's id and the number of a lane's later generation in the key its
#: driver knows the peer by (connection ids never hold it: ``wire.ConnId``).
KEY_SEPARATOR = "~"


def generation_key(conn_id: str, n: int) -> str:
    """The driver key of a connection's lane in its ``n``-th new generation (``n`` >= 1)."""
    return f"{conn_id}{KEY_SEPARATOR}{n}"


def connection_of(key: str) -> str:
    """The connection id a driver key (``generation_key``, or the id itself) belongs to."""
    return key.partition(KEY_SEPARATOR)[0]


class Lane:
    def __init__(
        self,
        name: str,
        driver: KVTransport,
        runner: DriverRunner,
        peer_info: bytes,
        models: tuple[CostModel, ...] = (),
        *,
        chosen: bool = False,
        standby: bool = False,
        key: str = "",
    ) -> None:
        self.name = name
        #: What this side's driver knows the peer by for this lane (``peer`` of its calls): the
        #: connection's id, then a new one each time the lane comes back from quarantine
        #: (``runtime.failover``: the receive side of the failed generation stays fenced).
        #: Written on the I/O thread only while the lane is out (no transfer takes it), read by
        #: the driver's and callers' threads.
        self.key = key
        #: The generation of ``key`` (0: the handshake's), and the highest either side offered.
        self.gen = 0
        self.gen_offered = 0
        #: Failures of this lane in a row (the quarantine's back-off doubles with each), and when
        #: it came back last (I/O thread).
        self.failures = 0
        self.back_at = 0.0
        #: When it last failed over (I/O thread; a peer's offer to take it back comes after).
        self.down_at = 0.0
        #: Back from quarantine, not yet proven: it takes one transfer at a time (the probe)
        #: until a batch of it finished; ``canary`` is that transfer (or a claim on the lane by
        #: a caller thread picking it, under ``canary_lock``).
        self.probation = False
        self.canary: object | None = None
        self.canary_lock = threading.Lock()
        self.driver = driver
        self.runner = runner
        self.peer_info = peer_info
        self.models = models
        self.two_sided = type(driver).capabilities.two_sided
        self.connect_queued = False
        # driver thread only: batch id -> (driver handle, its transfer), and the handles whose
        # poll raised, by transfer (their writes may still be finishing)
        self.handles: dict[int, tuple[int, object]] = {}
        self.failed_handles: dict[object, list[int]] = {}
        #: I/O thread: measured / predicted of this connection's recent transfers on the lane.
        self.ratios: collections.deque[float] = collections.deque(maxlen=RATIO_WINDOW)
        #: Read by caller threads when they pick a lane (a float is replaced atomically).
        self.correction = 1.0
        self.warned = False
        #: Whether its model is nominal: it learns its cost from this connection's transfers.
        self.learning = any(m.version == NOMINAL for m in models)
        #: Whether it is the handshake's chosen driver: never dropped (the connection's fate is
        #: its own), so a connection always has a lane to send on.
        self.chosen = chosen
        #: Kept only to fail over to: no transfer takes it while another lane is usable.
        self.standby = standby
        #: A learning lane that failed (its connect, or a transfer on it): no transfer is sent
        #: on it again for this connection (set on the I/O thread, read by caller threads).
        self.broken = False
        #: Whole transfers sent to it to be measured (caller threads, under the picker's lock),
        #: and the picker's count when it last took a whole transfer.
        self.explored = 0
        self.last_picked = 0
        #: I/O thread: when a batch on it last finished for this connection (failover's stall
        #: check: a lane that finishes nothing for long while its transfers wait has failed).
        self.last_progress = 0.0
        #: I/O thread: bytes per second of this connection's recent whole transfers on it, from
        #: submission to completion (queueing included: an underestimate, so a generous limit).
        self.observed_bps: collections.deque[float] = collections.deque(maxlen=RATIO_WINDOW)

    def __repr__(self) -> str:
        return f"<Lane {self.name}>"

    def failed(self, why: str, peer: str) -> None:
        """I/O thread: a transfer on this lane failed (or its connect did). A lane kept only to
        learn from is not tried again on this connection; the chosen driver's lane stays (the
        connection's fate is its own)."""
        if (self.learning or self.standby) and not self.chosen and not self.broken:
            self.broken = True
            log.warning("%s: not used again for %s on this connection: %s", self.name, peer, why)

    def fail_over(self) -> bool:
        """I/O thread: a transfer on this lane failed over to another (``runtime.failover``):
        no transfer is sent on it again, the chosen driver's included (the receiving side fences
        it), until it comes back from quarantine. Whether it was usable until now."""
        was = not self.broken
        if was:
            self.down_at = time.monotonic()
        self.broken = True
        with self.canary_lock:
            self.probation = False
            self.canary = None
        return was

    def back(self, key: str, gen: int, peer_info: bytes) -> None:
        """I/O thread: back from quarantine as generation ``gen``, its driver knowing the peer
        by ``key``: on probation (:meth:`claim_probe`) until a transfer of it passed."""
        self.key, self.gen, self.peer_info = key, gen, peer_info
        self.back_at = time.monotonic()
        with self.canary_lock:
            self.probation = True
            self.canary = None
        self.broken = False

    def proven(self) -> None:
        """I/O thread: a batch of its probe finished: every transfer may take it again."""
        with self.canary_lock:
            self.probation = False
            self.canary = None

    def claim_probe(self, claim: object) -> bool:
        """Any thread: whether a transfer may go on this lane now: always once proven; while
        on probation, only when no other transfer probes it (then ``claim`` does)."""
        if not self.probation:
            return True
        with self.canary_lock:
            if self.canary is not None or not self.probation:
                return not self.probation
            self.canary = claim
            return True

    def probing(self) -> bool:
        """Any thread: on probation with its probe in flight (no other transfer takes it)."""
        return self.probation and self.canary is not None

    def observed_seconds(self, nbytes: int) -> float:
        """Seconds ``nbytes`` took on this lane, at the median of its observed rates (0: none
        observed yet on this connection)."""
        if not self.observed_bps:
            return 0.0
        return nbytes / statistics.median(self.observed_bps)

    def raw_prediction(self, runs: int, nbytes: int) -> float:
        """Seconds the slower side's model gives (0 without a model)."""
        return slowest_prediction(self.models, runs, nbytes)

    def predict(self, runs: int, nbytes: int) -> float:
        return self.raw_prediction(runs, nbytes) * self.correction

    def observe(self, predicted: float, measured: float, peer: str) -> None:
        """I/O thread: a transfer the models predicted at ``predicted`` s (uncorrected) took
        ``measured`` s; rescale the predictions when they are far off, and say so once."""
        if predicted <= 0 or measured <= 0:
            return
        self.ratios.append(measured / predicted)
        if len(self.ratios) < MIN_SAMPLES:
            return
        median = statistics.median(self.ratios)
        if self.learning:
            if self.correction == 1.0:
                log.info(
                    "%s: learned its cost towards %s from %d transfers: %.2gx its nominal estimate",
                    self.name,
                    peer,
                    len(self.ratios),
                    median,
                )
            self.correction = median
            return
        was_off = self.correction != 1.0
        band = BACK_IN if was_off else FAR_OFF
        off = not 1 / band <= median <= band
        self.correction = median if off else 1.0
        if off and not self.warned:
            # Once per lane and connection: many peers must not turn this into a log flood.
            self.warned = True
            log.warning(
                "%s: transfers to %s take %.2gx what its calibrated model predicts (median of %d); %s for this "
                "connection, its predictions scaled by that factor (kvtransport calibrate measures it again)",
                self.name,
                peer,
                median,
                len(self.ratios),
                "demoted" if median > 1 else "promoted",
            )
        elif was_off and not off:
            log.debug("%s: predictions for %s agree with measurements again", self.name, peer)


class LanePicker:
    """Which lane a whole transfer of a learning connection goes to (any thread): one not yet
    measured enough first, then, every :data:`REVISIT_EVERY` transfers, the one that took a
    whole transfer longest ago; ``None``: the lowest prediction decides (then :meth:`picked`)."""

    def __init__(self, lanes: Sequence[Lane]) -> None:
        self._learning = [lane for lane in lanes if lane.learning]
        self._lock = threading.Lock()
        self._count = 0

    def explore(self) -> Lane | None:
        if len(self._learning) < 2:
            return None
        with self._lock:
            self._count += 1
            n = self._count
            # (a lane whose transfers never come back measured stops being tried after a while)
            usable = [lane for lane in self._learning if not lane.broken]
            unmeasured = [lane for lane in usable if len(lane.ratios) < MIN_SAMPLES and lane.explored < 2 * MIN_SAMPLES]
            if unmeasured:
                lane = min(unmeasured, key=lambda lane: (lane.explored, len(lane.ratios)))
            elif n % REVISIT_EVERY == 0 and (near := self._near_the_best(usable)):
                lane = min(near, key=lambda lane: lane.last_picked)
            else:
                return None
            lane.explored += 1
            lane.last_picked = n
            return lane

    @staticmethod
    def _near_the_best(lanes: list[Lane]) -> list[Lane]:
        """The lanes worth a revisit: measured within :data:`FAR_OFF` of the best lane's
        learned cost for a reference transfer (a far slower one would only cost its request)."""
        costs = {lane.name: lane.predict(REFERENCE_RUNS, REFERENCE_BYTES) for lane in lanes if lane.ratios}
        if not costs:
            return []
        best = min(costs.values())
        return [lane for lane in lanes if lane.name in costs and costs[lane.name] <= FAR_OFF * best]

    def picked(self, lane: Lane) -> None:
        """A whole transfer went to ``lane`` by its prediction."""
        lane.last_picked = self._count
