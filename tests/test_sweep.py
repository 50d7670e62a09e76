"""``kvtransport bench --sweep``: the grid, the page draws, every path side by side on the real
engines with every byte checked, the plot, and the decode side on another host
(``--listen`` / ``--connect``, on loopback)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtransport.spi.errors import ConfigError, KVTransportError
from kvtransport.tools import sweep, sweep_grid, sweep_report
from kvtransport.tools.bench_remote import Listener, RemotePeer, checked_args
from kvtransport.tools.peer_process import PeerProcess
from kvtransport.tools.presets import PRESETS, preset

from .conftest import require_engines, run_cli

#: Every kind of layout (GQA, MLA, hybrid with state) at short requests, two engines.
TOKEN = "s3cret-s3cret-s3cret"
#: A peer a listener may start quickly: one real engine, no NIXL import.
QUICK_PEER = ["--driver", "mooncake-gdr", "--pages", "8", "--layers", "1"]

SMALL = sweep_grid.Grid(
    models=("llama-3-70b-tp8", "deepseek-v3-mla", "qwen3-next-tp2"),
    tokens=(96,),
    page_tokens=(16,),
    placements=("contiguous", "mixed"),
    in_flight=(2,),
    reps=1,
    warmup=0,
    drivers=("nixl-ucx", "mooncake-staged"),
    max_pool_bytes=256 << 20,
)


@given(
    placement=st.sampled_from(sweep_grid.PLACEMENTS),
    n=st.integers(1, 64),
    k=st.integers(1, 8),
    slack=st.integers(0, 200),
    seed=st.integers(0, 2**32 - 1),
)
def test_drawn_requests_are_disjoint_in_range_and_shaped_by_placement(
    placement: str, n: int, k: int, slack: int, seed: int
) -> None:
    total = n * k + slack
    requests = sweep_grid.draw_pages(np.random.default_rng(seed), placement, n, k, total)
    assert len(requests) == k and all(len(r) == n for r in requests)
    flat = [p for r in requests for p in r]
    assert len(set(flat)) == n * k, "two requests (or one twice) were given the same page"
    assert all(0 <= p < total for p in flat)
    if placement == "contiguous":
        assert all(r == list(range(r[0], r[0] + n)) for r in requests)
    if placement == "scattered":
        assert all(r == sorted(r) for r in requests)


def test_a_mixed_placement_has_runs_of_several_lengths() -> None:
    rng = np.random.default_rng(3)
    (pages,) = sweep_grid.draw_pages(rng, "mixed", 4096, 1, 3 * 4096)
    breaks = np.flatnonzero(np.diff(pages) != 1)
    lengths = np.diff(np.concatenate([[-1], breaks, [len(pages) - 1]]))
    assert 1 < len(lengths) < 4096
    assert len(set(lengths.tolist())) > 5
    assert 4 < lengths.mean() < 16  # mean run length MIXED_MEAN_RUN = 8, give or take


def test_a_request_that_does_not_fit_and_an_unknown_grid_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        sweep_grid.draw_pages(np.random.default_rng(0), "scattered", 10, 3, 29)
    with pytest.raises(ConfigError, match="unknown model preset"):
        sweep_grid.Grid(("llama-9",), (16,), (16,), ("mixed",), (1,)).check()
    with pytest.raises(ConfigError, match="unknown placement"):
        sweep_grid.Grid(("llama-3-8b",), (16,), (16,), ("diagonal",), (1,)).check()
    with pytest.raises(ConfigError, match="positive"):
        sweep_grid.Grid(("llama-3-8b",), (16,), (0,), ("mixed",), (1,)).check()


@pytest.mark.parametrize(
    ("key", "regions", "page_bytes", "request_bytes"),
    [
        # 32 layers x K,V; 16 tokens x 8 heads x 128 x bf16 a page; a 4096-token request: 512 MiB.
        ("llama-3-8b", 64, 32768, 512 << 20),
        # one TP-8 rank: 80 layers x K,V of 1 head x 128: 160 regions of 4 KiB pages.
        ("llama-3-70b-tp8", 160, 4096, 160 << 20),
        # 61 layers of one latent row (512 + 64) x bf16 per token.
        ("deepseek-v3-mla", 61, 16 * 576 * 2, 61 * 256 * 16 * 576 * 2),
        # 12 attention layers x K,V of 1 head x 256, plus 36 x (24 KiB conv + 1 MiB fp32 ssm).
        ("qwen3-next-tp2", 24, 8192, 24 * 256 * 8192 + 36 * (24576 + (1 << 20))),
    ],
)
def test_presets_describe_real_per_rank_layouts(key: str, regions: int, page_bytes: int, request_bytes: int) -> None:
    p = preset(key)
    assert p.regions == regions and p.page_bytes(16) == page_bytes
    assert p.request_bytes(16, 256) == request_bytes  # 4096 tokens
    assert preset(key.upper()) is p


def test_points_over_the_memory_cap_are_reported_skipped_with_their_need() -> None:
    # 32k-token Llama-3-8B requests need 4 GiB each: over a 64 MiB cap, reported, never opened.
    grid = sweep_grid.Grid(
        ("llama-3-8b",), (32768,), (16,), ("scattered",), (1,), max_pool_bytes=64 << 20, drivers=("nixl-ucx",)
    )
    # No point is runnable, so no process may start.
    runner = sweep.Sweep(grid, spawn=_no_spawn)
    doc = runner.run()
    (point,) = doc["points"]
    assert "needs 8192 MiB" in point["skipped"] and "cap of 64 MiB" in point["skipped"]
    assert doc["layouts"] == []
    # Nothing measured is not a pass.
    assert doc["ok"] is False and "no point was measured" in sweep_report.render(doc)


def _no_spawn(args: list[str]) -> Any:
    raise AssertionError("a skipped point started a decode side")


def _check_paths(doc: dict[str, Any], grid: sweep_grid.Grid) -> None:
    assert doc["schema_version"] == sweep_report.SWEEP_SCHEMA_VERSION and doc["kind"] == "sweep"
    measured = [p for p in doc["points"] if "paths" in p]
    assert len(measured) == len(sweep_grid.points_of(grid))
    for p in measured:
        paths = p["paths"]
        assert set(paths) >= {"choice", *(grid.drivers or ()), "memcpy"}
        for label, f in paths.items():
            assert not f.get("error"), (label, f)
            assert f["verified"] == grid.reps and f["corrupt"] == 0, (label, f)
            assert f["median_gbps"] > 0 and f["p50_ms"] > 0 and f["p99_ms"] >= f["p50_ms"]
            assert f["cpu_s_per_gb"] > 0
        assert sum(paths["choice"]["drivers"].values()) == grid.reps * p["in_flight"]
        assert p["best_forced"] in (grid.drivers or ())
        assert p["ratio_choice_best"] > 0 and p["ratio_best_memcpy"] > 0 and p["planning_ms"] > 0
    for layout in doc["layouts"]:
        assert set(layout["connect_ms"]) == {"choice", *(grid.drivers or ())}
        assert all(ms > 0 for ms in layout["connect_ms"].values())
    assert doc["integrity_ok"] is True and doc["ok"] is True and not doc["errors"]
    # every path but memcpy moved every request of every timed round between the processes
    assert doc["requests_verified"] == sum((len(p["paths"]) - 1) * grid.reps * p["in_flight"] for p in measured)


def test_the_sweep_measures_every_path_on_real_engines_with_every_byte_checked(tmp_path: Path) -> None:
    require_engines()
    doc = sweep.Sweep(SMALL, timeout=120).run()
    _check_paths(doc, SMALL)
    hybrid = [p for p in doc["points"] if p["model"] == "qwen3-next-tp2"]
    # The hybrid's requests carry their state slots: the raw engines moved them as descriptors too.
    assert all(p["paths"]["raw:nixl"]["descriptors"] >= 72 for p in hybrid)
    mla = next(p for p in doc["points"] if p["model"] == "deepseek-v3-mla")
    assert mla["request_bytes"] == 6 * 61 * 16 * 576 * 2  # 96 tokens: 6 pages of 61 latent regions
    contiguous = next(p for p in doc["points"] if p["placement"] == "contiguous" and p["prompt_tokens"] == 96)
    # Naive is one descriptor per page and region; kvtransport's plan coalesces runs of pages.
    assert contiguous["paths"]["naive:nixl"]["descriptors"] > contiguous["paths"]["raw:nixl"]["descriptors"]
    text = sweep_report.render(doc)
    assert "integrity   OK" in text and "DeepSeek-V3" in text and "naive:mc" in text
    pytest.importorskip("matplotlib")
    from kvtransport.tools.sweep_plot import plot

    out = tmp_path / "sweep.png"
    plot(doc, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


class _LyingPeer:
    """A real decode process whose page digests are altered once: the sweep must notice."""

    def __init__(self, args: list[str], lie_about: str = "digests") -> None:
        self.inner = PeerProcess(*args, timeout=60)
        self.lied = False
        self.lie_about = lie_about

    def call(self, cmd: str, timeout: float = 60.0, **fields: Any) -> dict[str, Any]:
        answer = self.inner.call(cmd, timeout, **fields)
        if cmd == self.lie_about and not self.lied:
            answer["digests"][0] ^= 1
            self.lied = True
        return answer

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize(("model", "lie_about"), [("llama-3-8b", "digests"), ("qwen3-next-tp2", "state_digests")])
def test_a_corrupted_page_or_state_slot_fails_the_sweep(model: str, lie_about: str) -> None:
    require_engines()
    grid = sweep_grid.Grid(
        (model,), (16,), (16,), ("scattered",), (1,), reps=1, warmup=0, drivers=("nixl-ucx",), baselines=False
    )
    doc = sweep.Sweep(grid, spawn=lambda args: _LyingPeer(args, lie_about)).run()
    assert doc["integrity_ok"] is False and doc["ok"] is False
    (point,) = doc["points"]
    assert sum(f["corrupt"] for f in point["paths"].values()) >= 1
    assert "BAD" in sweep_report.render(doc) and "FAILED" in sweep_report.render(doc)


def test_a_raw_engine_that_writes_nothing_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The raw baselines are verified like kvtransport: the decode pages are poisoned first, so
    a write that never happened cannot pass for one."""
    require_engines()
    from kvtransport_nixl.raw import RawNixl

    monkeypatch.setattr(RawNixl, "write", lambda self, runs: None)
    grid = sweep_grid.Grid(("llama-3-8b",), (32,), (16,), ("mixed",), (1,), reps=1, warmup=0, drivers=("nixl-ucx",))
    doc = sweep.Sweep(grid).run()
    (point,) = doc["points"]
    assert point["paths"]["raw:nixl"]["corrupt"] == 1 and point["paths"]["naive:nixl"]["corrupt"] == 1
    assert point["paths"]["nixl-ucx"]["corrupt"] == 0 and doc["integrity_ok"] is False


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener("127.0.0.1:0", TOKEN, max_pool_bytes=64 << 20)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    yield server
    server.close()
    thread.join(5)


