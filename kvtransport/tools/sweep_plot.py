"""``kvtransport bench --sweep --plot FILE.png``: bandwidth and latency against request size,
a line per path, a row of panels per model. Needs matplotlib (``pip install kvtransport[plot]``);
nothing else in the library imports it."""

from __future__ import annotations

from typing import Any

from kvtransport.spi.errors import ConfigError

MARKERS = {"contiguous": "o", "scattered": "x", "mixed": "^"}


def require_matplotlib() -> None:
    """Raise before a long sweep, not after it, when the plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'kvtransport[plot]'") from None


def plot(doc: dict[str, Any], path: str) -> None:
    """One row per model, two panels (bandwidth, p50 latency per request) against request
    bytes, log-log; one line per path and placement (marker), at the sweep's smallest number
    in flight and smallest page size, so every line is one variable at a time."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    points = [p for p in doc["points"] if "paths" in p]
    if not points:
        raise ConfigError("the sweep measured no point: nothing to plot")
    k = min(p["in_flight"] for p in points)
    # One colour per path across every panel; the marker tells the placement.
    every = list(dict.fromkeys(label for p in points for label in p["paths"]))
    colours = {label: plt.get_cmap("tab10")(i % 10) for i, label in enumerate(every)}
    styles = {"kvtransport": "-", "raw": "--", "naive": ":", "memcpy": "-."}
    models = list(dict.fromkeys(p["model"] for p in points))
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 3.6 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        at = [p for p in points if p["model"] == model and p["in_flight"] == k]
        page = min(p["page_tokens"] for p in at) if at else 0
        at = [p for p in at if p["page_tokens"] == page]
        bw, lat = axes[row]
        labels = list(dict.fromkeys(label for p in at for label in p["paths"]))
        for label in labels:
            for placement, marker in MARKERS.items():
                series = sorted(
                    (p["request_bytes"], p["paths"][label])
                    for p in at
                    if p["placement"] == placement and label in p["paths"] and "median_gbps" in p["paths"][label]
                )
                if not series:
                    continue
                xs = [x for x, _ in series]
                name = f"{label} ({placement})"
                look = {"marker": marker, "color": colours[label], "linestyle": styles.get(series[0][1]["kind"], "-")}
                bw.plot(xs, [f["median_gbps"] for _, f in series], label=name, **look)
                if series[0][1].get("p50_ms"):
                    lat.plot(xs, [f["p50_ms"] for _, f in series], label=name, **look)
        for ax, what in ((bw, "GB/s (median, aggregate)"), (lat, "p50 latency per request (ms)")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("request bytes")
            ax.set_ylabel(what)
            ax.grid(True, which="both", alpha=0.3)
        name = next((lay["model_name"] for lay in doc["layouts"] if lay["model"] == model), model)
        bw.set_title(f"{name}, {page}-token pages, {k} in flight")
        lat.set_title(f"{name}: latency")
        bw.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
