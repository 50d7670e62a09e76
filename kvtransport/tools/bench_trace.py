"""``kvtransport bench --trace FILE``: serving load from a real trace, open loop.

The requests of the trace arrive when the trace says (its timestamps divided by ``--speedup``)
or as a Poisson process (``--rate``), whether or not earlier ones are done: a request that
arrives while others are moving waits for nobody but its pages. Each request's KV is sized by
its input length for the layout chosen; the decode side keeps a prefix cache of the trace's
block hashes (``--decode-cache-gib``), so only the part of a prompt it does not hold moves.

One replay is one *pass*: per request, when it arrived, when it was sent (it waited for decode
pages and for the decode side's announcement until then: *queued*), and when the decode side
saw it complete (*wire*: send to decode Success). Passes, all over the same arrivals:

* ``kvtransport``: every request, through an endpoint pair (prefill here, decode in a child
  process), with the driver the negotiation picks or the one named;
* ``kvtransport, small alone``: the requests of the smallest bucket only, at their own arrival
  times: what they see with nothing large beside them (the head-of-line comparison);
* ``raw FIFO`` and ``raw FIFO, small alone``: the same arrivals through the driver's engine used
  directly by a plain client that writes one request after another in arrival order.

Every page of every request is checked on the decode side (crc32 against the prefill's pages),
off the clock: decode pages go round the pool in a fixed scattered order; when they run out, the
pass waits for its requests in flight, stops its clock, has the decode side check every request
since the last pause and poison the pool, and goes on where it stopped (:class:`Checker`; each
side's CPU is counted between pauses only). ``--pool-gib`` sizes the pool; the report counts the
pauses.

What the figures include besides the transfer: kvtransport's queued time has the harness's
round trip to the decode process (which announces a request's pages, as a decode scheduler
would) and up to ``IDLE_S`` of polling; its end is the decode side's Success, the raw client's
the return of its write (the bytes are at the peer). A p99 over fewer than 100 requests is
their maximum.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from kvtransport.runtime.endpoint import Connection, Endpoint, State, Transfer
from kvtransport.spi.errors import KVTransportError
from kvtransport.spi.plan import plan
from kvtransport.tools.baseline import RawEngine, raw_engine_of
from kvtransport.tools.bench import Workload, _open_pair, close_pairs
from kvtransport.tools.kv_pool import KVPool
from kvtransport.tools.peer_process import PeerProcess
from kvtransport.tools.trace import BUCKETS, SMALL, PrefixCache, TraceRequest, arrivals, load, quantile

GiB = 1 << 30
#: ``--json`` carries it; it changes only when a field changes meaning or goes.
SCHEMA_VERSION = 1
#: How long the replay loop sleeps when nothing is due (it wakes for the next arrival sooner).
IDLE_S = 0.001


@dataclass(frozen=True)
class TraceSettings:
    """What ``bench --trace`` replays, and over which layout."""

    path: str
    #: The first N requests of the trace (``None``: all).
    requests: int | None = 500
    speedup: float = 1.0
    #: Poisson arrivals at this many requests a second instead of the trace's timestamps.
    rate: float | None = None
    #: The decode side's prefix cache, in KV bytes of this layout (0: none; every prompt moves
    #: whole). The default holds 1,024 of the trace's 512-token blocks at the default layout, as
    #: a 64 GiB decode pool of Llama-3-8B (all 32 layers) does.
    decode_cache_gib: float = 8.0
    #: Decode pages for requests in flight (at least two of the largest request).
    pool_gib: float = 1.0
    #: 4 of Llama-3-8B's 32 layers: 16 KiB a token, so the trace's longest prompt (126k
    #: tokens) is 2 GiB.
    layers: int = 4
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    page_tokens: int = 16
    seed: int = 1
    #: Also the raw engine's FIFO client, and the small requests alone.
    baseline: bool = True
    small_alone: bool = True

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token, every layer's K and V."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def item_len(self) -> int:
        return self.page_tokens * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def page_bytes(self) -> int:
        """KV bytes of one page, every layer's K and V."""
        return self.item_len * 2 * self.layers

    def describe(self) -> str:
        return (
            f"{self.layers} layers x (K,V), {self.kv_heads} KV heads x {self.head_dim} x {8 * self.dtype_bytes}-bit "
            f"({self.token_bytes // 1024} KiB a token), {self.page_tokens}-token pages, host memory"
        )


