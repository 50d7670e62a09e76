"""The sweep's workload model: what ``kvtransport bench --sweep`` sweeps and how.

A ``Grid`` names the axes (model presets x prompt lengths x page sizes x placements x requests
in flight) and the rounds per point; ``FULL`` and ``QUICK`` are the command line's two grids,
``with_overrides`` one with the axes a user named. Each combination is a ``Point``; what one
process's pools need for it (``needs``, ``pool_bytes``) against the cap (the grid's, or
``auto_pool_cap``'s share of this host's memory) says whether it runs or is skipped.
``draw_pages`` draws each round's requests for a placement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvtransport.spi.errors import ConfigError
from kvtransport.tools.presets import ModelPreset, preset

MiB, GiB = 1 << 20, 1 << 30
PLACEMENTS = ("contiguous", "scattered", "mixed")
#: Mean run length, in pages, of the "mixed" placement (runs drawn geometric, at least 1).
MIXED_MEAN_RUN = 8


@dataclass(frozen=True)
class Grid:
    models: tuple[str, ...]
    tokens: tuple[int, ...]
    page_tokens: tuple[int, ...]
    placements: tuple[str, ...]
    in_flight: tuple[int, ...]
    reps: int = 5
    #: Untimed (still verified) rounds at each point first.
    warmup: int = 1
    #: Forced drivers (``None``: every driver usable for host memory here).
    drivers: tuple[str, ...] | None = None
    #: Raw engines on kvtransport's descriptors and on one descriptor per page.
    baselines: bool = True
    #: The negotiated choice again, each request sent layer-wise (``Transfer.send_layerwise``,
    #: the default policy) with every layer marked at once: what layer-wise posting costs when
    #: there is no compute to overlap (``bench --layerwise`` measures the overlap).
    layerwise: bool = True
    #: The most KV and state memory one process's pool may take at a layout (``None``: a share
    #: of this host's available memory, :func:`auto_pool_cap`).
    max_pool_bytes: int | None = None
    seed: int = 1

    def check(self) -> None:
        for key in self.models:
            preset(key)
        bad = [p for p in self.placements if p not in PLACEMENTS]
        if bad:
            raise ConfigError(f"unknown placement {bad[0]!r}; known: {', '.join(PLACEMENTS)}")
        for what, values in (("tokens", self.tokens), ("page sizes", self.page_tokens), ("in flight", self.in_flight)):
            if not values or min(values) < 1:
                raise ConfigError(f"the sweep's {what} must be positive integers")
        if not (self.models and self.placements) or self.reps < 1 or self.warmup < 0:
            raise ConfigError("the sweep needs a model, a placement, and at least one repetition")


#: ``kvtransport bench --sweep``: the full grid (a long run: see docs/performance.md).
FULL = Grid(
    models=("llama-3-8b", "llama-3-70b-tp8", "deepseek-v3-mla", "qwen3-next-tp2"),
    tokens=(16, 512, 4096, 32768),
    page_tokens=(16, 64),
    placements=PLACEMENTS,
    in_flight=(1, 8, 64),
)
#: ``--sweep --quick``: every model and placement, short requests (about 6 minutes on a 2-core host).
QUICK = Grid(
    models=FULL.models,
    tokens=(16, 512),
    page_tokens=(16,),
    placements=PLACEMENTS,
    in_flight=(1, 4),
    reps=3,
    max_pool_bytes=512 * MiB,
)


@dataclass(frozen=True)
class Point:
    model: str
    page_tokens: int
    prompt_tokens: int
    placement: str
    in_flight: int

    def pages(self) -> int:
        return math.ceil(self.prompt_tokens / self.page_tokens)


def pool_bytes(p: ModelPreset, page_tokens: int, pages: int, slots: int) -> int:
    """Bytes of KV and state one process registers for ``pages`` pages and ``slots`` slots."""
    return p.kv_bytes(page_tokens, pages) + slots * p.state_bytes


def points_of(grid: Grid) -> list[Point]:
    return [
        Point(m, pt, t, pl, k)
        for m in grid.models
        for pt in grid.page_tokens
        for t in grid.tokens
        for pl in grid.placements
        for k in grid.in_flight
    ]


def needs(point: Point) -> tuple[int, int]:
    """Pool pages and state slots one process needs for ``point``: room for one more request
    than are in flight, so each round's requests are drawn from a pool with free pages left."""
    k = point.in_flight
    return point.pages() * (k + 1), 2 * k


def draw_pages(rng: np.random.Generator, placement: str, n: int, k: int, total: int) -> list[list[int]]:
    """``k`` requests of ``n`` pages each, pairwise disjoint, from a pool of ``total`` pages
    (at least ``n * k``). Contiguous: each request one run at a random place. Scattered: pages
    drawn uniformly, each request's sorted (a busy allocator's free list). Mixed: runs of
    geometric length (mean :data:`MIXED_MEAN_RUN` pages) at random places, visited in random
    order."""
    if n * k > total:
        raise ValueError(f"{k} requests of {n} pages do not fit in {total} pages")
    if placement == "contiguous":
        # k runs of n pages with the free pages spread between them at random.
        gaps = np.sort(rng.integers(0, total - n * k + 1, k))
        order = rng.permutation(k)
        return [list(range(int(gaps[j] + n * j), int(gaps[j] + n * j + n))) for j in order]
    if placement == "scattered":
        chosen = rng.choice(total, n * k, replace=False)
        return [sorted(chosen[j * n : (j + 1) * n].tolist()) for j in range(k)]
    if placement == "mixed":
        lengths: list[int] = []
        while sum(lengths) < n * k:
            lengths.append(int(rng.geometric(1 / MIXED_MEAN_RUN)))
        lengths[-1] -= sum(lengths) - n * k
        lengths = [x for x in lengths if x > 0]
        free = total - n * k
        cuts = np.sort(rng.integers(0, free + 1, len(lengths)))
        starts, at = [], 0
        for length, gap in zip(lengths, cuts, strict=True):
            starts.append(int(gap) + at)
            at += length
        runs = [list(range(s, s + length)) for s, length in zip(starts, lengths, strict=True)]
        flat = [p for j in rng.permutation(len(runs)) for p in runs[j]]
        return [flat[j * n : (j + 1) * n] for j in range(k)]
    raise ConfigError(f"unknown placement {placement!r}")


def auto_pool_cap(processes: int) -> int:
    """The pool cap when the grid names none: 60% of this host's available memory shared by
    the sweep's processes (this one and one per decode side), between 256 MiB and 8 GiB."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        avail = 8 * GiB
    return max(256 * MiB, min(8 * GiB, int(avail * 0.6) // max(1, processes)))


def with_overrides(base: Grid, **changes: Any) -> Grid:
    """``base`` with the axes the user named on the command line."""
    return replace(base, **{k: v for k, v in changes.items() if v is not None})
