"""Calibration: the cost-model fit, hostile models in a hello, the cache, the negotiation that
ranks by predicted time, and a real ``kvtransport calibrate`` run on this host's engines."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtransport.negotiation.calibration_cache import cache_path, read_cache, with_cached_models, write_cache
from kvtransport.negotiation.cost_model import MAX_MODELS_PER_DRIVER, CostModel, Point, fit, models_from_list
from kvtransport.negotiation.hello import Hello
from kvtransport.negotiation.negotiate import negotiate, pair_models, reference_transfer
from kvtransport.negotiation.registry import Policy
from kvtransport.spi.driver import TransferPath
from kvtransport.spi.errors import DriverUnavailable, ProtocolError

from .conftest import require_engines
from .hellos import FIRST_PARTY, hello, host

SHAPES = ((4, 64 << 10), (4, 64 << 20), (4096, 64 << 20), (1024, 64 << 20))

latencies = st.floats(1e-6, 0.05)
per_runs = st.floats(1e-8, 1e-4)
bandwidths = st.floats(0.05, 500.0)


# --- the fit --------------------------------------------------------------------------------


@given(latencies, per_runs, bandwidths)
def test_fit_recovers_the_model_that_produced_the_times(latency: float, per_run: float, gbps: float) -> None:
    truth = CostModel("tcp", latency, per_run, gbps)
    points = [Point(r, b, truth.predict(r, b)) for r, b in SHAPES]
    model = fit(points, path="tcp")
    for r, b in SHAPES:
        assert model.predict(r, b) == pytest.approx(truth.predict(r, b), rel=1e-6)
    assert model.gbps == pytest.approx(gbps, rel=1e-4)


@given(st.lists(st.floats(1e-6, 2.0), min_size=4, max_size=4))
def test_fit_never_returns_a_negative_or_unbounded_term(seconds: list[float]) -> None:
    """Whatever noise the medians carry, the model stays physical: no negative latency, cost
    per descriptor or bandwidth, and a finite prediction."""
    model = fit([Point(r, b, s) for (r, b), s in zip(SHAPES, seconds, strict=True)], path="shm")
    assert model.latency_s >= 0 and model.per_run_s >= 0 and model.gbps > 0
    assert math.isfinite(model.predict(16384, 512 << 20))
    CostModel.from_dict(model.to_dict())  # within the ranges a hello accepts


def test_fit_needs_three_shapes() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        fit([Point(4, 1, 0.1), Point(8, 2, 0.2)], path="tcp")


# --- models as a peer sends them ------------------------------------------------------------

good = {"path": "tcp", "latency_s": 1e-3, "per_run_s": 1e-6, "gbps": 2.0, "peer_host": "h", "version": "1"}


@given(
    st.sampled_from(["latency_s", "per_run_s", "gbps", "measured_at", "path", "version", "peer_host"]),
    st.one_of(
        st.just(float("nan")),
        st.just(float("inf")),
        st.just(-1.0),
        st.just(1e300),
        st.just(True),
        st.text(max_size=3),
        st.just("x" * 500),
        st.none(),
        st.lists(st.integers(), max_size=2),
        st.integers(min_value=2**63, max_value=2**70),
        st.just(10**400),
    ),
)
def test_a_hostile_model_field_is_a_protocol_error(key: str, value: object) -> None:
    data = {**good, key: value}
    try:
        model = CostModel.from_dict(data)
    except ProtocolError:
        return
    # What got through is in range and computes finitely.
    assert math.isfinite(model.predict(10**9, 10**15))
    assert isinstance(model.path, str) and len(model.path) <= 128


def test_a_hello_with_too_many_or_malformed_models_is_refused() -> None:
    with pytest.raises(ProtocolError):
        models_from_list([good] * (MAX_MODELS_PER_DRIVER + 1))
    with pytest.raises(ProtocolError):
        models_from_list({"path": "tcp"})
    doc = hello(host("a")).to_dict()
    doc["drivers"]["nixl-ucx"]["costs"] = [{**good, "gbps": 0}]
    with pytest.raises(ProtocolError, match="gbps"):
        Hello.from_dict(doc)


def test_models_travel_in_the_hello_unchanged() -> None:
    h = _with_models(hello(host("a")), {"nixl-ucx": (1e-3, 2e-6, 3.0)}, "a")
    back = Hello.from_dict(json.loads(json.dumps(h.to_dict())))
    assert back.drivers["nixl-ucx"].costs == h.drivers["nixl-ucx"].costs
    assert back.drivers["mooncake-gdr"].costs == ()


# --- the negotiation ------------------------------------------------------------------------

HOST_DRIVERS = ("mooncake-gdr", "mooncake-staged", "nixl-ucx", "nixl-staged")


def _with_models(h: Hello, figures: dict[str, tuple[float, float, float]], peer: str) -> Hello:
    """``h`` with a measured model per named driver, on the path its offer takes towards ``peer``."""
    drivers = dict(h.drivers)
    for name, (latency, per_run, gbps) in figures.items():
        path = _path(name)
        drivers[name] = dataclasses.replace(drivers[name], costs=(CostModel(path, latency, per_run, gbps, peer),))
    return dataclasses.replace(h, drivers=drivers)


def _path(name: str) -> str:
    d = negotiate(hello(host("a"), policy=Policy(force=name)), hello(host("a"), policy=Policy(force=name)), FIRST_PARTY)
    return d.path.value


model_figures = st.tuples(latencies, per_runs, bandwidths)


@given(st.fixed_dictionaries({n: model_figures for n in HOST_DRIVERS}))
def test_calibrated_pairs_pick_the_lowest_predicted_time_and_both_sides_agree(
    figures: dict[str, tuple[float, float, float]],
) -> None:
    a = _with_models(hello(host("a"), endpoint="prefill"), figures, "a")
    b = hello(host("a"), endpoint="decode")
    d = negotiate(a, b, FIRST_PARTY)
    assert d.basis == "calibrated"
    runs, nbytes = reference_transfer(a, b)
    predicted = {n: CostModel("x", *f).predict(runs, nbytes) for n, f in figures.items()}
    assert predicted[d.driver] == min(predicted.values())
    assert {c.driver: c.predicted_s for c in d.candidates if c.outcome != "rejected"} == pytest.approx(predicted)
    # The acceptor decodes the same hellos from the wire and must compute the same decision.
    wire = [Hello.from_dict(json.loads(json.dumps(x.to_dict()))) for x in (a, b)]
    assert negotiate(*wire, FIRST_PARTY).to_dict() == d.to_dict()


def test_the_slower_sides_model_rules_and_the_reason_says_measured() -> None:
    fast, slow = (1e-4, 1e-7, 50.0), (1e-4, 1e-7, 0.1)
    others = {n: (1e-3, 1e-6, 1.0) for n in HOST_DRIVERS if n != "nixl-ucx"}
    a = _with_models(hello(host("a")), {**others, "nixl-ucx": fast}, "a")
    b = _with_models(hello(host("a")), {"nixl-ucx": slow}, "a")
    d = negotiate(a, b, FIRST_PARTY)
    assert len(pair_models(a, b, "nixl-ucx", TransferPath.SHM)) == 2
    assert d.driver != "nixl-ucx"  # its slower model (0.1 GB/s, measured on b) counts
    assert "predicted" in d.reason and "measured" in d.reason


def test_without_models_for_every_candidate_the_choice_is_nominal_and_says_which_lack_one() -> None:
    a = _with_models(hello(host("a")), {"nixl-ucx": (1e-3, 1e-6, 100.0)}, "a")
    b = hello(host("a"))
    d = negotiate(a, b, FIRST_PARTY)
    assert d.basis == "nominal"
    assert d.driver == negotiate(hello(host("a")), b, FIRST_PARTY).driver  # as if no model at all
    assert "mooncake-gdr" in d.basis_note and "kvtransport calibrate" in d.reason
    bare = negotiate(hello(host("a")), b, FIRST_PARTY)
    assert bare.basis == "nominal" and "no driver has a measured cost model" in bare.basis_note


def test_a_model_measured_towards_another_host_is_not_used() -> None:
    figures = {n: (1e-3, 1e-6, 1.0) for n in HOST_DRIVERS}
    a = _with_models(hello(host("a")), figures, "somewhere-else")
    assert negotiate(a, hello(host("a")), FIRST_PARTY).basis == "nominal"


def test_policy_still_rules_over_predictions() -> None:
    figures = {n: (1e-3, 1e-6, 1.0) for n in HOST_DRIVERS} | {"nixl-ucx": (1e-5, 1e-9, 100.0)}
    a = _with_models(hello(host("a"), policy=Policy(force="mooncake-staged")), figures, "a")
    d = negotiate(a, hello(host("a")), FIRST_PARTY)
    assert d.driver == "mooncake-staged" and "forced" in d.reason
    excluded = _with_models(hello(host("a"), policy=Policy(exclude=("mooncake-staged",))), figures, "a")
    with pytest.raises(DriverUnavailable):
        negotiate(excluded, hello(host("a"), policy=Policy(force="mooncake-staged")), FIRST_PARTY)


# --- the cache ------------------------------------------------------------------------------


def test_cache_path_follows_the_environment(tmp_path: Path) -> None:
    assert cache_path({"KVTRANSPORT_CALIBRATION": "off"}) is None
    assert cache_path({"KVTRANSPORT_CALIBRATION": str(tmp_path / "c.json")}) == tmp_path / "c.json"
    assert cache_path({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "kvtransport" / "calibration.json"


def test_cache_merges_by_slot_and_the_hello_takes_only_the_current_version(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "calibration.json"
    old = CostModel("shm", 1e-3, 1e-6, 1.0, "h", version="0.9")
    write_cache(path, {"nixl-ucx": [old]}, "h")
    new = CostModel("shm", 2e-3, 1e-6, 3.0, "h", version="1.0")
    other = CostModel("tcp", 2e-3, 1e-6, 0.5, "h", version="1.0")
    write_cache(path, {"nixl-ucx": [new, other]}, "h")
    write_cache(path, {"nixl-ucx": [old]}, "another-host")
    cache = read_cache(path)
    assert sorted(m.path for m in cache["h"]["nixl-ucx"]) == ["shm", "tcp"]  # old's slot replaced
    assert cache["another-host"]["nixl-ucx"] == [old]
    hellos = dict(hello(host("h")).drivers)
    hellos["nixl-ucx"] = dataclasses.replace(
        hellos["nixl-ucx"], status=dataclasses.replace(hellos["nixl-ucx"].status, version="1.0")
    )
    taken = with_cached_models(hellos, "h", path, machine="h")
    assert set(taken["nixl-ucx"].costs) == {new, other}
    assert taken["mooncake-gdr"].costs == ()  # its version ("") was never calibrated


def test_a_loopback_model_serves_this_boots_host_id_and_survives_a_reboot(tmp_path: Path) -> None:
    """The cache is filed by machine, and a loopback model names no far host: an endpoint reads
    it as its own host id, whatever this boot's id is."""
    path = tmp_path / "calibration.json"
    write_cache(path, {"nixl-ucx": [CostModel("shm", 1e-3, 1e-6, 3.0, "", version="")]}, "machine-1")
    for boot in ("boot-a", "boot-b"):
        taken = with_cached_models(hello(host(boot)).drivers, boot, path, machine="machine-1")
        assert [m.peer_host for m in taken["nixl-ucx"].costs] == [boot]
    assert with_cached_models(hello(host("a")).drivers, "a", path, machine="machine-2")["nixl-ucx"].costs == ()