@dataclass(frozen=True)
class Planned:
    """A trace request as the replay moves it."""

    request: TraceRequest
    arrival_s: float
    cached_tokens: int
    pages: int


@dataclass
class Outcome:
    """One request of one pass (seconds on the replay's clock, from its start)."""

    index: int
    bucket: str
    bytes: int
    arrival_s: float
    sent_s: float = math.nan
    finished_s: float = math.nan
    ok: bool = False
    error: str = ""

    @property
    def queued_s(self) -> float:
        return self.sent_s - self.arrival_s

    @property
    def wire_s(self) -> float:
        return self.finished_s - self.sent_s

    @property
    def total_s(self) -> float:
        return self.finished_s - self.arrival_s


@dataclass
class Pass:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    #: CPU seconds of each side over the pass (the decode side's checksums taken out).
    cpu_s: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    #: Times the pass stopped its clock to check pages (:class:`Checker`).
    pauses: int = 0

    @property
    def bytes(self) -> int:
        return sum(o.bytes for o in self.outcomes if o.ok)

    def figures(self) -> dict[str, Any]:
        done = [o for o in self.outcomes if o.ok]
        out: dict[str, Any] = {
            "requests": len(self.outcomes),
            "verified": len(done),
            "failed": [{"index": o.index, "error": o.error} for o in self.outcomes if not o.ok][:10],
            "bytes": self.bytes,
            "pauses": self.pauses,
            "gbps": round(self.bytes / self.wall_s / 1e9, 3) if self.wall_s > 0 else 0.0,
            "overall": _latencies(done),
            "buckets": {label: _latencies([o for o in done if o.bucket == label]) for label, _ in BUCKETS},
        }
        gb = self.bytes / 1e9
        if gb > 0 and self.cpu_s:
            out["cpu_s_per_gb"] = {side: round(s / gb, 3) for side, s in self.cpu_s.items()}
        return out


