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
"""

from __future__ import annotations

import collections
import logging
import statistics
from typing import TYPE_CHECKING

from kvtransport.negotiation.cost_model import CostModel, slowest_prediction

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


class Lane:
    def __init__(
        self,
        name: str,
        driver: KVTransport,
        runner: DriverRunner,
        peer_info: bytes,
        models: tuple[CostModel, ...] = (),
    ) -> None:
        self.name = name
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

    def __repr__(self) -> str:
        return f"<Lane {self.name}>"

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