def test_a_model_measured_on_other_memory_is_not_used() -> None:
    figures = {n: (1e-3, 1e-6, 1.0) for n in HOST_DRIVERS}
    a = _with_models(hello(host("a")), figures, "a")
    on_cuda = dataclasses.replace(
        a,
        drivers={
            n: dataclasses.replace(e, costs=tuple(dataclasses.replace(m, memory="cuda") for m in e.costs))
            for n, e in a.drivers.items()
        },
    )
    assert negotiate(a, hello(host("a")), FIRST_PARTY).basis == "calibrated"
    assert negotiate(on_cuda, hello(host("a")), FIRST_PARTY).basis == "nominal"


def test_fit_of_shapes_that_took_no_time_stays_finite() -> None:
    model = fit([Point(r, b, 0.0) for r, b in SHAPES], path="shm")
    assert model.gbps > 0 and model.predict(1, 1) >= 0


def test_a_corrupt_cache_is_ignored_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "calibration.json"
    overflow = '{"schema": 1, "models": {"h": {"nixl-ucx": [{"path": "shm", "latency_s": 1' + "0" * 400 + "}]}}}"
    texts = (
        "{not json",
        json.dumps({"schema": 99, "models": {}}),
        json.dumps({"schema": 1, "models": 3}),
        overflow,
        "[" * 100_000 + "]" * 100_000,
    )
    for text in texts:
        path.write_text(text)
        with caplog.at_level(logging.WARNING):
            assert read_cache(path) == {}
        assert "ignoring the calibration cache" in caplog.text
        caplog.clear()
    path.write_text(json.dumps({"schema": 1, "models": {"h": {"nixl-ucx": [{**good, "gbps": -1}]}}}))
    assert read_cache(path) == {}


