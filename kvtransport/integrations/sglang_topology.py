"""Where an SGLang scheduler rank stands: its attention-TP and DP ranks, how its instance routes
requests to DP ranks, and which hosts its bootstrap registry and data socket use.

SGLang resolves its configuration once per process (``sglang.srt.runtime_context.publish``):
attention-TP size is ``tp_size / (attn_dp_size * attn_cp_size)``, the bootstrap port may be an
alias of the operator's, and so on. The raw ``ServerArgs`` an operator typed are not what the
scheduler runs with, so the backend reads the published values, as SGLang's own backends do.
A process that never published (a caller driving the backend classes directly, as kvtransport's
older tests and tools do) gets the values from ``KVArgs`` and the server-args object instead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from typing import Any

from kvtransport.spi.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP_PORT = 8998
#: The host a rank's endpoint listens on, when the default (below) is not what the network needs.
ENV_LISTEN_HOST = "KVTRANSPORT_SGLANG_LISTEN_HOST"
#: With discovery on etcd: the name (``host:port``) prefill ranks register their instance under,
#: when it is not ``--host:--disaggregation-bootstrap-port`` (the address the router hands decode).
ENV_DISCOVERY_INSTANCE = "KVTRANSPORT_DISCOVERY_INSTANCE"


def discovery_instance(topology: RankTopology) -> str:
    """The name a prefill instance's routes go under in etcd: what the router hands decode as
    its bootstrap address. ``KVTRANSPORT_DISCOVERY_INSTANCE`` if set; this host's outward
    address for a wildcard ``--host`` (the loopback stand-in names no host to another one);
    else ``bootstrap_host:bootstrap_port``."""
    chosen = os.environ.get(ENV_DISCOVERY_INSTANCE, "").strip()
    if chosen:
        return chosen
    host = outward_ip() if topology.bootstrap_wildcard else topology.bootstrap_host
    return f"{host}:{topology.bootstrap_port}"


WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


@dataclasses.dataclass(frozen=True)
class RankTopology:
    """One rank's place in its instance, in the terms decode and prefill pair by."""

    #: Attention tensor-parallel rank and width: KV heads are split over these, and a decode
    #: rank pairs with the prefill rank of the same attention-TP rank.
    attn_tp_rank: int
    attn_tp_size: int
    #: The DP group this rank serves requests for (attention-DP rank, or the system DP rank
    #: when SGLang runs several DP replicas) and how many there are.
    dp_rank: int
    dp_size: int
    #: Whether a request's DP rank is ``bootstrap_room % dp_size`` (SGLang's
    #: ``--load-balance-method follow_bootstrap_room``); otherwise prefill publishes each room's
    #: rank and decode asks for it.
    follow_bootstrap_room: bool
    pp_size: int
    attn_cp_size: int
    #: Where prefill ranks register: the bootstrap server runs with the tokenizer manager, on
    #: node 0 (``--dist-init-addr``'s host when prefill spans nodes).
    bootstrap_host: str
    bootstrap_port: int
    #: The address this rank's endpoint listens on: reachable from other hosts whenever the
    #: instance serves them (``--host`` is the HTTP server's bind address, 127.0.0.1 by default).
    listen_host: str
    #: True when the values came from SGLang's published configuration.
    resolved: bool
    #: True when ``bootstrap_host`` stands in for a wildcard ``--host`` (0.0.0.0, ::, empty):
    #: right for the registry on this host, not a name other hosts know the instance by.
    bootstrap_wildcard: bool = False

    @property
    def dp_routing(self) -> str:
        return "follow_bootstrap_room" if self.follow_bootstrap_room else "registered per room"


def rank_topology(kv_args: Any, server_args: Any) -> RankTopology:
    """This process's topology: SGLang's published configuration if there is one, else the
    values in ``kv_args`` and ``server_args``."""
    try:
        return _published(kv_args)
    except (ImportError, ValueError, RuntimeError, AttributeError) as exc:
        log.debug("SGLang configuration not published (%s); using KVArgs and server args", exc)
        return _unpublished(kv_args, server_args)


