"""``KVTransportConnector``: vLLM's KV connector (``KVConnectorBase_V1``) on kvtransport's
endpoints, so a vLLM prefill/decode deployment gets per-pair driver negotiation, the
authenticated control plane, metrics and unequal TP.

Enable it on both instances, with no patch to vLLM::

    --kv-transfer-config '{"kv_connector": "KVTransportConnector",
                           "kv_connector_module_path": "kvtransport.integrations.vllm",
                           "kv_role": "kv_both"}'

The flow is push: prefill finishes a request (``max_tokens=1``), holds its blocks and returns
``kv_transfer_params`` naming its ranks' control addresses; decode, given those params by the
proxy, allocates blocks, announces them to the prefill ranks the TP map names, and each prefill
rank writes its blocks with the driver the handshake chose. The scheduler side is
:mod:`~kvtransport.integrations.vllm.scheduler_side`, the worker side
:mod:`~kvtransport.integrations.vllm.worker_side`; this module only adapts vLLM's calls to them.
docs/vllm.md has the deployment and the settings.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvtransport.integrations.vllm.layout import describe_kv_caches
from kvtransport.integrations.vllm.scheduler_side import Orders, SchedulerSide
from kvtransport.integrations.vllm.sglang_registry import SGLangRegistration, parse_bootstrap
from kvtransport.integrations.vllm.worker_side import WorkerSide
from kvtransport.runtime.auth import load_secret
from kvtransport.runtime.endpoint import Endpoint
from kvtransport.spi.env import env_flag, env_number
from kvtransport.spi.errors import ConfigError
from kvtransport.spi.handoff import HANDOFF_SLOT_BYTES
from kvtransport.spi.memory import HOST, Region

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = ["KVTransportConnector", "KVTransportHandshake", "KVTransportMetadata"]

#: How long prefill holds a finished request's blocks for a decode that has not announced it
#: (vLLM's NIXL connector: ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s).
ENV_LEASE = "KVTRANSPORT_VLLM_LEASE_S"
DEFAULT_LEASE_S = 480.0
#: The host a worker's endpoint listens on (default: vLLM's ``VLLM_HOST_IP`` / this host's IP).
ENV_LISTEN_HOST = "KVTRANSPORT_VLLM_LISTEN_HOST"
#: SGLang's layer-wise switch (integrations.sglang.layerwise), said to have no effect here.
ENV_LAYERWISE = "KVTRANSPORT_LAYERWISE"
#: vLLM's ``kv_role`` as the role a layout states.
_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}

#: Slots of a worker's handoff arena: the first-token handoffs to SGLang decodes it can be
#: writing at once (one a request from its announcement to its last write; spi.handoff).
HANDOFF_SLOTS = 1024


@dataclass
class KVTransportMetadata(KVConnectorMetadata):
    """One step's orders from the scheduler to every worker."""

    orders: Orders


