"""``kvtransport bench``: the main job. A prefill endpoint (this process) sends KV pages of a
realistic layout to a decode endpoint (a child process) on loopback, with the driver the
negotiation picks (or the one named), verifies every byte on both ends, and compares with the
driver's engine used directly on the same descriptors in the same run.

Timing, per request: from ``send()`` until the decode side reports Success (end-to-end, what a
serving engine waits for), and until the prefill side saw its writes complete. The raw engine
is timed from its write call to its return (its bytes are then at the peer). Requests
alternate which of the two goes first, so drift on a noisy machine hits both alike. Figures are
medians over requests.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import math
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from kvtransport.negotiation.registry import load_driver
from kvtransport.runtime.endpoint import Connection, Endpoint, State, Transfer
from kvtransport.spi.driver import KVTransport
from kvtransport.spi.errors import KVTransportError, NegotiationError
from kvtransport.spi.plan import plan
from kvtransport.tools import cpu_pin
from kvtransport.tools.baseline import RawEngine, raw_engine_of
from kvtransport.tools.bench_hosts import Across, CutClock
from kvtransport.tools.kv_pool import KVPool
from kvtransport.tools.peer_process import Peer, PeerProcess

MiB = 1 << 20
#: ``--json`` reports carry it; it changes only when a field changes meaning or goes
#: (docs/performance.md, "The report's JSON").
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Workload:
    """What is sent: a model's KV layout and a number of prompts of a given length."""

    model: str = "Llama-3-8B"
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    page_tokens: int = 16
    prompt_tokens: int = 4096
    requests: int = 8
    #: The pools hold this many requests' worth of pages; each request's pages are drawn from
    #: them, so runs are as fragmented as a busy allocator leaves them.
    pool_factor: int = 2
    placement: str = "scattered"  # or "contiguous"
    seed: int = 1
    #: Untimed requests first (connections, first-touch page faults); still verified.
    warmup: int = 1
    #: CUDA device holding both pools (``None``: host memory).
    device: int | None = None

    @property
    def item_len(self) -> int:
        """Bytes of one page in one K or V region."""
        return self.page_tokens * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def regions(self) -> int:
        return self.layers * 2

    @property
    def pages_per_request(self) -> int:
        return math.ceil(self.prompt_tokens / self.page_tokens)

    @property
    def pool_pages(self) -> int:
        return self.pages_per_request * max(1, self.pool_factor)

    @property
    def request_bytes(self) -> int:
        return self.pages_per_request * self.item_len * self.regions

    def pages(self, rng: np.random.Generator) -> list[int]:
        n, total = self.pages_per_request, self.pool_pages
        if self.placement == "contiguous":
            start = int(rng.integers(0, total - n + 1))
            return list(range(start, start + n))
        return sorted(rng.choice(total, n, replace=False).tolist())

    def describe(self) -> str:
        where = "host memory" if self.device is None else f"cuda:{self.device}"
        return (
            f"{self.model}: {self.layers} layers x (K,V), {self.kv_heads} KV heads x {self.head_dim} x "
            f"{8 * self.dtype_bytes}-bit, {self.page_tokens}-token pages; {self.requests} requests x "
            f"{self.prompt_tokens} tokens = {self.request_bytes / MiB:.0f} MiB each, pages {self.placement}, "
            f"KV in {where}"
        )


@dataclass
class Sample:
    request: int
    runs: int
    end_to_end_s: float = 0.0
    sender_s: float = 0.0
    raw_s: float = 0.0
    ok: bool = False
    raw_ok: bool | None = None
    compare_s: float = 0.0
    compare_ok: bool | None = None
    #: The same number of bytes copied in this process, one contiguous copy per region: the
    #: bound any path on this host is measured against (host KV only).
    memcpy_s: float = 0.0
    #: The driver kvtransport's transfer took (a calibrated connection picks one per transfer),
    #: and what its cost models predicted (0: no model).
    driver: str = ""
    predicted_s: float = 0.0
    #: When its driver failed and it went over ``driver`` instead (``runtime.failover``):
    #: the driver it failed on, and when (monotonic; 0: it did not move).
    failed_over_from: str = ""
    failed_over_at: float = 0.0