def test_a_sweep_runs_its_decode_sides_through_a_listener(listener: Listener) -> None:
    require_engines()
    grid = sweep_grid.Grid(
        ("llama-3-8b",), (16, 64), (16,), ("mixed",), (1, 2), reps=1, warmup=0, drivers=("mooncake-gdr",)
    )
    runner = sweep.Sweep(
        grid,
        spawn=lambda args: RemotePeer(listener.address, args, TOKEN),
        clock_offset=lambda peer: peer.measure_clock(),  # type: ignore[attr-defined]
        remote=listener.address,
    )
    doc = runner.run()
    _check_paths(doc, grid)
    assert doc["clock_error_ms"] > 0 and doc["remote"] == listener.address
    assert "decode sides at" in sweep_report.render(doc)
    # One host, one monotonic clock: each offset measured is zero within its own error bound.
    peer = RemotePeer(listener.address, QUICK_PEER, TOKEN)
    try:
        for _ in range(3):
            assert abs(peer.measure_clock()) <= peer.clock_error + 2e-4
    finally:
        peer.close()
    _no_peers_left(listener)
    # A client that vanishes without a word (its socket just closes): its peer ends too.
    gone = RemotePeer(listener.address, QUICK_PEER, TOKEN)
    assert listener.peers == 1
    gone.sock.close()
    gone._file.close()
    _no_peers_left(listener)


