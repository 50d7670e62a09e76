"""A vLLM prefill instance made findable by SGLang decode instances: each worker's endpoint
registered as SGLang's prefill ranks are (dp 0 of 1, its TP rank), at the registry SGLang's
decode asks with the bootstrap address of each request.

``kv_connector_extra_config["sglang_bootstrap"]`` (``host:port``) names that registry. Worker
TP rank 0 serves it (kvtransport's bootstrap server, what an SGLang prefill instance runs on
``--disaggregation-bootstrap-port``) unless discovery runs on etcd (``KVTRANSPORT_DISCOVERY``),
where the name only names the instance. The proxy then sends each request to SGLang's decode
with that ``bootstrap_host``/``bootstrap_port`` and a room, and to vLLM's prefill with the same
room (:mod:`kvtransport.integrations.vllm.to_sglang`).
"""

from __future__ import annotations

import logging
from typing import Any

from kvtransport.integrations.bootstrap import BootstrapServer
from kvtransport.integrations.discovery import Directory, directory_for, discovery_from_env
from kvtransport.runtime.endpoint import Endpoint
from kvtransport.spi.errors import ConfigError

__all__ = ["SGLangRegistration", "parse_bootstrap"]

log = logging.getLogger(__name__)

#: How long a worker's first registration waits for the registry (rank 0 may start it later);
#: it then goes on in the background.
FIRST_WAIT_S = 5.0


def parse_bootstrap(value: Any) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) as (host, port); :class:`ConfigError` naming the setting."""
    text = str(value or "").strip()
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"kv_connector_extra_config['sglang_bootstrap'] must be host:port (the bootstrap address SGLang's "
            f"decode is given), got {text!r}"
        )
    return host, int(port)


class SGLangRegistration:
    """One worker's route at the SGLang registry (and, on TP rank 0, the registry itself)."""

    def __init__(self, address: str, endpoint: Endpoint, *, tp_rank: int, tp_size: int, block_size: int) -> None:
        host, port = parse_bootstrap(address)
        discovery = discovery_from_env()
        self.server: BootstrapServer | None = None
        if tp_rank == 0 and discovery is None:
            self.server = BootstrapServer(host, port)
        directory: Directory | None = None
        try:
            name = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            self.directory = directory = directory_for(name, discovery)
            layout = endpoint.layout
            self.directory.keep_registered(
                {
                    "address": str(endpoint.address),
                    "tp_rank": tp_rank,
                    "tp_size": tp_size,
                    "dp_rank": 0,
                    "dp_size": 1,
                    "follow_bootstrap_room": True,
                    "page_size": block_size,
                    "kv_cache_dtype": str(layout.dtype)[:64],
                    "endpoint": endpoint.name,
                },
                first_wait=FIRST_WAIT_S,
            )
        except BaseException:
            # Started but never registered: the registry's port and threads go with it.
            if directory is not None:
                directory.close()
            if self.server is not None:
                self.server.close()
            raise
        log.info(
            "kvtransport vLLM worker tp=%d/%d registered for SGLang decodes at %s%s",
            tp_rank,
            tp_size,
            self.directory.base,
            " (serving the registry)" if self.server is not None else "",
        )

    def close(self) -> None:
        """Remove the route (best effort: an unremoved one expires) and stop the registry."""
        try:
            self.directory.unregister(timeout=1.0)
        except Exception as exc:  # noqa: BLE001 - shutdown never raises
            log.debug("unregistering from %s failed: %s", self.directory.base, exc)
        self.directory.close()
        if self.server is not None:
            self.server.close()