@dataclass
class Report:
    workload: Workload
    driver: str
    path: str
    estimate_gbps: float
    reason: str
    rejected: dict[str, str]
    raw_engine: bool
    samples: list[Sample] = field(default_factory=list)
    #: A second kvtransport driver measured on the same requests (``--compare``).
    compare: str | None = None
    #: What the choice rested on: ``"calibrated"`` cost models or ``"nominal"`` estimates.
    basis: str = "nominal"
    #: ``--pin``: the CPUs each process ran on, as each process read its threads' sets back.
    pinned: dict[str, list[list[int]]] | None = None
    #: Where the two processes ran.
    placement: str = "two processes on loopback"
    #: Whether the connection learned its lanes' costs (two hosts, no calibration).
    learning: bool = False
    #: KV bytes of the requests that arrived, by every path (warm-up and baseline included; a
    #: request a cut caught counts once, for the try that arrived).
    kv_bytes_moved: int = 0
    #: ``--cut-at`` across simulated hosts: what the cut did (bench_hosts.CutRecord).
    cut: dict[str, Any] | None = None

    @property
    def integrity_ok(self) -> bool:
        return bool(self.samples) and all(_sample_ok(s) for s in self.samples)

    def _gbps(self, seconds: float) -> float:
        return self.workload.request_bytes / seconds / 1e9 if seconds > 0 else 0.0

    def figures(self) -> dict[str, Any]:
        def stats(values: list[float]) -> dict[str, float]:
            if not values:
                return {}
            p90 = nearest_rank(values, 0.9)
            med = statistics.median(values)
            return {
                "median_gbps": round(self._gbps(med), 3),
                "p50_ms": round(med * 1e3, 2),
                "p90_ms": round(p90 * 1e3, 2),
            }

        out: dict[str, Any] = {
            "end_to_end": stats([s.end_to_end_s for s in self.samples]),
            "sender": stats([s.sender_s for s in self.samples]),
        }
        if self.compare:
            out["compare"] = stats([s.compare_s for s in self.samples])
            other = out["compare"].get("median_gbps", 0.0)
            if other:
                out["ratio_compare"] = round(out["end_to_end"]["median_gbps"] / other, 3)
        memcpy = [s.memcpy_s for s in self.samples if s.memcpy_s > 0]
        if memcpy:
            out["memcpy"] = stats(memcpy)
            if out["memcpy"]["median_gbps"]:
                out["ratio_memcpy"] = round(out["end_to_end"]["median_gbps"] / out["memcpy"]["median_gbps"], 3)
        if self.raw_engine:
            out["raw"] = stats([s.raw_s for s in self.samples])
            raw = out["raw"].get("median_gbps", 0.0)
            if raw:
                out["ratio_end_to_end"] = round(out["end_to_end"]["median_gbps"] / raw, 3)
                out["ratio_sender"] = round(out["sender"]["median_gbps"] / raw, 3)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "workload": asdict(self.workload) | {"request_bytes": self.workload.request_bytes},
            "driver": self.driver,
            "compare": self.compare,
            "path": self.path,
            "estimate_gbps": self.estimate_gbps,
            "reason": self.reason,
            "basis": self.basis,
            "pinned": self.pinned,
            "rejected": self.rejected,
            "figures": self.figures(),
            "integrity": {
                "ok": self.integrity_ok,
                "requests_verified": sum(s.ok for s in self.samples),
                "raw_requests_verified": sum(bool(s.raw_ok) for s in self.samples),
                "compare_requests_verified": sum(bool(s.compare_ok) for s in self.samples),
                "bytes_verified": sum(s.ok for s in self.samples) * self.workload.request_bytes,
            },
            "requests": [asdict(s) for s in self.samples],
            "kv_bytes_moved": self.kv_bytes_moved,
            "cut": self.cut,
        }

    def render(self) -> str:
        w, f = self.workload, self.figures()
        lines = [
            f"kvtransport bench: prefill -> decode, {self.placement}",
            f"  workload    {w.describe()}",
            f"  driver      {self.driver} ({self.path}, ~{self.estimate_gbps:g} GB/s estimated): {self.reason}",
        ]
        lines += [f"              not {name}: {why}" for name, why in self.rejected.items()]
        if self.pinned:
            lines.append(
                f"  pinned      prefill on CPUs {_cpu_sets(self.pinned['prefill'])}, decode on CPUs "
                f"{_cpu_sets(self.pinned['decode'])} (--pin: no core shared, as on two hosts)"
            )
        taken = collections.Counter(s.driver for s in self.samples if s.driver)
        if set(taken) - {self.driver}:
            why = (
                "the connection tried each lane, then sent each request on the one it measured fastest"
                if self.learning
                else "each request took the lane predicted fastest for its plan"
            )
            lines.append("  per transfer " + ", ".join(f"{n} x{c}" for n, c in taken.most_common()) + f" ({why})")

        def row(label: str, s: dict[str, float]) -> str:
            return f"  {label:<12}{s['median_gbps']:7.2f} GB/s   p50 {s['p50_ms']:8.1f} ms   p90 {s['p90_ms']:8.1f} ms"

        lines.append(row("end-to-end", f["end_to_end"]) + "   (send() -> decode Success)")
        lines.append(row("sender", f["sender"]) + "   (send() -> prefill Success)")
        if "compare" in f:
            lines.append(row(str(self.compare)[:11], f["compare"]) + "   (end-to-end, same requests)")
            if "ratio_compare" in f:
                lines.append(
                    f"  ratio       {f['ratio_compare']:.2f}x end-to-end ({self.driver} / {self.compare}, medians)"
                )
        if "raw" in f:
            lines.append(row("raw engine", f["raw"]) + "   (same descriptors, engine API directly)")
            if "ratio_end_to_end" in f:
                lines.append(
                    f"  ratio       {f['ratio_end_to_end']:.2f}x end-to-end, {f['ratio_sender']:.2f}x sender "
                    "(kvtransport / raw engine, medians)"
                )
        elif self.workload.device is not None:
            lines.append("  raw engine  not compared for device KV (scripts/gpu-check measures copy bandwidths)")
        elif self.cut is not None:
            lines.append("  raw engine  not measured (--cut-at: a raw engine's write has no timeout to ride out a cut)")
        else:
            lines.append(f"  raw engine  not measured ({self.driver} offers no raw-engine baseline, or --no-baseline)")
        if "memcpy" in f:
            lines.append(row("memcpy", f["memcpy"]) + "   (as many bytes, one copy per region, in-process)")
            if "ratio_memcpy" in f:
                lines.append(f"  ratio       {f['ratio_memcpy']:.2f}x end-to-end (kvtransport / memcpy, medians)")
        verified = sum(s.ok for s in self.samples)
        total_gib = verified * w.request_bytes / (1 << 30)
        raw_note = ""
        if self.raw_engine:
            raw_note = f"; raw engine {sum(bool(s.raw_ok) for s in self.samples)}/{len(self.samples)}"
        if self.compare:
            raw_note += f"; {self.compare} {sum(bool(s.compare_ok) for s in self.samples)}/{len(self.samples)}"
        lines.append(
            f"  integrity   {'OK' if self.integrity_ok else 'FAILED'}: {verified}/{len(self.samples)} requests, "
            f"{total_gib:.2f} GiB checked page by page (crc32 on both ends){raw_note}"
        )
        return "\n".join(lines)


