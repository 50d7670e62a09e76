"""``kvtransport bench --sweep``: the bench over a grid of workloads, every path side by side.

A grid is model presets x prompt lengths x page sizes x placements x requests in flight. For
every layout (model, page size) the sweep opens, against one prefill pool in this process, a
decode process for kvtransport's own choice (every driver open, negotiated) and one per forced
driver; the raw engines named by those drivers run on the same descriptors kvtransport plans
("raw") and on one descriptor per page and region, as serving engines issue them ("naive");
memcpy of the same bytes in this process is the bound. Each point's repetitions rotate which
path goes first, so a noisy machine's drift hits every path alike, and every request of every
path is checked page by page (and slot by slot for state) on the decode side.

Per point and path: median aggregate bandwidth (the round's bytes over its first send to its
last request's decode Success), p50 and p99 per-request latency, CPU seconds per GB moved
(both processes, from the round's start to its end), and per point the planning time of one
request. Per layout and path: the handshake's time. A point whose pools would exceed
``max_pool_bytes`` is reported as skipped, with the bytes it needs.

This module measures: ``Sweep`` runs a grid's points (the grid, its points and the page draws
are ``sweep_grid``'s) and returns the sweep's document (its entries' shape and the table it is
printed as are ``sweep_report``'s).
"""

from __future__ import annotations

import base64
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TextIO

import numpy as np

from kvtransport.negotiation.registry import load_driver
from kvtransport.runtime.endpoint import Connection, Endpoint, State
from kvtransport.spi.errors import KVTransportError, NegotiationError
from kvtransport.spi.plan import Runs, plan
from kvtransport.tools.baseline import RawEngine, raw_engine_of
from kvtransport.tools.bench import Progress, await_announced, nearest_rank
from kvtransport.tools.bench_remote import listen_url
from kvtransport.tools.kv_pool import KVPool
from kvtransport.tools.peer_process import Peer, PeerProcess
from kvtransport.tools.presets import ModelPreset, preset
from kvtransport.tools.sweep_grid import Grid, MiB, Point, auto_pool_cap, draw_pages, needs, points_of, pool_bytes
from kvtransport.tools.sweep_report import SWEEP_SCHEMA_VERSION, point_doc, verdicts


@dataclass(frozen=True)
class Layout:
    """What one (model, page size) registers, sized for the largest point run at it."""

    preset: ModelPreset
    page_tokens: int
    pool_pages: int
    state_slots: int

    @property
    def item_len(self) -> int:
        return self.preset.page_bytes(self.page_tokens)

    @property
    def state(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((self.state_slots, item, buffers) for item, buffers in self.preset.state)

    def request_bytes(self, pages: int) -> int:
        return self.preset.request_bytes(self.page_tokens, pages)

    def pool(self) -> KVPool:
        return KVPool(
            self.pool_pages,
            self.preset.regions,
            self.item_len,
            0,
            shared=False,
            state=self.state,
            mla=self.preset.kv_per_layer == 1,
            page_tokens=self.page_tokens,
        )

    def peer_args(self, driver: str) -> list[str]:
        args = ["--driver", driver, "--pages", str(self.pool_pages), "--layers", str(self.preset.regions)]
        args += ["--item", str(self.item_len), "--aux-slots", "0", "--private", "--name", "decode"]
        args += ["--page-tokens", str(self.page_tokens)]
        if self.state:
            args += ["--state", json.dumps([list(g) for g in self.state])]
        if self.preset.kv_per_layer == 1:
            args.append("--mla")
        return args


@dataclass
class PathResult:
    """One path at one point: per timed round its seconds and CPU, per request its latency."""

    kind: str  # "kvtransport" | "raw" | "naive" | "memcpy"
    rounds_s: list[float] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    verified: int = 0
    corrupt: int = 0
    descriptor_counts: list[int] = field(default_factory=list)
    drivers: Counter[str] = field(default_factory=Counter)
    error: str = ""

    def figures(self, round_bytes: int) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "verified": self.verified, "corrupt": self.corrupt}
        if self.error:
            out["error"] = self.error
        if self.rounds_s:
            med = statistics.median(self.rounds_s)
            out["median_gbps"] = round(round_bytes / med / 1e9, 3) if med > 0 else 0.0
            out["round_p50_ms"] = round(med * 1e3, 3)
        if self.latencies_s:
            out["p50_ms"] = round(statistics.median(self.latencies_s) * 1e3, 3)
            out["p99_ms"] = round(nearest_rank(self.latencies_s, 0.99) * 1e3, 3)
        if self.cpu_s and round_bytes:
            out["cpu_s_per_gb"] = round(statistics.median(self.cpu_s) / (round_bytes / 1e9), 3)
        if self.descriptor_counts:
            out["descriptors"] = int(statistics.median(self.descriptor_counts))
        if self.drivers:
            out["drivers"] = dict(self.drivers)
        return out


