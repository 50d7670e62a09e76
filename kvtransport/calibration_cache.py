"""The per-user cache of calibrated cost models, and what an endpoint's hello takes from it.

The cache (``KVTRANSPORT_CALIBRATION``: a file path, or ``off``; default
``$XDG_CACHE_HOME/kvtransport/calibration.json``) holds models keyed by host id, driver, path and
far host, each with the driver version it was measured with: an endpoint puts into its hello
only the models of this host whose version is the driver's current one, so an upgrade falls
back on nominal figures until the next calibration.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path

from .cost_model import CostModel, models_from_list
from .errors import ProtocolError
from .hello import DriverHello

log = logging.getLogger(__name__)

ENV_CALIBRATION = "KVTRANSPORT_CALIBRATION"
CACHE_SCHEMA = 1


def cache_path(env: Mapping[str, str] | None = None) -> Path | None:
    """Where the cache lives (``None``: ``KVTRANSPORT_CALIBRATION=off``)."""
    env = os.environ if env is None else env
    value = env.get(ENV_CALIBRATION, "").strip()
    if value.lower() in ("off", "0", "none", "false"):
        return None
    if value:
        return Path(value).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtransport" / "calibration.json"


def read_cache(path: Path | None) -> dict[str, dict[str, list[CostModel]]]:
    """host id -> driver -> models. A missing file is empty; an unreadable one is logged and
    treated as empty (the endpoint then uses nominal figures, and says so)."""
    if path is None or not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or doc.get("schema") != CACHE_SCHEMA:
            raise ProtocolError(f"schema {doc.get('schema') if isinstance(doc, dict) else None!r}, not {CACHE_SCHEMA}")
        out: dict[str, dict[str, list[CostModel]]] = {}
        for host, drivers in dict(doc["models"]).items():
            out[str(host)] = {str(d): list(models_from_list(m)) for d, m in dict(drivers).items()}
        return out
    except (OSError, ValueError, TypeError, KeyError, ProtocolError) as exc:
        log.warning("ignoring the calibration cache %s: %s (run kvtransport calibrate again)", path, exc)
        return {}


def write_cache(path: Path, models: Mapping[str, Iterable[CostModel]], host: str) -> None:
    """Merge ``models`` (driver -> models) for ``host`` into the cache: a model replaces the one
    of the same driver, path and far host. Written atomically (a reader never sees half)."""
    cache = read_cache(path)
    mine = cache.setdefault(host, {})
    for driver, new in models.items():
        kept = [m for m in mine.get(driver, []) if not any(_same_slot(m, n) for n in new)]
        mine[driver] = kept + list(new)
    doc = {
        "schema": CACHE_SCHEMA,
        "models": {h: {d: [m.to_dict() for m in ms] for d, ms in ds.items()} for h, ds in cache.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration-")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _same_slot(a: CostModel, b: CostModel) -> bool:
    return (a.path, a.peer_host) == (b.path, b.peer_host)


def with_cached_models(
    hellos: Mapping[str, DriverHello], host: str, path: Path | None = None, *, env: Mapping[str, str] | None = None
) -> dict[str, DriverHello]:
    """``hellos`` with each usable driver's cached models of this host and driver version."""
    cache = read_cache(cache_path(env) if path is None else path).get(host, {})
    out = dict(hellos)
    for name, entry in hellos.items():
        if entry.status is None or not entry.status.available:
            continue
        current = [m for m in cache.get(name, []) if m.version == entry.status.version]
        if current:
            out[name] = replace(entry, costs=tuple(current))
    return out
