"""``kvtransport bench --trace``: the trace reader, the arrivals, the decode side's prefix cache
(hypothesis), and a short open-loop replay of Mooncake's production trace on real engines."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport.spi.errors import KVTransportError
from kvtransport.tools import bench_trace
from kvtransport.tools.trace import (
    BLOCK_TOKENS,
    BUCKETS,
    PrefixCache,
    TraceRequest,
    arrivals,
    bucket_of,
    load,
    quantile,
)

from .conftest import require_engines, run_cli

#: Mooncake's conversation trace, where CI and the README put it (never copied into the project).
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake-conversation.jsonl"


def _line(timestamp: float, tokens: int, blocks: list[int] | None = None) -> str:
    ids = blocks if blocks is not None else list(range(math.ceil(tokens / BLOCK_TOKENS)))
    return json.dumps({"timestamp": timestamp, "input_length": tokens, "output_length": 7, "hash_ids": ids})


def test_a_trace_is_read_in_arrival_order_with_seconds_and_blocks(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([_line(2000, 600, [0, 1]), _line(0, 512, [0]), "", _line(1000, 1025, [0, 5, 6])]))
    reqs = load(path)
    assert [(r.index, r.timestamp_s, r.input_tokens, r.blocks) for r in reqs] == [
        (1, 0.0, 512, (0,)),
        (2, 1.0, 1025, (0, 5, 6)),
        (0, 2.0, 600, (0, 1)),
    ]
    assert [r.index for r in load(path, limit=2)] == [1, 0]


@pytest.mark.parametrize(
    "line, why",
    [
        ("{not json", "JSONDecodeError"),
        (json.dumps({"timestamp": 0, "hash_ids": []}), "input_length"),
        (_line(-5, 512), "out of range"),
        (_line(0, 0, []), "out of range"),
        (_line(0, 1024, [1]), "1 hash_ids for 1024 tokens"),
        (json.dumps({"timestamp": "soon", "input_length": 5, "hash_ids": [1]}), "ValueError"),
    ],
)
def test_a_malformed_trace_line_is_named_with_the_reason(tmp_path: Path, line: str, why: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(_line(0, 512) + "\n" + line + "\n")
    with pytest.raises(KVTransportError, match=rf"bad.jsonl:2: not a trace request .*{why}"):
        load(path)


def test_a_missing_or_empty_trace_says_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(KVTransportError, match=r"no trace at .*JSON-lines"):
        load(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(KVTransportError, match="has no request"):
        load(tmp_path / "empty.jsonl")


def test_buckets_cut_at_4k_16k_64k_tokens() -> None:
    assert [bucket_of(n) for n in (1, 4096, 4097, 16384, 16385, 65536, 65537, 126195)] == [
        "<=4k",
        "<=4k",
        "4k-16k",
        "4k-16k",
        "16k-64k",
        "16k-64k",
        ">64k",
        ">64k",
    ]
    assert [label for label, _ in BUCKETS] == ["<=4k", "4k-16k", "16k-64k", ">64k"]


def _requests(times: list[float]) -> list[TraceRequest]:
    return [TraceRequest(i, t, 512, 1, (i,)) for i, t in enumerate(sorted(times))]


@given(st.lists(st.floats(0, 1e4), min_size=1, max_size=50), st.floats(0.1, 100))
def test_arrivals_are_the_trace_timestamps_scaled_from_zero(times: list[float], speedup: float) -> None:
    reqs = _requests(times)
    got = arrivals(reqs, speedup=speedup)
    assert got[0] == 0.0
    assert got == sorted(got)
    for r, t in zip(reqs, got, strict=True):
        assert t == pytest.approx((r.timestamp_s - reqs[0].timestamp_s) / speedup, abs=1e-9)


def test_poisson_arrivals_have_the_asked_rate() -> None:
    got = arrivals(_requests([0.0] * 5000), rate=50.0, seed=3)
    gaps = [b - a for a, b in itertools.pairwise(got)]
    assert got[0] == 0.0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.05)
    with pytest.raises(KVTransportError, match="--rate must be positive"):
        arrivals(_requests([0.0]), rate=0)
    with pytest.raises(KVTransportError, match="--speedup must be positive"):
        arrivals(_requests([0.0]), speedup=0)


prompts = st.lists(
    st.tuples(st.lists(st.integers(0, 30), min_size=1, max_size=12), st.integers(0, BLOCK_TOKENS - 1)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=200)
@given(prompts, st.integers(0, 40), st.sampled_from([1, 16, 64]))
def test_the_prefix_cache_is_bounded_and_counts_leading_cached_blocks_only(
    seq: list[tuple[list[int], int]], capacity: int, page: int
) -> None:
    """Against a model: a prompt's cached tokens are its leading blocks that were held just
    before it, in whole pages, never the whole prompt; the cache never holds more than its
    capacity, and holds a prompt's first blocks at least as long as its later ones."""
    cache = PrefixCache(capacity)
    for blocks, short in seq:
        tokens = len(blocks) * BLOCK_TOKENS - short
        held = {b for b in blocks if b in cache}
        lead = 0
        while lead < len(blocks) and blocks[lead] in held:
            lead += 1
        cached = cache.lookup(blocks, tokens, page)
        expect = min(lead * BLOCK_TOKENS, tokens - 1)
        assert cached == expect - expect % page
        assert 0 <= cached < tokens and cached % page == 0
        assert len(cache) <= capacity
        if capacity >= len(set(blocks)):
            assert all(b in cache for b in blocks)


