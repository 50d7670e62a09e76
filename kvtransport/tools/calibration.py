"""``kvtransport calibrate``: measure each usable driver's cost model on this host.

A calibration runs a decode endpoint in a child process (every driver open in it) and, per
driver, a prefill endpoint in this process that offers only that driver. It moves four shapes
through the real endpoint API, every byte verified on the far side: one page (the fixed latency
of a batch), many pages in long contiguous runs (bandwidth), as many bytes in short scattered
runs (cost per descriptor), and those runs cut into 4 KiB pieces (the cost per descriptor of
small pages). :func:`~kvtransport.negotiation.cost_model.fit` turns the medians into a
:class:`~kvtransport.negotiation.cost_model.CostModel`; a fifth shape, runs of four pages, is measured but
not fitted, and the report shows the model's error on it.

The models are saved to the per-user cache (:mod:`~kvtransport.negotiation.calibration_cache`), which
endpoints read when they build their hello.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from kvtransport.negotiation.calibration_cache import cache_path, write_cache
from kvtransport.negotiation.cost_model import CostModel, Point, fit
from kvtransport.negotiation.hello import load_drivers
from kvtransport.negotiation.registry import Policy
from kvtransport.runtime.endpoint import Endpoint
from kvtransport.spi.errors import ConfigError, KVTransportError
from kvtransport.spi.memory import HOST
from kvtransport.spi.plan import plan
from kvtransport.spi.probe import machine_key
from kvtransport.tools.bench import Sample, timed_transfer
from kvtransport.tools.bench_remote import listen_url
from kvtransport.tools.kv_pool import KVPool
from kvtransport.tools.peer_process import Peer, PeerProcess

log = logging.getLogger(__name__)

#: The calibration pool: regions x pages x bytes per page, on each side.
REGIONS, PAGES, ITEM_BYTES = 4, 2048, 16 << 10


@dataclass
class DriverCalibration:
    driver: str
    path: str = ""
    model: CostModel | None = None
    points: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""

    @property
    def check_error(self) -> float:
        """The model's relative error on the shape it was not fitted on (0 when not measured)."""
        for p in self.points:
            if p["shape"] == CHECK and p.get("seconds"):
                return float(p["predicted"] / p["seconds"] - 1.0)
        return 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "driver": self.driver,
            "check_error": self.check_error,
            "path": self.path,
            "model": self.model.to_dict() if self.model else None,
            "points": self.points,
            "seconds": self.seconds,
            "error": self.error,
        }


@dataclass
class CalibrationReport:
    host: str
    drivers: list[DriverCalibration]
    seconds: float = 0.0
    cache: str = ""  # where the models were saved ("" when not saved)
    save_error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "seconds": self.seconds,
            "cache": self.cache,
            "save_error": self.save_error,
            "drivers": [d.to_dict() for d in self.drivers],
        }

    def render(self) -> str:
        lines = [f"kvtransport calibrate: {len(self.drivers)} driver(s) on machine {self.host}, {self.seconds:.1f} s"]
        for d in self.drivers:
            if d.model is None:
                lines.append(f"  {d.driver:<16} FAILED: {d.error}")
                continue
            towards = f"  towards host {d.model.peer_host}" if d.model.peer_host else ""
            lines.append(
                f"  {d.driver:<16} {d.path:<6} {d.model.describe()}  (off by {d.check_error:+.0%} on "
                f"{CHECK!r}; {d.seconds:.1f} s){towards}"
            )
            for p in d.points:
                note = "" if p["shape"] in FITTED else "  (not fitted)"
                lines.append(
                    f"  {'':<16} {p['shape']:<11} {p['runs']:>5} runs {p['bytes'] / (1 << 20):7.2f} MiB  "
                    f"measured {p['seconds'] * 1e3:8.2f} ms  model {p['predicted'] * 1e3:8.2f} ms{note}"
                )
        lines.append(
            f"  saved to {self.cache}: endpoints of this host now rank drivers by these models"
            if self.cache
            else f"  NOT SAVED: {self.save_error}"
            if self.save_error
            else "  not saved (--no-save or KVTRANSPORT_CALIBRATION=off)"
        )
        return "\n".join(lines)


def usable_drivers(names: Iterable[str] | None = None) -> list[str]:
    """Drivers that can move host KV here and that the environment's policy permits."""
    loaded = load_drivers(names)
    policy = Policy.from_env(known=loaded.hellos)
    return [
        name
        for name, entry in sorted(loaded.hellos.items())
        if entry.status is not None and entry.status.serves(HOST) and policy.permits(name)[0]
    ]


