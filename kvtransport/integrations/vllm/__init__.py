"""kvtransport as vLLM's KV connector: ``kv_connector_module_path="kvtransport.integrations.vllm"``,
``kv_connector="KVTransportConnector"`` (docs/vllm.md).

Importing this package does not import vLLM: the connector class loads when vLLM asks for it,
and the parts without vLLM (the params, the KV description, both sides' bookkeeping) are
usable and tested on their own.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KVTransportConnector"]


def __getattr__(name: str) -> Any:
    if name in ("KVTransportConnector", "KVTransportMetadata", "KVTransportHandshake"):
        return getattr(importlib.import_module("kvtransport.integrations.vllm.connector"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
