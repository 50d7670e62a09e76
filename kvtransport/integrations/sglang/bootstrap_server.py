"""The SGLang instance's bootstrap server (:class:`KVTransportKVBootstrapServer`): SGLang's
class over kvtransport's registry of prefill rank endpoints."""

from __future__ import annotations

import logging

from kvtransport.integrations.bootstrap import BootstrapServer
from kvtransport.integrations.discovery import discovery_from_env
from kvtransport.integrations.sglang.common import BaseKVBootstrapServer

log = logging.getLogger(__name__)


class KVTransportKVBootstrapServer(BaseKVBootstrapServer):
    """The instance's registry of prefill rank endpoints (HTTP, see
    :mod:`kvtransport.integrations.bootstrap`).

    Binds the host SGLang gives it (``--host``, 127.0.0.1 by default). A host reachable from
    other machines (``0.0.0.0``, a NIC address) needs ``KVTRANSPORT_SECRET`` (or
    ``KVTRANSPORT_INSECURE=1``), else this raises ``ConfigError`` at start-up. With discovery on
    etcd (``KVTRANSPORT_DISCOVERY``) it starts nothing: ``host:port`` only names the instance."""

    def __init__(self, host: str, port: int) -> None:
        self.server: BootstrapServer | None = None
        discovery = discovery_from_env()
        if discovery is not None:
            # The ranks publish their routes in etcd: nothing listens here; host:port only
            # names the instance (SGLang puts it in every request).
            log.info("bootstrap server %s:%d not started: routes are on %s", host, port, discovery.describe())
            self.host, self.port = host, port
            return
        self.server = BootstrapServer(host, port)
        self.host, self.port = self.server.host, self.server.port

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
