"""The sweep's results as a document and as a table.

The document ``Sweep.run`` returns (and ``--json`` prints) carries ``SWEEP_SCHEMA_VERSION``;
each point's entry starts from ``point_doc`` (its workload) and ends with ``verdicts`` (its
headline: the best forced driver, the choice against it, the best path against memcpy).
``render`` is the table ``kvtransport bench --sweep`` prints: a row per point, GB/s per path,
the choice's latency and CPU. The plot is ``sweep_plot``'s.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvtransport.tools.presets import preset
from kvtransport.tools.sweep_grid import GiB, MiB, Point

#: The sweep's ``--json`` document; it changes only when a field changes meaning or goes
#: (docs/performance.md, "The sweep's JSON").
SWEEP_SCHEMA_VERSION = 1


def point_doc(p: Point) -> dict[str, Any]:
    return asdict(p) | {
        "pages_per_request": p.pages(),
        "request_bytes": preset(p.model).request_bytes(p.page_tokens, p.pages()),
    }


def verdicts(paths: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The point's headline: the best forced driver, the choice against it, the best path
    against memcpy."""

    def gbps(label: str) -> float:
        f = paths.get(label, {})
        return 0.0 if f.get("corrupt") or f.get("error") else float(f.get("median_gbps", 0.0))

    # A path that corrupted a byte or failed is never the best, whatever its median.
    sound = {label for label, f in paths.items() if not f.get("corrupt") and not f.get("error")}
    forced = [
        label for label, f in paths.items() if f["kind"] == "kvtransport" and label != "choice" and label in sound
    ]
    out: dict[str, Any] = {}
    if forced:
        best = max(forced, key=gbps)
        out["best_forced"] = best
        if gbps(best) and gbps("choice"):
            out["ratio_choice_best"] = round(gbps("choice") / gbps(best), 3)
    if gbps("layerwise:choice") and gbps("choice"):
        out["ratio_layerwise_choice"] = round(gbps("layerwise:choice") / gbps("choice"), 3)
    moving = [label for label, f in paths.items() if f["kind"] != "memcpy" and label in sound]
    if moving and gbps("memcpy"):
        best_any = max(moving, key=gbps)
        out["best_path"] = best_any
        out["ratio_best_memcpy"] = round(gbps(best_any) / gbps("memcpy"), 3)
    return out


def render(doc: dict[str, Any]) -> str:
    """The sweep as a table: a row per point, GB/s per path, the choice's latency and CPU."""
    points = [p for p in doc["points"] if "paths" in p]
    labels: list[str] = []
    for p in points:
        labels += [label for label in p["paths"] if label not in labels]
    short = {label: _short(label) for label in labels}
    lines = [
        f"kvtransport bench --sweep: {len(points)} points measured, "
        f"{len(doc['points']) - len(points)} skipped, {doc.get('seconds', 0):.0f} s; GB/s (medians, aggregate "
        "over the requests in flight); the choice's latency p50/p99 per request from its round's start; its "
        "CPU s per GB, both processes, idle cost subtracted",
    ]
    if doc.get("remote"):
        lines.append(
            f"  decode sides at {doc['remote']} (another host: latencies carry the clock offset's error, "
            f"at most {doc.get('clock_error_ms', 0):.2f} ms)"
        )
    for layout in doc["layouts"]:
        c = layout["choice"]
        lanes = f", lanes {'/'.join(c['lanes'])}" if len(c["lanes"]) > 1 else ""
        lines.append(
            f"  {layout['model_name']}, {layout['page_tokens']}-token pages: choice {c['driver']} "
            f"({c['basis']}{lanes}); connect "
            + ", ".join(f"{_short(k)} {v:.1f} ms" for k, v in layout["connect_ms"].items())
        )
    head = f"{'model':<16}{'pg':>3}{'tokens':>7} {'place':<6}{'k':>3}{'MiB':>8} "
    head += "".join(f"{short[label]:>10}" for label in labels)
    head += f"{'ch/best':>8}{'best/mc':>8}{'p50ms':>9}{'p99ms':>9}{'cpu/GB':>7}{'planms':>7}"
    lines += ["", head]
    for p in points:
        row = f"{p['model'][:15]:<16}{p['page_tokens']:>3}{p['prompt_tokens']:>7} {p['placement'][:5]:<6}"
        row += f"{p['in_flight']:>3}{p['in_flight'] * p['request_bytes'] / MiB:>8.1f} "
        for label in labels:
            f = p["paths"].get(label, {})
            cell = "ERR" if f.get("error") else ("BAD" if f.get("corrupt") else f"{f.get('median_gbps', 0):.2f}")
            row += f"{cell:>10}"
        choice = p["paths"].get("choice", {})
        row += f"{p.get('ratio_choice_best', 0):>8.2f}{p.get('ratio_best_memcpy', 0):>8.2f}"
        row += f"{choice.get('p50_ms', 0):>9.2f}{choice.get('p99_ms', 0):>9.2f}"
        row += f"{choice.get('cpu_s_per_gb', 0):>7.2f}{p.get('planning_ms', 0):>7.2f}"
        lines.append(row)
    skipped = [p for p in doc["points"] if "skipped" in p]
    if skipped:
        lines.append(
            f"  skipped {len(skipped)} points, e.g. {skipped[0]['model']} {skipped[0]['prompt_tokens']} "
            f"tokens x{skipped[0]['in_flight']}: {skipped[0]['skipped']}"
        )
    lines += [f"  error {e}" for e in doc.get("errors", [])[:8]]
    if len(doc.get("errors", [])) > 8:
        lines.append(f"  ... {len(doc['errors']) - 8} more errors (--json lists them all)")
    if not points:
        lines.append("  integrity   FAILED: no point was measured")
    else:
        verdict = "OK" if doc.get("integrity_ok") else "FAILED (a cell marked BAD had a wrong byte)"
        lines.append(
            f"  integrity   {verdict}: {doc.get('requests_verified', 0)} requests, "
            f"{doc.get('bytes_verified', 0) / GiB:.2f} GiB checked page by page and slot by slot"
        )
    return "\n".join(lines)


def _short(label: str) -> str:
    names = {"mooncake": "mc", "nixl": "nixl", "mooncake-gdr": "mc-gdr", "mooncake-staged": "mc-stg"}
    kind, _, rest = label.partition(":")
    if rest:
        return f"{kind}:{names.get(rest, rest)}"[:9]
    return names.get(label, label)[:9]