def calibrate(
    drivers: Iterable[str] | None = None,
    *,
    reps: int = 5,
    save: bool = True,
    timeout: float = 60.0,
    progress: TextIO | None = None,
    spawn: Callable[[list[str]], Peer] | None = None,
) -> CalibrationReport:
    """Measure every usable driver (or those named), fit their models, and save them.

    ``spawn`` starts the decode side from :mod:`kvtransport.tools.peer` arguments (default: a child
    process here; ``bench_remote.RemotePeer`` for one on another host, over the real link: its
    models are then filed under that host)."""
    if reps < 1:
        raise ConfigError(f"calibration needs at least one repetition per shape, got {reps}")
    started = time.monotonic()
    host = machine_key()
    names = usable_drivers(drivers)
    if drivers is not None:
        missing = sorted(set(drivers) - set(names))
        if missing:
            raise ConfigError(f"cannot calibrate {', '.join(missing)}: not usable for host memory here (see doctor)")
    pool = KVPool(PAGES, REGIONS, ITEM_BYTES, 0, shared=False)
    pool.fill(7)
    peer: Peer | None = None
    results: list[DriverCalibration] = []
    args = ["--driver", "auto", "--pages", str(PAGES), "--layers", str(REGIONS), "--item", str(ITEM_BYTES)]
    args += ["--aux-slots", "0", "--private", "--name", "calibrate-decode"]
    try:
        peer = spawn(args) if spawn is not None else PeerProcess(*args, timeout=timeout)
        for index, name in enumerate(names):
            if hasattr(peer, "measure_clock"):
                peer.measure_clock()  # its Success times are on its clock, which drifts from ours
            if progress is not None:
                progress.write(f"calibrating {name} ({index + 1}/{len(names)})\n")
                progress.flush()
            results.append(_calibrate_one(name, pool, peer, reps, timeout))
    finally:
        if peer is not None:
            peer.close()
        pool.close()
    report = CalibrationReport(host, results)
    path = cache_path()
    fitted = {r.driver: [r.model] for r in results if r.model is not None}
    if save and path is not None and fitted:
        try:
            write_cache(path, fitted, host)
            report.cache = str(path)
        except OSError as exc:
            report.save_error = f"could not save to {path}: {exc}"
            log.warning("calibration: %s", report.save_error)
    report.seconds = time.monotonic() - started
    return report


#: The shapes the model is fitted on; ``CHECK`` is measured too but left out of the fit, so the
#: report shows how well the model predicts a shape it did not see.
FITTED = ("one page", "contiguous", "scattered", "small pieces")
CHECK = "runs of 4"
#: The "small pieces" shape sends the scattered pages cut into runs of this many bytes: what a
#: layout of small pages (one KV head of a TP-8 rank: 4 KiB) gives a driver. A driver's cost per
#: descriptor depends on the descriptor's size (UCX's is lower for small ones, a staging ring's
#: gather higher), so the fit must see both sizes.
SMALL_PIECE = 4 << 10


def _shapes(pages: int) -> dict[str, list[int]]:
    half = pages // 2
    return {
        "one page": [pages // 3],
        "contiguous": list(range(half)),
        "scattered": list(range(0, pages, 2)),
        "small pieces": list(range(0, pages, 2)),
        CHECK: [p for p in range(pages) if p % 8 < 4],
    }


def _calibrate_one(name: str, pool: KVPool, peer: Peer, reps: int, timeout: float) -> DriverCalibration:
    result = DriverCalibration(name)
    started = time.monotonic()
    classes = load_drivers([name]).classes
    endpoint: Endpoint | None = None
    try:
        # A decode side on another host names the address it reached us on: listen there.
        here = getattr(peer, "local_host", "127.0.0.1")
        endpoint = Endpoint(
            pool.regions, pool.layout, drivers=classes, name=f"calibrate-{name}", listen=listen_url(here)
        )
        answer = peer.call("connect", address=endpoint.address, timeout=timeout)
        if "error" in answer:
            raise KVTransportError(f"{answer['error']}: {answer.get('message', '')[:300]}")
        conn = endpoint.accept(timeout)
        assert conn.decision is not None and conn.peer_regions is not None
        result.path = conn.decision.path.value
        points = []
        requests = itertools.count()
        cut = endpoint.max_run_bytes
        for shape, pages in _shapes(PAGES).items():
            # Between transfers (none in flight) the sender's cut of runs may change.
            endpoint.max_run_bytes = SMALL_PIECE if shape == "small pieces" else cut
            runs = plan(pool.regions.kv, conn.peer_regions.kv, pages, pages, max_run_bytes=endpoint.max_run_bytes)
            expected = pool.page_digests(pages)
            seconds = []
            for rep in range(reps + 1):  # the first is a warm-up
                sample = Sample(next(requests), len(runs))
                timed_transfer(sample, conn, peer, pages, pages, expected, timeout)
                if not sample.ok:
                    raise KVTransportError(f"{shape!r}: the bytes that arrived differ from those sent")
                peer.call("forget", tags=[f"bench-{sample.request}"], timeout=timeout)
                if rep:
                    seconds.append(sample.end_to_end_s)
            points.append(Point(len(runs), runs.total_bytes, statistics.median(seconds)))
            result.points.append({"shape": shape, "runs": len(runs), "bytes": runs.total_bytes})
        status = endpoint.hello.drivers[name].status
        fitted = [p for p, e in zip(points, result.points, strict=True) if e["shape"] in FITTED]
        # Loopback: the far host is this one, which the cache files as "" (the host id changes
        # at each boot; the endpoint that reads the model fills in its own). Another host's
        # models are filed under its id, and count only towards it.
        far = conn.peer_host_id
        model = fit(
            fitted,
            path=result.path,
            peer_host="" if far == endpoint.hello.host.host_id else far,
            version=status.version if status else "",
        )
        result.model = replace(model, measured_at=time.time())
        for entry, point in zip(result.points, points, strict=True):
            entry["seconds"] = point.seconds
            entry["predicted"] = model.predict(point.runs, point.nbytes)
    except (KVTransportError, RuntimeError, OSError, ValueError, ArithmeticError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        log.warning("calibrating %s failed: %s", name, result.error)
    finally:
        if endpoint is not None:
            endpoint.close()
        result.seconds = time.monotonic() - started
    return result