def _published(kv_args: Any) -> RankTopology:
    from sglang.srt.runtime_context import get_disagg, get_parallel, get_serving

    parallel = get_parallel()
    system_dp = int(parallel.dp_size or 1)
    if system_dp > 1:  # DP replicas, each its own attention group (SGLang's registry does the same)
        dp_rank, dp_size = int(getattr(kv_args, "system_dp_rank", 0) or 0), system_dp
    else:
        dp_rank, dp_size = int(parallel.attn_dp_rank), int(parallel.attn_dp_size)
    host = str(get_serving().host or "")
    dist_init_addr = parallel.dist_init_addr
    multi_node = bool(dist_init_addr) and int(parallel.nnodes or 1) > 1
    bootstrap_host = _host_of(str(dist_init_addr)) if dist_init_addr else WILDCARDS.get(host, host)
    wildcard = not dist_init_addr and host in WILDCARDS
    return RankTopology(
        attn_tp_rank=int(parallel.attn_tp_rank),
        attn_tp_size=int(parallel.attn_tp_size),
        dp_rank=dp_rank,
        dp_size=max(dp_size, 1),
        follow_bootstrap_room=str(parallel.load_balance_method) == "follow_bootstrap_room",
        pp_size=int(parallel.pp_size or 1),
        attn_cp_size=int(parallel.attn_cp_size or 1),
        bootstrap_host=bootstrap_host,
        bootstrap_port=int(get_disagg().disaggregation_bootstrap_port),
        listen_host=_listen_host(host, multi_node),
        resolved=True,
        bootstrap_wildcard=wildcard,
    )


def _unpublished(kv_args: Any, server_args: Any) -> RankTopology:
    host = str(getattr(server_args, "host", "") or "127.0.0.1")
    tp_size = int(getattr(server_args, "tp_size", 1) or 1)
    dp_size = int(getattr(server_args, "dp_size", 1) or 1)
    if getattr(server_args, "enable_dp_attention", False) and dp_size > 1:
        # KVArgs cannot say where the rank stands then: SGLang's prefill sets engine_rank to
        # the global TP rank, its decode to the attention-TP rank, and neither carries the
        # attention-DP rank. Reading engine_rank as the attention-TP rank would pair the wrong
        # ranks; SGLang's scheduler always publishes the real values.
        raise ConfigError(
            "SGLang's runtime context is not published and DP attention is on (--enable-dp-attention, "
            f"--dp-size {dp_size}): this rank's attention-TP and DP ranks cannot be told from KVArgs. Create the "
            "backend inside SGLang's scheduler (which publishes them with sglang.srt.runtime_context.publish)"
        )
    return RankTopology(
        attn_tp_rank=int(kv_args.engine_rank),
        attn_tp_size=tp_size,
        dp_rank=int(getattr(kv_args, "system_dp_rank", 0) or 0),
        dp_size=dp_size,
        follow_bootstrap_room=True,
        pp_size=int(getattr(server_args, "pp_size", 1) or 1),
        attn_cp_size=1,
        bootstrap_host=WILDCARDS.get(host, host),
        bootstrap_port=int(getattr(server_args, "disaggregation_bootstrap_port", DEFAULT_BOOTSTRAP_PORT)),
        listen_host=os.environ.get(ENV_LISTEN_HOST, "").strip() or host,
        resolved=False,
        bootstrap_wildcard=host in WILDCARDS,
    )


def _host_of(addr: str) -> str:
    """The host of ``host:port`` (``[v6]:port`` too)."""
    if addr.startswith("["):
        return addr[1 : addr.index("]")]
    return addr.rsplit(":", 1)[0] if addr.count(":") == 1 else addr


def _listen_host(http_host: str, multi_node: bool) -> str:
    """Loopback only for a single-node instance whose HTTP server is on loopback (peers on the
    same host reach it); a wildcard, a NIC address or a multi-node instance listens on this
    host's outward address, which the rank's registered route then names.
    ``KVTRANSPORT_SGLANG_LISTEN_HOST`` overrides both."""
    chosen = os.environ.get(ENV_LISTEN_HOST, "").strip()
    if chosen:
        return chosen
    if http_host in ("127.0.0.1", "localhost", "::1") and not multi_node:
        return http_host
    if http_host not in WILDCARDS and http_host not in ("127.0.0.1", "localhost", "::1"):
        return http_host
    return outward_ip()


def outward_ip() -> str:
    """This host's address on the interface of its default route (no packet is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))
        return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()