class Progress:
    """A one-line progress bar on a terminal, a line per quarter otherwise; silent if off."""

    def __init__(self, total: int, stream: TextIO | None, unit: str = "requests") -> None:
        self.total, self.stream, self.done, self.unit = total, stream, 0, unit
        self.tty = bool(stream and stream.isatty())
        self._quarter = -1

    def note(self, text: str) -> None:
        if self.stream:
            self.stream.write(("\r\033[K" if self.tty else "") + text + ("" if self.tty else "\n"))
            self.stream.flush()

    def step(self, detail: str) -> None:
        self.done += 1
        if not self.stream:
            return
        if self.tty:
            width = 30
            filled = int(width * self.done / self.total)
            self.note(f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {detail}")
            if self.done == self.total:
                self.stream.write("\n")
        elif self.done * 4 // self.total > self._quarter:
            self._quarter = self.done * 4 // self.total
            self.note(f"{self.done}/{self.total} {self.unit} {detail}")


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by nearest rank (one of the values; the largest for a
    high ``q`` over few values)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def await_announced(senders: Iterable[Transfer], timeout: float) -> None:
    """Return once no sender still waits for the receiver's announcement of its pages;
    :class:`KVTransportError` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(s.state is State.BOOTSTRAPPING for s in senders):
        if time.monotonic() > deadline:
            raise KVTransportError("the decode side's announcements did not arrive")
        time.sleep(0.0005)


def _classes(driver: str | None) -> dict[str, type[KVTransport]] | None:
    return None if driver is None else {driver: load_driver(driver)}


def run(
    workload: Workload,
    *,
    driver: str | None = None,
    baseline: bool = True,
    progress: TextIO | None = None,
    timeout: float = 120.0,
    compare: str | None = None,
    pin: bool = False,
    across: Across | None = None,
) -> Report:
    """Run the bench; raises a :class:`KVTransportError` when no driver can serve the pair.
    ``pin``: this process's threads on the first half of its CPUs for the run, the decode
    process on the rest (see :mod:`kvtransport.tools.cpu_pin`). ``across``: the decode side
    on another simulated host (:mod:`kvtransport.tools.bench_hosts`)."""
    if not pin:
        return _run(workload, driver, baseline, progress, timeout, compare, None, across)
    prefill_cpus, decode_cpus = cpu_pin.split_halves(cpu_pin.available())
    # Before the pool, the endpoint and the engines start threads: they inherit the set.
    unpin = cpu_pin.pin_process(prefill_cpus)
    try:
        return _run(workload, driver, baseline, progress, timeout, compare, decode_cpus)
    finally:
        cpu_pin.restore(unpin)


def _run(
    workload: Workload,
    driver: str | None,
    baseline: bool,
    progress: TextIO | None,
    timeout: float,
    compare: str | None,
    decode_cpus: list[int] | None,
    across: Across | None = None,
) -> Report:
    pool = KVPool(workload.pool_pages, workload.regions, workload.item_len, 0, shared=False, device=workload.device)
    bar = Progress(workload.requests, progress)
    bar.note(f"filling {workload.pool_pages * workload.item_len * workload.regions / MiB:.0f} MiB of prefill KV")
    pool.fill(workload.seed)
    pairs: list[tuple[Endpoint, PeerProcess | None]] = []
    raw: RawEngine | None = None
    clock = CutClock(across) if across is not None and across.cut_at is not None else None
    if clock is not None:
        baseline = False  # a raw engine has no timeouts of its own to survive a cut with
    report: Report | None = None
    try:
        endpoint, peer, conn = _open_pair(pool, workload, driver, timeout, pairs, decode_cpus, across)
        assert conn.decision is not None and conn.peer_regions is not None
        decision = conn.decision
        report = Report(
            workload,
            decision.driver,
            decision.path.value,
            decision.gbps,
            decision.reason,
            {c.driver: c.reason for c in decision.candidates if c.outcome != "chosen"},
            raw_engine=False,
            compare=compare,
            basis=decision.basis,
            learning=decision.learning,
        )
        if across is not None:
            report.placement = "two simulated hosts (network, PID, IPC and mount namespaces, one switch per rail)"
        if decode_cpus is not None:
            # As each process reads its threads back, not as asked: a pin that did not hold shows.
            report.pinned = {"prefill": cpu_pin.process_cpus(), "decode": peer.call("cpus", timeout=timeout)["cpus"]}
        other = _open_pair(pool, workload, compare, timeout, pairs, decode_cpus, across) if compare else None
        # Raw engines are compared on host KV; device KV is measured against copy bandwidths by
        # scripts/gpu-check instead (a raw engine may not register device memory at all).
        raw_cls = raw_engine_of(endpoint.classes[decision.driver]) if baseline and workload.device is None else None
        if raw_cls is not None:
            info = peer.call("raw_open", driver=decision.driver, timeout=timeout)["info"]
            raw = raw_cls(pool.regions, endpoint.host)
            raw.connect(base64.b64decode(info))
            report.raw_engine = True
        # One request's bytes of one region: memcpy's reference copies into it, region by region.
        scratch = (
            np.empty(workload.pages_per_request * workload.item_len, np.uint8) if workload.device is None else None
        )
        rng = np.random.default_rng(workload.seed)
        for i in range(-workload.warmup, workload.requests):
            src, dst = workload.pages(rng), workload.pages(rng)
            runs = plan(pool.regions.kv, conn.peer_regions.kv, src, dst, max_run_bytes=endpoint.max_run_bytes)
            sample = Sample(i, len(runs))
            expected = pool.page_digests(src)
            order = ["kvtransport", "compare", "raw"]
            if i == 0 and clock is not None:
                clock.start()
            for which in order if i % 2 == 0 else order[::-1]:
                if which == "kvtransport":
                    if clock is None:
                        timed_transfer(sample, conn, peer, src, dst, expected, timeout)
                    else:
                        conn = _through_cut(clock, report, sample, endpoint, conn, peer, src, dst, expected, timeout)
                    report.kv_bytes_moved += workload.request_bytes
                elif which == "compare" and other is not None:
                    report.kv_bytes_moved += workload.request_bytes
                    probe = Sample(i, len(runs))
                    timed_transfer(probe, other[2], other[1], src, dst, expected, timeout)
                    sample.compare_s, sample.compare_ok = probe.end_to_end_s, probe.ok
                elif which == "raw" and raw is not None:
                    report.kv_bytes_moved += workload.request_bytes
                    _via_raw(sample, raw, runs, peer, dst, expected, timeout)
            if scratch is not None:
                sample.memcpy_s = _memcpy_s(pool, scratch, len(src))
            if i < 0:
                if not _sample_ok(sample):
                    report.samples.append(sample)  # a corrupted warm-up fails the run too
                continue
            report.samples.append(sample)
            bar.step(f"({workload.request_bytes / MiB:.0f} MiB each, last {sample.end_to_end_s * 1e3:.0f} ms)")
        return report
    finally:
        if clock is not None:
            clock.close()
            if report is not None:
                report.cut = clock.record.to_dict()
        if raw is not None:
            raw.close()
        close_pairs(pairs)
        pool.close()


def _through_cut(
    clock: CutClock,
    report: Report,
    sample: Sample,
    endpoint: Endpoint,
    conn: Connection,
    peer: PeerProcess,
    src: list[int],
    dst: list[int],
    expected: list[int],
    timeout: float,
) -> Connection:
    """One request while a cut may come: when it fails, the failure is recorded (the detection
    time), and once the link is back the request goes again on a new connection until it
    arrives. Returns the connection the bench goes on with."""
    while True:
        try:
            timed_transfer(sample, conn, peer, src, dst, expected, timeout)
        except KVTransportError as exc:
            if not clock.record.cut_time:
                raise
            clock.record.failed.append(
                {"request": sample.request, "after_s": clock.since_cut(), "error": f"{type(exc).__name__}: {exc}"}
            )
            conn = _reconnect(clock, endpoint, peer, timeout)
            continue
        if sample.failed_over_from and clock.record.cut_time:
            clock.record.healed.append(
                {
                    "request": sample.request,
                    "from": sample.failed_over_from,
                    "to": sample.driver,
                    "moved_after_s": clock.since_cut(sample.failed_over_at),
                    "after_s": clock.since_cut(),
                }
            )
        if clock.record.failed and clock.record.failed[-1]["request"] == sample.request:
            clock.record.recovered.append(
                {
                    "request": sample.request,
                    "after_s": clock.since_cut(),
                    "after_restore_s": round(time.monotonic() - clock.record.restore_time, 3),
                }
            )
        return conn


def _reconnect(clock: CutClock, endpoint: Endpoint, peer: PeerProcess, timeout: float) -> Connection:
    """A new connection from the decode side, once the link is back."""
    if not clock.restored.wait(clock.across.cut_for + timeout):
        raise KVTransportError("the simulated link was never restored")
    deadline = time.monotonic() + timeout
    while True:
        try:
            peer.call("connect", address=endpoint.address, timeout=min(10.0, timeout))
            return endpoint.accept(timeout)
        except (RuntimeError, KVTransportError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _cpu_sets(sets: list[list[int]]) -> str:
    return " / ".join(",".join(map(str, s)) for s in sets)


def _sample_ok(s: Sample) -> bool:
    return s.ok and s.raw_ok is not False and s.compare_ok is not False


def close_pairs(pairs: list[tuple[Endpoint, PeerProcess | None]]) -> None:
    """Close each decode process, then its prefill endpoint (what :func:`_open_pair` opened)."""
    for ep, peer_process in pairs:
        if peer_process is not None:
            peer_process.close()
        ep.close()


def _open_pair(
    pool: KVPool,
    workload: Workload,
    driver: str | None,
    timeout: float,
    opened: list[tuple[Endpoint, PeerProcess | None]],
    cpus: list[int] | None = None,
    across: Across | None = None,
) -> tuple[Endpoint, PeerProcess, Connection]:
    """A prefill endpoint over ``pool`` and a decode endpoint in a child process (on ``cpus``
    only, when given; on another simulated host with ``across``), connected."""
    listen = across.listen if across is not None else "tcp://127.0.0.1:0"
    endpoint = Endpoint(pool.regions, pool.layout, drivers=_classes(driver), name="prefill", listen=listen)
    opened.append((endpoint, None))
    peer = PeerProcess(
        *("--driver", driver or "auto", "--pages", str(workload.pool_pages), "--layers", str(workload.regions)),
        *("--item", str(workload.item_len), "--aux-slots", "0", "--private", "--name", "decode"),
        *(("--device", str(workload.device)) if workload.device is not None else ()),
        *(("--cpus", ",".join(map(str, cpus))) if cpus else ()),
        *(("--listen", across.decode_listen) if across is not None else ()),
        timeout=timeout,
        launcher=across.decode_launcher if across is not None else (),
    )
    opened[-1] = (endpoint, peer)
    try:
        peer.call("connect", address=endpoint.address, timeout=timeout)
    except RuntimeError as exc:
        raise NegotiationError(f"decode side could not connect: {exc}") from None
    return endpoint, peer, endpoint.accept(timeout)


def timed_transfer(
    sample: Sample,
    conn: Connection,
    peer: Peer,
    src: list[int],
    dst: list[int],
    expected: list[int],
    timeout: float,
) -> None:
    """One request through kvtransport, verified: the decode side's pages poisoned, announced,
    sent, awaited on both sides; ``sample`` gets the end-to-end and sender seconds, whether every
    page arrived intact, the driver taken and its prediction. A request the decode side does not
    end in Success raises. ``sample.request`` names it: unique on its connection."""
    tag = f"bench-{sample.request}"
    peer.call("poison", pages=dst, timeout=timeout)
    peer.call("expect", transfers={tag: dst}, timeout=timeout)
    t = conn.sender(tag)
    deadline = time.monotonic() + timeout
    while t.state is State.BOOTSTRAPPING and time.monotonic() < deadline:
        time.sleep(0.0005)
    start = time.monotonic()
    t.send(src, last=True)
    t.wait(timeout)
    sample.sender_s = time.monotonic() - start
    sample.driver, sample.predicted_s = t.driver, t.predicted_s
    sample.failed_over_from, sample.failed_over_at = t.failed_over_from, t.failed_over_at
    answer = peer.call("wait", tags=[tag], timeout=timeout + 5)
    state = answer["states"][tag]
    if state[0] != "SUCCESS":
        raise KVTransportError(f"decode side ended request {sample.request} in {state[0]}: {state[2]}")
    # A peer on another host reports on its own clock; its measured offset maps it onto ours.
    sample.end_to_end_s = answer["finished"][tag] - float(getattr(peer, "clock_offset", 0.0)) - start
    sample.ok = peer.call("digests", pages=dst, timeout=timeout)["digests"] == expected


def _memcpy_s(pool: KVPool, scratch: npt.NDArray[np.uint8], pages: int) -> float:
    """Seconds to copy ``pages`` pages of every region, contiguous, into ``scratch``."""
    n = pages * pool.item_len
    start = time.monotonic()
    for b in pool.buffers:
        np.copyto(scratch[:n], b.array[:n])
    return time.monotonic() - start


def _via_raw(
    sample: Sample, raw: RawEngine, runs: Any, peer: PeerProcess, dst: list[int], expected: list[int], timeout: float
) -> None:
    peer.call("poison", pages=dst, timeout=timeout)
    start = time.monotonic()
    raw.write(runs)
    sample.raw_s = time.monotonic() - start
    sample.raw_ok = peer.call("digests", pages=dst, timeout=timeout)["digests"] == expected


def connect_cost(count: int, driver: str | None = None, timeout: float = 60.0) -> dict[str, Any]:
    """``kvtransport bench --connects N``: what a handshake costs, with the deployment secret
    and without one (loopback: the same exchange under the well-known key, so the difference
    is the secret's own cost). Per mode a decode process connects to an endpoint of this
    process and closes again, ``count`` times, in rounds of 5 that alternate between the modes
    (drift on a noisy machine hits both alike); medians of the decode side's ``connect()``."""
    import contextlib
    import os
    import secrets

    modes = ("secret", "none")
    samples: dict[str, list[float]] = {m: [] for m in modes}
    with contextlib.ExitStack() as stack:
        pairs = {}
        for mode in modes:
            secret = secrets.token_hex(32) if mode == "secret" else None
            env = {k: v for k, v in os.environ.items() if k not in ("KVTRANSPORT_SECRET", "KVTRANSPORT_SECRET_FILE")}
            if secret is not None:
                env["KVTRANSPORT_SECRET"] = secret
            pool = KVPool(64, 1, 4096, 0)
            stack.callback(pool.close)
            endpoint = Endpoint(pool.regions, pool.layout, drivers=_classes(driver), name="prefill", secret=secret)
            stack.callback(endpoint.close)
            peer = PeerProcess(
                *("--driver", driver or "auto", "--pages", "64", "--layers", "1", "--item", "4096"),
                *("--aux-slots", "0", "--private", "--name", "decode"),
                env=env,
                timeout=timeout,
            )
            stack.callback(peer.close)
            pairs[mode] = (endpoint, peer)
        done = 0
        while done < count:
            n = min(5, count - done)
            for mode in modes:
                endpoint, peer = pairs[mode]
                got = peer.call("connects", address=endpoint.address, count=n, timeout=timeout)["seconds"]
                samples[mode] += got
            done += n
    out: dict[str, Any] = {"count": count, "driver": driver or "auto"}
    for mode in modes:
        ms = sorted(s * 1e3 for s in samples[mode])
        out[mode] = {"p50_ms": statistics.median(ms), "p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))]}
    out["secret_minus_none_p50_ms"] = out["secret"]["p50_ms"] - out["none"]["p50_ms"]
    return out


def render_connect_cost(doc: dict[str, Any]) -> str:
    lines = [f"connect() cost, {doc['count']} handshakes each, driver {doc['driver']} (decode process -> this one)"]
    for mode, label in (("secret", "with KVTRANSPORT_SECRET"), ("none", "without a secret (loopback)")):
        d = doc[mode]
        lines.append(f"  {label:<30} p50 {d['p50_ms']:7.2f} ms   p90 {d['p90_ms']:7.2f} ms")
    lines.append(f"  difference of the medians: {doc['secret_minus_none_p50_ms']:+.2f} ms")
    return "\n".join(lines)


#: The most KV memory ``--in-flight`` allocates per process (each side holds N + 1 requests' pages).
IN_FLIGHT_MAX_POOL = 4 << 30
GiB = 1 << 30


def in_flight(
    workload: Workload,
    count: int,
    *,
    driver: str | None = None,
    timeout: float = 120.0,
    progress: TextIO | None = None,
) -> dict[str, Any]:
    """``kvtransport bench --in-flight N``: rounds of ``count`` requests sent at once (each
    announced, then all sent, then all awaited) against rounds of one request, alternating, on
    one connection; the aggregate bandwidth of each (bytes of the round over the time from its
    first send to its last request's decode Success), medians, every page checked."""
    if count < 2:
        raise KVTransportError("--in-flight N compares N requests at once with one: N must be at least 2")
    workload = dataclasses.replace(workload, pool_factor=max(workload.pool_factor, count + 1))
    pool_bytes = workload.pool_pages * workload.item_len * workload.regions
    if pool_bytes > IN_FLIGHT_MAX_POOL:
        raise KVTransportError(
            f"--in-flight {count} with {workload.prompt_tokens}-token requests needs {pool_bytes / GiB:.1f} GiB of KV "
            f"in each process (more than {IN_FLIGHT_MAX_POOL / GiB:.0f} GiB); use shorter requests "
            "(--prompt-tokens 256) or fewer in flight"
        )
    pool = KVPool(workload.pool_pages, workload.regions, workload.item_len, 0, shared=False, device=workload.device)
    pool.fill(workload.seed)
    pairs: list[tuple[Endpoint, PeerProcess | None]] = []
    rounds: dict[int, list[float]] = {1: [], count: []}
    wrong: list[str] = []
    try:
        _, peer, conn = _open_pair(pool, workload, driver, timeout, pairs)
        assert conn.decision is not None
        rng = np.random.default_rng(workload.seed)
        total = workload.pool_pages
        n = workload.pages_per_request
        for i in range(-workload.warmup, workload.requests):
            for k in (1, count) if i % 2 == 0 else (count, 1):
                src_all = rng.choice(total, n * k, replace=False).tolist()
                dst_all = rng.choice(total, n * k, replace=False).tolist()
                tags = {f"f{i}-{k}-{j}": (src_all[j * n : (j + 1) * n], dst_all[j * n : (j + 1) * n]) for j in range(k)}
                peer.call("poison", pages=dst_all, timeout=timeout)
                peer.call("expect", transfers={t: d for t, (_, d) in tags.items()}, timeout=timeout)
                senders = {t: conn.sender(t) for t in tags}
                await_announced(senders.values(), timeout)
                start = time.monotonic()
                for t, (src, _) in tags.items():
                    senders[t].send(src, last=True)
                answer = peer.call("wait", tags=list(tags), timeout=timeout + 5)
                for t, state in answer["states"].items():
                    if state[0] != "SUCCESS":
                        raise KVTransportError(f"decode side ended {t} in {state[0]}: {state[2]}")
                seconds = max(answer["finished"].values()) - start
                got = peer.call("digests", pages=dst_all, timeout=timeout)["digests"]
                if got != pool.page_digests(src_all):
                    wrong.append(f"round {i} of {k} in flight")
                if i >= 0:
                    rounds[k].append(seconds)
            if progress is not None and i >= 0:
                progress.write(f"\r  round {i + 1}/{workload.requests}")
                progress.flush()
        if progress is not None:
            progress.write("\n")
        figures = {
            str(k): {
                "p50_ms": statistics.median(v) * 1e3,
                "aggregate_gbps": k * workload.request_bytes / statistics.median(v) / 1e9,
            }
            for k, v in rounds.items()
            if v
        }
        one, many = figures.get("1"), figures.get(str(count))
        return {
            "driver": conn.decision.driver,
            "workload": workload.describe(),
            "in_flight": count,
            "rounds": workload.requests,
            "figures": figures,
            "ratio": many["aggregate_gbps"] / one["aggregate_gbps"] if one and many else None,
            "integrity": {"ok": not wrong, "mismatches": wrong},
        }
    finally:
        close_pairs(pairs)
        pool.close()


def render_in_flight(doc: dict[str, Any]) -> str:
    f, k = doc["figures"], doc["in_flight"]
    lines = [
        f"kvtransport bench, {k} requests in flight against 1, driver {doc['driver']}",
        f"  workload    {doc['workload']}",
    ]
    for key, label in (("1", "1 in flight "), (str(k), f"{k} in flight".ljust(12))):
        if key in f:
            lines.append(
                f"  {label} {f[key]['aggregate_gbps']:6.2f} GB/s aggregate   p50 {f[key]['p50_ms']:8.1f} ms a round"
            )
    if doc["ratio"] is not None:
        lines.append(f"  ratio       {doc['ratio']:.2f}x ({k} in flight / 1, aggregate bandwidth, medians)")
    integrity = doc["integrity"]
    verdict = "OK" if integrity["ok"] else "FAILED: " + "; ".join(integrity["mismatches"][:3])
    lines.append(f"  integrity   {verdict}: every page of every request checked")
    return "\n".join(lines)