def _latencies(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    if not outcomes:
        return {"requests": 0}

    def ms(values: list[float], q: float) -> float:
        return round(quantile(values, q) * 1e3, 2)

    total = [o.total_s for o in outcomes]
    queued = [o.queued_s for o in outcomes]
    wire = [o.wire_s for o in outcomes]
    return {
        "requests": len(outcomes),
        "total_ms": {"p50": ms(total, 0.5), "p90": ms(total, 0.9), "p99": ms(total, 0.99), "max": ms(total, 1.0)},
        "queued_ms": {"p50": ms(queued, 0.5), "p99": ms(queued, 0.99)},
        "wire_ms": {"p50": ms(wire, 0.5), "p90": ms(wire, 0.9), "p99": ms(wire, 0.99), "max": ms(wire, 1.0)},
    }


def prepare(settings: TraceSettings) -> list[Planned]:
    """The trace's requests with their arrivals and what the decode cache leaves to move."""
    requests = load(settings.path, settings.requests)
    times = arrivals(requests, speedup=settings.speedup, rate=settings.rate, seed=settings.seed)
    block_bytes = 512 * settings.token_bytes
    cache = PrefixCache(int(settings.decode_cache_gib * GiB // block_bytes))
    out = []
    for r, t in zip(requests, times, strict=True):
        cached = cache.lookup(r.blocks, r.input_tokens, settings.page_tokens)
        out.append(Planned(r, t, cached, math.ceil((r.input_tokens - cached) / settings.page_tokens)))
    return out


class Ring:
    """The decode pool's pages, handed out in a fixed scattered order (a busy allocator's) and
    checked in batches: a request whose pages would go past the end waits for a pause, in
    which the decode side checks every request since the last one and the pool is poisoned
    again (:class:`Checker`)."""

    def __init__(self, total: int, rng: np.random.Generator) -> None:
        self.total = total
        self._order: list[int] = rng.permutation(total).tolist()
        self._pos = 0

    def fits(self, n: int) -> bool:
        return self._pos + n <= self.total

    def take(self, n: int) -> list[int]:
        if not self.fits(n):
            raise ValueError(f"{n} pages wanted, {self.total - self._pos} left before a pause")
        out = sorted(self._order[self._pos : self._pos + n])
        self._pos += n
        return out

    def restart(self) -> None:
        self._pos = 0


class Checker:
    """The pauses of a pass: the clock stops, the decode side's pages of every request since
    the last pause are checked against the prefill's, the pool is poisoned again, and the
    clock goes on where it stopped. Each side's CPU is counted between pauses only."""

    def __init__(self, peer: PeerProcess, pool: KVPool, ring: Ring, timeout: float) -> None:
        self.peer, self.pool, self.ring, self.timeout = peer, pool, ring, timeout
        self.batch: list[tuple[Outcome, list[int], list[int]]] = []
        self.pauses = 0
        self.paused_s = 0.0
        peer.call("poison", pages=list(range(ring.total)), timeout=timeout)
        self.cpu = {"prefill": -time.process_time(), "decode": -self._decode_cpu()}

    def _decode_cpu(self) -> float:
        return float(self.peer.call("cpu", timeout=self.timeout)["cpu"])

    def note(self, outcome: Outcome, src: list[int], dst: list[int]) -> None:
        self.batch.append((outcome, src, dst))

    def pause(self) -> float:
        """Check, poison and restart the ring; returns the seconds the clock stood still."""
        stopped = time.monotonic()
        self.cpu["prefill"] += time.process_time()
        self.cpu["decode"] += self._decode_cpu()
        self._check()
        self.peer.call("poison", pages=list(range(self.ring.total)), timeout=self.timeout)
        self.ring.restart()
        self.cpu["decode"] -= self._decode_cpu()
        self.cpu["prefill"] -= time.process_time()
        self.pauses += 1
        paused = time.monotonic() - stopped
        self.paused_s += paused
        return paused

    def finish(self) -> dict[str, float]:
        """The last check; each side's CPU seconds over the pass, pauses left out."""
        self.cpu["prefill"] += time.process_time()
        self.cpu["decode"] += self._decode_cpu()
        self._check()
        return dict(self.cpu)

    def _check(self) -> None:
        if not self.batch:
            return
        pages = [p for _, _, dst in self.batch for p in dst]
        got = self.peer.call("digests", pages=pages, timeout=self.timeout)["digests"]
        at = 0
        for outcome, src, dst in self.batch:
            if outcome.ok and got[at : at + len(dst)] != self.pool.page_digests(src):
                outcome.ok, outcome.error = False, "pages arrived wrong (crc32 mismatch)"
            at += len(dst)
        self.batch.clear()


@dataclass
class _Flight:
    outcome: Outcome
    src: list[int]
    dst: list[int]
    sender: Transfer
    sent: bool = False


def _outcome(p: Planned, settings: TraceSettings) -> Outcome:
    return Outcome(p.request.index, p.request.bucket, p.pages * settings.page_bytes, p.arrival_s)


def _replay(
    name: str,
    conn: Connection,
    peer: PeerProcess,
    pool: KVPool,
    planned: Sequence[Planned],
    settings: TraceSettings,
    timeout: float,
    progress: TextIO | None,
    tag_prefix: str,
) -> Pass:
    """One kvtransport pass (its tags start with ``tag_prefix``: unique on the connection).
    Requests are admitted in arrival order once decode pages are free for them; when the
    ring of pages runs out, admissions wait until the requests in flight ended, then the
    pass pauses (:class:`Checker`)."""
    rng = np.random.default_rng(settings.seed)
    ring = Ring(pool.num_pages, rng)
    checker = Checker(peer, pool, ring, timeout)
    result = Pass(name)
    waiting: collections.deque[Planned] = collections.deque()
    flights: dict[str, _Flight] = {}
    epoch = time.monotonic()
    deadline = epoch + (planned[-1].arrival_s if planned else 0.0) + timeout
    nxt = 0
    while nxt < len(planned) or waiting or flights:
        now = time.monotonic()
        if now > deadline:
            raise KVTransportError(
                f"trace replay ({name}): {len(flights) + len(waiting)} requests still open, none ended for "
                f"{timeout:g} s after the last arrival"
            )
        while nxt < len(planned) and epoch + planned[nxt].arrival_s <= now:
            waiting.append(planned[nxt])
            nxt += 1
        if waiting and not flights and not ring.fits(waiting[0].pages):
            paused = checker.pause()
            epoch += paused
            deadline += paused
        announce: dict[str, list[int]] = {}
        while waiting and ring.fits(waiting[0].pages):
            p = waiting.popleft()
            tag = f"{tag_prefix}{p.request.index}"
            dst = ring.take(p.pages)
            src = sorted(rng.choice(pool.num_pages, p.pages, replace=False).tolist())
            flights[tag] = _Flight(_outcome(p, settings), src, dst, conn.sender(tag))
            announce[tag] = dst
        # The decode side is asked about a request once this side's writes ended (its own
        # clock stamps when it saw it complete, so asking later changes no figure).
        collect = [tag for tag, f in flights.items() if f.sent and f.sender.state.final]
        ended_now: dict[str, Any] = {}
        if announce or collect:
            ended_now = peer.call("replay", expect=announce, collect=collect, timeout=timeout)["ended"]
        if ended_now:
            # A stall, not a slow backlog, ends the replay: the deadline moves with progress.
            deadline = max(deadline, time.monotonic() + timeout)
        for tag, ended in ended_now.items():
            f = flights.pop(tag)
            state = ended["state"]
            f.outcome.finished_s = float(ended["finished"]) - epoch
            f.outcome.ok = state[0] == "SUCCESS" and not f.outcome.error
            f.outcome.error = f.outcome.error or ("" if f.outcome.ok else f"{state[1]}: {state[2]}")
            result.outcomes.append(f.outcome)
            checker.note(f.outcome, f.src, f.dst)
            if progress is not None and len(result.outcomes) % 50 == 0:
                progress.write(f"\r  {name}: {len(result.outcomes)}/{len(planned)} requests")
                progress.flush()
        for f in flights.values():
            if f.sent or f.sender.state is State.BOOTSTRAPPING:
                continue
            f.outcome.sent_s = time.monotonic() - epoch
            f.sent = True  # (sent or failed: either way the decode side's end is collected)
            if f.sender.state is State.WAITING_FOR_INPUT:
                try:
                    f.sender.send(f.src, last=True)
                except KVTransportError as exc:
                    f.outcome.error = f"{type(exc).__name__}: {exc}"
        if not announce and not ended_now:
            wake = epoch + planned[nxt].arrival_s if nxt < len(planned) else math.inf
            time.sleep(max(0.0, min(IDLE_S, wake - time.monotonic())))
    result.wall_s = max((o.finished_s for o in result.outcomes), default=0.0)
    result.cpu_s = checker.finish()
    result.pauses = checker.pauses
    if progress is not None:
        progress.write("\n")
    result.outcomes.sort(key=lambda o: o.index)
    return result


def _replay_raw(
    name: str,
    raw: RawEngine,
    peer: PeerProcess,
    pool: KVPool,
    peer_regions: Any,
    planned: Sequence[Planned],
    settings: TraceSettings,
    max_run_bytes: int | None,
    timeout: float,
) -> Pass:
    """The same arrivals through the raw engine, one request after another in arrival order
    (a plain FIFO client), the same pauses to check as kvtransport's pass."""
    rng = np.random.default_rng(settings.seed)
    ring = Ring(pool.num_pages, rng)
    checker = Checker(peer, pool, ring, timeout)
    result = Pass(name)
    epoch = time.monotonic()
    for p in planned:
        if not ring.fits(p.pages):
            epoch += checker.pause()
        dst = ring.take(p.pages)
        src = sorted(rng.choice(pool.num_pages, p.pages, replace=False).tolist())
        outcome = _outcome(p, settings)
        wait = epoch + p.arrival_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        outcome.sent_s = time.monotonic() - epoch
        try:
            raw.write(plan(pool.regions.kv, peer_regions, src, dst, max_run_bytes=max_run_bytes))
            outcome.ok = True
        except Exception as exc:  # noqa: BLE001 - the engine's own error, reported per request
            outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.finished_s = time.monotonic() - epoch
        result.outcomes.append(outcome)
        checker.note(outcome, src, dst)
    result.wall_s = max((o.finished_s for o in result.outcomes), default=0.0)
    result.cpu_s = checker.finish()
    result.pauses = checker.pauses
    return result


def run(
    settings: TraceSettings, *, driver: str | None = None, timeout: float = 120.0, progress: TextIO | None = None
) -> dict[str, Any]:
    """Replay the trace; the report as a dict (``render`` prints it)."""
    planned = prepare(settings)
    page_bytes = settings.page_bytes
    largest = max(p.pages for p in planned)
    pool_pages = max(math.ceil(settings.pool_gib * GiB / page_bytes), 2 * largest)
    workload = Workload(
        layers=settings.layers,
        kv_heads=settings.kv_heads,
        head_dim=settings.head_dim,
        dtype_bytes=settings.dtype_bytes,
        page_tokens=settings.page_tokens,
        prompt_tokens=pool_pages * settings.page_tokens,
        requests=len(planned),
        pool_factor=1,
        seed=settings.seed,
    )
    if progress is not None:
        progress.write(f"filling {pool_pages * page_bytes / GiB:.2f} GiB of prefill KV\n")
    pool = KVPool(pool_pages, workload.regions, workload.item_len, 0, shared=False)
    pairs: list[tuple[Endpoint, PeerProcess | None]] = []
    raw: RawEngine | None = None
    try:
        pool.fill(settings.seed)
        endpoint, peer, conn = _open_pair(pool, workload, driver, timeout, pairs)
        assert conn.decision is not None and conn.peer_regions is not None
        decision = conn.decision
        small = [p for p in planned if p.request.bucket == SMALL]
        # The small requests alone: only when the trace has others beside them.
        alone = settings.small_alone and 0 < len(small) < len(planned)
        # Warm-up, untimed (first touches, the lanes' first batches): the first requests at once.
        warm = [dataclasses.replace(p, arrival_s=0.0) for p in planned[: min(16, len(planned))]]
        _replay("warm-up", conn, peer, pool, warm, settings, timeout, None, "w")
        passes = [_replay("kvtransport", conn, peer, pool, planned, settings, timeout, progress, "k")]
        if alone:
            passes.append(
                _replay("kvtransport, small alone", conn, peer, pool, small, settings, timeout, progress, "s")
            )
        raw_cls = raw_engine_of(endpoint.classes[decision.driver]) if settings.baseline else None
        if raw_cls is not None:
            info = peer.call("raw_open", driver=decision.driver, timeout=timeout)["info"]
            raw = raw_cls(pool.regions, endpoint.host)
            raw.connect(base64.b64decode(info))
            args = (peer, pool, conn.peer_regions.kv)
            passes.append(_replay_raw("raw FIFO", raw, *args, planned, settings, endpoint.max_run_bytes, timeout))
            if alone:
                passes.append(
                    _replay_raw("raw FIFO, small alone", raw, *args, small, settings, endpoint.max_run_bytes, timeout)
                )
        return _report(settings, planned, decision.driver, decision.reason, passes)
    finally:
        if raw is not None:
            raw.close()
        close_pairs(pairs)
        pool.close()


def _report(
    settings: TraceSettings, planned: Sequence[Planned], driver: str, reason: str, passes: list[Pass]
) -> dict[str, Any]:
    by_name = {p.name: p.figures() for p in passes}
    prompt = sum(p.request.input_tokens for p in planned) * settings.token_bytes
    cached = sum(p.cached_tokens for p in planned) * settings.token_bytes

    def p99(name: str, bucket: str | None = None) -> float | None:
        f = by_name.get(name)
        if f is None:
            return None
        section = f["overall"] if bucket is None else f["buckets"].get(bucket, {})
        value = section.get("total_ms", {}).get("p99")
        return None if value is None else float(value)

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    comparisons: dict[str, Any] = {
        "p99_vs_raw": {
            "overall": ratio(p99("kvtransport"), p99("raw FIFO")),
            **{label: ratio(p99("kvtransport", label), p99("raw FIFO", label)) for label, _ in BUCKETS},
        },
        "head_of_line": {
            "kvtransport": ratio(p99("kvtransport", SMALL), p99("kvtransport, small alone", SMALL)),
            "raw FIFO": ratio(p99("raw FIFO", SMALL), p99("raw FIFO, small alone", SMALL)),
        },
    }
    span = planned[-1].arrival_s if planned else 0.0
    return {
        "schema_version": SCHEMA_VERSION,
        "trace": settings.path,
        "settings": dataclasses.asdict(settings),
        "layout": settings.describe(),
        "arrivals": {
            "requests": len(planned),
            "span_s": round(span, 3),
            "rate_per_s": round(len(planned) / span, 3) if span > 0 else None,
            "by_bucket": {label: sum(p.request.bucket == label for p in planned) for label, _ in BUCKETS},
        },
        "prefix_cache": {
            "prompt_bytes": prompt,
            "cached_bytes": cached,
            "hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
        },
        "driver": driver,
        "reason": reason,
        "passes": by_name,
        "comparisons": comparisons,
        "integrity": {
            "ok": all(p.outcomes and all(o.ok for o in p.outcomes) for p in passes),
            "verified": {p.name: sum(o.ok for o in p.outcomes) for p in passes},
        },
    }


def render(doc: dict[str, Any]) -> str:
    s, a, c = doc["settings"], doc["arrivals"], doc["prefix_cache"]
    how = f"Poisson at {s['rate']:g}/s" if s["rate"] else f"the trace's timestamps / {s['speedup']:g}"
    lines = [
        f"kvtransport bench --trace {doc['trace']}: open loop, prefill -> decode, two processes on loopback",
        f"  arrivals    {a['requests']} requests over {a['span_s']:.1f} s ({how}); "
        + ", ".join(f"{k} {v}" for k, v in a["by_bucket"].items()),
        f"  layout      {doc['layout']}",
        f"  prefix      decode cache {s['decode_cache_gib']:g} GiB: {c['hit_ratio']:.0%} of prompt KV cached, "
        f"{(c['prompt_bytes'] - c['cached_bytes']) / GiB:.2f} GiB of {c['prompt_bytes'] / GiB:.2f} GiB moved",
        f"  driver      {doc['driver']}: {doc['reason']}",
        "  latency, arrival -> decode Success (ms)   p50      p90      p99      max   queued p99  wire p99"
        "    GB/s  CPU s/GB pre/dec",
    ]
    for name, f in doc["passes"].items():
        o = f["overall"]
        if o["requests"] == 0:
            lines.append(f"  {name:<38} no request completed")
            continue
        t, q, w = o["total_ms"], o["queued_ms"], o["wire_ms"]
        cpu = f.get("cpu_s_per_gb", {})
        cpu_text = f"{cpu.get('prefill', 0):.2f}/{cpu.get('decode', 0):.2f}" if cpu else "-"
        lines.append(
            f"  {name:<38}{t['p50']:8.1f} {t['p90']:8.1f} {t['p99']:8.1f} {t['max']:8.1f} {q['p99']:11.1f} "
            f"{w['p99']:9.1f} {f['gbps']:7.2f}  {cpu_text}"
        )
    lines.append("  p99 by input length (ms)  " + "  ".join(f"{label:>10}" for label, _ in BUCKETS))
    for name, f in doc["passes"].items():
        cells = []
        for label, _ in BUCKETS:
            b = f["buckets"].get(label, {})
            cells.append(f"{b['total_ms']['p99']:10.1f}" if b.get("requests") else f"{'-':>10}")
        lines.append(f"    {name:<24}" + "  ".join(cells))
    cmp_ = doc["comparisons"]
    vs = cmp_["p99_vs_raw"]
    if vs["overall"] is not None:
        lines.append(
            "  ratio       p99 kvtransport / raw FIFO: "
            + ", ".join(f"{k} {v:.2f}x" for k, v in vs.items() if v is not None)
        )
    hol = cmp_["head_of_line"]
    if any(v is not None for v in hol.values()):
        lines.append(
            f"  head-of-line  {SMALL} requests' p99 in the mix / alone at the same arrivals: "
            + ", ".join(f"{k} {v:.2f}x" for k, v in hol.items() if v is not None)
        )
    paused = {k: f["pauses"] for k, f in doc["passes"].items() if f["pauses"]}
    if paused:
        lines.append(
            "  pauses      the clock stopped to check pages when decode pages ran out ("
            + ", ".join(f"{k} {v}" for k, v in paused.items())
            + "; kvtransport's requests in flight finish first, which queues later ones: --pool-gib)"
        )
    i = doc["integrity"]
    verdict = "OK" if i["ok"] else "FAILED"
    lines.append(
        f"  integrity   {verdict}: "
        + ", ".join(f"{k} {v}/{doc['passes'][k]['requests']}" for k, v in i["verified"].items())
        + " requests verified page by page (crc32)"
    )
    return "\n".join(lines)
