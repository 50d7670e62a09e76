"""Discovery: where each prefill rank's endpoint can be reached, on the built-in registry or on
etcd (``KVTRANSPORT_DISCOVERY=etcd://host1:2379,host2:2379/prefix``). See docs/discovery.md."""

from kvtransport.integrations.discovery.directory import Directory, directory_for
from kvtransport.integrations.discovery.entries import Entry, ForgedEntry, decode_entry, encode_entry
from kvtransport.runtime.discovery_config import (
    DEFAULT_PREFIX,
    DEFAULT_TTL,
    ENV_DISCOVERY,
    ENV_DISCOVERY_TTL,
    EtcdConfig,
    discovery_from_env,
    discovery_ttl,
    parse_discovery,
)

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_TTL",
    "ENV_DISCOVERY",
    "ENV_DISCOVERY_TTL",
    "Directory",
    "Entry",
    "EtcdConfig",
    "ForgedEntry",
    "decode_entry",
    "directory_for",
    "discovery_from_env",
    "discovery_ttl",
    "encode_entry",
    "parse_discovery",
]