# --- a real calibration ---------------------------------------------------------------------


CALIBRATE_ARGS = ("--driver", "nixl-ucx", "--driver", "mooncake-gdr", "--reps", "2", "--json")


def test_calibrate_measures_real_engines_saves_and_endpoints_then_rank_by_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvtransport calibrate`` on two real engines (two processes, bytes verified), then an
    endpoint of this host carries the models and a connection between two processes is
    decided on them."""
    cache = tmp_path / "calibration.json"
    env = {**os.environ, "KVTRANSPORT_CALIBRATION": str(cache)}
    out = subprocess.run(
        [sys.executable, "-m", "kvtransport.tools.cli", "calibrate", *CALIBRATE_ARGS],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["seconds"] < 60
    assert {d["driver"] for d in report["drivers"]} == {"nixl-ucx", "mooncake-gdr"}
    for d in report["drivers"]:
        assert not d["error"] and d["model"]["gbps"] > 0
        assert {p["shape"] for p in d["points"]} == {"one page", "contiguous", "scattered", "small pieces", "runs of 4"}
        # more descriptors for the same bytes never cost less (the fit's terms are non-negative)
        by = {p["shape"]: p for p in d["points"]}
        assert by["scattered"]["predicted"] >= by["contiguous"]["predicted"]
        assert by["small pieces"]["runs"] == 4 * by["scattered"]["runs"]  # 16 KiB pages cut into 4 KiB
        assert by["small pieces"]["bytes"] == by["scattered"]["bytes"]
    saved = read_cache(cache)
    (host_models,) = saved.values()
    assert set(host_models) == {"nixl-ucx", "mooncake-gdr"}

    # Endpoints of this host now decide on the models (both sides read the same cache).
    from kvtransport.negotiation.registry import load_driver
    from kvtransport.runtime.endpoint import Endpoint
    from kvtransport.tools.kv_pool import KVPool
    from kvtransport.tools.peer_process import PeerProcess

    monkeypatch.setenv("KVTRANSPORT_CALIBRATION", str(cache))
    pool = KVPool(64, 4, 4096, 0, shared=False)
    classes = {n: load_driver(n) for n in ("nixl-ucx", "mooncake-gdr")}
    ep = Endpoint(pool.regions, pool.layout, drivers=classes, name="prefill")
    peer = None
    try:
        hello = ep.hello.drivers["nixl-ucx"]
        assert hello.costs, (hello.status, [m.version for m in host_models["nixl-ucx"]])
        peer = PeerProcess(
            *("--driver", "auto", "--pages", "64", "--layers", "4", "--item", "4096", "--aux-slots", "0"),
            "--private",
            timeout=60,
        )
        peer.call("connect", address=ep.address, timeout=60)
        conn = ep.accept(60)
        assert conn.decision is not None
        assert conn.decision.basis == "calibrated", conn.decision.reason
        assert "predicted" in conn.decision.reason
    finally:
        if peer is not None:
            peer.close()
        ep.close()
        pool.close()


# --- the choice per transfer ----------------------------------------------------------------


# (latency, per descriptor) of each driver: which one wins few descriptors and which many. The
# driver that wins many is also the connection's chosen one (its reference request has 1,024), so
# the two cases put the two-sided mooncake-staged once as the chosen lane, once as the other.
CROSSOVERS = {
    "staged-for-many": {"nixl-ucx": (1e-4, 1e-3), "mooncake-staged": (5e-3, 0.0)},
    "staged-for-few": {"nixl-ucx": (5e-3, 0.0), "mooncake-staged": (1e-4, 1e-3)},
}


@pytest.mark.parametrize("crossover", sorted(CROSSOVERS))
def test_each_transfer_takes_the_lane_its_shape_favours_on_real_engines(
    tmp_path: Path, crossover: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With models that favour one driver for few descriptors and the other for many, one
    connection between two processes keeps both drivers as lanes and sends each transfer on
    the one its plan predicts faster; every byte arrives on both."""
    from kvtransport.negotiation.calibration_cache import write_cache
    from kvtransport.negotiation.hello import load_drivers
    from kvtransport.runtime.endpoint import Endpoint, State
    from kvtransport.spi.probe import machine_key
    from kvtransport.tools.kv_pool import KVPool
    from kvtransport.tools.peer_process import PeerProcess

    names = ("nixl-ucx", "mooncake-staged")
    loaded = load_drivers(names)
    me = machine_key()
    versions = {n: loaded.hellos[n].status.version for n in names}  # type: ignore[union-attr]
    cache = tmp_path / "calibration.json"
    paths = {"nixl-ucx": "shm", "mooncake-staged": "tcp"}
    figures = CROSSOVERS[crossover]
    for n in names:
        write_cache(cache, {n: [CostModel(paths[n], *figures[n], 100.0, "", versions[n])]}, me)
    few_driver = min(names, key=lambda n: figures[n][0] + 4 * figures[n][1])
    many_driver = min(names, key=lambda n: figures[n][0] + 32 * figures[n][1])
    assert few_driver != many_driver
    monkeypatch.setenv("KVTRANSPORT_CALIBRATION", str(cache))
    pool = KVPool(64, 4, 4096, 0, shared=False)
    pool.fill(3)
    ep = Endpoint(pool.regions, pool.layout, drivers=loaded.classes, name="prefill")
    peer = None
    try:
        peer = PeerProcess(
            *("--driver", "auto", "--pages", "64", "--layers", "4", "--item", "4096", "--aux-slots", "0"),
            "--private",
            timeout=60,
        )
        peer.call("connect", address=ep.address, timeout=60)
        conn = ep.accept(60)
        assert conn.decision is not None and conn.decision.basis == "calibrated"
        assert set(conn.decision.lanes) == set(names), conn.decision.to_dict()
        shapes = {"few": list(range(8)), "many": list(range(20, 36, 2))}  # 4 runs against 32
        peer.call("expect", transfers=shapes, timeout=30)
        sent = {}
        for tag, pages in shapes.items():
            t = conn.sender(tag)
            deadline = time.monotonic() + 30
            while t.state is State.BOOTSTRAPPING and time.monotonic() < deadline:
                time.sleep(0.001)
            t.send(pages)
            sent[tag] = t
        for t in sent.values():
            t.wait(30)
        assert conn.decision.driver == many_driver
        assert sent["few"].driver == few_driver and sent["many"].driver == many_driver
        latency, per_run = figures[few_driver]
        assert sent["few"].predicted_s == pytest.approx(latency + 4 * per_run + 8 * 4 * 4096 / 100e9, rel=1e-3)
        assert all(t.measured_s > 0 for t in sent.values())
        states = peer.call("wait", tags=list(shapes), timeout=30)["states"]
        assert all(s[0] == "SUCCESS" for s in states.values()), states
        for pages in shapes.values():
            assert peer.call("digests", pages=pages, timeout=30)["digests"] == pool.page_digests(pages)
        counted = {(d["driver"], d["role"]) for d in ep.metrics.snapshot()["drivers"]}
        assert {(n, "send") for n in names} <= counted  # each under its own driver
    finally:
        if peer is not None:
            peer.close()
        ep.close()
        pool.close()


