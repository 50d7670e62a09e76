"""``kvtransport bench --layerwise``: whole-request sends against layer-wise sends of the same
requests, with prefill compute simulated per layer, side by side in one run.

Each request is computed layer by layer in this process (``--compute-ms-per-layer`` of a busy
loop or of real matrix products on the CPU) and sent to a decode process on loopback twice,
alternating which goes first: once as a whole after its last layer (what serving engines do
today), once layer-wise (``Transfer.send_layerwise``: each layer marked ready as it is
computed). For each it reports, as medians:

- the *tail*: from the end of the last layer's compute to the decode side's Success, what
  time-to-first-token pays on top of prefill;
- *end to end*: from the start of the first layer's compute to the decode side's Success;

and the ratio whole / layer-wise of each, every page of every request checked on both ends.
It also sends one layer group's worth of each request's pages (of every layer) whole and alone,
the yardstick of the target: a layer-wise tail of at most that move plus 0.5 ms, when compute
per layer is at least that move.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, TextIO

import numpy as np

from kvtransport.runtime.endpoint import Endpoint, State
from kvtransport.runtime.layer_groups import LayerwisePolicy
from kvtransport.spi.errors import KVTransportError
from kvtransport.tools.bench import Sample, Workload, _open_pair, await_announced, close_pairs, timed_transfer
from kvtransport.tools.kv_pool import KVPool
from kvtransport.tools.peer_process import PeerProcess

MODES = ("whole", "layerwise")
#: Request numbers of the yardstick's transfers (``timed_transfer`` tags them ``bench-<n>``).
ALONE_TAGS = 1_000_000
COMPUTE = ("busy", "matmul")


def compute_for(seconds: float, how: str, scratch: np.ndarray[Any, Any]) -> None:
    """Stand in for one layer's prefill compute for ``seconds``: a busy loop that lets other
    threads in between its checks (``busy``), or matrix products (``matmul``), on a CPU core."""
    deadline = time.perf_counter() + seconds
    if how == "matmul":
        while time.perf_counter() < deadline:
            np.matmul(scratch, scratch)
        return
    while time.perf_counter() < deadline:
        time.sleep(0)  # burns the core, as compute does, but yields the interpreter


def run(
    workload: Workload,
    compute_ms: float,
    *,
    compute: str = "busy",
    driver: str | None = None,
    policy: LayerwisePolicy | None = None,
    timeout: float = 120.0,
    progress: TextIO | None = None,
) -> dict[str, Any]:
    if compute_ms < 0:
        raise KVTransportError("--compute-ms-per-layer must be 0 or more")
    if compute not in COMPUTE:
        raise KVTransportError(f"--compute must be one of {', '.join(COMPUTE)}")
    policy = policy or LayerwisePolicy.from_env()
    pool = KVPool(workload.pool_pages, workload.regions, workload.item_len, 0, shared=False, device=workload.device)
    pool.fill(workload.seed)
    scratch = np.ones((96, 96), dtype=np.float32)
    pairs: list[tuple[Endpoint, PeerProcess | None]] = []
    samples: dict[str, dict[str, list[float]]] = {m: {"tail": [], "e2e": [], "groups": []} for m in MODES}
    samples["alone"] = {"e2e": []}
    wrong: list[str] = []
    layers = workload.layers
    try:
        _, peer, conn = _open_pair(pool, workload, driver, timeout, pairs)
        assert conn.decision is not None
        rng = np.random.default_rng(workload.seed)
        for i in range(-workload.warmup, workload.requests):
            src, dst = workload.pages(rng), workload.pages(rng)
            expected = pool.page_digests(src)
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                tag = f"lw-{i}-{mode}"
                peer.call("poison", pages=dst, timeout=timeout)
                peer.call("expect", transfers={tag: dst}, timeout=timeout)
                t = conn.sender(tag)
                await_announced([t], timeout)
                start = time.monotonic()
                groups = 1
                if mode == "whole":
                    for _ in range(layers):
                        compute_for(compute_ms / 1e3, compute, scratch)
                    computed = time.monotonic()
                    t.send(src, last=True)
                else:
                    stream = t.send_layerwise(src, policy=policy)
                    for layer in range(layers):
                        compute_for(compute_ms / 1e3, compute, scratch)
                        if layer == layers - 1:
                            computed = time.monotonic()
                        stream.layer_ready(layer)
                    groups = len(stream.groups)
                if t.wait(timeout) is not State.SUCCESS:
                    raise KVTransportError(f"request {tag} did not succeed")
                answer = peer.call("wait", tags=[tag], timeout=timeout + 5)
                state = answer["states"][tag]
                if state[0] != "SUCCESS":
                    raise KVTransportError(f"decode side ended {tag} in {state[0]}: {state[2]}")
                finished = float(answer["finished"][tag])
                if peer.call("digests", pages=dst, timeout=timeout)["digests"] != expected:
                    wrong.append(tag)
                if i >= 0:
                    samples[mode]["tail"].append(finished - computed)
                    samples[mode]["e2e"].append(finished - start)
                    samples[mode]["groups"].append(groups)
                if mode == "layerwise":
                    # The yardstick: one group's worth of pages (all layers), sent whole alone
                    # (its tag ``bench-<n>``, unique beside these modes' ``lw-`` tags).
                    k = max(1, -(-len(src) // groups))
                    alone = Sample(ALONE_TAGS + i, 0)
                    timed_transfer(alone, conn, peer, src[:k], dst[:k], expected[:k], timeout)
                    if not alone.ok:
                        wrong.append(f"lw-{i}-alone")
                    elif i >= 0:
                        samples["alone"]["e2e"].append(alone.end_to_end_s)
            if progress is not None and i >= 0:
                progress.write(f"\r  request {i + 1}/{workload.requests}")
                progress.flush()
        if progress is not None:
            progress.write("\n")
        return _document(workload, conn.decision.driver, compute_ms, compute, policy, samples, wrong)
    finally:
        close_pairs(pairs)
        pool.close()


def _document(
    workload: Workload,
    driver: str,
    compute_ms: float,
    compute: str,
    policy: LayerwisePolicy,
    samples: dict[str, dict[str, list[float]]],
    wrong: list[str],
) -> dict[str, Any]:
    figures = {
        mode: {
            "tail_p50_ms": statistics.median(s["tail"]) * 1e3,
            "e2e_p50_ms": statistics.median(s["e2e"]) * 1e3,
            "groups_p50": statistics.median(s["groups"]),
        }
        for mode, s in samples.items()
        if s.get("tail")
    }
    whole, layered = figures.get("whole"), figures.get("layerwise")
    alone = statistics.median(samples["alone"]["e2e"]) * 1e3 if samples["alone"]["e2e"] else None
    return {
        "driver": driver,
        "workload": workload.describe(),
        "compute_ms_per_layer": compute_ms,
        "compute": compute,
        "policy": dataclasses.asdict(policy),
        "below_min_tokens": workload.prompt_tokens < policy.min_tokens,
        "requests": workload.requests,
        "figures": figures,
        "one_group_alone_ms": alone,
        "target_met": (layered["tail_p50_ms"] <= alone + 0.5) if layered and alone is not None else None,
        "tail_ratio": whole["tail_p50_ms"] / layered["tail_p50_ms"] if whole and layered else None,
        "e2e_ratio": whole["e2e_p50_ms"] / layered["e2e_p50_ms"] if whole and layered else None,
        "integrity": {"ok": not wrong, "mismatches": wrong},
    }


def render(doc: dict[str, Any]) -> str:
    f = doc["figures"]
    lines = [
        f"kvtransport bench --layerwise: whole-request against layer-wise sends, driver {doc['driver']}",
        f"  workload    {doc['workload']}",
        f"  compute     {doc['compute_ms_per_layer']:g} ms per layer ({doc['compute']}), in the prefill process",
    ]
    p = doc["policy"]
    below = " (request below min_tokens: one batch)" if doc["below_min_tokens"] else ""
    lines.append(
        f"  policy      min_tokens {p['min_tokens']}, first group {p['first_group']} layer(s), "
        f"{'adaptive' if p['adaptive'] else 'fixed'}{below}"
    )
    for mode, label in (("whole", "whole      "), ("layerwise", "layer-wise ")):
        if mode in f:
            m = f[mode]
            lines.append(
                f"  {label} tail p50 {m['tail_p50_ms']:8.2f} ms   end-to-end p50 {m['e2e_p50_ms']:8.2f} ms"
                f"   ({m['groups_p50']:g} batch{'es' if m['groups_p50'] != 1 else ''})"
            )
    if doc["tail_ratio"] is not None:
        lines.append(
            f"  ratio       {doc['tail_ratio']:.2f}x tail, {doc['e2e_ratio']:.2f}x end-to-end"
            " (whole / layer-wise, medians)"
        )
    if doc["one_group_alone_ms"] is not None:
        met = {True: "met", False: "not met", None: "n/a"}[doc["target_met"]]
        lines.append(
            f"  one group   alone p50 {doc['one_group_alone_ms']:.2f} ms (its pages of every layer, sent whole); "
            f"target tail <= that + 0.5 ms: {met}"
        )
    integrity = doc["integrity"]
    verdict = "OK" if integrity["ok"] else "FAILED: " + ", ".join(integrity["mismatches"][:3])
    lines.append(f"  integrity   {verdict}: every page of every request checked on both ends")
    return "\n".join(lines)
