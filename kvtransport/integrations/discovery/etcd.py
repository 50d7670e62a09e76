"""Discovery on etcd: each prefill rank's route under a lease its owner keeps alive, with a
generation and the deployment secret's signature; readers look routes up with a bounded wait.

Keys (``prefix`` from ``KVTRANSPORT_DISCOVERY``; the instance is what SGLang calls the
bootstrap address, ``host:port``, percent-encoded into one path segment)::

    <prefix>/instances/<instance>/ranks/<dp_rank>/<tp_rank>  ->  signed entry (entries.py)

- **Leases.** A :class:`EtcdDirectory` that registers takes one lease of ``ttl`` seconds
  (``KVTRANSPORT_DISCOVERY_TTL``, 10 by default) and refreshes it every third of that on a
  daemon thread. A process that dies stops refreshing: etcd deletes its entries when the lease
  expires, at most ``ttl`` seconds later. A lease that expired while its owner lived (etcd
  restarted without its data, a partition longer than the TTL) is replaced by a new one and the
  entry written again on the next refresh: entries come back as their owners refresh.
- **Generations.** Each client writes the nanosecond clock of its start as its generation. A
  rank that restarts writes a larger one over its old entry (whose lease may still run), and a
  client whose key holds a larger generation than its own stops refreshing it (superseded):
  readers find the newest start, and peers reconnect to it.
- **Who may write.** Readers accept only entries their deployment secret signed (entries.py);
  any other is ignored, counted (``forged``) and logged, rate-limited. Without a secret, every
  etcd endpoint must be on loopback unless ``KVTRANSPORT_INSECURE=1``.

etcd is reached through its HTTP gateway with ``etcd3gw`` (imported when first used: install
``kvtransport[etcd]``), endpoints tried in order, the one that answered last first.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from kvtransport.integrations.bootstrap.routes import validated
from kvtransport.integrations.discovery.entries import Entry, ForgedEntry, decode_entry, encode_entry
from kvtransport.runtime.auth import ENV_INSECURE, ENV_SECRET, RateLimitedLog, Secret, is_loopback, load_secret
from kvtransport.runtime.discovery_config import EtcdConfig, discovery_ttl
from kvtransport.spi.errors import ConfigError, ConnectError, ProtocolError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds between tries while etcd does not answer a first registration, doubling up to the cap.
FIRST_RETRY_S, MAX_RETRY_S = 0.5, 10.0
#: Seconds between reads while a looked-up rank has no entry yet.
LOOKUP_POLL_S = 0.05


class DiscoveryUnreachable(ConnectError):
    """No etcd endpoint answered: worth trying again, unlike a refusal."""


class EtcdStore:
    """One process's clients of one etcd cluster (shared by its directories: ``store_for``)."""

    def __init__(self, config: EtcdConfig, timeout: float) -> None:
        try:
            from etcd3gw.client import Etcd3Client
        except ImportError as exc:
            raise ConfigError(
                f"discovery on etcd ({config.describe()}) needs the etcd3gw package: pip install 'kvtransport[etcd]'"
            ) from exc
        self.config = config
        self._clients = [Etcd3Client(host=h, port=p, timeout=timeout) for h, p in config.endpoints]
        self._current = 0
        self._lock = threading.Lock()

    def run(self, what: str, fn: Callable[[Any], T]) -> T:
        """``fn(client)`` on the endpoint that answered last, then on each other one; raises
        :class:`DiscoveryUnreachable` naming every failure when none answers."""
        from etcd3gw.exceptions import Etcd3Exception
        from requests import RequestException

        with self._lock:
            first = self._current
        failures = []
        for i in itertools.islice(itertools.cycle(range(len(self._clients))), first, first + len(self._clients)):
            try:
                result = fn(self._clients[i])
            except (Etcd3Exception, RequestException, OSError) as exc:
                host, port = self.config.endpoints[i]
                failures.append(f"{host}:{port}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            with self._lock:
                self._current = i
            return result
        raise DiscoveryUnreachable(f"etcd at {self.config.describe()}: {what} failed ({'; '.join(failures)})")


_stores: dict[EtcdConfig, EtcdStore] = {}
_stores_lock = threading.Lock()


def store_for(config: EtcdConfig, timeout: float = 5.0) -> EtcdStore:
    """The process's store of ``config`` (one per cluster a process names: a handful at most)."""
    with _stores_lock:
        store = _stores.get(config)
        if store is None:
            store = _stores[config] = EtcdStore(config, timeout)
        return store


def check_policy(config: EtcdConfig, secret: Secret, env: Mapping[str, str] | None = None) -> str:
    """Whether routes may be published to and read from ``config`` with ``secret``, in one line;
    raises :class:`ConfigError` for an unauthenticated deployment on a non-loopback etcd."""
    import os

    env = os.environ if env is None else env
    if secret.authenticated:
        return f"entries signed with the deployment secret from {secret.source}"
    if all(is_loopback(f"tcp://{h}:{p}") for h, p in config.endpoints):
        return "entries NOT signed (no secret): etcd on loopback only"
    if env.get(ENV_INSECURE, "").strip() == "1":
        return f"entries NOT signed: {ENV_INSECURE}=1; anyone who can write to etcd can redirect a prefill rank"
    raise ConfigError(
        f"refusing discovery on {config.describe()} without a deployment secret: anyone who can write to etcd "
        f"could redirect decode ranks to an endpoint of their own. Set {ENV_SECRET} in every process of the "
        f"deployment, or {ENV_INSECURE}=1 if the network is trusted"
    )


class EtcdDirectory:
    """The routes of one prefill instance (``instance``: its bootstrap address) on etcd.

    The same calls as :class:`~kvtransport.integrations.bootstrap.BootstrapClient`: a prefill
    rank registers and keeps its route alive; a decode rank looks routes up."""

    _forged_total = 0  # every directory of the process: ``forged_entries()``
    #: Rooms are not published here: instances that route by bootstrap room only.
    serves_rooms = False

    def __init__(
        self,
        instance: str,
        config: EtcdConfig,
        *,
        timeout: float = 5.0,
        ttl: float | None = None,
        secret: Secret | None = None,
        generation: int | None = None,
    ) -> None:
        self.instance = instance
        self.config = config
        self.timeout = timeout
        self.ttl = discovery_ttl() if ttl is None else ttl
        self._secret = load_secret() if secret is None else secret
        check_policy(config, self._secret)
        self._store = store_for(config, timeout)
        self.base = config.describe()
        self._prefix = f"{config.prefix}/instances/{urllib.parse.quote(instance, safe='')}"
        #: This start's generation: a later start of the same rank writes a larger one.
        self.generation = time.time_ns() if generation is None else generation
        self._lease: int | None = None
        self._route: dict[str, Any] | None = None
        self._interval = self.ttl / 3
        self._keeper: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        #: Set while the route is registered.
        self.registered = threading.Event()
        #: Set once a later start of this rank took the key: this client stops refreshing.
        self.superseded = False
        #: Entries this directory ignored because their signature did not verify.
        self.forged = 0
        self._warnings = RateLimitedLog(log)

    def __repr__(self) -> str:
        return f"EtcdDirectory({self.instance!r} on {self.base})"

    def key(self, dp_rank: int, tp_rank: int) -> str:
        return f"{self._prefix}/ranks/{int(dp_rank)}/{int(tp_rank)}"

    # -- writes ---------------------------------------------------------------------------------

    def register(self, route: Mapping[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Publish ``route`` under its (dp, tp) key, on this client's lease (taken now if it has
        none or it expired). Raises :class:`ConnectError` when a later start of the rank holds
        the key, :class:`DiscoveryUnreachable` when etcd does not answer within ``timeout``."""
        clean = validated(dict(route))
        key = self.key(clean["dp_rank"], clean["tp_rank"])
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            try:
                with self._lock:
                    self._write(key, clean)
                    self._route = clean
                break
            except DiscoveryUnreachable:
                if time.monotonic() + FIRST_RETRY_S >= deadline:
                    raise
                time.sleep(FIRST_RETRY_S)
        self.registered.set()
        return {"ttl": self.ttl, "generation": self.generation}

    def _write(self, key: str, route: dict[str, Any]) -> None:
        current = self._read(key)
        if current is not None and current.generation > self.generation:
            self.superseded = True
            raise ConnectError(
                f"prefill rank dp={route['dp_rank']} tp={route['tp_rank']} of {self.instance} is registered in "
                f"{self.base} by a later start (generation {current.generation} > {self.generation}); this one "
                "no longer publishes it"
            )
        value = encode_entry(self._secret, key, route, self.generation)
        for _ in range(2):
            if self._lease is None:
                self._lease = self._store.run("grant a lease", lambda c: c.lease(ttl=max(2, round(self.ttl))).id)
            if self._store.run("put", lambda c: self._put_on_lease(c, key, value)):
                return
            # The lease expired before this write (etcd restarted empty, or nothing refreshed
            # it for longer than its TTL): a new one, and the entry on it.
            log.info("discovery: the lease of %s expired in etcd; taking a new one", key)
            self._lease = None
        raise ConnectError(f"etcd at {self.base} lost two fresh leases in a row while writing {key}")

    def _put_on_lease(self, client: Any, key: str, value: bytes) -> bool:
        """Whether the put went through (``False``: etcd knows the lease no longer)."""
        from etcd3gw.exceptions import Etcd3Exception

        try:
            client.put(key, value, lease=self._lease_of(client))
        except Etcd3Exception as exc:
            if "not found" in str(exc).lower():
                return False
            raise
        return True

    def _lease_of(self, client: Any) -> Any:
        from etcd3gw.lease import Lease

        assert self._lease is not None
        return Lease(self._lease, client=client)

    def keep_registered(
        self, route: Mapping[str, Any], interval: float | None = None, *, first_wait: float | None = None
    ) -> bool:
        """Register ``route``, then keep its lease alive (and the entry written) on a daemon
        thread every ``interval`` seconds (a third of the TTL by default) until :meth:`close`.
        etcd not answering within ``first_wait`` is tried again in the background, with a
        warning. Returns whether the route is registered already."""
        clean = validated(dict(route))
        if interval is not None:
            if not interval > 0:
                raise ConfigError(f"refresh interval {interval!r} must be a positive number of seconds")
            self._interval = interval
        try:
            self.register(clean, timeout=first_wait)
            registered = True
        except DiscoveryUnreachable as exc:
            log.warning("discovery: %s; registering in the background until etcd answers", exc)
            with self._lock:
                self._route = clean
            registered = False
        with self._lock:
            if self._keeper is None:
                self._stop.clear()
                self._keeper = threading.Thread(target=self._keep, name="kvtransport-discovery-refresh", daemon=True)
                self._keeper.start()
        return registered

    def _keep(self) -> None:
        retry = FIRST_RETRY_S
        while not self._stop.wait(self._interval if self.registered.is_set() else retry):
            with self._lock:
                route = self._route
            if route is None or self.superseded:
                return
            first = not self.registered.is_set()
            try:
                self._refresh(route)
            except ConnectError as exc:
                if self.superseded:
                    log.warning("discovery: %s", exc)
                    self.registered.clear()
                    return
                retry = min(retry * 2, MAX_RETRY_S)
                self.registered.clear()
                self._warnings.warning(
                    "discovery: refreshing rank dp=%s tp=%s of %s failed (next try in %g s): %s",
                    route["dp_rank"],
                    route["tp_rank"],
                    self.instance,
                    retry,
                    exc,
                )
                continue
            retry = FIRST_RETRY_S
            self.registered.set()
            if first:
                log.info("discovery: rank dp=%s tp=%s of %s registered", route["dp_rank"], route["tp_rank"], self.base)

    def _refresh(self, route: dict[str, Any]) -> None:
        """One refresh: keep the lease alive; a lease etcd no longer knows is replaced and the
        entry written again; an entry that went missing (or was overwritten by something that is
        not a later start) is written again."""
        key = self.key(route["dp_rank"], route["tp_rank"])
        with self._lock:
            if self._lease is not None:
                left = self._store.run("refresh the lease", lambda c: self._lease_of(c).refresh())
                if left <= 0:
                    log.info("discovery: the lease of %s expired in etcd; taking a new one", key)
                    self._lease = None
            current = None if self._lease is None else self._read(key)
            if current is None or current.generation != self.generation:
                self._write(key, route)

    def register_room(self, room: int, dp_rank: int, timeout: float | None = None) -> None:
        raise ConfigError(
            "discovery on etcd serves prefill instances that route by bootstrap room "
            "(SGLang's --load-balance-method follow_bootstrap_room); one that registers each room needs the "
            "built-in bootstrap server (unset KVTRANSPORT_DISCOVERY)"
        )

    def unregister(self, timeout: float | None = None) -> None:
        """Stop refreshing and revoke the lease: etcd deletes this client's entries now."""
        self.close()
        with self._lock:
            lease, self._lease = self._lease, None
            self._route = None
        self.registered.clear()
        if lease is not None:
            from etcd3gw.lease import Lease

            self._store.run("revoke the lease", lambda c: Lease(lease, client=c).revoke())

    def close(self) -> None:
        """Stop the refresher (the entries stay until the lease expires)."""
        with self._lock:
            keeper, self._keeper = self._keeper, None
            self._stop.set()
        if keeper is not None and keeper is not threading.current_thread():
            keeper.join(self.timeout + 1)

    # -- reads ----------------------------------------------------------------------------------

    def _read(self, key: str) -> Entry | None:
        """The verified entry under ``key``, or ``None`` (none, or one this secret did not sign:
        counted and logged)."""
        values = self._store.run("get", lambda c: c.get(key))
        if not values:
            return None
        try:
            return decode_entry(self._secret, key, values[0])
        except ForgedEntry as exc:
            self.forged += 1
            EtcdDirectory._forged_total += 1
            self._warnings.warning("discovery: %s", exc)
            return None
        except ProtocolError as exc:
            self._warnings.warning("discovery: ignoring a malformed entry: %s", exc)
            return None

    def lookup(self, dp_rank: int, tp_rank: int, wait: float, stop: threading.Event | None = None) -> dict[str, Any]:
        """The route of prefill rank (dp, tp), read again until it is registered or ``wait``
        passes (or ``stop`` is set); its ``generation`` is added to it."""
        key = self.key(dp_rank, tp_rank)
        deadline = time.monotonic() + wait
        forged_before = self.forged
        last = "no entry"
        while True:
            try:
                entry = self._read(key)
                if entry is not None:
                    return {**entry.route, "generation": entry.generation}
                last = "no entry" if self.forged == forged_before else f"{self.forged - forged_before} forged entries"
            except DiscoveryUnreachable as exc:
                last = str(exc)
            if time.monotonic() >= deadline:
                raise ConnectError(
                    f"prefill rank dp={dp_rank} tp={tp_rank} of {self.instance} is not registered in {self.base} "
                    f"(waited {wait:g} s; {last}): not started yet, or gone and its lease expired"
                )
            if stop is not None and stop.wait(LOOKUP_POLL_S):
                raise ConnectError(f"stopped looking up prefill rank dp={dp_rank} tp={tp_rank} in {self.base}")
            if stop is None:
                time.sleep(LOOKUP_POLL_S)

    def reachable(self) -> str:
        """For ``kvtransport doctor``: "" when etcd answers, else why not."""
        try:
            self._store.run("read the prefix", lambda c: c.get(self._prefix))
        except DiscoveryUnreachable as exc:
            return str(exc)
        return ""


def forged_entries() -> int:
    """Entries every directory of this process ignored because their signature did not verify."""
    return EtcdDirectory._forged_total
