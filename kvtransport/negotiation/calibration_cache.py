"""The per-user cache of calibrated cost models, and what an endpoint's hello takes from it.

The cache (``KVTRANSPORT_CALIBRATION``: a file path, or ``off``; default
``$XDG_CACHE_HOME/kvtransport/calibration.json``) holds models keyed by machine (``machine-id`` and
hostname, so they survive a reboot), driver, path, far host and KV memory, each with the driver
version it was measured with: an endpoint puts into its hello only the models of this machine
whose version is the driver's current one, so an upgrade falls back on nominal figures until the
next calibration.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path

from kvtransport.negotiation.cost_model import MAX_MODELS_PER_DRIVER, CostModel, models_from_list
from kvtransport.negotiation.hello import DriverHello
from kvtransport.spi.errors import ProtocolError
from kvtransport.spi.probe import machine_key

log = logging.getLogger(__name__)

ENV_CALIBRATION = "KVTRANSPORT_CALIBRATION"
CACHE_SCHEMA = 1


def cache_path(env: Mapping[str, str] | None = None) -> Path | None:
    """Where the cache lives (``None``: ``KVTRANSPORT_CALIBRATION=off``, or no home folder to
    put it in)."""
    env = os.environ if env is None else env
    value = env.get(ENV_CALIBRATION, "").strip()
    if value.lower() in ("off", "0", "none", "false"):
        return None
    if value:
        return Path(value).expanduser()
    try:
        base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    except RuntimeError:  # no HOME and no passwd entry (some containers)
        return None
    return Path(base) / "kvtransport" / "calibration.json"


def read_cache(path: Path | None) -> dict[str, dict[str, list[CostModel]]]:
    """machine key -> driver -> models. A missing file is empty; one that cannot be read or
    parsed, whatever is wrong with it, is logged and treated as empty (the endpoint then uses
    nominal figures, and says so)."""
    if path is None:
        return {}
    try:
        if not path.exists():
            return {}
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or doc.get("schema") != CACHE_SCHEMA:
            raise ProtocolError(f"schema {doc.get('schema') if isinstance(doc, dict) else None!r}, not {CACHE_SCHEMA}")
        out: dict[str, dict[str, list[CostModel]]] = {}
        for host, drivers in dict(doc["models"]).items():
            out[str(host)] = {str(d): list(models_from_list(m)) for d, m in dict(drivers).items()}
        return out
    except Exception as exc:  # noqa: BLE001 - a bad cache must never stop an endpoint
        log.warning(
            "ignoring the calibration cache %s: %s: %s (run kvtransport calibrate again)",
            path,
            type(exc).__name__,
            str(exc)[:200],
        )
        return {}


def write_cache(path: Path, models: Mapping[str, Iterable[CostModel]], machine: str) -> None:
    """Merge ``models`` (driver -> models) for ``machine`` into the cache: a model replaces the
    one of the same driver, path, far host and memory; the newest ``MAX_MODELS_PER_DRIVER`` of a
    driver are kept. Written atomically (a reader never sees half), readable by everyone (it
    holds measurements, no secret)."""
    cache = read_cache(path)
    mine = cache.setdefault(machine, {})
    for driver, new in models.items():
        fresh = list(new)
        kept = [m for m in mine.get(driver, []) if not any(_same_slot(m, n) for n in fresh)]
        mine[driver] = (kept + fresh)[-MAX_MODELS_PER_DRIVER:]
    doc = {
        "schema": CACHE_SCHEMA,
        "models": {h: {d: [m.to_dict() for m in ms] for d, ms in ds.items()} for h, ds in cache.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _same_slot(a: CostModel, b: CostModel) -> bool:
    return (a.path, a.peer_host, a.memory) == (b.path, b.peer_host, b.memory)


def with_cached_models(
    hellos: Mapping[str, DriverHello],
    host_id: str,
    path: Path | None = None,
    *,
    machine: str | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, DriverHello]:
    """``hellos`` with each usable driver's cached models of this machine and driver version
    (a loopback model's far host, "" in the cache, becomes ``host_id``, this boot's host id)."""
    try:
        where = cache_path(env) if path is None else path
    except Exception as exc:  # noqa: BLE001 - a bad setting must never stop an endpoint
        log.warning("no calibration cache: %s", exc)
        return dict(hellos)
    cache = read_cache(where).get(machine_key() if machine is None else machine, {})
    out = dict(hellos)
    for name, entry in hellos.items():
        if entry.status is None or not entry.status.available:
            continue
        version = entry.status.version
        current = [replace(m, peer_host=m.peer_host or host_id) for m in cache.get(name, []) if m.version == version]
        if current:
            out[name] = replace(entry, costs=tuple(current[-MAX_MODELS_PER_DRIVER:]))
    return out
