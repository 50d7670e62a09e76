"""A driver's measured cost: fixed latency per batch, cost per descriptor, bandwidth.

``kvtransport calibrate`` fits a :class:`CostModel` per driver and path from transfers of known
shape (:func:`fit`); the hello carries the models, and the negotiation predicts with them
(:meth:`CostModel.predict`) which driver moves a transfer of a given shape (descriptor count,
bytes) soonest. A peer's models arrive in its hello, so :meth:`CostModel.from_dict` checks every
field's type and range (``schema.CostModelDoc``) before anything computes with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np
from msgspec import Meta

# The bounds are the schema's (a peer's hello cannot make a prediction overflow, go negative or
# come out NaN); re-exported for the calibration's own checks.
from kvtransport.negotiation.schema import (
    MAX_GBPS,
    MAX_LATENCY_S,
    MAX_MODELS_PER_DRIVER,
    MAX_PER_RUN_S,
    MAX_TEXT,
    MIN_GBPS,
    CostModelDoc,
    parse,
)

__all__ = [
    "MAX_GBPS",
    "MAX_LATENCY_S",
    "MAX_MODELS_PER_DRIVER",
    "MAX_PER_RUN_S",
    "MAX_TEXT",
    "MIN_GBPS",
    "CostModel",
    "Point",
    "fit",
    "models_from_list",
    "slowest_prediction",
    "NOMINAL",
]


#: The ``version`` of a model made from a driver's nominal estimate for a connection to learn
#: from (negotiate.nominal_model): never measured, never saved.
NOMINAL = "nominal"


@dataclass(frozen=True)
class CostModel:
    """What moving one batch costs on one driver and path, between this host and ``peer_host``
    (this host's own id for a loopback calibration)."""

    path: str
    latency_s: float
    per_run_s: float
    gbps: float
    #: The far host's id (a hello's ``host.host_id``); "" in the cache for a loopback
    #: calibration, which an endpoint reads as its own host.
    peer_host: str = ""
    version: str = ""  # the driver version it was measured with
    measured_at: float = 0.0  # unix time
    #: The memory family the KV was in when it was measured (``host``, ``cuda``).
    memory: str = "host"

    def predict(self, runs: int, nbytes: int) -> float:
        """Seconds to move ``nbytes`` in ``runs`` descriptors, end to end."""
        return self.latency_s + runs * self.per_run_s + nbytes / (self.gbps * 1e9)

    def describe(self) -> str:
        return f"{self.latency_s * 1e3:.2f} ms + {self.per_run_s * 1e6:.2f} us/descriptor + {self.gbps:.2f} GB/s"

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self.document())

    def document(self) -> CostModelDoc:
        """As the hello carries it (the fields are the schema's, one for one)."""
        return CostModelDoc(**dataclasses.asdict(self))

    @classmethod
    def from_document(cls, doc: CostModelDoc) -> CostModel:
        return cls(**msgspec.structs.asdict(doc))

    @classmethod
    def from_dict(cls, data: Any) -> CostModel:
        """A model from a hello or the cache; :class:`ProtocolError` on anything out of range."""
        return cls.from_document(parse(data, CostModelDoc, "cost model"))


def slowest_prediction(models: Sequence[CostModel], runs: int, nbytes: int) -> float:
    """The slowest of ``models``' predictions (the two sides' models of one driver; 0 without
    a model): what the negotiation and a connection's lanes predict with."""
    return max((m.predict(runs, nbytes) for m in models), default=0.0)


def models_from_list(raw: Any) -> tuple[CostModel, ...]:
    """A driver's models as the calibration cache holds them (``None``: none)."""
    if raw is None:
        return ()
    return tuple(map(CostModel.from_document, parse(raw, _ModelList, "cost models")))


_ModelList = Annotated[list[CostModelDoc], Meta(max_length=MAX_MODELS_PER_DRIVER)]


@dataclass(frozen=True)
class Point:
    """One measured shape: descriptors, bytes, and the median seconds it took."""

    runs: int
    nbytes: int
    seconds: float


def fit(points: Sequence[Point], *, path: str, peer_host: str = "", version: str = "") -> CostModel:
    """The non-negative latency, per-descriptor cost and bandwidth that best explain ``points``
    (least squares; a term that comes out negative, which is noise, is fixed at zero and the
    others refitted). Needs shapes that differ in bytes at equal descriptors and in descriptors
    at equal bytes to tell the three apart."""
    if len(points) < 3:
        raise ValueError(f"fitting a cost model needs at least 3 measured shapes, got {len(points)}")
    a = np.array([[1.0, float(p.runs), float(p.nbytes)] for p in points])
    y = np.array([p.seconds for p in points])
    active = [0, 1, 2]
    coef = np.zeros(3)
    while active:
        solution, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (solution >= 0).all():
            coef[:] = 0.0
            coef[active] = solution
            break
        active = [i for i, c in zip(active, solution, strict=True) if c >= 0]
    # Bandwidth must be finite: a fit with no byte term (every copy free) means the bytes were
    # too few to see; the largest shape's own rate is the honest floor then.
    largest = max(points, key=lambda p: p.nbytes)
    per_byte = coef[2] if coef[2] > 0 else largest.seconds / max(1, largest.nbytes)
    per_byte = max(per_byte, 1.0 / (MAX_GBPS * 1e9))  # every shape took no time: the fastest allowed
    gbps = min(MAX_GBPS, max(MIN_GBPS, 1.0 / per_byte / 1e9))
    return CostModel(
        path=path,
        latency_s=min(MAX_LATENCY_S, float(coef[0])),
        per_run_s=min(MAX_PER_RUN_S, float(coef[1])),
        gbps=float(gbps),
        peer_host=peer_host,
        version=version,
    )
