"""Every ``KVTRANSPORT_*`` environment variable kvtransport reads, and the warning for the rest.

A typo in a variable name must not pass silently: an endpoint and ``kvtransport doctor`` warn
about each ``KVTRANSPORT_*`` variable nothing reads, with the closest known name. The catalogue
lives here, above the modules that read the variables, so that none of them imports another
only to learn its neighbours' names.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Iterable, Mapping

from kvtransport.negotiation.registry import ENV_DRIVER, ENV_DRIVERS, ENV_EXCLUDE, ENV_FAILOVER
from kvtransport.runtime.auth import ENV_INSECURE, ENV_SECRET, ENV_SECRET_FILE
from kvtransport.runtime.config import ENV_VARS as CONFIG_ENV_VARS
from kvtransport.runtime.discovery_config import ENV_DISCOVERY, ENV_DISCOVERY_TTL
from kvtransport.runtime.layer_groups import ENV_VARS as LAYERWISE_ENV_VARS
from kvtransport.spi.topology import ENV_VARS as RAILS_ENV_VARS

log = logging.getLogger(__name__)

#: Every ``KVTRANSPORT_*`` variable the core reads; drivers add theirs via ``env_vars``.
CORE_ENV_VARS = frozenset(
    {
        ENV_DRIVER,
        ENV_DRIVERS,
        ENV_EXCLUDE,
        ENV_FAILOVER,
        "KVTRANSPORT_LOG_LEVEL",
        "KVTRANSPORT_STAGING_RING_BYTES",
        "KVTRANSPORT_STAGING_CHUNK_BYTES",
        "KVTRANSPORT_MAX_MESSAGE_BYTES",
        # the calibration cache (calibration_cache)
        "KVTRANSPORT_CALIBRATION",
        # integrations.bootstrap's, named: importing it would pull an HTTP server into every process
        "KVTRANSPORT_BOOTSTRAP_ROUTE_TTL",
        # the discovery backend (discovery_config)
        ENV_DISCOVERY,
        ENV_DISCOVERY_TTL,
        # the SGLang adapter's (integrations.sglang_topology), named: importing it needs SGLang
        "KVTRANSPORT_SGLANG_LISTEN_HOST",
        "KVTRANSPORT_LAYERWISE",  # and integrations.sglang.layerwise's switch
        "KVTRANSPORT_DISCOVERY_INSTANCE",
        # the vLLM connector's (integrations.vllm.connector), named: importing it needs vLLM
        "KVTRANSPORT_VLLM_LEASE_S",
        "KVTRANSPORT_VLLM_LISTEN_HOST",
        # the deployment secret (auth), read by the bootstrap registry
        ENV_SECRET,
        ENV_SECRET_FILE,
        ENV_INSECURE,
        # layer-wise sends (layer_groups)
        *LAYERWISE_ENV_VARS,
        # rails chosen by topology (spi.topology)
        *RAILS_ENV_VARS,
        *CONFIG_ENV_VARS,
    }
)
#: Variables of the first-party drivers, known even when a driver is not installed.
FIRST_PARTY_ENV_VARS = frozenset(
    {
        "KVTRANSPORT_NIXL_BACKEND",
        "KVTRANSPORT_NIXL_BACKEND_PARAMS",
        "KVTRANSPORT_MOONCAKE_PROTOCOL",
        "KVTRANSPORT_MOONCAKE_DEVICE",
        "KVTRANSPORT_MOONCAKE_MAX_BATCH",
    }
)


def unknown_env_vars(env: Mapping[str, str] | None = None, driver_vars: Iterable[str] = ()) -> list[str]:
    """``KVTRANSPORT_*`` variables set in ``env`` that nothing reads (likely typos)."""
    env = os.environ if env is None else env
    known = CORE_ENV_VARS | FIRST_PARTY_ENV_VARS | set(driver_vars)
    return sorted(k for k in env if k.startswith("KVTRANSPORT_") and k not in known)


def warn_unknown_env_vars(env: Mapping[str, str] | None = None, driver_vars: Iterable[str] = ()) -> list[str]:
    unknown = unknown_env_vars(env, driver_vars)
    all_known = sorted(CORE_ENV_VARS | FIRST_PARTY_ENV_VARS | set(driver_vars))
    for var in unknown:
        close = difflib.get_close_matches(var, all_known, n=1, cutoff=0.7)
        hint = f" (did you mean {close[0]}?)" if close else ""
        log.warning("ignoring unknown environment variable %s%s", var, hint)
    return unknown