def test_a_prompt_seen_again_moves_only_its_last_page() -> None:
    cache = PrefixCache(100)
    blocks = [7, 8, 9]
    assert cache.lookup(blocks, 1500, 16) == 0
    assert cache.lookup(blocks, 1500, 16) == 1488  # 1499 cached tokens, down to a page
    assert cache.lookup([7, 8, 4], 1500, 16) == 1024  # a shared prefix of two blocks
    assert PrefixCache(0).lookup(blocks, 1500, 16) == 0


def test_quantiles_are_values_by_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (quantile(values, 0.5), quantile(values, 0.99), quantile(values, 1.0)) == (50.0, 99.0, 100.0)
    assert quantile([3.0], 0.99) == 3.0


def test_the_real_trace_is_read_whole() -> None:
    if not TRACE.is_file():
        pytest.skip(f"Mooncake's trace is not at {TRACE} (../shared/traces/ beside the checkout)")
    reqs = load(TRACE)
    assert len(reqs) == 12031
    assert max(r.input_tokens for r in reqs) == 126195
    # The conversation trace reuses prefixes (turns of one conversation): a cache finds some,
    # a larger one more (37% of all prompt tokens with no bound), none without one.
    hits = []
    for gib in (0.0, 4.0, 64.0):
        plan = bench_trace.prepare(bench_trace.TraceSettings(str(TRACE), requests=2000, layers=1, decode_cache_gib=gib))
        assert len(plan) == 2000
        hits.append(sum(p.cached_tokens for p in plan) / sum(p.request.input_tokens for p in plan))
    assert hits[0] == 0.0 < 0.03 < hits[1] < hits[2]


def test_a_short_replay_of_the_trace_is_verified_and_keeps_small_requests_off_large_ones() -> None:
    """150 requests of Mooncake's trace, sped up 20x, open loop over nixl-ucx: every page of
    every request of every pass verified, every request measured; and the head-of-line
    property, by comparison within the run (not by absolute times)."""
    require_engines()
    if not TRACE.is_file():
        pytest.skip(f"Mooncake's trace is not at {TRACE}")
    proc = run_cli(
        "bench",
        *("--trace", str(TRACE), "--requests", "150", "--speedup", "20", "--layers", "1", "--kv-heads", "2"),
        *("--decode-cache-gib", "1", "--pool-gib", "2.5", "--driver", "nixl-ucx", "--json"),
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["schema_version"] == bench_trace.SCHEMA_VERSION
    assert doc["integrity"]["ok"] is True
    passes = doc["passes"]
    assert set(passes) == {"kvtransport", "kvtransport, small alone", "raw FIFO", "raw FIFO, small alone"}
    small = doc["arrivals"]["by_bucket"]["<=4k"]
    assert passes["kvtransport"]["verified"] == passes["raw FIFO"]["verified"] == 150
    assert passes["kvtransport, small alone"]["verified"] == small > 0
    for f in passes.values():
        o = f["overall"]
        assert o["total_ms"]["p50"] <= o["total_ms"]["p99"] <= o["total_ms"]["max"]
        assert o["queued_ms"]["p50"] >= 0 and o["wire_ms"]["p50"] > 0
    assert doc["prefix_cache"]["cached_bytes"] > 0
    assert doc["comparisons"]["p99_vs_raw"]["overall"] > 0
    # Head-of-line, within the run: the raw FIFO client serves a small request after every
    # large one that arrived before it; kvtransport interleaves them. Its small requests' p99
    # grows far less in the mix than the raw client's (measured: 5x against 54x).
    hol = doc["comparisons"]["head_of_line"]
    assert hol["kvtransport"] * 3 < hol["raw FIFO"], hol
    assert doc["comparisons"]["p99_vs_raw"]["<=4k"] < 0.5, doc["comparisons"]


@pytest.mark.parametrize(
    "args, why",
    [
        (["--trace", "/nonexistent/trace.jsonl"], "no trace at /nonexistent/trace.jsonl"),
        (["--trace", str(TRACE), "--rate", "10gbit"], "--rate with --trace is requests a second"),
        (["--trace", str(TRACE), "--hosts", "2"], "--trace runs alone"),
        (["--trace", str(TRACE), "--prefill-tp", "2"], "between one prefill and one decode rank"),
        (["--trace", str(TRACE), "--requests", "0"], "--requests must be positive"),
        (["--trace", str(TRACE), "--requests=0"], "--requests must be positive"),
        (["--trace", str(TRACE), "--listen", "127.0.0.1:0"], "--trace runs alone"),
        (["--trace", str(TRACE), "--prompt-tokens=512"], "--prompt-tokens do not apply to --trace"),
        (["--trace", str(TRACE), "--speedup", "2", "--rate", "5"], "one or the other"),
        (["--trace", str(TRACE), "--decode-cache-gib", "-1"], "--decode-cache-gib must be 0 or more"),
        (["--speedup", "2"], "--speedup need --trace"),
    ],
)
def test_bench_trace_refuses_what_it_cannot_replay_with_the_reason(args: list[str], why: str) -> None:
    proc = run_cli("bench", *args, timeout=60)
    assert proc.returncode != 0
    assert why in proc.stderr, proc.stderr[-2000:]
