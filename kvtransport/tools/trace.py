"""A serving trace as ``kvtransport bench --trace`` replays it: the requests of a JSON-lines
trace (Mooncake's release format), their arrival times (the trace's own, scaled, or Poisson at
a rate), the decode side's prefix cache that decides how much of each prompt has to move, and
the length buckets the report is cut by.

The trace format is the one of Mooncake's FAST'25 release: one object a line with
``timestamp`` (ms from the start), ``input_length`` and ``output_length`` (tokens) and
``hash_ids`` (one id per 512-token block of the prompt; an id at a position stands for the whole
prefix up to that block, so two prompts share their first k blocks exactly when their first k
ids are equal).
"""

from __future__ import annotations

import collections
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtransport.spi.errors import KVTransportError

#: Tokens per ``hash_ids`` block in Mooncake's trace release.
BLOCK_TOKENS = 512
#: The report's input-length buckets: (label, largest input length in tokens, inclusive).
BUCKETS: tuple[tuple[str, float], ...] = (
    ("<=4k", 4096),
    ("4k-16k", 16384),
    ("16k-64k", 65536),
    (">64k", math.inf),
)
#: The bucket whose requests the head-of-line figures are about.
SMALL = BUCKETS[0][0]


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, as read."""

    index: int
    #: Seconds from the trace's start.
    timestamp_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]

    @property
    def bucket(self) -> str:
        return bucket_of(self.input_tokens)


def bucket_of(tokens: int) -> str:
    for label, top in BUCKETS:
        if tokens <= top:
            return label
    raise AssertionError("the last bucket has no upper bound")


def load(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The requests of the trace's first ``limit`` lines (all: ``None``), in arrival order.
    A missing file or a malformed line raises :class:`KVTransportError` naming the line."""
    p = Path(path)
    if not p.is_file():
        raise KVTransportError(
            f"no trace at {p}: --trace takes a JSON-lines file such as ../shared/traces/mooncake-conversation.jsonl"
        )
    out: list[TraceRequest] = []
    with p.open() as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            out.append(_parse(line, number, len(out), p))
    if not out:
        raise KVTransportError(f"the trace {p} has no request")
    out.sort(key=lambda r: (r.timestamp_s, r.index))
    return out


def _parse(line: str, number: int, index: int, path: Path) -> TraceRequest:
    try:
        doc = json.loads(line)
        timestamp, tokens = float(doc["timestamp"]), int(doc["input_length"])
        output = int(doc.get("output_length", 0))
        blocks = tuple(int(b) for b in doc.get("hash_ids", ()))
        if not (math.isfinite(timestamp) and timestamp >= 0 and tokens > 0 and output >= 0):
            raise ValueError("timestamp, input_length or output_length out of range")
        if len(blocks) != math.ceil(tokens / BLOCK_TOKENS):
            raise ValueError(f"{len(blocks)} hash_ids for {tokens} tokens (one per {BLOCK_TOKENS}-token block)")
    except (ValueError, KeyError, TypeError) as exc:
        raise KVTransportError(f"{path}:{number}: not a trace request ({type(exc).__name__}: {exc})") from None
    return TraceRequest(index, timestamp / 1e3, tokens, output, blocks)


def arrivals(
    requests: Sequence[TraceRequest], *, speedup: float = 1.0, rate: float | None = None, seed: int = 1
) -> list[float]:
    """Each request's arrival, seconds from the replay's start: the trace's timestamps divided
    by ``speedup``, or (``rate``) a Poisson process of ``rate`` requests a second, in the
    trace's order. Non-decreasing; the first is 0."""
    if rate is not None:
        if not rate > 0:
            raise KVTransportError(f"--rate must be positive, not {rate}")
        rng = random.Random(seed)
        t, out = 0.0, []
        for _ in requests:
            out.append(t)
            t += rng.expovariate(rate)
        return out
    if not speedup > 0:
        raise KVTransportError(f"--speedup must be positive, not {speedup}")
    if not requests:
        return []
    start = requests[0].timestamp_s
    return [(r.timestamp_s - start) / speedup for r in requests]


class PrefixCache:
    """The decode side's prefix cache, by block: a prompt whose first k blocks are cached needs
    only the rest moved (SGLang's decode radix cache, vLLM's prefix cache). Least recently used
    blocks go first once ``capacity`` blocks are held; a prompt's blocks are held once it
    arrived. Bounded: never more than ``capacity`` entries."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("a cache holds zero blocks or more")
        self.capacity = capacity
        self._blocks: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def cached_tokens(self, blocks: Sequence[int], tokens: int, page_tokens: int) -> int:
        """How many of a prompt's leading tokens are cached, counted in whole pages and never
        the whole prompt (its last token is always computed, so at least one page moves)."""
        hits = 0
        for block in blocks:
            if block not in self._blocks:
                break
            hits += 1
        cached = min(hits * BLOCK_TOKENS, tokens - 1)
        return cached - cached % page_tokens

    def admit(self, blocks: Iterable[int]) -> None:
        """The prompt arrived: its blocks are held (most recently used), the oldest dropped.
        Its first block is made the most recent, its last the least: as a radix cache evicts
        leaves first, a prefix never loses its head while its tail stays."""
        if self.capacity == 0:
            return
        for block in reversed(list(blocks)):
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def lookup(self, blocks: Sequence[int], tokens: int, page_tokens: int) -> int:
        """:meth:`cached_tokens` then :meth:`admit`: what a request finds, then holds."""
        cached = self.cached_tokens(blocks, tokens, page_tokens)
        self.admit(blocks)
        return cached


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by nearest rank (one of ``values``)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