@dataclass
class KVTransportHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler after registering its KV: its control address."""

    address: str
    tp_rank: int


def _tp_rank(vllm_config: Any) -> int:
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    return int(vllm_config.parallel_config.rank) % tp


def _listen_host(extra: dict[str, Any]) -> str:
    host = str(extra.get("listen_host") or os.environ.get(ENV_LISTEN_HOST, "")).strip()
    if host:
        return host
    from vllm.utils.network_utils import get_ip

    return str(get_ip())


class KVTransportConnector(KVConnectorBase_V1):
    """vLLM's connector over kvtransport (both roles; ``kv_role`` ``kv_producer``,
    ``kv_consumer`` or ``kv_both``)."""

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # Sleep releases the KV memory the drivers registered; re-registering on wake-up (and
        # telling the peers) is not done: refuse sleep mode rather than leave engines pointing
        # at freed memory.
        return False

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = vllm_config.kv_transfer_config
        self._extra: dict[str, Any] = dict(config.kv_connector_extra_config or {})
        self.engine_id = str(config.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise ConfigError(
                f"kvtransport's vLLM connector moves one KV cache group; this model has {len(groups)} "
                "(hybrid attention with --disable-hybrid-kv-cache-manager off?): vLLM turns the hybrid manager "
                "off for this connector unless told otherwise"
            )
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._registration: SGLangRegistration | None = None
        if self._extra.get("sglang_bootstrap"):
            parse_bootstrap(self._extra["sglang_bootstrap"])  # a typo fails at start, on every role
            if int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1) > 1:
                raise ConfigError(
                    "kv_connector_extra_config['sglang_bootstrap'] registers one vLLM instance as one SGLang prefill "
                    "instance of one DP rank: run SGLang decodes' vLLM prefills with data_parallel_size 1"
                )
        self._failed_blocks: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self.engine_id, self.block_size, self.tp_size, load_secret())
        self._vllm_config = vllm_config

    # -- scheduler side -----------------------------------------------------------------------

    def _sched(self) -> SchedulerSide:
        assert self.scheduler is not None, "a scheduler-side call on the worker's connector"
        return self.scheduler

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            self._sched().after_alloc(request, (), 0, num_external_tokens)
            return
        # The request's blocks in order: those its prefix cache had (hashed), then the new ones
        # the load fills. Null blocks (a sliding window's skipped head) hold nothing and are
        # written by nobody; they count in the prefix, as positions prefill does not send.
        group = blocks.blocks[0]
        new = [b.block_id for b in group if b.block_hash is None and not b.is_null]
        held = len(group) - len(new)
        self._sched().after_alloc(request, new, held, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVTransportMetadata(self._sched().take_orders())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        completed = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        return self._sched().finished(request, block_ids, completed)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().sent(connector_output.finished_sending or set())

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        # Token-major blocks, each layer's blocks one range: a layer is a region, a block a
        # page, and unequal TP can cut heads out of each token (layout.py). vLLM takes it when
        # the attention backend supports it; layout.py describes (or refuses) what it resolves.
        model = getattr(vllm_config, "model_config", None)
        if model is not None and getattr(model, "use_mla", False):
            return None
        return "LBNHC"

    def has_pending_push_work(self) -> bool:
        # Prefill keeps stepping while blocks wait for decode: the workers' polls release them;
        # and either side while orders wait for a step (a decline of a request that ended).
        sched = self.scheduler
        return sched is not None and (bool(sched.holding) or sched.has_orders())

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        addresses = {}
        for rank, meta in metadata.items():
            if not isinstance(meta, KVTransportHandshake):
                raise ConfigError(f"TP rank {rank} published {type(meta).__name__}, not kvtransport's handshake")
            addresses[int(rank)] = meta.address
        self._sched().set_addresses(addresses)

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        config = self._vllm_config
        layers = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        tp_rank = _tp_rank(config)
        kv = describe_kv_caches(
            layers,
            block_size=self.block_size,
            use_mla=bool(config.model_config.use_mla),
            tp_rank=tp_rank,
            tp_size=self.tp_size,
            total_kv_heads=int(config.model_config.get_total_num_kv_heads()),
        )
        host = _listen_host(self._extra)
        # The first-token handoffs an SGLang decode reads from its aux slot are written from
        # here (spi.handoff): registered with the KV, on the host as SGLang's aux slots are.
        self._arena = np.zeros((HANDOFF_SLOTS, HANDOFF_SLOT_BYTES), dtype=np.uint8)
        arena = Region(int(self._arena.ctypes.data), self._arena.nbytes, HOST, HANDOFF_SLOT_BYTES, "aux[handoff]")
        endpoint = Endpoint(
            dataclasses.replace(kv.regions, aux=(arena,)),
            dataclasses.replace(
                kv.layout,
                aux_item_lens=(HANDOFF_SLOT_BYTES,),
                # The role kv_role gives this instance: an SGLang decode pairs with a vLLM
                # prefill only (spi.cross_engine).
                extra={
                    **kv.layout.extra,
                    "role": _ROLES.get(str(self._vllm_config.kv_transfer_config.kv_role), "both"),
                },
            ),
            listen=f"tcp://{host}:0",
            name=f"vllm:{self.engine_id[:12]}:tp{tp_rank}",
        )
        lease = float(self._extra.get("lease_s") or env_number(ENV_LEASE, DEFAULT_LEASE_S))
        self.worker = WorkerSide(
            endpoint, tp_rank=tp_rank, tp_size=self.tp_size, lease_s=lease, handoff_arena=self._arena
        )
        if self._extra.get("sglang_bootstrap"):
            self._registration = SGLangRegistration(
                str(self._extra["sglang_bootstrap"]),
                endpoint,
                tp_rank=tp_rank,
                tp_size=self.tp_size,
                block_size=self.block_size,
            )
        if env_flag(ENV_LAYERWISE, False):
            # vLLM's P/D flow hands a request to decode only once prefill finished it (and its
            # NIXL push mode writes after request_finished too): there is no announced
            # destination while the layers are computed, so nothing to stream them into.
            log.info(
                "kvtransport vLLM worker: %s=1 has no effect here: decode's blocks are known only after prefill "
                "finished the request, so each request is sent whole (docs/vllm.md)",
                ENV_LAYERWISE,
            )
        log.info(
            "kvtransport vLLM worker tp=%d/%d: %d layers, %d blocks of %d tokens in %s, listening on %s",
            tp_rank,
            self.tp_size,
            kv.layout.num_layers,
            kv.num_blocks,
            self.block_size,
            kv.layout.memory,
            endpoint.address,
        )

    def _work(self) -> WorkerSide:
        if self.worker is None:
            raise ConfigError("kvtransport's vLLM connector: a transfer before register_kv_caches()")
        return self.worker

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self.worker is None:
            return None
        return KVTransportHandshake(self.worker.address, self.worker.tp_rank)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVTransportMetadata):
            return
        worker = self._work()
        for hold in meta.orders.holds:
            worker.hold(hold.request, hold.blocks, hold.name, hold.first_token)
        for load in meta.orders.loads:
            if load.remote is None:
                worker.fail_load(load.request, load.blocks, ConfigError(load.error))
            else:
                worker.load(load.request, load.blocks, load.prefix, load.remote)
        for decline in meta.orders.declines:
            worker.decline(decline.request, decline.remote, decline.reason)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete between steps: a loading request is not scheduled until done

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # prefill offers a request's blocks once it finished (request_finished)

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = self._work().poll(finished_req_ids)
        self._failed_blocks |= results.failed_blocks
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        if self._registration is not None:
            self._registration.close()
            self._registration = None
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.holding.clear()