class _Driver:
    from kvtransport.spi.driver import Capabilities

    capabilities = Capabilities(reads=frozenset({"host"}), writes=frozenset({"host"}))


def test_a_lane_whose_transfers_run_far_slower_than_predicted_is_demoted(caplog: pytest.LogCaptureFixture) -> None:
    from kvtransport.runtime.lane import MIN_SAMPLES, Lane

    lane = Lane("x", _Driver(), None, b"", (CostModel("shm", 1e-3, 0.0, 1.0),))  # type: ignore[arg-type]
    with caplog.at_level(logging.DEBUG, logger="kvtransport.runtime.lane"):
        for _ in range(MIN_SAMPLES):
            lane.observe(0.01, 0.04, "peer")  # 4x slower than predicted
        assert lane.correction == pytest.approx(4.0)
        assert lane.predict(1, 0) == pytest.approx(4 * lane.raw_prediction(1, 0))
        assert "demoted" in caplog.text
        for _ in range(16):
            lane.observe(0.01, 0.018, "peer")  # 1.8x: inside the 2x band, but not back within 1.5x
        assert lane.correction == pytest.approx(1.8)
        for _ in range(16):
            lane.observe(0.01, 0.011, "peer")  # agreeing again
        assert lane.correction == 1.0 and "agree" in caplog.text
        for _ in range(16):
            lane.observe(0.01, 0.05, "peer")  # off again: scaled, but warned once per connection
        assert lane.correction == pytest.approx(5.0)
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 1
    within = Lane("y", _Driver(), None, b"", ())  # type: ignore[arg-type]
    for _ in range(8):
        within.observe(0.01, 0.015, "peer")  # 1.5x: within the 2x band
    assert within.correction == 1.0


