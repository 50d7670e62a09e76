"""The SGLang instance's bootstrap server (:class:`KVTransportKVBootstrapServer`): SGLang's
class over kvtransport's registry of prefill rank endpoints."""

from __future__ import annotations

from kvtransport.integrations.bootstrap import BootstrapServer
from kvtransport.integrations.sglang.common import BaseKVBootstrapServer


class KVTransportKVBootstrapServer(BaseKVBootstrapServer):
    """The instance's registry of prefill rank endpoints (HTTP, see
    :mod:`kvtransport.integrations.bootstrap`).

    Binds the host SGLang gives it (``--host``, 127.0.0.1 by default). A host reachable from
    other machines (``0.0.0.0``, a NIC address) needs ``KVTRANSPORT_SECRET`` (or
    ``KVTRANSPORT_INSECURE=1``), else this raises ``ConfigError`` at start-up."""

    def __init__(self, host: str, port: int) -> None:
        self.server = BootstrapServer(host, port)
        self.host, self.port = self.server.host, self.server.port

    def close(self) -> None:
        self.server.close()
