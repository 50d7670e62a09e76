"""Which discovery backend a process uses, from ``KVTRANSPORT_DISCOVERY`` (the backends are
``kvtransport.integrations.discovery``; the setting lives here, with the other settings, so that
``kvtransport doctor`` can read it).

Unset (or ``bootstrap``): the built-in registry, one HTTP server per prefill instance
(``kvtransport.integrations.bootstrap``). ``etcd://host1:2379,host2:2379/prefix``: an etcd
cluster, through its HTTP gateway (v3 API), every key under ``/prefix`` (``/kvtransport`` when
the URL names none). A URL that does not parse raises :class:`~kvtransport.spi.errors.ConfigError`
naming the variable: a deployment that meant etcd must not quietly fall back to the built-in
registry.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

from kvtransport.runtime.auth import ENV_INSECURE, ENV_SECRET, Secret, insecure_opt_out, is_loopback
from kvtransport.spi.errors import ConfigError

ENV_DISCOVERY = "KVTRANSPORT_DISCOVERY"
#: Seconds an etcd entry lives after its owner's last refresh (its lease's TTL).
ENV_DISCOVERY_TTL = "KVTRANSPORT_DISCOVERY_TTL"
DEFAULT_TTL = 10.0
#: The TTLs the variable accepts (etcd's lease granularity is one second).
MIN_TTL, MAX_TTL = 2.0, 3600.0
DEFAULT_PREFIX = "/kvtransport"
#: What a key prefix may hold: etcd takes any bytes, but a prefix is written in URLs and logs.
_PREFIX = re.compile(r"(/[A-Za-z0-9._-]+)+")


@dataclass(frozen=True)
class EtcdConfig:
    """An etcd cluster: its client endpoints (tried in order) and the prefix of every key."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str = DEFAULT_PREFIX

    def describe(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        return f"etcd://{hosts}{self.prefix}"


#: ``None``: the built-in registry.
Discovery = EtcdConfig | None


def parse_discovery(value: str) -> Discovery:
    """``KVTRANSPORT_DISCOVERY``'s value, read (raises ``ConfigError`` naming what is wrong)."""
    text = value.strip()
    if text in ("", "bootstrap"):
        return None
    what = f"{ENV_DISCOVERY}={value!r}"
    if not text.startswith("etcd://"):
        raise ConfigError(f"{what}: expected 'bootstrap' or etcd://host:port[,host:port...][/prefix]")
    rest = text.removeprefix("etcd://")
    hosts, slash, path = rest.partition("/")
    prefix = "/" + path.rstrip("/") if slash and path.strip("/") else DEFAULT_PREFIX
    if not _PREFIX.fullmatch(prefix):
        raise ConfigError(f"{what}: the key prefix {prefix!r} may hold letters, digits, '.', '_', '-' and '/'")
    endpoints: list[tuple[str, int]] = []
    for part in hosts.split(","):
        try:
            url = urllib.parse.urlsplit("//" + part.strip())
            host, port = url.hostname, url.port
        except ValueError:
            host, port = None, None
        if not host:
            raise ConfigError(f"{what}: {part!r} is not host[:port]")
        endpoints.append((host, 2379 if port is None else port))
    return EtcdConfig(tuple(endpoints), prefix)


def discovery_from_env(env: Mapping[str, str] | None = None) -> Discovery:
    return parse_discovery((os.environ if env is None else env).get(ENV_DISCOVERY, ""))


def discovery_ttl(env: Mapping[str, str] | None = None) -> float:
    """``KVTRANSPORT_DISCOVERY_TTL`` (seconds, at least 2: etcd's lease granularity is one)."""
    raw = (os.environ if env is None else env).get(ENV_DISCOVERY_TTL, "")
    if not raw.strip():
        return DEFAULT_TTL
    try:
        ttl = float(raw)
    except ValueError:
        ttl = float("nan")
    if not MIN_TTL <= ttl <= MAX_TTL:
        raise ConfigError(f"{ENV_DISCOVERY_TTL}={raw!r}: seconds between {MIN_TTL:g} and {MAX_TTL:g}")
    return ttl


def check_policy(config: EtcdConfig, secret: Secret, env: Mapping[str, str] | None = None) -> str:
    """Whether routes may be published to and read from ``config`` with ``secret``, in one line;
    raises :class:`ConfigError` for an unauthenticated deployment on a non-loopback etcd."""
    env = os.environ if env is None else env
    if secret.authenticated:
        return f"entries signed with the deployment secret from {secret.source}"
    if all(is_loopback(f"tcp://{h}:{p}") for h, p in config.endpoints):
        return "entries NOT signed (no secret): etcd on loopback only"
    if insecure_opt_out(env):
        return f"entries NOT signed: {ENV_INSECURE}=1; anyone who can write to etcd can redirect a prefill rank"
    raise ConfigError(
        f"refusing discovery on {config.describe()} without a deployment secret: anyone who can write to etcd "
        f"could redirect decode ranks to an endpoint of their own. Set {ENV_SECRET} in every process of the "
        f"deployment, or {ENV_INSECURE}=1 if the network is trusted"
    )
