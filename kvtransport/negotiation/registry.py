"""Driver discovery and selection: entry points in ``kvtransport.drivers``, env-var policy.

Discovery is quiet and lazy. :func:`list_drivers` reads entry-point metadata only (nothing is
imported); :func:`load_driver` imports exactly the one driver asked for, through stevedore's
``DriverManager``, and checks it (a ``KVTransport`` subclass, named as registered, built for
this ``DRIVER_API_VERSION``). Nothing is scanned at ``import kvtransport``. A broken third-party
plugin that nobody selected is logged at DEBUG and reported by ``doctor``; the driver a user
asked for re-raises loudly.

The user's policy comes from three environment variables (see docs/environment.md):
``KVTRANSPORT_DRIVER`` forces one driver, ``KVTRANSPORT_DRIVERS`` lists the allowed drivers in
preference order, ``KVTRANSPORT_EXCLUDE`` removes drivers.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from kvtransport.spi.driver import DRIVER_API_VERSION, KVTransport, declared_capabilities
from kvtransport.spi.errors import (
    ConfigError,
    DriverAPIMismatch,
    DriverLoadError,
    DuplicateDriver,
    NoSuchDriver,
)

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kvtransport.drivers"

ENV_DRIVER = "KVTRANSPORT_DRIVER"
ENV_DRIVERS = "KVTRANSPORT_DRIVERS"
ENV_EXCLUDE = "KVTRANSPORT_EXCLUDE"
ENV_FAILOVER = "KVTRANSPORT_FAILOVER"
#: ``KVTRANSPORT_FAILOVER``: ``auto`` keeps a standby driver for connections between two
#: hosts, ``on`` for every connection, ``off`` for none (either side's ``off`` wins).
FAILOVER_SETTINGS = ("auto", "on", "off")


@dataclass(frozen=True)
class DriverEntry:
    """One registered driver, from entry-point metadata (nothing imported)."""

    name: str
    target: str  # "module:attribute"
    distribution: str
    version: str

    def to_dict(self) -> dict[str, str]:
        return {
            "name": self.name,
            "target": self.target,
            "distribution": self.distribution,
            "version": self.version,
        }


def list_drivers() -> list[DriverEntry]:
    """Every registered driver entry, sorted by name; duplicates are kept (doctor shows them).

    The same distribution seen twice on ``sys.path`` (an editable install beside a build dir)
    counts once.
    """
    seen: set[tuple[str, str, str]] = set()
    entries = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else "<unknown>"
        dist_version = dist.version if dist is not None else ""
        key = (ep.name, ep.value, dist_name)
        if key in seen:
            continue
        seen.add(key)
        entries.append(DriverEntry(ep.name, ep.value, dist_name, dist_version))
    return sorted(entries, key=lambda e: (e.name, e.distribution))


def installed_names(entries: Iterable[DriverEntry] | None = None) -> list[str]:
    return sorted({e.name for e in (list_drivers() if entries is None else entries)})


def suggest(name: str, known: Iterable[str]) -> str:
    """``No such driver: 'x'. Did you mean 'y'? Installed: ...``"""
    known = sorted(set(known))
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    installed = ", ".join(known) if known else "none (pip install kvtransport-nixl, ...)"
    return f"No such driver: {name!r}.{hint} Installed: {installed}"


def duplicates(entries: Iterable[DriverEntry]) -> dict[str, list[DriverEntry]]:
    by_name: dict[str, list[DriverEntry]] = {}
    for entry in entries:
        by_name.setdefault(entry.name, []).append(entry)
    return {name: group for name, group in by_name.items() if len(group) > 1}


def _duplicate_error(name: str, group: list[DriverEntry]) -> DuplicateDriver:
    who = " and ".join(f"{e.distribution} {e.version} ({e.target})" for e in group)
    return DuplicateDriver(f"driver name {name!r} is registered by several distributions: {who}; uninstall one of them")


def load_driver(name: str, entries: list[DriverEntry] | None = None) -> type[KVTransport]:
    """Import and validate the driver registered as ``name``; raise a typed error if it fails."""
    entries = list_drivers() if entries is None else entries
    group = [e for e in entries if e.name == name]
    if not group:
        raise NoSuchDriver(suggest(name, (e.name for e in entries)))
    if len(group) > 1:
        raise _duplicate_error(name, group)
    entry = group[0]

    from stevedore import driver as stevedore_driver  # imported only when a driver is loaded
    from stevedore.exception import MultipleMatches, NoMatches

    def on_failure(_manager: Any, _ep: Any, err: BaseException) -> None:
        raise DriverLoadError(
            f"driver {name!r} from {entry.distribution} {entry.version} failed to load "
            f"({entry.target}): {type(err).__name__}: {err}"
        ) from err

    try:
        manager = stevedore_driver.DriverManager(
            ENTRY_POINT_GROUP,
            name,
            invoke_on_load=False,
            on_load_failure_callback=on_failure,
            on_missing_entrypoints_callback=None,
        )
    except MultipleMatches as exc:
        raise _duplicate_error(name, group) from exc
    except NoMatches as exc:  # metadata and stevedore's cache disagree: a stale install
        raise DriverLoadError(
            f"driver {name!r} is listed by {entry.distribution} but its entry point could not "
            f"be resolved ({exc}); reinstall {entry.distribution}"
        ) from exc
    return validate_driver_class(name, manager.driver, entry)


def validate_driver_class(name: str, obj: Any, entry: DriverEntry | None = None) -> type[KVTransport]:
    where = f" from {entry.distribution} ({entry.target})" if entry else ""
    if not (isinstance(obj, type) and issubclass(obj, KVTransport)):
        raise DriverLoadError(f"driver {name!r}{where} is {obj!r}, not a subclass of kvtransport.KVTransport")
    registered = obj.__dict__.get("name")
    if registered != name:
        raise DriverLoadError(
            f"driver {name!r}{where}: class {obj.__qualname__} calls itself {registered!r}; "
            "the entry-point name and the class's `name` must match"
        )
    version = obj.__dict__.get("api_version")
    if version != DRIVER_API_VERSION:
        raise DriverAPIMismatch(
            f"driver {name!r}{where} was built for another driver API: "
            f"expected {DRIVER_API_VERSION}, got {version}; upgrade "
            f"{entry.distribution if entry else 'the driver'} or kvtransport"
        )
    try:
        declared_capabilities(obj)
    except TypeError as exc:
        raise DriverLoadError(f"driver {name!r}{where}: {exc}") from exc
    return obj


# --- policy from the environment -------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """Which drivers the user allows: forced one, allowed list (preference order), excluded."""

    force: str | None = None
    allow: tuple[str, ...] = ()  # empty: every driver
    exclude: tuple[str, ...] = ()
    #: Whether a connection keeps a standby driver to fail over to (:data:`FAILOVER_SETTINGS`).
    failover: str = "auto"

    def permits(self, name: str) -> tuple[bool, str]:
        """(allowed, reason if not) for ``name`` under this policy."""
        if name in self.exclude:
            return False, f"excluded by {ENV_EXCLUDE}"
        if self.force is not None and name != self.force:
            return False, f"{ENV_DRIVER}={self.force} forces another driver"
        if self.allow and name not in self.allow:
            return False, f"not listed in {ENV_DRIVERS}={','.join(self.allow)}"
        return True, ""

    def rank(self, name: str) -> int:
        """Position in the user's preference list (0 when there is none)."""
        return self.allow.index(name) if name in self.allow else 0

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        known: Iterable[str] | None = None,
    ) -> Policy:
        """Read the policy from ``env`` (default ``os.environ``), checking every name.

        ``known`` is the set of valid driver names (default: the installed ones). A name that
        is not among them raises :class:`NoSuchDriver` with a suggestion.
        """
        env = os.environ if env is None else env
        known_set = set(installed_names() if known is None else known)
        force = env.get(ENV_DRIVER, "").strip() or None
        allow = _split(env.get(ENV_DRIVERS, ""))
        exclude = _split(env.get(ENV_EXCLUDE, ""))
        for var, names in (
            (ENV_DRIVER, [force] if force else []),
            (ENV_DRIVERS, allow),
            (ENV_EXCLUDE, exclude),
        ):
            for name in names:
                if name not in known_set:
                    raise NoSuchDriver(f"{var}: {suggest(name, known_set)}")
        if force and force in exclude:
            raise ConfigError(f"{ENV_DRIVER}={force} is also listed in {ENV_EXCLUDE}")
        if force and allow and force not in allow:
            raise ConfigError(f"{ENV_DRIVER}={force} is not among {ENV_DRIVERS}={','.join(allow)}")
        failover = env.get(ENV_FAILOVER, "").strip().lower() or "auto"
        if failover not in FAILOVER_SETTINGS:
            raise ConfigError(f"{ENV_FAILOVER}={failover!r}: use one of {', '.join(FAILOVER_SETTINGS)}")
        return cls(force=force, allow=tuple(allow), exclude=tuple(exclude), failover=failover)


def _split(text: str) -> list[str]:
    names: list[str] = []
    for part in text.replace(" ", ",").split(","):
        if part and part not in names:
            names.append(part)
    return names