def _no_peers_left(listener: Listener, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while listener.peers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listener.peers == 0, "a decode process outlived its client"


def test_a_listener_refuses_strangers_foreign_arguments_and_oversized_pools(listener: Listener) -> None:
    require_engines()
    with pytest.raises(KVTransportError, match="token"):
        RemotePeer(listener.address, ["--driver", "mooncake-gdr"], "guess")
    with pytest.raises(KVTransportError, match="real driver"):  # the test drivers map files a peer names
        RemotePeer(listener.address, ["--driver", "fake"], TOKEN)
    with pytest.raises(KVTransportError, match="page-tokens"):
        RemotePeer(listener.address, ["--driver", "auto", "--page-tokens", str(1 << 30)], TOKEN)
    with pytest.raises(KVTransportError, match="buffers"):
        RemotePeer(listener.address, ["--driver", "auto", "--layers", "100000", "--item", "1"], TOKEN)
    with pytest.raises(KVTransportError, match="integer"):
        RemotePeer(listener.address, ["--driver", "auto", "--pages", "\u00b2"], TOKEN)
    with pytest.raises(KVTransportError, match="not allowed"):
        RemotePeer(listener.address, ["--options", '{"x": "y"}'], TOKEN)
    with pytest.raises(KVTransportError, match="exceeds"):
        RemotePeer(
            listener.address, ["--driver", "auto", "--pages", "100000", "--layers", "64", "--item", "32768"], TOKEN
        )
    with pytest.raises(KVTransportError, match="exceeds"):  # aux slots are memory too
        RemotePeer(listener.address, ["--driver", "auto", "--aux-slots", "100000000000"], TOKEN)
    with pytest.raises(KVTransportError, match="must be an integer"):  # no negative to offset a huge state
        RemotePeer(
            listener.address, ["--driver", "auto", "--layers", "-1", "--state", "[[1000, 1000000, 1000]]"], TOKEN
        )
    for state in ("[[1e400, 1, 1]]", "[[1.5, 1, 1]]", "[[Infinity, 1, 1]]", "{}", "[" * 5000):
        with pytest.raises(KVTransportError, match="state"):
            RemotePeer(listener.address, ["--driver", "auto", "--state", state], TOKEN)
    with pytest.raises(KVTransportError, match="token"):
        RemotePeer(listener.address, ["--driver", "mooncake-gdr"], TOKEN[:-1] + "é")
    with pytest.raises(ConfigError, match="at least 16"):
        Listener("127.0.0.1:0", "short")
    # ... and keeps serving the client that has the token.
    peer = RemotePeer(listener.address, QUICK_PEER, TOKEN)
    try:
        assert abs(peer.measure_clock()) <= peer.clock_error + 1e-3
    finally:
        peer.close()


ALLOWED = {"--driver", "--pages", "--layers", "--item", "--aux-slots", "--name", "--page-tokens", "--state"}


@given(st.lists(st.sampled_from([*ALLOWED, "--private", "--mla", "--options", "--device", "--timeouts", "4", "x"])))
def test_listener_arguments_are_whitelisted(args: list[str]) -> None:
    args = ["--driver", "auto", *args]
    try:
        out = checked_args(args, 1 << 40)
    except ConfigError:
        return
    # accepted unchanged but for private memory, or refused
    assert out == (args if "--private" in args else [*args, "--private"])
    i = 0
    while i < len(args):  # every position is a known flag, or the value right after a valued one
        assert args[i] in ALLOWED | {"--private", "--mla"}
        i += 2 if args[i] in ALLOWED else 1


@pytest.mark.parametrize("flag", ["--options", "--device", "--timeouts", "--seed", "--listen"])
def test_listener_refuses_arguments_beyond_the_pool(flag: str) -> None:
    with pytest.raises(ConfigError, match="not allowed"):
        checked_args(["--driver", "auto", flag, "1"], 1 << 30)


def test_sweep_cli_json_and_text(tmp_path: Path) -> None:
    require_engines()
    args = ["bench", "--sweep", "--models", "deepseek-v3-mla", "--tokens", "32", "--placements", "scattered"]
    args += ["--page-sizes", "64"]
    args += ["--concurrency", "1", "--reps", "1", "--warmup", "0", "--drivers", "nixl-ucx", "--no-baseline"]
    proc = run_cli(*args, "--json", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    (point,) = doc["points"]
    # --no-baseline: no raw, no naive; the choice sent layer-wise too
    assert set(point["paths"]) == {"choice", "nixl-ucx", "layerwise:choice", "memcpy"}
    assert point["paths"]["layerwise:choice"]["verified"] == 1 and "ratio_layerwise_choice" in point
    assert "1/1 rounds" in proc.stderr
    text = run_cli(*args, timeout=240)
    assert text.returncode == 0, text.stderr[-3000:]
    assert "deepseek-v3-mla" in text.stdout and "integrity   OK: 3 requests" in text.stdout
    without = run_cli(*args, "--no-layerwise", "--json", timeout=240)
    assert without.returncode == 0, without.stderr[-3000:]
    assert "layerwise:choice" not in json.loads(without.stdout)["points"][0]["paths"]
    ignored = run_cli("bench", "--sweep", "--driver", "nixl-ucx", timeout=60)
    assert ignored.returncode == 2 and "--drivers" in ignored.stderr
    listed = run_cli("bench", "--list-models", timeout=60)
    assert listed.returncode == 0 and all(key in listed.stdout for key in PRESETS)


def test_a_stranger_that_sends_nothing_or_floods_cannot_stop_the_listener(
    listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from kvtransport.tools import bench_remote

    require_engines()
    monkeypatch.setattr(bench_remote, "REQUEST_TIMEOUT_S", 0.5)
    silent = [socket.create_connection(("127.0.0.1", int(listener.address.rsplit(":", 1)[1]))) for _ in range(40)]
    try:
        for conn in silent[:5]:
            conn.sendall(b"{")  # a request that never ends
        import time

        time.sleep(1.0)  # every silent one is past its deadline and dropped
        # ... on a loaded machine perhaps a little later: "busy" (the per-host quota of
        # connections that owe their request) is retried; a stopped listener would never answer.
        deadline = time.monotonic() + 10
        while True:
            try:
                peer = RemotePeer(listener.address, QUICK_PEER, TOKEN)
                break
            except Exception as exc:
                if "busy" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        peer.close()
    finally:
        for conn in silent:
            conn.close()


def test_one_workload_between_hosts_runs_with_the_benchs_own_flags(tmp_path: Path) -> None:
    """``kvtransport bench --connect`` without ``--sweep``: the default 4096-token workload (a
    1 GiB pool per process) is measured, not skipped by the quick grid's cap."""
    require_engines()
    import os
    import subprocess
    import sys
    import time

    env = {**os.environ, "KVTRANSPORT_BENCH_TOKEN": TOKEN}
    log = tmp_path / "listener.log"  # a file, not a pipe: the peers log there too, and never block
    with open(log, "w") as sink:
        server = subprocess.Popen(
            [sys.executable, "-m", "kvtransport.tools.cli", "bench", "--listen", "127.0.0.1:0"], env=env, stderr=sink
        )
    try:
        deadline = time.monotonic() + 30
        while "serving decode sides on" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        line = next(x for x in log.read_text().splitlines() if "serving decode sides on" in x)
        address = line.rsplit(" ", 1)[1].strip()
        proc = run_cli(
            "bench",
            "--connect",
            address,
            "--requests",
            "1",
            "--drivers",
            "nixl-ucx",
            "--no-baseline",
            "--json",
            timeout=240,
            env={"KVTRANSPORT_BENCH_TOKEN": TOKEN},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        doc = json.loads(proc.stdout)
        (point,) = doc["points"]
        assert point["prompt_tokens"] == 4096 and point["paths"]["nixl-ucx"]["verified"] == 1
        assert doc["remote"] == address
    finally:
        server.terminate()
        server.wait(30)


def test_the_plot_draws_a_line_per_path_from_the_sweeps_json(tmp_path: Path) -> None:
    """The plot's own test, on a sweep document made here (the real sweep's, on real engines,
    runs in the full tier): one PNG, and a document without measured points refused."""
    pytest.importorskip("matplotlib")
    from kvtransport.spi.errors import ConfigError
    from kvtransport.tools.sweep_plot import plot

    def path(kind: str, gbps: float) -> dict[str, object]:
        return {"kind": kind, "median_gbps": gbps, "p50_ms": 1.0 / gbps}

    points = [
        {
            "model": model,
            "in_flight": 1,
            "page_tokens": 16,
            "placement": placement,
            "request_bytes": size,
            "paths": {"kvtransport": path("kvtransport", size / 1e6), "raw:nixl": path("raw", size / 2e6)},
        }
        for model in ("llama-3-8b", "deepseek-v3-mla")
        for placement in ("contiguous", "scattered")
        for size in (1 << 20, 8 << 20, 64 << 20)
    ]
    doc = {"points": points, "layouts": [{"model": "llama-3-8b", "model_name": "Llama-3-8B"}]}
    out = tmp_path / "sweep.png"
    plot(doc, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    with pytest.raises(ConfigError, match="no point"):
        plot({"points": [{"model": "x"}], "layouts": []}, str(tmp_path / "empty.png"))
