"""The discovery interface (:class:`Directory`) and the backend a process uses for an instance.

A prefill rank registers its route (its endpoint's address and parallel layout) under its
(dp, tp) rank and keeps it alive; a decode rank looks up the routes of the prefill instance a
request names (what SGLang calls its bootstrap address). Two backends implement it: the
built-in registry (:class:`~kvtransport.integrations.bootstrap.BootstrapClient`, one HTTP
server per prefill instance, the default) and etcd
(:class:`~kvtransport.integrations.discovery.etcd.EtcdDirectory`, ``KVTRANSPORT_DISCOVERY``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Protocol

from kvtransport.integrations.bootstrap import BootstrapClient
from kvtransport.runtime.discovery_config import Discovery, discovery_from_env


class Directory(Protocol):
    """Where one prefill instance's ranks can be reached."""

    base: str
    registered: threading.Event
    #: Whether :meth:`register_room` publishes rooms (instances that do not route by room need it).
    serves_rooms: bool

    def register(self, route: Mapping[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Publish ``route`` under its (dp, tp) rank once."""

    def keep_registered(
        self, route: Mapping[str, Any], interval: float | None = None, *, first_wait: float | None = None
    ) -> bool:
        """Publish ``route`` and keep it alive until :meth:`close`; whether it is registered already."""

    def register_room(self, room: int, dp_rank: int, timeout: float | None = None) -> None:
        """Publish that DP rank ``dp_rank`` took request ``room``."""

    def lookup(self, dp_rank: int, tp_rank: int, wait: float, stop: threading.Event | None = None) -> dict[str, Any]:
        """The route of rank (dp, tp), waiting up to ``wait`` seconds for it to appear."""

    def unregister(self, timeout: float | None = None) -> None:
        """Stop keeping the route alive and remove it."""

    def close(self) -> None:
        """Stop keeping the route alive (it expires by itself)."""


def directory_for(instance: str, discovery: Discovery | str | None = "env") -> Directory:
    """The directory of prefill instance ``instance`` (``host:port``) on the configured backend
    (``discovery``: ``"env"`` reads ``KVTRANSPORT_DISCOVERY``; ``None`` is the built-in one)."""
    config = discovery_from_env() if discovery == "env" else discovery
    if config is None:
        return BootstrapClient(instance)
    assert not isinstance(config, str)
    from kvtransport.integrations.discovery.etcd import EtcdDirectory

    return EtcdDirectory(instance, config)
