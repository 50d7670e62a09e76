"""Unequal tensor parallelism on real engines: P prefill ranks and D decode ranks, one process
each, every decode rank fed by its sources (``tp_map.sources``) through one ``FanIn``. Each
prefill rank's rows hold bytes that are a function of (layer, page, token, global head), so a
decode rank checks every byte of every head it holds against what it should have received,
without trusting any sender; pages nobody announced must stay zero."""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from kvtransport.spi.tp_map import held_heads, sources
from kvtransport.tools.peer_process import PeerProcess

from .conftest import require_engines

PAGES, LAYERS, AUX, HEAD_BYTES, LATENT_BYTES = 48, 4, 4, 64, 256
FAST = json.dumps({"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0})


@dataclass
class Deployment:
    prefill: list[PeerProcess]
    decode: list[PeerProcess]
    #: decode rank -> [(prefill rank, its connection index for that decode rank)]
    links: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    #: decode rank -> its connection indices, in the order of ``links``
    decode_conns: dict[int, list[int]] = field(default_factory=dict)

    def close(self) -> None:
        for p in self.prefill + self.decode:
            p.close()


def _item(heads: int, tp: int, rank: int, mla: bool) -> int:
    return 16 * LATENT_BYTES if mla else 16 * len(held_heads(heads, tp, rank)) * HEAD_BYTES


def _peer(driver: str, name: str, heads: int, tp: int, rank: int, mla: bool, seed: int = 0) -> PeerProcess:
    return PeerProcess(
        *("--driver", driver, "--pages", str(PAGES), "--layers", str(LAYERS if not mla else LAYERS // 2)),
        *("--item", str(_item(heads, tp, rank, mla)), "--aux-slots", str(AUX), "--private", "--name", name),
        *("--tp", f"{heads},{tp},{rank}", "--timeouts", FAST, *(("--mla",) if mla else ())),
        *(("--seed", str(seed)) if seed else ()),
    )


def deploy(driver: str, prefill_tp: int, decode_tp: int, heads: int, mla: bool) -> Deployment:
    dep = Deployment([], [])
    try:
        for p in range(prefill_tp):
            dep.prefill.append(_peer(driver, f"prefill{p}", heads, prefill_tp, p, mla, seed=100 + p))
            dep.prefill[-1].call("fill_heads")
        accepted = [0] * prefill_tp
        for d in range(decode_tp):
            dep.decode.append(_peer(driver, f"decode{d}", heads, decode_tp, d, mla))
            dep.links[d], dep.decode_conns[d] = [], []
            for i, p in enumerate(sources(prefill_tp, decode_tp, d)):
                decision = dep.decode[d].call("connect", address=dep.prefill[p].address, timeout=20)["decision"]
                assert decision["driver"] == driver, decision
                dep.prefill[p].call("accept", timeout=20)
                dep.links[d].append((p, accepted[p]))
                dep.decode_conns[d].append(i)
                accepted[p] += 1
        return dep
    except BaseException:
        dep.close()
        raise


@pytest.fixture
def deployments() -> Iterator[list[Deployment]]:
    made: list[Deployment] = []
    yield made
    for dep in made:
        dep.close()


def _transfer(dep: Deployment, tag: str, src: list[int], dst: list[int], skip: frozenset[int] = frozenset()) -> None:
    """Every decode rank announces ``dst`` to its sources (aux slot 1); every source not in
    ``skip`` sends ``src`` with aux slot 2."""
    for d, conns in dep.decode_conns.items():
        dep.decode[d].call("expect_from", conns=conns, transfers={f"{tag}.d{d}": dst}, aux={f"{tag}.d{d}": 1})
    for d, links in dep.links.items():
        for p, k in links:
            if p not in skip:
                dep.prefill[p].call("send", conn=k, transfers={f"{tag}.d{d}": [src]}, aux={f"{tag}.d{d}": 2})


CASES = [
    # (prefill TP, decode TP, total KV heads, MLA)
    (2, 1, 4, False),
    (1, 2, 4, False),
    (4, 2, 4, False),
    (2, 4, 4, False),
    (4, 1, 2, False),  # two prefill ranks hold each head: each is sent once
    (1, 4, 2, False),  # decode ranks share heads
    (2, 1, 0, True),
    (1, 2, 0, True),
    (4, 2, 0, True),
    (2, 4, 0, True),
]


@pytest.mark.engines
@pytest.mark.parametrize(("prefill_tp", "decode_tp", "heads", "mla"), CASES)
def test_every_head_arrives_once_from_the_right_rank(
    deployments: list[Deployment], prefill_tp: int, decode_tp: int, heads: int, mla: bool
) -> None:
    require_engines()
    driver = "mooncake-gdr" if (prefill_tp + decode_tp) % 2 else "nixl-ucx"
    dep = deploy(driver, prefill_tp, decode_tp, heads, mla)
    deployments.append(dep)
    src, dst = [3, 4, 5, 9, 20, 21, 40], [10, 11, 30, 31, 32, 2, 47]
    _transfer(dep, "req", src, dst)
    for d, rank in enumerate(dep.decode):
        states = rank.call("wait", tags=[f"req.d{d}"], timeout=30)["states"]
        assert states[f"req.d{d}"][0] == "SUCCESS", states
        assert rank.call("check_heads", src=src, dst=dst)["mismatch"] == ""
        # The aux slot comes from the first source only, whole.
        first = sources(prefill_tp, decode_tp, d)[0]
        assert rank.call("aux_digest", slot=1)["digest"] == dep.prefill[first].call("aux_digest", slot=2)["digest"]
        others = [p for p in range(PAGES) if p not in dst]
        zero = zlib.crc32(bytes(_item(heads, decode_tp, d, mla) * (LAYERS // 2 if mla else LAYERS)))
        assert set(rank.call("digests", pages=others)["digests"]) == {zero}, "pages nobody announced changed"


@pytest.mark.engines
def test_a_staged_driver_gathers_the_slices(deployments: list[Deployment]) -> None:
    """Sliced pages are many short runs: the staged path packs them into ring chunks."""
    require_engines()
    dep = deploy("mooncake-staged", 2, 1, 8, False)
    deployments.append(dep)
    src, dst = list(range(0, 24)), list(range(24, 48))
    _transfer(dep, "big", src, dst)
    assert dep.decode[0].call("wait", tags=["big.d0"], timeout=30)["states"]["big.d0"][0] == "SUCCESS"
    assert dep.decode[0].call("check_heads", src=src, dst=dst)["mismatch"] == ""


@pytest.mark.engines
def test_a_source_killed_mid_request_fails_the_request_and_stops_the_others(deployments: list[Deployment]) -> None:
    """Decode rank 0 of TP 1 is fed by prefill ranks 0 and 1; rank 1 dies before it sends. The
    decode request fails (PeerLost within the heartbeat timeout), its other part is aborted,
    so prefill rank 0's sender fails too, and no write lands in the pages after that."""
    require_engines()
    dep = deploy("mooncake-gdr", 2, 1, 4, False)
    deployments.append(dep)
    dep.decode[0].call("expect_from", conns=dep.decode_conns[0], transfers={"k.d0": [1, 2, 3]})
    dep.prefill[1].kill()
    state = dep.decode[0].call("wait", tags=["k.d0"], timeout=15)["states"]["k.d0"]
    assert state[0] == "FAILED" and state[1] == "PeerLost", state
    p, k = dep.links[0][0]
    # The decode side's abort of the other part reaches prefill rank 0 (as an early abort: no
    # sender exists there yet) ...
    deadline = time.monotonic() + 10
    while dep.prefill[p].call("stats")["stats"]["early_aborts"] < 1:
        assert time.monotonic() < deadline, "prefill rank 0 never heard that the request failed"
        time.sleep(0.05)
    # ... so its sender fails as it is created; sending raises.
    with pytest.raises(RuntimeError, match=r"another source of 'k\.d0' failed"):
        dep.prefill[p].call("send", conn=k, transfers={"k.d0": [[5, 6, 7]]}, timeout=5)
    sent = dep.prefill[p].call("wait", tags=["k.d0"], timeout=10)["states"]["k.d0"]
    assert sent[0] == "FAILED", f"prefill rank 0 went on with a request its decode rank gave up: {sent}"
    # A dead source never confirms its drain; its connection ended, and the decode side fenced
    # it (its receive engine refuses anything more): the request is drained, and nothing of it
    # was written.
    deadline = time.monotonic() + 10
    while not dep.decode[0].call("state", tags=["k.d0"])["states"]["k.d0"][3]:
        assert time.monotonic() < deadline, "the pages of a request whose dead source was fenced never came back"
        time.sleep(0.05)
    zero = zlib.crc32(bytes(_item(4, 1, 0, False) * LAYERS))
    assert set(dep.decode[0].call("digests", pages=[1, 2, 3])["digests"]) == {zero}


@pytest.mark.engines
def test_an_abort_of_one_part_fails_every_source(deployments: list[Deployment]) -> None:
    """Prefill rank 1 of 2 aborts its part (SGLang's sender abort): the decode request fails
    and prefill rank 0's sender, not yet done, is failed by the decode side's abort."""
    require_engines()
    dep = deploy("nixl-ucx", 2, 1, 4, False)
    deployments.append(dep)
    dep.decode[0].call("expect_from", conns=dep.decode_conns[0], transfers={"a.d0": [1, 2]})
    (p0, k0), (p1, k1) = dep.links[0]
    dep.prefill[p1].call("send", conn=k1, transfers={"a.d0": []}, timeout=5)  # registers the sender only
    dep.prefill[p1].call("abort", tag="a.d0", reason="client went away")
    state = dep.decode[0].call("wait", tags=["a.d0"], timeout=10)["states"]["a.d0"]
    assert state[0] == "FAILED" and "client went away" in state[2], state
    dep.prefill[p0].call("send", conn=k0, transfers={"a.d0": []}, timeout=5)
    other = dep.prefill[p0].call("wait", tags=["a.d0"], timeout=10)["states"]["a.d0"]
    assert other[0] == "FAILED", f"prefill rank 0's part of a failed request: {other}"


@pytest.mark.engines
def test_a_destination_announced_to_the_wrong_ranks_is_refused_before_anything_moves(
    deployments: list[Deployment],
) -> None:
    """Decode rank 0 of TP 2 is fed by prefill ranks 0 and 1 of TP 4: announcing to only one of
    them, to prefill rank 3 (which feeds decode rank 1), or giving the aux slot to a source that
    does not send it is refused at once, so no request can succeed with heads or aux missing."""
    require_engines()
    dep = deploy("nixl-ucx", 4, 2, 4, False)
    deployments.append(dep)
    decode = dep.decode[0]
    with pytest.raises(RuntimeError, match=r"receives from prefill ranks \[0, 1\]"):
        decode.call("expect_from", conns=[1], transfers={"x.d0": [1]})
    decode.call("connect", address=dep.prefill[3].address, timeout=20)
    dep.prefill[3].call("accept", timeout=20)
    with pytest.raises(RuntimeError, match="not one of this rank's sources"):
        decode.call("expect", conn=2, transfers={"y.d0": [1]})
    with pytest.raises(RuntimeError, match="first source only"):
        decode.call("expect", conn=1, transfers={"z.d0": [1]}, aux={"z.d0": 0})
