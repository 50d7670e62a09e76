"""``kvtransport bench``, the main job: real engines in two processes, bytes verified, the raw
engine measured beside it; and the report's arithmetic and verdict."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from typing import Any

import pytest

from kvtransport.spi.errors import KVTransportError
from kvtransport.tools import bench, cli, cpu_pin
from kvtransport.tools.bench import Report, Sample, Workload
from kvtransport.tools.kv_pool import KVPool

from .conftest import require_engines, run_cli

SMALL = ["--requests", "3", "--prompt-tokens", "512", "--layers", "4", "--json"]


@pytest.mark.parametrize("driver", [None, "nixl-ucx", "mooncake-gdr"])
def test_bench_moves_verified_bytes_and_compares_with_the_raw_engine(driver: str | None) -> None:
    require_engines()
    args = ["bench", *SMALL, *(["--driver", driver] if driver else [])]
    proc = run_cli(*args, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    # On this CPU host the negotiation prefers UCX shared memory over Mooncake TCP.
    assert report["driver"] == (driver or "nixl-ucx")
    assert report["integrity"]["ok"] is True
    assert report["integrity"]["requests_verified"] == 3
    assert report["integrity"]["raw_requests_verified"] == 3
    assert report["integrity"]["bytes_verified"] == 3 * 32 * 8 * 32 * 1024  # requests x pages x regions x page bytes
    figures = report["figures"]
    assert report["schema_version"] == bench.SCHEMA_VERSION
    for key in ("end_to_end", "sender", "raw", "memcpy"):
        assert figures[key]["median_gbps"] > 0 and figures[key]["p50_ms"] > 0
    assert figures["ratio_end_to_end"] > 0
    # The memcpy reference moved the same bytes in every measured request.
    assert all(r["runs"] > 0 and r["memcpy_s"] > 0 for r in report["requests"])
    e2e, memcpy = figures["end_to_end"]["median_gbps"], figures["memcpy"]["median_gbps"]
    assert figures["ratio_memcpy"] == pytest.approx(e2e / memcpy, abs=2e-3)


def test_bench_text_report_names_driver_ratio_and_integrity() -> None:
    require_engines()
    proc = run_cli("bench", *SMALL[:-1], "--driver", "nixl-ucx", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "driver      nixl-ucx (shm" in out
    assert "raw engine" in out and "ratio" in out
    assert "memcpy " in out and "(kvtransport / memcpy, medians)" in out
    assert "integrity   OK: 3/3 requests" in out
    assert "3/3 requests" in proc.stderr  # progress went to stderr, not into the report


def test_bench_with_a_driver_that_cannot_serve_exits_with_the_reason() -> None:
    proc = run_cli("bench", *SMALL, "--driver", "cuda-local", timeout=120)
    assert proc.returncode == 2
    assert "cuda-local" in proc.stderr and "CUDA" in proc.stderr


def _report(ok: list[bool], raw_ok: list[bool | None], seconds: list[float]) -> Report:
    w = Workload(requests=len(ok))
    r = Report(w, "x", "shm", 4.0, "because", {}, raw_engine=True)
    for i, (good, raw_good, s) in enumerate(zip(ok, raw_ok, seconds, strict=True)):
        r.samples.append(Sample(i, 10, end_to_end_s=s, sender_s=s, raw_s=s / 2, ok=good, raw_ok=raw_good))
    return r


def test_report_median_p90_and_ratio() -> None:
    r = _report([True] * 5, [True] * 5, [0.1, 0.2, 0.3, 0.4, 1.0])
    f = r.figures()
    assert f["end_to_end"]["p50_ms"] == 300.0
    assert f["end_to_end"]["p90_ms"] == 1000.0
    assert f["end_to_end"]["median_gbps"] == round(r.workload.request_bytes / 0.3 / 1e9, 3)
    assert f["ratio_end_to_end"] == pytest.approx(0.5, abs=0.01)
    assert r.integrity_ok


@pytest.mark.parametrize(("ok", "raw_ok"), [([True, False], [True, True]), ([True, True], [True, False])])
def test_one_corrupted_request_fails_the_whole_report(ok: list[bool], raw_ok: list[bool | None]) -> None:
    r = _report(ok, raw_ok, [0.1, 0.1])
    assert not r.integrity_ok
    assert "integrity   FAILED" in r.render()
    assert r.to_dict()["integrity"]["ok"] is False


def test_cli_exits_non_zero_when_integrity_fails(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.setattr(bench, "run", lambda *a, **k: _report([False], [None], [0.1]))
    assert cli.main(["bench", "--requests", "1"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_poisoned_pages_no_longer_match_so_a_missing_write_is_caught() -> None:
    pool = KVPool(8, 2, 4096, 0, shared=False)
    try:
        pool.fill(3)
        before = pool.page_digests([1, 2])
        pool.poison([1])
        after = pool.page_digests([1, 2])
        assert after[0] != before[0] and after[1] == before[1]
    finally:
        pool.close()


def test_workload_sizes_follow_the_model() -> None:
    w = Workload()
    assert w.item_len == 32 * 1024
    assert w.request_bytes == 512 * 1024 * 1024
    assert w.pages_per_request == 256 and w.regions == 64


def test_bench_compares_a_staged_driver_with_the_driver_it_stages_over() -> None:
    require_engines()
    proc = run_cli("bench", *SMALL, "--driver", "mooncake-staged", "--compare", "mooncake-gdr", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert (report["driver"], report["compare"]) == ("mooncake-staged", "mooncake-gdr")
    assert report["integrity"]["compare_requests_verified"] == 3
    assert report["figures"]["compare"]["median_gbps"] > 0 and report["figures"]["ratio_compare"] > 0


def test_bench_pin_runs_each_process_on_cpus_of_its_own_and_gives_them_back() -> None:
    """``--pin``: the report says where each process's threads ran, as each read them back
    (the decode process from its own threads, not what it was asked), the two sets are
    disjoint and together every CPU; in-process, the caller's threads get their CPUs back."""
    require_engines()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("--pin needs two CPUs")
    proc = run_cli("bench", *SMALL, "--driver", "mooncake-gdr", "--pin", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["integrity"]["ok"] is True and report["integrity"]["raw_requests_verified"] == 3
    half = len(cpus) // 2
    assert report["pinned"] == {"prefill": [cpus[:half]], "decode": [cpus[half:]]}
    w = Workload(requests=1, prompt_tokens=64, layers=1, warmup=0)
    before = cpu_pin.process_cpus()
    pinned = bench.run(w, driver="mooncake-gdr", pin=True)
    assert pinned.integrity_ok and pinned.pinned is not None
    assert pinned.pinned["prefill"] == [cpus[:half]] and pinned.pinned["decode"] == [cpus[half:]]
    assert cpu_pin.process_cpus() == before


def test_a_pin_that_fails_half_way_gives_back_what_it_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to pin to a part of them")
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, daemon=True)
    helper.start()  # a second thread, so that the pin fails after pinning one
    before = cpu_pin.process_cpus()
    real = os.sched_setaffinity
    calls: list[int] = []

    def flaky(tid: int, mask: Any) -> None:
        calls.append(tid)
        if len(calls) == 2:
            raise PermissionError("not allowed")
        real(tid, mask)

    monkeypatch.setattr(os, "sched_setaffinity", flaky)
    try:
        with pytest.raises(KVTransportError, match="could not pin"):
            cpu_pin.pin_process(cpus[:1])
        assert len(calls) >= 2
        monkeypatch.setattr(os, "sched_setaffinity", real)
        assert cpu_pin.process_cpus() == before
    finally:
        stop.set()