@dataclass
class Pair:
    """A prefill endpoint of this process and its connected decode side."""

    label: str  # "choice" or the forced driver's name
    endpoint: Endpoint
    peer: Peer
    conn: Connection
    connect_s: float
    #: Offset of the peer's monotonic clock against ours (0 on one host), measured per point.
    clock_offset: float = 0.0
    #: CPU seconds per second the peer process spends with nothing to do (reported; not
    #: subtracted, since that process serves this path alone).
    idle_cpu: float = 0.0
    #: Set once the peer's protocol may be out of step (it failed or timed out a command).
    broken: str = ""


PeerFactory = Callable[[list[str]], Peer]
#: What a path's failure can raise: kvtransport's own errors, a peer's failed or timed-out
#: command, a socket's.
PATH_ERRORS = (KVTransportError, RuntimeError, TimeoutError, OSError)


#: The path of the negotiated choice sent layer-wise (``Grid.layerwise``).
LAYERWISE = "layerwise:choice"


@dataclass
class Sweep:
    grid: Grid
    timeout: float = 120.0
    progress: TextIO | None = None
    #: Starts a decode side from ``kvtransport.tools.peer`` arguments (default: a child process).
    spawn: PeerFactory | None = None
    #: Measures a peer's clock offset and returns it (default: none, one host).
    clock_offset: Callable[[Peer], float] | None = None
    #: Where the decode sides run, when not here (``--connect``).
    remote: str = ""
    doc: dict[str, Any] = field(default_factory=dict)
    _rounds: int = 0

    def run(self) -> dict[str, Any]:
        grid = self.grid
        grid.check()
        grid = replace(grid, models=tuple(dict.fromkeys(preset(m).key for m in grid.models)))
        from kvtransport.tools.calibration import usable_drivers

        forced = list(grid.drivers) if grid.drivers is not None else usable_drivers()
        if not forced:
            raise NegotiationError("no driver is usable for host memory here (see kvtransport doctor)")
        cap = grid.max_pool_bytes if grid.max_pool_bytes is not None else auto_pool_cap(2 + len(forced))
        runnable: list[Point] = []
        skipped: list[tuple[Point, int]] = []
        for p in points_of(grid):
            pages, slots = needs(p)
            size = pool_bytes(preset(p.model), p.page_tokens, pages, slots)
            if size <= cap:
                runnable.append(p)
            else:
                skipped.append((p, size))
        self.doc = {
            "schema_version": SWEEP_SCHEMA_VERSION,
            "kind": "sweep",
            "grid": asdict(grid) | {"drivers": forced, "max_pool_bytes": cap},
            "remote": self.remote or None,
            "clock_error_ms": 0.0,
            "layouts": [],
            "points": [],
            "errors": [],
        }
        bar = Progress(len(runnable) * (grid.reps + grid.warmup), self.progress, unit="rounds")
        started = time.monotonic()
        for p, size in skipped:
            self.doc["points"].append(
                point_doc(p)
                | {
                    "skipped": f"needs {size / MiB:.0f} MiB of KV and state per process, more than the cap of "
                    f"{cap / MiB:.0f} MiB (--max-pool-mib)"
                }
            )
        layouts: dict[tuple[str, int], list[Point]] = {}
        for p in runnable:
            layouts.setdefault((p.model, p.page_tokens), []).append(p)
        for (model, page_tokens), at in layouts.items():
            pages = max(needs(p)[0] for p in at)
            slots = max(needs(p)[1] for p in at) if preset(model).state else 0
            self._run_layout(Layout(preset(model), page_tokens, pages, slots), at, forced, bar)
        measured = [p for p in self.doc["points"] if "paths" in p]
        paths = [f for p in measured for f in p["paths"].values()]
        self.doc["seconds"] = round(time.monotonic() - started, 1)
        self.doc["measured"] = len(measured)
        self.doc["integrity_ok"] = bool(measured) and not any(f["corrupt"] for f in paths)
        # Requests moved between the two processes and checked there (memcpy's copies are checked
        # too, but move nothing).
        moved = [(p, f) for p in measured for f in p["paths"].values() if f["kind"] != "memcpy"]
        self.doc["requests_verified"] = sum(f["verified"] * p["in_flight"] for p, f in moved)
        self.doc["bytes_verified"] = sum(f["verified"] * p["in_flight"] * p["request_bytes"] for p, f in moved)
        self.doc["errors"] += [
            f"{p['model']} {p['prompt_tokens']} tokens {p['placement']} x{p['in_flight']} {label}: {f['error']}"
            for p in measured
            for label, f in p["paths"].items()
            if f.get("error")
        ]
        self.doc["ok"] = self.doc["integrity_ok"] and not self.doc["errors"]
        return self.doc

    def _spawn(self, args: list[str]) -> Peer:
        return self.spawn(args) if self.spawn is not None else PeerProcess(*args, timeout=self.timeout)

    def _open_pair(self, label: str, layout: Layout, pool: KVPool, stack: ExitStack) -> Pair:
        classes = None if label == "choice" else {label: load_driver(label)}
        peer = self._spawn(layout.peer_args("auto" if label == "choice" else label))
        stack.callback(peer.close)
        # A peer on another host names the address it reached us on: listen there.
        here = getattr(peer, "local_host", "127.0.0.1")
        endpoint = Endpoint(pool.regions, pool.layout, drivers=classes, name="prefill", listen=listen_url(here))
        stack.callback(endpoint.close)
        try:
            answer = peer.call("connect", address=endpoint.address, timeout=self.timeout)
        except RuntimeError as exc:
            raise NegotiationError(f"the decode side could not connect: {exc}") from None
        conn = endpoint.accept(self.timeout)
        return Pair(label, endpoint, peer, conn, float(answer.get("seconds", 0.0)))

    def _measure_clocks(self, pairs: list[Pair]) -> None:
        if self.clock_offset is None:
            return
        for pair in pairs:
            if not pair.broken:
                pair.clock_offset = self.clock_offset(pair.peer)
                error = float(getattr(pair.peer, "clock_error", 0.0)) * 1e3
                self.doc["clock_error_ms"] = round(max(self.doc["clock_error_ms"], error), 3)

    def _idle_rates(self, pairs: list[Pair], seconds: float = 0.5) -> float:
        """CPU seconds per second this process (returned) and each peer (``Pair.idle_cpu``) use
        with nothing moving. This process's rate, what the other paths' endpoints, engines and
        heartbeats cost meanwhile, is subtracted from each path's CPU."""
        before = {p.label: float(p.peer.call("cpu", timeout=self.timeout)["cpu"]) for p in pairs}
        here = time.process_time()
        time.sleep(seconds)
        rate = (time.process_time() - here) / seconds
        for p in pairs:
            p.idle_cpu = max(0.0, (float(p.peer.call("cpu", timeout=self.timeout)["cpu"]) - before[p.label]) / seconds)
        return rate

    def _run_layout(self, layout: Layout, at: list[Point], forced: list[str], bar: Progress) -> None:
        grid = self.grid
        size = pool_bytes(layout.preset, layout.page_tokens, layout.pool_pages, layout.state_slots)
        bar.note(f"{layout.preset.name}, {layout.page_tokens}-token pages: {size / MiB:.0f} MiB pools")
        with ExitStack() as stack:
            pool = layout.pool()
            stack.callback(pool.close)
            pool.fill(grid.seed)
            pairs: list[Pair] = []
            failed: dict[str, str] = {}
            for label in ["choice", *forced]:
                try:
                    pairs.append(self._open_pair(label, layout, pool, stack))
                except PATH_ERRORS as exc:
                    failed[label] = f"{type(exc).__name__}: {exc}"
                    self.doc["errors"].append(f"{layout.preset.key} {layout.page_tokens}-token pages {label}: {exc}")
            if not pairs:
                return
            raws: dict[str, tuple[RawEngine, Pair]] = {}
            if grid.baselines:
                for pair in pairs:
                    if pair.label == "choice":
                        continue
                    raw_cls = raw_engine_of(pair.endpoint.classes[pair.label])
                    engine = raw_cls.__module__.split(".")[0].removeprefix("kvtransport_") if raw_cls else ""
                    if raw_cls is None or engine in raws:
                        continue
                    try:
                        info = pair.peer.call("raw_open", driver=pair.label, timeout=self.timeout)["info"]
                        raw = raw_cls(pool.regions, pair.endpoint.host)
                        stack.callback(raw.close)
                        raw.connect(base64.b64decode(info))
                        raws[engine] = (raw, pair)
                    except Exception as exc:  # noqa: BLE001 - a raw engine that cannot start is reported
                        self.doc["errors"].append(f"{layout.preset.key}: raw {engine} did not start: {exc}")
            idle_here = self._idle_rates(pairs)
            choice = next((p for p in pairs if p.label == "choice"), None)
            decision = choice.conn.decision if choice is not None else None
            self.doc["layouts"].append(
                {
                    "model": layout.preset.key,
                    "model_name": layout.preset.name,
                    "note": layout.preset.note,
                    "page_tokens": layout.page_tokens,
                    "pool_pages": layout.pool_pages,
                    "state_slots": layout.state_slots,
                    "pool_bytes": size,
                    "choice": {
                        "driver": decision.driver if decision else "",
                        "basis": decision.basis if decision else "",
                        "reason": decision.reason if decision else failed.get("choice", ""),
                        "lanes": list(decision.lanes) if decision else [],
                    },
                    "connect_ms": {p.label: round(p.connect_s * 1e3, 2) for p in pairs},
                    "failed": failed,
                    "idle_cpu_percent": {"prefill": round(idle_here * 100, 1)}
                    | {p.label: round(p.idle_cpu * 100, 1) for p in pairs},
                }
            )
            rng = np.random.default_rng(grid.seed)
            for point in at:
                self._measure_clocks(pairs)
                doc = self._run_point(point, layout, pool, pairs, raws, idle_here, rng, bar)
                self.doc["points"].append(doc)

    def _run_point(
        self,
        point: Point,
        layout: Layout,
        pool: KVPool,
        pairs: list[Pair],
        raws: dict[str, tuple[RawEngine, Pair]],
        idle_here: float,
        rng: np.random.Generator,
        bar: Progress,
    ) -> dict[str, Any]:
        grid, n, k = self.grid, point.pages(), point.in_flight
        round_bytes = k * layout.request_bytes(n)
        results: dict[str, PathResult] = {p.label: PathResult("kvtransport") for p in pairs}
        if grid.layerwise and "choice" in {p.label for p in pairs}:
            results[LAYERWISE] = PathResult("layerwise")
        for engine in raws:
            results[f"raw:{engine}"] = PathResult("raw")
            results[f"naive:{engine}"] = PathResult("naive")
        results["memcpy"] = PathResult("memcpy")
        for p in pairs:
            if p.broken:
                results[p.label].error = p.broken
        labels = list(results)
        by_label = {p.label: p for p in pairs}
        planning: list[float] = []
        copy = _Memcpy(pool, layout, n, k)
        peer_regions = pairs[0].conn.peer_regions
        assert peer_regions is not None
        for rep in range(-grid.warmup, grid.reps):
            src = draw_pages(rng, point.placement, n, k, layout.pool_pages)
            dst = draw_pages(rng, point.placement, n, k, layout.pool_pages)
            slots = layout.state_slots
            src_slots = rng.choice(slots, k, replace=False).tolist() if layout.state else []
            dst_slots = rng.choice(slots, k, replace=False).tolist() if layout.state else []
            work = _Round(src, dst, src_slots, dst_slots, len(layout.state))
            work.expected = [pool.page_digests(s) for s in src]
            work.expected_state = [pool.state_digests(g, src_slots) for g in range(len(layout.state))]
            t0 = time.perf_counter()
            plan(pool.regions.kv, peer_regions.kv, src[0], dst[0])
            planning.append(time.perf_counter() - t0)
            shift = (rep + grid.warmup) % len(labels)
            timed = rep >= 0
            for label in labels[shift:] + labels[:shift]:
                result = results[label]
                if result.error:
                    continue
                pair = by_label.get(label)
                try:
                    if result.kind == "kvtransport":
                        assert pair is not None
                        self._kvtransport_round(pair, work, result, idle_here, timed=timed)
                    elif result.kind == "layerwise":
                        pair = by_label["choice"]
                        if pair.broken:
                            result.error = pair.broken
                            continue
                        self._kvtransport_round(pair, work, result, idle_here, timed=timed, layerwise=True)
                    elif result.kind in ("raw", "naive"):
                        raw, pair = raws[label.partition(":")[2]]
                        if pair.broken:
                            result.error = pair.broken
                            continue
                        self._raw_round(
                            raw, pair, pool, work, result, idle_here, naive=result.kind == "naive", timed=timed
                        )
                    else:
                        copy.round(work, result, idle_here, timed=timed)
                except PATH_ERRORS as exc:
                    result.error = f"{type(exc).__name__}: {exc}"
                    if pair is not None and not isinstance(exc, KVTransportError):
                        pair.broken = f"{label}'s decode side stopped answering: {result.error}"
            bar.step(f"{point.model} {point.prompt_tokens} tok {point.placement} x{k}")
        doc = point_doc(point)
        doc["planning_ms"] = round(statistics.median(planning) * 1e3, 3)
        doc["paths"] = {label: r.figures(round_bytes) for label, r in results.items()}
        doc |= verdicts(doc["paths"])
        return doc

    def _kvtransport_round(
        self, pair: Pair, work: _Round, result: PathResult, idle_here: float, *, timed: bool, layerwise: bool = False
    ) -> None:
        peer, conn, timeout = pair.peer, pair.conn, self.timeout
        self._rounds += 1
        tags = [f"sweep-{self._rounds}-{j}" for j in range(len(work.src))]
        peer.call("poison", pages=work.all_dst, state=work.state_lists(work.dst_slots), timeout=timeout)
        state = {t: work.state_of(work.dst_slots, j) for j, t in enumerate(tags)} if work.groups else {}
        before_peer = peer.call(
            "expect", transfers=dict(zip(tags, work.dst, strict=True)), state=state, timeout=timeout
        )["cpu"]
        senders = [conn.sender(t) for t in tags]
        await_announced(senders, timeout)
        before = time.process_time()
        start = time.monotonic()
        for j, s in enumerate(senders):
            items = work.state_of(work.src_slots, j) if work.groups else None
            if layerwise:
                stream = s.send_layerwise(work.src[j], state=items)
                stream.layers_ready(range(stream.num_layers))
            else:
                s.send(work.src[j], last=True, state=items)
        # Our side first, with the whole timeout: the peer's own wait is short (its default),
        # and a transfer still running when a round gives up would write into the pages the
        # next round poisons and checks.
        end = time.monotonic() + timeout
        for s in senders:
            try:
                s.wait(max(0.0, end - time.monotonic()))
            except KVTransportError:
                pass
        answer = peer.call("wait", tags=tags, timeout=timeout + 5)
        wall = time.monotonic() - start
        # Less what this process spends meanwhile on nothing (the other paths' idle endpoints
        # and engines live here too); the decode process serves this path alone.
        cpu = time.process_time() - before + answer["cpu"] - before_peer - idle_here * wall
        failed = [(t, answer["states"][t]) for t in tags if answer["states"][t][0] != "SUCCESS"]
        if failed or any(s.state is not State.SUCCESS for s in senders):
            for s in senders:
                s.abort("sweep: the round failed")
            for t in tags:
                peer.call("abort", tag=t, reason="sweep: the round failed", timeout=timeout)
            pair.broken = f"{pair.label}: a round did not end in Success ({failed[:1] or 'prefill side'})"
            raise KVTransportError(pair.broken)
        finished = [answer["finished"][t] - pair.clock_offset - start for t in tags]
        ok = self._verified(peer, work)
        if timed:
            result.drivers.update(s.driver for s in senders)
        peer.call("forget", tags=tags, timeout=timeout)
        _record(result, ok, timed, max(finished), finished, cpu)

    def _raw_round(
        self,
        raw: RawEngine,
        pair: Pair,
        pool: KVPool,
        work: _Round,
        result: PathResult,
        idle_here: float,
        *,
        naive: bool,
        timed: bool,
    ) -> None:
        peer, timeout = pair.peer, self.timeout
        regions = pair.conn.peer_regions
        assert regions is not None
        parts = []
        for j in range(len(work.src)):
            cap = pool.item_len if naive else None
            parts.append(plan(pool.regions.kv, regions.kv, work.src[j], work.dst[j], max_run_bytes=cap))
            for g in range(work.groups):
                mine, theirs = pool.regions.state_group(g), regions.state_group(g)
                cap = mine[0].item_len if naive else None
                parts.append(plan(mine, theirs, [work.src_slots[j]], [work.dst_slots[j]], max_run_bytes=cap))
        runs = Runs.concat(parts)
        result.descriptor_counts.append(len(runs) // max(1, len(work.src)))
        before_peer = peer.call("poison", pages=work.all_dst, state=work.state_lists(work.dst_slots), timeout=timeout)[
            "cpu"
        ]
        before = time.process_time()
        start = time.monotonic()
        try:
            raw.write(runs)
        except Exception as exc:  # the raw engine's own error, reported as this path's
            # Its writes may still land: nothing more goes through this peer's pages.
            pair.broken = f"raw engine write failed: {exc}"
            raise KVTransportError(pair.broken) from exc
        seconds = time.monotonic() - start
        cpu = time.process_time() - before + peer.call("cpu", timeout=timeout)["cpu"] - before_peer
        cpu -= idle_here * seconds
        ok = self._verified(peer, work)
        # The raw engine returns when every byte is at the peer: each request's latency (from
        # the round's start to its completion) is the whole batch's.
        _record(result, ok, timed, seconds, [seconds] * len(work.src), cpu)

    def _verified(self, peer: Peer, work: _Round) -> bool:
        got = peer.call("digests", pages=work.all_dst, timeout=self.timeout)["digests"]
        if got != [d for e in work.expected for d in e]:
            return False
        return all(
            peer.call("state_digests", group=g, items=work.dst_slots, timeout=self.timeout)["digests"]
            == work.expected_state[g]
            for g in range(work.groups)
        )


def _record(result: PathResult, ok: bool, timed: bool, round_s: float, latencies: list[float], cpu: float) -> None:
    if not ok:
        result.corrupt += 1  # warm-up rounds included: a wrong byte is never forgiven
    elif timed:
        result.verified += 1
    if timed:
        result.rounds_s.append(round_s)
        result.latencies_s += latencies
        result.cpu_s.append(max(0.0, cpu))


@dataclass
class _Round:
    """One repetition's requests: per request its pages (and state slots) on each side."""

    src: list[list[int]]
    dst: list[list[int]]
    src_slots: list[int]
    dst_slots: list[int]
    groups: int
    expected: list[list[int]] = field(default_factory=list)
    expected_state: list[list[int]] = field(default_factory=list)  # per group, per request

    @property
    def all_dst(self) -> list[int]:
        return [p for d in self.dst for p in d]

    def state_of(self, slots: list[int], j: int) -> list[list[int]]:
        return [[slots[j]] for _ in range(self.groups)]

    def state_lists(self, slots: list[int]) -> list[list[int]]:
        return [list(slots) for _ in range(self.groups)] if self.groups else []


class _Memcpy:
    """The bound: each request's bytes copied in this process, region by region, one
    contiguous copy of as many bytes as the request holds in each region (from where its
    first page lies, so rounds do not reuse one cached source), into a destination of the
    whole round's size; then each copy is checked against its source."""

    def __init__(self, pool: KVPool, layout: Layout, n: int, k: int) -> None:
        self.pool, self.n, self.k = pool, n, k
        self.size = n * layout.item_len
        self.items = [item for item, _ in layout.preset.state]
        # Per request: one copy of its pages per KV region, one of its slot per state buffer.
        self.lengths = [self.size] * len(pool.buffers) + [
            i for i, g in zip(self.items, pool.state_buffers, strict=True) for _ in g
        ]
        self.dst = np.empty(layout.request_bytes(n) * k, np.uint8)

    def round(self, work: _Round, result: PathResult, idle_here: float, *, timed: bool) -> None:
        pool, size = self.pool, self.size
        spans: list[tuple[Any, int, int]] = []  # (source array, its offset, destination offset)
        at = 0
        for j in range(self.k):
            first = min(work.src[j][0], pool.num_pages - self.n) * pool.item_len
            for b in pool.buffers:
                spans.append((b.array, first, at))
                at += size
            slot = work.src_slots[j] if work.src_slots else 0
            for item, group in zip(self.items, pool.state_buffers, strict=True):
                for b in group:
                    spans.append((b.array, slot * item, at))
                    at += item
        lengths = self.lengths
        before = time.process_time()
        start = time.monotonic()
        latencies, per = [], len(lengths)
        for j in range(self.k):
            for (array, offset, to), length in zip(spans[j * per : (j + 1) * per], lengths, strict=True):
                np.copyto(self.dst[to : to + length], array[offset : offset + length])
            latencies.append(time.monotonic() - start)
        seconds = time.monotonic() - start
        cpu = time.process_time() - before - idle_here * seconds
        ok = all(
            np.array_equal(self.dst[to : to + length], array[offset : offset + length])
            for (array, offset, to), length in zip(spans, lengths * self.k, strict=True)
        )
        _record(result, ok, timed, seconds, latencies, cpu)