def test_lanes_with_nominal_models_try_each_lane_then_follow_what_they_measured(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An uncalibrated connection between two hosts: whole transfers go to each learning lane
    until it has MIN_SAMPLES measurements; then the lane that measured fastest wins, however
    close to its nominal figure it measured, and a lane measured long ago is revisited."""
    from kvtransport.negotiation.cost_model import NOMINAL
    from kvtransport.runtime.lane import MIN_SAMPLES, REVISIT_EVERY, Lane, LanePicker

    def nominal(gbps: float) -> tuple[CostModel, ...]:
        return (CostModel("tcp", 0.5e-3, 1e-6, gbps, "far", NOMINAL),)

    # Nominally "a" is twice as fast as "b"; on this link "b" is, by 20%.
    a = Lane("a", _Driver(), None, b"", nominal(2.0))  # type: ignore[arg-type]
    b = Lane("b", _Driver(), None, b"", nominal(1.0))  # type: ignore[arg-type]
    measured = {"a": 0.012, "b": 0.010}
    nbytes = 8 << 20
    picker = LanePicker([a, b])
    picks = []
    with caplog.at_level(logging.INFO, logger="kvtransport.runtime.lane"):
        for _ in range(1, 3 * REVISIT_EVERY):
            lane = picker.explore()
            if lane is None:
                lane = min((a, b), key=lambda x: x.predict(1, nbytes))
                picker.picked(lane)
            picks.append(lane.name)
            lane.observe(lane.raw_prediction(1, nbytes), measured[lane.name], "peer")
    explore = 2 * MIN_SAMPLES
    assert sorted(picks[:explore]) == ["a"] * MIN_SAMPLES + ["b"] * MIN_SAMPLES, picks[:explore]
    after = picks[explore:]
    # Revisits of the lane that took a transfer longest ago ("a"), one in REVISIT_EVERY; else "b".
    assert after.count("a") == len([n for n in range(explore + 1, len(picks) + 1) if n % REVISIT_EVERY == 0])
    assert after.count("b") == len(after) - after.count("a") > 0
    assert a.predict(1, nbytes) == pytest.approx(0.012) and b.predict(1, nbytes) == pytest.approx(0.010)
    assert "learned its cost" in caplog.text and all(r.levelno == logging.INFO for r in caplog.records)
    # A lane with a measured model does not learn: it is scaled only when far off (above).
    assert not Lane("c", _Driver(), None, b"", (CostModel("tcp", 1e-3, 0.0, 1.0),)).learning  # type: ignore[arg-type]
    assert LanePicker([a]).explore() is None


def test_a_learning_lane_that_fails_or_measures_far_slower_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    """A lane kept only to learn from: once a transfer on it failed it is never picked again on
    that connection; one that measured more than FAR_OFF slower than the best is not revisited
    (a revisit would only cost its request). A lane with a measured model never breaks."""
    from kvtransport.negotiation.cost_model import NOMINAL
    from kvtransport.runtime.lane import FAR_OFF, MIN_SAMPLES, REVISIT_EVERY, Lane, LanePicker

    def lane(name: str) -> Lane:
        return Lane(name, _Driver(), None, b"", (CostModel("tcp", 0.5e-3, 1e-6, 1.0, "far", NOMINAL),))  # type: ignore[arg-type]

    fast, slow, doomed = lane("fast"), lane("slow"), lane("doomed")
    seconds = {"fast": 0.01, "slow": 0.01 * (FAR_OFF + 1), "doomed": 0.01}
    picker = LanePicker([fast, slow, doomed])
    picks = []
    with caplog.at_level(logging.WARNING, logger="kvtransport.runtime.lane"):
        for _ in range(4 * REVISIT_EVERY):
            chosen = picker.explore()
            if chosen is None:
                chosen = min((x for x in (fast, slow, doomed) if not x.broken), key=lambda x: x.predict(1, 1 << 20))
                picker.picked(chosen)
            picks.append(chosen.name)
            if chosen is doomed:
                doomed.failed("a transfer failed: EngineError", "peer")
                continue
            chosen.observe(chosen.raw_prediction(1, 1 << 20), seconds[chosen.name], "peer")
    assert picks.count("doomed") == 1 and doomed.broken
    assert picks.count("slow") == MIN_SAMPLES, "a lane far slower than the best was revisited"
    assert picks.count("fast") == len(picks) - 1 - MIN_SAMPLES
    assert sum("not used again" in r.message for r in caplog.records) == 1
    measured = Lane("m", _Driver(), None, b"", (CostModel("tcp", 1e-3, 0.0, 1.0),))  # type: ignore[arg-type]
    measured.failed("a transfer failed", "peer")
    assert not measured.broken
    # Nor does the handshake's chosen driver, learning or not: a connection keeps a lane to send on.
    chosen = Lane("c", _Driver(), None, b"", fast.models, chosen=True)  # type: ignore[arg-type]
    chosen.failed("a transfer failed", "peer")
    assert chosen.learning and not chosen.broken


def test_a_done_naming_a_one_sided_lane_still_waits_for_the_two_sided_lanes_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer's "done" may name any lane: the receiver does not take its word for which driver
    moved the bytes, and waits until its two-sided lane's copies into the pages are over."""
    from kvtransport.negotiation.hello import describe_driver
    from kvtransport.runtime import ordered as ordered_module
    from kvtransport.runtime import session as session_module
    from kvtransport.runtime.endpoint import Endpoint, State
    from kvtransport.spi.probe import machine_key
    from kvtransport.testing.fake import FakeDriver, FakeTwoSided
    from kvtransport.tools.kv_pool import KVPool

    drivers = {"fake": FakeDriver, "fake-two-sided": FakeTwoSided}
    cache = tmp_path / "calibration.json"
    # fake wins requests of many descriptors (the connection's chosen driver), fake-two-sided few.
    figures = {"fake": (5e-3, 0.0), "fake-two-sided": (1e-4, 1e-3)}
    for n, cls in drivers.items():
        version = describe_driver(cls).status.version  # type: ignore[union-attr]
        write_cache(cache, {n: [CostModel("memcpy", *figures[n], 100.0, "", version)]}, machine_key())
    monkeypatch.setenv("KVTRANSPORT_CALIBRATION", str(cache))
    # The sender lies: its "done" names the chosen (one-sided) driver whatever lane it took.
    honest = session_module.encode

    def lying(kind: str, *limit: int | None, **fields: object) -> bytes:
        return honest(kind, *limit, **{**fields, "lane": ""}) if kind == "done" else honest(kind, *limit, **fields)

    monkeypatch.setattr(session_module, "encode", lying)
    # Its chunk's notice goes as a message of its own (not inside the "done", whose lane it would
    # share), so that the "done" alone names the wrong lane.
    monkeypatch.setattr(ordered_module, "MAX_DONE_NOTICES", 0)
    a_pool, b_pool = KVPool(64, 2, 512, 4), KVPool(64, 2, 512, 4)
    a_pool.fill(1)
    prefill = Endpoint(a_pool.regions, a_pool.layout, drivers=drivers, name="prefill")
    decode = Endpoint(
        b_pool.regions, b_pool.layout, drivers=drivers, name="decode", driver_options={"fake.inbound_delay": "1.0"}
    )
    try:
        recv_conn = decode.connect(prefill.address)
        send_conn = prefill.accept(5)
        assert recv_conn.decision is not None and recv_conn.decision.driver == "fake"
        assert set(recv_conn.decision.lanes) == set(drivers)
        r = recv_conn.expect("lie", [3])
        t = send_conn.sender("lie")
        deadline = time.monotonic() + 5
        while t.state is State.BOOTSTRAPPING and time.monotonic() < deadline:
            time.sleep(0.001)
        t.send([5])
        t.wait(5)
        assert t.driver == "fake-two-sided"  # one page: the two-sided lane
        time.sleep(0.4)
        assert r.state is not State.SUCCESS, "Success while the two-sided lane was still copying into the page"
        assert r.wait(5) is State.SUCCESS
        assert b_pool.page_digests([3]) == a_pool.page_digests([5])
    finally:
        prefill.close()
        decode.close()
        a_pool.close()
        b_pool.close()


def test_calibrate_towards_a_listener_files_the_models_under_the_far_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvtransport calibrate --connect``: the decode side served by ``kvtransport bench
    --listen`` (here on loopback), its Success times mapped through the measured clock offset,
    bytes verified; the models are filed under the far host's id (this test's peer claims
    another one), so they count only towards that host."""
    import threading

    from kvtransport.runtime.handles import Connection
    from kvtransport.tools.bench_remote import Listener, RemotePeer
    from kvtransport.tools.calibration import calibrate

    require_engines()
    cache = tmp_path / "calibration.json"
    monkeypatch.setenv("KVTRANSPORT_CALIBRATION", str(cache))
    monkeypatch.setattr(Connection, "peer_host_id", property(lambda self: "far-host-0001"))
    listener = Listener("127.0.0.1:0", "t0ken-t0ken-t0ken")
    thread = threading.Thread(target=listener.serve, daemon=True)
    thread.start()
    peers: list[RemotePeer] = []

    def spawn(args: list[str]) -> RemotePeer:
        peers.append(RemotePeer(listener.address, args, "t0ken-t0ken-t0ken"))
        return peers[-1]

    try:
        report = calibrate(["nixl-ucx"], reps=1, spawn=spawn)
    finally:
        listener.close()
        thread.join(5)
    (d,) = report.drivers
    assert d.model is not None, d.error
    assert d.model.peer_host == "far-host-0001" and "towards host far-host-0001" in report.render()
    assert peers[0].clock_error > 0  # the offset was measured before any transfer was timed
    assert all(p["seconds"] > 0 for p in d.points)
    (models,) = read_cache(cache).values()
    assert [m.peer_host for m in models["nixl-ucx"]] == ["far-host-0001"]
    # An endpoint here carries it as a model towards that host (not rewritten to its own id as
    # a loopback model is), so a pair of this host's endpoints stays nominal, and a pair with
    # the far host is calibrated.
    from kvtransport.negotiation.hello import load_drivers

    real = load_drivers(["nixl-ucx"]).hellos
    taken = with_cached_models(real, "this-boot", cache)
    assert [m.peer_host for m in taken["nixl-ucx"].costs] == ["far-host-0001"]
    here = dataclasses.replace(hello(host("this-boot")), drivers={"nixl-ucx": taken["nixl-ucx"]})
    path = TransferPath(d.model.path)
    assert pair_models(here, hello(host("this-boot")), "nixl-ucx", path) == []
    assert pair_models(here, hello(host("far-host-0001")), "nixl-ucx", path) == [d.model]
