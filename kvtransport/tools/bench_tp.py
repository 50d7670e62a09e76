"""``kvtransport bench --prefill-tp P --decode-tp D``: a model's KV moved between P prefill ranks
and D decode ranks (one process each, the per-rank layouts of the model's sharding), every byte
of every head checked on the decode ranks, against the equal-TP transfer of the same bytes
(one prefill rank to one decode rank, whole pages) in the same run, on the same driver. With
``--decode-engine vllm`` the prefill ranks' pools are SGLang's and the decode ranks' vLLM's
(LBNHC), with ``--prefill-engine vllm`` the other way round: the pages are regrouped per head
on the way (``spi.page_geometry``), and the comparison is the same bytes between two pools of
one engine.

Timing, per request: from the first prefill rank's ``send`` until the last decode rank's
request is complete (every source's part arrived). Requests alternate which of the two
deployments goes first, so drift on a noisy machine hits both alike. Figures are medians.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from kvtransport.spi.errors import KVTransportError
from kvtransport.spi.tp_map import held_heads, sources
from kvtransport.tools.bench import MiB, Workload
from kvtransport.tools.peer_process import PeerProcess


@dataclass
class Ranks:
    """One deployment: its prefill and decode rank processes and who feeds whom."""

    prefill_tp: int
    decode_tp: int
    prefill: list[PeerProcess] = field(default_factory=list)
    decode: list[PeerProcess] = field(default_factory=list)
    #: decode rank -> [(prefill rank, that prefill rank's connection index for it)]
    links: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    #: Each connection's negotiated driver and the decision's reason.
    decisions: list[tuple[str, str]] = field(default_factory=list)

    def close(self) -> None:
        for p in self.prefill + self.decode:
            p.close()


def _rank(
    workload: Workload, driver: str, name: str, tp: int, rank: int, timeout: float, engine: str = "", role: str = ""
) -> PeerProcess:
    heads = len(held_heads(workload.kv_heads, tp, rank))
    item = workload.page_tokens * heads * workload.head_dim * workload.dtype_bytes
    return PeerProcess(
        *("--driver", driver or "auto", "--pages", str(workload.pool_pages), "--layers", str(workload.regions)),
        *("--item", str(item), "--aux-slots", "0", "--private", "--name", name),
        *("--tp", f"{workload.kv_heads},{tp},{rank}", "--engine", engine, "--role", role or "prefill"),
        timeout=timeout,
    )


def deploy(
    workload: Workload,
    driver: str,
    prefill_tp: int,
    decode_tp: int,
    timeout: float,
    engines: tuple[str, str] = ("", ""),
) -> Ranks:
    """P prefill and D decode rank processes, each decode rank connected to its sources;
    ``engines``: the engines whose pools the two sides are shaped as (``("sglang", "vllm")``:
    SGLang prefill ranks feeding vLLM decode ranks, the pages regrouped on the way; or the
    reverse)."""
    if workload.page_tokens != 16:
        raise KVTransportError("the unequal-TP bench uses 16-token pages")
    ranks = Ranks(prefill_tp, decode_tp)
    try:
        for p in range(prefill_tp):
            ranks.prefill.append(_rank(workload, driver, f"prefill{p}", prefill_tp, p, timeout, engines[0]))
            ranks.prefill[-1].call("fill_heads", timeout=timeout)
        accepted = [0] * prefill_tp
        for d in range(decode_tp):
            ranks.decode.append(_rank(workload, driver, f"decode{d}", decode_tp, d, timeout, engines[1], "decode"))
            ranks.links[d] = []
            for p in sources(prefill_tp, decode_tp, d):
                answer = ranks.decode[d].call("connect", address=ranks.prefill[p].address, timeout=timeout)
                decision = answer["decision"]
                if decision:
                    ranks.decisions.append((str(decision["driver"]), str(decision["reason"])))
                ranks.prefill[p].call("accept", timeout=timeout)
                ranks.links[d].append((p, accepted[p]))
                accepted[p] += 1
        return ranks
    except BaseException:
        ranks.close()
        raise


def transfer(ranks: Ranks, tag: str, src: list[int], dst: list[int], timeout: float) -> tuple[float, str]:
    """One request on every rank; (seconds from the first send to the last decode rank done,
    '' or the first byte that is wrong)."""
    for d, links in ranks.links.items():
        ranks.decode[d].call("poison", pages=dst, timeout=timeout)
        conns = list(range(len(links)))
        ranks.decode[d].call("expect_from", conns=conns, transfers={f"{tag}.d{d}": dst}, timeout=timeout)
    start = time.monotonic()
    for d, links in ranks.links.items():
        for p, k in links:
            ranks.prefill[p].call("send", conn=k, transfers={f"{tag}.d{d}": [src]}, timeout=timeout)
    finished = 0.0
    for d in ranks.links:
        answer = ranks.decode[d].call("wait", tags=[f"{tag}.d{d}"], wait_s=timeout, timeout=timeout + 10)
        state = answer["states"][f"{tag}.d{d}"]
        if state[0] != "SUCCESS":
            raise KVTransportError(f"decode rank {d} ended {tag} in {state[0]}: {state[2]}")
        finished = max(finished, float(answer["finished"][f"{tag}.d{d}"]))
    for d in ranks.links:
        wrong = ranks.decode[d].call("check_heads", src=src, dst=dst, timeout=timeout)["mismatch"]
        if wrong:
            return finished - start, f"decode rank {d}: {wrong}"
    return finished - start, ""


@dataclass
class TPReport:
    workload: Workload
    driver: str
    prefill_tp: int
    decode_tp: int
    #: Why the negotiation chose ``driver`` ('' when it was forced with ``--driver``).
    negotiated: str = ""
    unequal_s: list[float] = field(default_factory=list)
    equal_s: list[float] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    #: The engines the two sides' pools are shaped as ('' for kvtransport's own).
    engines: tuple[str, str] = ("", "")

    def figures(self) -> dict[str, Any]:
        nbytes = self.workload.request_bytes
        out: dict[str, Any] = {"request_mib": nbytes / MiB}
        for name, samples in (("unequal", self.unequal_s), ("equal", self.equal_s)):
            if samples:
                p50 = statistics.median(samples)
                out[name] = {"p50_ms": p50 * 1e3, "gbps": nbytes / p50 / 1e9}
        if "unequal" in out and "equal" in out:
            out["ratio"] = out["unequal"]["gbps"] / out["equal"]["gbps"]
        return out

    @property
    def ok(self) -> bool:
        return not self.mismatches and bool(self.unequal_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "driver": self.driver,
            "negotiated": self.negotiated,
            "prefill_tp": self.prefill_tp,
            "decode_tp": self.decode_tp,
            "engines": list(self.engines),
            "workload": self.workload.describe(),
            "requests": len(self.unequal_s),
            "figures": self.figures(),
            "integrity": {"ok": self.ok, "mismatches": self.mismatches},
        }

    def render(self) -> str:
        f = self.figures()
        across = f", {self.engines[0]} prefill -> {self.engines[1]} decode" if any(self.engines) else ""
        lines = [
            f"kvtransport bench, prefill TP {self.prefill_tp} -> decode TP {self.decode_tp}{across}, "
            f"driver {self.driver}",
            f"  workload    {self.workload.describe()}",
        ]
        if self.negotiated:
            lines.append(f"  chosen      {self.driver} by the negotiation: {self.negotiated}")
        if "unequal" in f:
            u = f["unequal"]
            label = f"{self.engines[0]}->{self.engines[1]}" if any(self.engines) else "   "
            lines.append(
                f"  TP {self.prefill_tp}->{self.decode_tp} {label} {u['gbps']:6.2f} GB/s   p50 {u['p50_ms']:8.1f} ms"
            )
        if "equal" in f:
            e = f["equal"]
            lines.append(
                f"  TP 1->1       {e['gbps']:6.2f} GB/s   p50 {e['p50_ms']:8.1f} ms   (the same bytes, whole pages)"
            )
        if "ratio" in f:
            what = "regrouped across engines" if any(self.engines) else "unequal"
            lines.append(f"  ratio       {f['ratio']:.2f}x ({what} / equal TP, one engine's whole pages, medians)")
        verdict = "OK" if self.ok else "FAILED: " + "; ".join(self.mismatches[:3])
        lines.append(f"  integrity   {verdict}: every head of every page checked on every decode rank")
        return "\n".join(lines)


def run(
    workload: Workload,
    driver: str,
    prefill_tp: int,
    decode_tp: int,
    *,
    compare_equal: bool = True,
    timeout: float = 120.0,
    progress: TextIO | None = None,
    engines: tuple[str, str] = ("", ""),
) -> TPReport:
    report = TPReport(workload, driver, prefill_tp, decode_tp, engines=engines)
    deployments: dict[str, Ranks] = {}
    try:
        deployments["unequal"] = deploy(workload, driver, prefill_tp, decode_tp, timeout, engines)
        if not driver:  # negotiated: the equal-TP comparison runs on the driver it chose
            chosen = sorted(set(deployments["unequal"].decisions))
            if len({name for name, _ in chosen}) != 1:
                raise KVTransportError(f"the ranks' connections negotiated different drivers: {chosen}")
            report.driver, report.negotiated = chosen[0]
            driver = report.driver
        if compare_equal:
            deployments["equal"] = deploy(workload, driver, 1, 1, timeout)
        rng = np.random.default_rng(workload.seed)
        for i in range(-workload.warmup, workload.requests):
            src, dst = workload.pages(rng), workload.pages(rng)
            order = list(deployments) if i % 2 == 0 else list(deployments)[::-1]
            for name in order:
                seconds, wrong = transfer(deployments[name], f"r{i}-{name}", src, dst, timeout)
                if wrong:
                    report.mismatches.append(f"{name} request {i}: {wrong}")
                if i >= 0:
                    (report.unequal_s if name == "unequal" else report.equal_s).append(seconds)
            if progress is not None:
                progress.write(f"\r  request {i + 1}/{workload.requests}")
                progress.flush()
        if progress is not None:
            progress.write("\n")
        return report
    finally:
        for ranks in deployments.values():
            ranks.close()


def main_json(report: TPReport) -> str:
    return json.dumps(report.to_dict(), indent=2)