def test_pin_refuses_a_single_cpu_and_the_modes_it_does_not_model() -> None:
    with pytest.raises(KVTransportError, match="at least 2 CPUs"):
        cpu_pin.split_halves([3])
    assert cpu_pin.split_halves([0, 1, 2]) == ([0], [1, 2])
    for mode in (["--in-flight", "2"], ["--sweep", "--quick"], ["--connects", "2"], ["--prefill-tp", "2"]):
        proc = run_cli("bench", *SMALL, "--pin", *mode, timeout=60)
        assert proc.returncode != 0 and "--pin pins the one prefill and one decode process" in proc.stderr, mode


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "driver"), [(2, 1, "nixl-ucx"), (1, 2, "")])
def test_bench_with_unequal_tp_checks_every_head(prefill_tp: int, decode_tp: int, driver: str) -> None:
    """``--prefill-tp P --decode-tp D``: P + D rank processes (and one pair at TP 1 for the
    same bytes, on the same driver), every head of every page checked on every decode rank.
    Without ``--driver`` the negotiation picks a driver that gathers sliced pages, and says so."""
    require_engines()
    args = ["bench", "--requests", "2", "--prompt-tokens", "256", "--layers", "2", "--json"]
    args += ["--driver", driver] if driver else []
    proc = run_cli(*args, "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert (report["prefill_tp"], report["decode_tp"], report["requests"]) == (prefill_tp, decode_tp, 2)
    if driver:
        assert (report["driver"], report["negotiated"]) == (driver, "")
    else:
        assert report["driver"] in ("mooncake-staged", "nixl-staged"), report
        assert "sliced by KV head (TP 1 and 2)" in report["negotiated"], report
    assert report["integrity"] == {"ok": True, "mismatches": []}
    figures = report["figures"]
    assert figures["unequal"]["gbps"] > 0 and figures["equal"]["gbps"] > 0 and figures["ratio"] > 0


@pytest.mark.parametrize(
    ("engine_flag", "tp_flag", "engines"),
    [
        # SGLang-shaped prefill ranks into vLLM-shaped (LBNHC) decode ranks at TP 1 -> 2: each
        # decode rank's blocks checked head by head, K then V of each token
        ("--decode-engine", "--decode-tp", ["sglang", "vllm"]),
        # vLLM-shaped prefill ranks (blocks, the handoff arena) at TP 2 into an SGLang-shaped
        # decode rank (pages, stated aux rows): every head checked in SGLang's K and V buffers
        ("--prefill-engine", "--prefill-tp", ["vllm", "sglang"]),
    ],
)
def test_bench_across_engines_regroups_pages_with_every_head_checked(
    engine_flag: str, tp_flag: str, engines: list[str]
) -> None:
    """The bench between two engines' pools: every head of every page checked on the decode
    ranks against what the prefill ranks held; the negotiation picks a driver that gathers the
    per-head runs and says why."""
    require_engines()
    args = ["bench", "--requests", "2", "--prompt-tokens", "64", "--layers", "2", "--json"]
    proc = run_cli(*args, engine_flag, "vllm", tp_flag, "2", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["engines"] == engines and report[tp_flag[2:].replace("-", "_")] == 2, report
    assert report["driver"] in ("mooncake-staged", "nixl-staged"), report
    regrouped = r"regrouped per head between (vllm and sglang|sglang and vllm) pools"
    assert re.search(regrouped, report["negotiated"]), report
    assert report["integrity"] == {"ok": True, "mismatches": []}
    assert report["figures"]["ratio"] > 0


def test_bench_in_flight_sends_rounds_of_concurrent_requests_and_checks_every_page() -> None:
    """``--in-flight N``: rounds of N requests at once against rounds of one, each page of each
    request checked; the report gives both aggregate bandwidths and their ratio."""
    require_engines()
    args = ["bench", "--driver", "nixl-ucx", "--in-flight", "3", "--requests", "2", "--prompt-tokens", "64"]
    proc = run_cli(*args, "--layers", "2", "--json", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert (report["driver"], report["in_flight"], report["rounds"]) == ("nixl-ucx", 3, 2)
    assert report["integrity"] == {"ok": True, "mismatches": []}
    assert report["figures"]["1"]["aggregate_gbps"] > 0 and report["figures"]["3"]["aggregate_gbps"] > 0
    assert report["ratio"] > 0


def test_bench_layerwise_compares_whole_and_layer_wise_sends_with_every_page_checked() -> None:
    """``--layerwise``: each request computed layer by layer here and sent whole and layer-wise
    (a batch per layer group), plus its last group's pages alone; every page checked."""
    require_engines()
    args = ["bench", "--driver", "nixl-ucx", "--layerwise", "--requests", "2", "--prompt-tokens", "256"]
    proc = run_cli(*args, "--layers", "4", "--compute-ms-per-layer", "1", "--json", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["driver"] == "nixl-ucx" and doc["integrity"] == {"ok": True, "mismatches": []}
    whole, layered = doc["figures"]["whole"], doc["figures"]["layerwise"]
    assert whole["groups_p50"] == 1 and layered["groups_p50"] > 1
    assert doc["policy"]["min_tokens"] == 128 and not doc["below_min_tokens"]
    assert doc["one_group_alone_ms"] > 0 and doc["tail_ratio"] > 0 and doc["e2e_ratio"] > 0
    assert isinstance(doc["target_met"], bool)
    text = run_cli(*args, "--layers", "4", "--compute-ms-per-layer", "1", timeout=240)
    assert text.returncode == 0 and "integrity   OK" in text.stdout and "layer-wise  tail" in text.stdout


def test_bench_consumer_vllm_times_the_connector_against_the_endpoint_with_bytes_checked() -> None:
    """``--consumer vllm``: the same requests through the vLLM connector's worker sides and
    through the endpoint, alternating, each request's last block checked (a wrong one fails
    the run); the report has both medians and their difference."""
    require_engines()
    args = ["bench", "--consumer", "vllm", "--driver", "nixl-ucx", "--requests", "6", "--prompt-tokens", "64"]
    proc = run_cli(*args, "--layers", "4", "--json", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["driver"] == "nixl-ucx" and doc["tokens"] == 64 and doc["requests"] == 6
    assert set(doc["median_ms"]) == {"connector", "raw"} and all(v > 0 for v in doc["median_ms"].values())
    assert doc["overhead_ms"] == pytest.approx(doc["median_ms"]["connector"] - doc["median_ms"]["raw"])
    text = run_cli(*args, "--layers", "4", timeout=240)
    assert text.returncode == 0 and "overhead" in text.stdout and "connector  p50" in text.stdout


def test_the_bench_and_its_peer_do_not_import_the_test_kit() -> None:
    """The bench is the product's main job: its pools and decode peer live in the library, and
    only the fakes (fault injection) load ``kvtransport.testing``."""
    code = (
        "import sys, kvtransport.tools.cli, kvtransport.tools.bench, kvtransport.tools.bench_tp, "
        "kvtransport.tools.soak, kvtransport.tools.peer; "
        "assert kvtransport.tools.peer.driver_classes('auto') is None; "
        "print(sorted(m for m in sys.modules if m.startswith('kvtransport.testing')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    code = (
        "import sys, kvtransport.tools.peer as p; p.driver_classes('fake'); "
        "print('kvtransport.testing.fake' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "True"
