"""A driver's measured cost: fixed latency per batch, cost per descriptor, bandwidth.

``kvtransport calibrate`` fits a :class:`CostModel` per driver and path from transfers of known
shape (:func:`fit`); the hello carries the models, and the negotiation predicts with them
(:meth:`CostModel.predict`) which driver moves a transfer of a given shape (descriptor count,
bytes) soonest. A peer's models arrive in its hello, so :meth:`CostModel.from_dict` checks every
field's type and range before anything computes with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtransport.spi.errors import ProtocolError

#: Ranges a model's figures must fall in (a peer's hello cannot make a prediction overflow,
#: go negative or come out NaN).
MAX_LATENCY_S = 10.0
MAX_PER_RUN_S = 0.1
MIN_GBPS, MAX_GBPS = 1e-4, 1e5
#: At most this many models per driver in one hello (one per path it was calibrated on).
MAX_MODELS_PER_DRIVER = 16
MAX_TEXT = 128


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
        return {
            "path": self.path,
            "latency_s": self.latency_s,
            "per_run_s": self.per_run_s,
            "gbps": self.gbps,
            "peer_host": self.peer_host,
            "version": self.version,
            "measured_at": self.measured_at,
            "memory": self.memory,
        }

    @classmethod
    def from_dict(cls, data: Any) -> CostModel:
        """A model from a hello or the cache; :class:`ProtocolError` on anything out of range."""
        if not isinstance(data, Mapping):
            raise ProtocolError(f"a cost model must be a mapping, got {type(data).__name__}")
        return cls(
            path=_text(data, "path"),
            latency_s=_number(data, "latency_s", 0.0, MAX_LATENCY_S),
            per_run_s=_number(data, "per_run_s", 0.0, MAX_PER_RUN_S),
            gbps=_number(data, "gbps", MIN_GBPS, MAX_GBPS),
            peer_host=_text(data, "peer_host"),
            version=_text(data, "version"),
            measured_at=_number(data, "measured_at", 0.0, 1e11),
            memory=_text(data, "memory") if "memory" in data else "host",
        )


def slowest_prediction(models: Sequence[CostModel], runs: int, nbytes: int) -> float:
    """The slowest of ``models``' predictions (the two sides' models of one driver; 0 without
    a model): what the negotiation and a connection's lanes predict with."""
    return max((m.predict(runs, nbytes) for m in models), default=0.0)


def models_from_list(raw: Any) -> tuple[CostModel, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_MODELS_PER_DRIVER:
        raise ProtocolError(f"a driver's cost models must be a list of at most {MAX_MODELS_PER_DRIVER}")
    return tuple(CostModel.from_dict(m) for m in raw)


def _text(data: Mapping[str, Any], key: str) -> str:
    value = data.get(key, "")
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise ProtocolError(f"cost model field {key!r} must be text of at most {MAX_TEXT} characters")
    return value


def _number(data: Mapping[str, Any], key: str, low: float, high: float) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"cost model field {key!r} must be a number, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:
        raise ProtocolError(f"cost model field {key!r} is too large") from None
    if not math.isfinite(value) or not low <= value <= high:
        raise ProtocolError(f"cost model field {key!r} = {value!r} is outside [{low:g}, {high:g}]")
    return value


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
