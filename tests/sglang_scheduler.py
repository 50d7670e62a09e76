"""One rank of an SGLang 0.5.23 prefill or decode instance, on CPU, in its own process: SGLang's
own scheduler code drives kvtransport's SGLang backend, and this process stands in only for
what cannot run here.

Run by tests/test_sglang_scheduler.py, one process per rank, talking JSON lines (stdin in,
the original stdout out; everything else that prints goes to stderr):

* ``{"cmd": "configure", "config": {...}}`` (re)builds the instance: SGLang's ``ServerArgs``
  (``--disaggregation-transfer-backend kvtransport``) published with
  ``runtime_context.publish`` under the rank SGLang's launcher would give it, SGLang's
  ``ModelConfig`` and KV dtype resolution, SGLang's memory pools as its KVCacheConfigurator
  builds them for the model (``MHATokenToKVPool`` / ``MLATokenToKVPool``, ``ReqToTokenPool`` or
  decode's ``DecodeReqToTokenPool``, the token allocator; for a hybrid sliding-window model
  (gpt-oss) ``SWAKVPool`` with an MHA sub-pool each for the full-attention and the
  sliding-window layers, and ``SWATokenToKVPoolAllocator``; for a hybrid linear-attention model
  (Qwen3-Next) ``HybridReqToTokenPool`` with its ``MambaPool``, or decode's
  ``HybridMambaDecodeReqToTokenPool``, under a ``HybridLinearKVPool``), the tree cache as
  build_kv_cache has SGLang's registry build it (``create_tree_cache``: a ``UnifiedRadixCache``
  with the FULL, and SWA or MAMBA, components), disabled as for ``--disable-radix-cache`` (0.5.23
  has no ``ChunkCache``) unless the decode instance runs with
  ``--disaggregation-decode-enable-radix-cache`` (config ``decode_radix_cache``: the ServerArgs
  flag, from which SGLang's PD hook resolves ``disable_radix_cache=False``; build_kv_cache's
  ``validate_decode_radix_cache`` checks the model first; ``disable_overlap_schedule``: both
  instances with ``--disable-overlap-schedule``); the scheduler's ``is_hybrid_swa`` /
  ``is_hybrid_ssm`` / ``sliding_window_size`` as build_kv_cache resolves them (the window
  through ``resolve_sliding_window_size`` and the model class's own
  ``get_attention_sliding_window_size``); then ``Scheduler.init_disaggregation`` itself, which
  builds ``MetadataBuffers``, ``ReqToMetadataIdxAllocator`` and the queues
  (``PrefillBootstrapQueue``, or ``DecodeTransferQueue`` + ``DecodePreallocQueue``), and with
  them ``KVArgs`` (``setup_state_kv_args`` adds ``StateType.SWA`` or ``StateType.MAMBA``) and the
  adapter's manager. Prefill rank 0 first starts the bootstrap server
  with SGLang's ``start_disagg_service()`` (what its TokenizerManager calls on node 0).
* ``{"cmd": "run", "requests": [...], "timeout": s}`` builds SGLang ``Req`` objects, hands them to
  ``Scheduler._add_request_to_queue`` and runs the scheduler loop until every request of this
  rank concluded (prefill: ``pop_bootstrapped``, ``process_pending_chunked_abort``,
  ``resolve_waiting_queue_bootstrap``, ``process_prefill_chunk`` -> ``send_kv_chunk``, the last
  ``send_kv_chunk(last_chunk=True)`` with ``set_buf`` and the state payloads (``_swa_payload``,
  ``_mamba_payload``) inside, ``process_disagg_prefill_inflight_queue``; decode:
  ``prefetch_prefill_dp_rank_queries`` and ``process_decode_queue``, i.e. ``pop_preallocated``
  with its real allocation (the SWA tail, the mamba slot) and its state payloads for
  ``_send_kv_metadata``, then ``pop_transferred`` and
  ``_commit_transfer_to_req``; then the prebuilt batch: ``get_new_prebuilt_batch``, i.e.
  ``init_next_round_input``, ``ScheduleBatch.init_new``, ``prepare_for_prebuilt`` and
  ``process_prebuilt`` (SGLang's ``FutureMap``), and ``process_batch_result_prebuilt`` of
  SGLang's ``SchedulerBatchResultProcessor``; client aborts through ``Scheduler.abort_request``). With the
  decode radix cache a request that finished leaves its prompt's whole pages in decode's tree
  (``release_kv_cache(checkpoint=True)``), where ``_match_prefix_and_lock`` finds them for a
  later request with the same leading tokens: ``_pre_alloc`` allocates only what follows,
  ``send_metadata`` announces ``decode_prefix_len`` and prefill's ``finalize_bootstrap`` starts
  its sends there. A request spec may say ``shared_prefix: [seed, n]`` (its first ``n`` tokens
  are those of a prompt made from ``seed``), ``decode_after: [rid, ...]`` (it reaches decode
  once those concluded there), ``max_new_tokens`` and ``corrupt_rank`` (with
  ``prefill_corrupt``: only that attention-TP rank's forward writes the wrong content). It
  answers per request: ``state`` ("success"/"failed"/"corrupt"/"timeout"), the error, the KV and
  state bytes verified (decode), ``decode_prefix_len`` (what decode promised; what prefill
  read), the bytes the backend's transfer metric counts (prefill:
  ``get_transfer_metric().transfer_total_bytes``), how many prefill ranks the receiver lists in
  ``bootstrap_infos`` while the request waits in the transfer queue (decode: ``sources``;
  SGLang's deferred release waits for each one's drain), when it failed and got its pages back,
  and what was left allocated (KV pages, request rows, metadata slots, SWA pages, mamba slots;
  what decode's tree holds unlocked is not allocated to anyone, what it holds locked is:
  ``tree_locked_tokens``).
* ``{"cmd": "close"}``.

Stand-ins, each because it cannot run here: the model forward (it allocates with SGLang's
``alloc_for_extend``, after the real ``ScheduleBatch.maybe_evict_swa`` frees the SWA slots that
slid out of the window, and writes deterministic KV and state, and "samples" a deterministic
first token and logprobs); the loaded model (no weights: ``LoadedModel`` answers with the
architecture class's own methods); the model runner object (its KV bookkeeping fields only);
the memory profiler (pool sizes are small constants: the SWA pool is ``swa_full_tokens_ratio``
of the full one, the prefill mamba pool a slot per request row where
``--max-mamba-cache-size`` is unset); the output streamer and
``send_abort_output`` (IPC to the detokenizer/tokenizer: they record what the client would be
told); the grammar, beam-search and n-gram embedding managers (unused); the running batch and
the decode batches: none runs, so a request with tokens left to generate after its prebuilt
batch ends as its last decode step would end it (``_handle_finish_state_updated_req``:
``release_kv_cache(checkpoint=True)``), without the generated tokens' KV. The process groups are
gloo groups among this side's processes, given to SGLang through ``override_permanently``.

KV content is a pure function of (the prompt's tokens up to the position, layer, token position,
global KV head, dim, K/V), the tokens through a running hash (``token_keys``), as a causal
model's KV at a position depends on every token before it: two requests share a position's KV
exactly when they share the tokens up to it, so the prefix pages decode's tree kept from one
request are right for another only if the tree matched the right tokens. The prefill rank writes
it into the pages its allocator handed out; the decode rank recomputes it from its own copy of
the prompt for the heads it owns and compares the bits of every element of every layer (K and V,
or MLA's latent) of the whole prompt, the prefix from its tree included, so a page sent to the
wrong place, the wrong rank's heads or a stale aux row fails the test. As the content names the
global head, the two sides agree on it whatever attention-TP size each runs (``--tp-size``,
``--dp-size``, ``--dp-attention`` are per process: prefill and decode may differ), and a decode
rank fed by several prefill ranks checks each one's heads in every token. State the same way: the
sliding-window layers' KV of the window tokens (the same function, at the tokens' SWA slots),
and each mamba state tensor's slot row as a function of (the key of the last token computed,
tensor, attention-TP rank, tokens computed, element), checked bit for bit in the slot decode gave
the request. Pages, SWA pages and mamba slots written that no request was given as a destination
are reported too (what decode's tree holds keeps its content from run to run and counts as
given, and so does a slot holding exactly a delivered request's mamba state once its tree
forked it: SGLang's copy, not a transfer's write).

Not covered: a prefill-side radix cache (prefill runs with ``--disable-radix-cache``, so its
``prefix_len`` is 0 and it computes every token); decode HiCache (``--enable-hierarchical-cache``
on decode: a prefix matched in host memory or storage, ``decode_prefix_len`` beyond the device
prefix, loaded back by CUDA-stream copies); the mamba radix cache's ``extra_buffer`` strategy
(page size > 1 or overlap scheduling: SGLang refuses it without CUDA-like state snapshots, so a
hybrid linear-attention model gets a decode prefix here only with page size 1 and
``--disable-overlap-schedule``, SGLang's ``no_buffer``); decode's radix cache with DP attention
(SGLang: experimental, needs prefix-aware routing); a decode prefix for a request SGLang
retracts or rebootstraps (no decode batch runs here).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import logging
import math
import os
import sys
import threading
import time
import traceback
from array import array
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

# The protocol owns the original stdout; C libraries (UCX, Mooncake) and SGLang's prints go to stderr.
_PROTO = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

_STAND_INS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stand_ins")
if _STAND_INS not in sys.path:
    sys.path.insert(0, _STAND_INS)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402

from tests import model_content  # noqa: E402

# What every SGLang process does first: the kvtransport plugin makes
# TransferBackend("kvtransport") and get_kv_class resolve to the adapter.
load_plugins()

from sglang.srt.configs.hybrid_arch import mambaish_config  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.disaggregation.decode import (  # noqa: E402
    DecodeReqToTokenPool,
    HybridMambaDecodeReqToTokenPool,
    SchedulerDisaggregationDecodeMixin,
)
from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.layers.dp_attention import compute_dp_attention_world_info  # noqa: E402
from sglang.srt.managers.disagg_service import start_disagg_service  # noqa: E402
from sglang.srt.managers.io_struct import AbortReq  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.managers.scheduler_components.batch_result_processor import (  # noqa: E402
    SchedulerBatchResultProcessor,
)
from sglang.srt.managers.scheduler_components.logprob_result_processor import (  # noqa: E402
    SchedulerLogprobResultProcessor,
)
from sglang.srt.mem_cache.allocation import alloc_for_extend  # noqa: E402
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.kv_cache_builder import uses_ssm_state, validate_decode_radix_cache  # noqa: E402
from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype  # noqa: E402
from sglang.srt.mem_cache.memory_pool import (  # noqa: E402
    HybridLinearKVPool,
    HybridReqToTokenPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
)
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.model_executor.model_runner_components.load_model_utils import (  # noqa: E402
    resolve_sliding_window_size,
)
from sglang.srt.runtime_context import (  # noqa: E402
    SpawnRanks,
    get_disagg,
    get_exec,
    get_memory,
    get_model,
    get_parallel,
    get_schedule,
    publish,
)
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

log = logging.getLogger("sglang_scheduler")

HEAD_DIM = 16
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 32, 8
VOCAB = 256
TOP_LOGPROBS = 2
#: Rows of the request table; the decode side pre-allocates as many again (DecodeReqToTokenPool).
MAX_RUNNING = 96
MAX_CONTEXT = 512
#: What one forward of the last chunk takes here (between a request's previous send and its last).
FORWARD_S = 0.3


# ---------------------------------------------------------------------------------------------
# The deterministic content both sides agree on without talking to each other
# ---------------------------------------------------------------------------------------------


_INT_OF, _FINITE_BELOW = model_content.INT_OF, model_content.FINITE_BELOW
token_keys, kv_content = model_content.token_keys, model_content.kv_content


def state_content(
    key: int, entry: int, shard: int, tokens: int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """One slot's row (``shape``, ``dtype``) of mamba state tensor number ``entry`` as the forward
    leaves it after the first ``tokens`` tokens of a prompt (``key``: the key of the last of them)
    on attention-TP rank ``shard`` (each holds its heads' share of the state): each element's
    bit pattern a function of the key, the tensor, the shard, the token count and the element;
    all finite numbers."""
    elem = torch.arange(math.prod(shape), dtype=torch.int64)
    value = key * 1_000_003 + entry * 7_919 + shard * 131 + tokens * 104_729 + elem * 17 + 3 * 65_537 + 1
    size = torch.empty((), dtype=dtype).element_size()
    return (value % _FINITE_BELOW[size]).to(_INT_OF[size]).view(dtype).reshape(shape)


def compare(got: torch.Tensor, want: torch.Tensor, first: int = 0, rows: str = "tokens", row: str = "position") -> str:
    """Empty when every bit of ``got`` is ``want``'s; else which rows (tokens, numbered from
    ``first``) differ."""
    ints = _INT_OF[got.element_size()]
    ok = (got.view(ints) == want.view(ints)).reshape(got.shape[0], -1).all(dim=1)
    if bool(ok.all()):
        return ""
    bad = (~ok).nonzero().flatten()
    return (
        f"{len(bad)} of {len(ok)} {rows} differ, first at {row} {first + int(bad[0])} "
        f"(got {got[bad[0]].flatten()[:4].tolist()}, want {want[bad[0]].flatten()[:4].tolist()})"
    )


def output_token(room: int) -> int:
    return (room * 31 + 7) % VOCAB


def token_logprob(room: int) -> float:
    return -float(room % 1000) / 64.0  # exact in float32


def top_logprobs(room: int) -> tuple[list[float], list[int]]:
    return [-0.5 - (room % 7) / 8.0, -1.25], [output_token(room), (output_token(room) + 1) % VOCAB]


def cached_tokens(room: int) -> int:
    return room % 5


def prompt_ids(room: int, length: int) -> array[int]:
    return array("q", ((room * 7 + i * 13) % VOCAB for i in range(length)))


def prompt_of(spec: dict[str, Any]) -> array[int]:
    """A request's prompt: ``prompt_ids`` of its room, or, with ``shared_prefix`` ``[seed, n]``,
    the first ``n`` tokens of ``prompt_ids(seed, ...)`` followed by its room's tokens from there
    on (requests with the same seed share those ``n`` tokens; a room's tokens differ from a
    seed's at every position unless the two are equal mod ``VOCAB``); ``tokens``, when the spec
    names them."""
    if spec.get("tokens"):  # the proxy's own prompt, sent to another engine's decode too
        return array("q", (int(t) for t in spec["tokens"]))
    ids = prompt_ids(spec["room"], spec["prompt_len"])
    if spec.get("shared_prefix"):
        seed, n = (int(x) for x in spec["shared_prefix"])
        ids[:n] = prompt_ids(seed, min(n, len(ids)))
    return ids


# ---------------------------------------------------------------------------------------------
# Stand-ins for what a scheduler process has and this one cannot run
# ---------------------------------------------------------------------------------------------


class OutputStreamer:
    """Stands in for the scheduler's output streamer (IPC to the detokenizer): records what the
    client would be told, which is how this harness learns a request concluded."""

    def __init__(self) -> None:
        self.finished: dict[str, tuple[Any, float]] = {}

    def stream_output(self, reqs: list[Req], return_logprob: bool = False, *args: Any, **kwargs: Any) -> None:
        for req in reqs:
            if req.finished_reason is not None and req.rid not in self.finished:
                self.finished[req.rid] = (req.finished_reason, time.time())


#: Where a model class of an architecture the harness serves lives (what SGLang's ModelRegistry
#: resolves; importing one module is far cheaper than the registry's scan of every model).
_MODEL_MODULES = {"GptOssForCausalLM": "sglang.srt.models.gpt_oss"}


class LoadedModel:
    """Stands in for the loaded model (no weights here): what the model runner asks the model
    about its KV, SGLang's own methods of the architecture's class where it has them."""

    def __init__(self, model_config: ModelConfig) -> None:
        self.config = model_config.hf_config
        arch = model_config.hf_config.architectures[0]
        module = _MODEL_MODULES.get(arch)
        self._cls = getattr(importlib.import_module(module), arch) if module else None

    def __getattr__(self, name: str) -> Callable[..., Any]:
        attr = getattr(self._cls, name, None) if name != "_cls" else None
        if attr is None or not callable(attr):
            raise AttributeError(name)
        return lambda *args, **kwargs: attr(self, *args, **kwargs)


class ModelWorker:
    """Stands in for the TP worker's forward (no model): the KV writes its attention layers
    make, layer by layer, each through the pool's own ``set_kv_buffer`` as SGLang's attention
    backends call it, and the mamba state. It samples nothing (finish_prefill does)."""

    def __init__(self, inst: Instance) -> None:
        self.inst = inst

    def forward_batch_generation(self, batch: Any, **kwargs: Any) -> SimpleNamespace:
        for req, start, end, corrupt in batch.writes:
            keys = token_keys(req.origin_input_ids)
            self.inst.write_kv(keys, batch.out_cache_loc, start, end, corrupt)
            if self.inst.is_hybrid_ssm:
                self.inst.write_mamba(keys, self.inst.mamba_slot(req), end, corrupt)
        return SimpleNamespace(
            has_sampled_token_ids=False, logits_output=None, copy_done=None, extra_keep_alive_refs=None
        )


class _Noop:
    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def group_ns(group: Any, size: int) -> SimpleNamespace:
    return SimpleNamespace(cpu_group=group, world_size=size, is_last_rank=True, is_first_rank=True)


class _SchedulerBase:
    """The attributes SGLang's Scheduler sets in its constructor and the disaggregation code
    reads, plus SGLang's own Scheduler methods that the queues and the abort path call."""

    init_disaggregation = Scheduler.init_disaggregation
    abort_request = Scheduler.abort_request
    collect_inflight_reqs = Scheduler.collect_inflight_reqs
    _collect_inflight_batches = Scheduler._collect_inflight_batches
    _release_aborted_request = Scheduler._release_aborted_request
    _hosts_rust_server = Scheduler._hosts_rust_server
    _add_request_to_queue = Scheduler._add_request_to_queue
    _set_or_validate_priority = Scheduler._set_or_validate_priority
    _prefetch_kvcache = Scheduler._prefetch_kvcache
    retire_unadmitted_request = Scheduler.retire_unadmitted_request
    process_pending_chunked_abort = Scheduler.process_pending_chunked_abort

    def __init__(self, inst: Instance) -> None:
        self.server_args = inst.server_args
        self.model_config = inst.model_config
        self.req_to_token_pool = inst.req_to_token_pool
        self.token_to_kv_pool_allocator = inst.allocator
        self.tree_cache = inst.tree_cache
        self.max_total_num_tokens = inst.pool_tokens
        self.max_running_requests = MAX_RUNNING
        self.spec_algorithm = SpeculativeAlgorithm.NONE
        self.draft_worker = None
        self.scheduler_stage_metrics = None
        self.enable_unified_memory = False
        self.enable_hisparse = False
        self.enable_decode_hicache = False
        self.enable_hicache_storage = False
        self.enable_lmcache = False
        self.enable_priority_scheduling = False
        self.abort_on_priority_when_disabled = False
        self.schedule_low_priority_values_first = False
        self.enable_lora = False
        self.enable_overlap = False
        self.enable_staging = False
        self.enable_continuous_input_polling = False
        self.result_queue: list[Any] = []
        self.rust_server = None
        self.random_seed = 0
        self.kv_shard_widening = 1
        self.processed_tokens_counter = 0
        self.tp_size = inst.tp_size
        self.attn_tp_cpu_group = inst.attn_tp_group
        self.attn_cp_cpu_group = inst.attn_cp_group
        self.tp_cpu_group = inst.world_group
        # What the Scheduler takes from kv_cache_builder.build_kv_cache's result.
        self.is_hybrid_swa = inst.is_hybrid_swa
        self.is_hybrid_ssm = inst.is_hybrid_ssm
        self.sliding_window_size = inst.sliding_window_size
        # Stand-in for the TP worker and its model runner (no model here): their KV bookkeeping only.
        self.tp_worker = SimpleNamespace(
            is_hybrid_swa=inst.is_hybrid_swa,
            sliding_window_size=inst.sliding_window_size,
            model_runner=SimpleNamespace(
                effective_logical_max_total_num_tokens=inst.pool_tokens,
                kv_cache_dtype_str=inst.kv_cache_dtype_str,
                full_max_total_num_tokens=inst.pool_tokens if inst.is_hybrid_swa else None,
                swa_max_total_num_tokens=inst.swa_tokens if inst.is_hybrid_swa else None,
            ),
        )
        self.metrics_reporter = SimpleNamespace(enable_metrics=False)  # SGLang's, with metrics off
        self.output_streamer = OutputStreamer()
        self.beam_coordinator = _Noop()  # no beam search
        # SGLang's batch-result processor (Scheduler.init_batch_result_processor builds it from
        # these): decode's _commit_transfer_to_req counts reasoning tokens with it, and its
        # process_batch_result_prebuilt concludes a prebuilt batch. What it has no use for here
        # (metrics, HiSparse, KV offload, speculative and model workers) is None.
        self.batch_result_processor = SchedulerBatchResultProcessor(
            is_generation=True,
            disaggregation_mode=inst.mode,
            enable_overlap=False,
            enable_overlap_mlx=False,
            model_config=inst.model_config,
            token_to_kv_pool_allocator=inst.allocator,
            tree_cache=inst.tree_cache,
            hisparse_coordinator=None,
            req_to_token_pool=inst.req_to_token_pool,
            decode_offload_manager=None,
            metrics_collector=None,
            metrics_reporter=self.metrics_reporter,
            draft_worker=None,
            model_worker=None,
            logprob_result_processor=SchedulerLogprobResultProcessor(model_config=inst.model_config),
            output_streamer=self.output_streamer,
            beam_coordinator=self.beam_coordinator,
            abort_request=self.abort_request,
        )
        # SGLang's relay of one decode step's outputs to the next (process_prebuilt stashes the
        # first output token in it), on CPU.
        self.future_map = self.spec_algorithm.create_future_map(
            torch.device("cpu"), inst.req_to_token_pool, needs_cpu_seq_lens=True, needs_confidence_relay=False
        )
        self.ngram_embedding_manager = _Noop()  # no n-gram embedding model
        self.grammar_manager = _Noop()  # no grammar requests
        self.mm_receiver = None
        self.dllm_config = None
        self.chunked_req: Req | None = None
        self._pending_chunked_abort_req: Req | None = None
        self.waiting_queue: list[Req] = []
        # Stand-in for the running ScheduleBatch: no batch runs here, so it stays empty.
        self.running_batch = SimpleNamespace(reqs=[], batch_is_full=False, batch_size=lambda: 0)
        self.last_batch = None
        self.aborted_outputs: dict[str, float] = {}

    def send_abort_output(self, abort_req: Any, req: Req) -> None:
        """Stands in for the IPC to the tokenizer (``Scheduler.send_abort_output``)."""
        self.aborted_outputs.setdefault(req.rid, time.time())


class PrefillScheduler(_SchedulerBase, SchedulerDisaggregationPrefillMixin):
    #: SGLang's own: the early send of a cached prefix, then the forward (the model worker
    #: below), with whatever hooks the plugins installed around it (KVTRANSPORT_LAYERWISE).
    run_batch = Scheduler.run_batch
    update_cache_from_scheduler = Scheduler.update_cache_from_scheduler
    _copy_auxiliary_output_to_cpu = Scheduler._copy_auxiliary_output_to_cpu
    _maybe_report_active_ranks = Scheduler._maybe_report_active_ranks

    def __init__(self, inst: Instance) -> None:
        super().__init__(inst)
        # What run_batch reads that the constructor sets; the profiler is off.
        self.forward_ct = 0
        self._sched_idled = False
        self.scripted_scheduler_hook = None
        self.profiler_manager = _Noop()
        self.forward_sleep_time = None
        self.is_generation = True
        self.enable_pdmux = False
        self.enable_unified_cache_external_linker = False
        self.attn_dp_enabled = False
        self.metrics_reporter.record_scheduler_active = lambda *args: None
        self.model_worker = ModelWorker(inst)


class DecodeScheduler(_SchedulerBase, SchedulerDisaggregationDecodeMixin):
    pass


# ---------------------------------------------------------------------------------------------
# One instance (a configuration) of this rank
# ---------------------------------------------------------------------------------------------


class Instance:
    def __init__(self, rank: int, topo: dict[str, Any], cfg: dict[str, Any], world_group: Any) -> None:
        self.rank = rank
        self.role = topo["role"]
        self.mode = DisaggregationMode.PREFILL if self.role == "prefill" else DisaggregationMode.DECODE
        self.tp_size = topo["tp_size"]
        self.cfg = cfg
        self.page_size = int(cfg["page_size"])
        self.mla = bool(cfg.get("mla", False))
        self.max_context = int(cfg.get("max_context", MAX_CONTEXT))  # a request row's tokens
        self.world_group = world_group
        self.server_args = ServerArgs(
            model_path=cfg.get("model_path") or topo["model_path"],
            disaggregation_mode=self.role,
            disaggregation_transfer_backend="kvtransport",
            device="cpu",
            skip_tokenizer_init=True,
            tp_size=topo["tp_size"],
            dp_size=topo["dp_size"],
            enable_dp_attention=topo["dp_attention"],
            disaggregation_bootstrap_port=int(cfg["bootstrap_port"]),
            page_size=self.page_size,
            # Prefill runs without a radix cache; for decode SGLang's PD hook resolves it from
            # --disaggregation-decode-enable-radix-cache (handle_pd_disaggregation: without it
            # disable_radix_cache=True, with it False).
            **({"disable_radix_cache": True} if self.role == "prefill" else {}),
            disaggregation_decode_enable_radix_cache=self.role == "decode" and bool(cfg.get("decode_radix_cache")),
            num_reserved_decode_tokens=int(cfg.get("num_reserved_decode_tokens", 16)),
            **({"disable_overlap_schedule": True} if cfg.get("disable_overlap_schedule") else {}),
            mem_fraction_static=0.5,
        )
        # As SGLang's launcher places a scheduler: the WORLD rank is the TP rank; under DP
        # attention the DP controller hands each rank its attention-DP index as dp_rank.
        dp_rank = None
        if topo["dp_attention"]:
            _, _, dp_rank, _ = compute_dp_attention_world_info(rank, topo["tp_size"], topo["dp_size"], 1)
        publish(self.server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank, dp_rank=dp_rank, gpu_id=0))
        par = get_parallel()
        self.attn_tp_group = topo["attn_tp_groups"][par.attn_dp_rank]
        self.attn_cp_group = topo["attn_cp_groups"][rank]
        # SGLang's model runner builds these groups on a GPU; here they are gloo groups of this
        # side's processes (docs/sglang-contract.md section 6), so poll_and_all_reduce runs a real
        # MIN all-reduce across the ranks.
        par.override_permanently(
            attn_tp_group=group_ns(self.attn_tp_group, par.attn_tp_size), pp_group=group_ns(None, 1)
        )
        self.model_config = ModelConfig.from_server_args(self.server_args)
        resolved, dtype = configure_kv_cache_dtype(
            server_args_kv_cache_dtype=get_model().kv_cache_dtype,
            model=None,
            model_dtype=self.model_config.dtype,
            is_draft_worker=False,
            is_dflash=False,
            speculative_draft_attention_backend=None,
        )
        self.kv_cache_dtype_str = resolved if resolved is not None else get_model().kv_cache_dtype
        self.dtype = dtype
        self.pool_tokens = int(cfg.get("pool_tokens", 16384))
        # What SGLang's model runner and kv_cache_builder.build_kv_cache derive from the model config.
        self.is_hybrid_swa = bool(self.model_config.is_hybrid_swa)
        self.is_hybrid_ssm = uses_ssm_state(self.model_config)
        self.mamba_config: Any = mambaish_config(self.model_config) if self.is_hybrid_ssm else None
        self.sliding_window_size: int | None = None
        self.swa_tokens = 0
        if self.is_hybrid_swa:
            self.sliding_window_size = resolve_sliding_window_size(LoadedModel(self.model_config), self.model_config)
            # The pool configurator's split (pool_configurator.py: full tokens * swa_full_tokens_ratio).
            ratio = get_schedule().swa_full_tokens_ratio
            self.swa_tokens = int(self.pool_tokens * ratio) // self.page_size * self.page_size
        self._build_pools(par, dtype)
        self.tree_cache = self._build_tree_cache()
        self.bootstrap_server: Any = None
        self.registry_starter: threading.Thread | None = None
        delay = float(cfg.get("registry_delay", 0))
        if self.mode == DisaggregationMode.PREFILL and rank == 0:
            # What SGLang's TokenizerManager does on node 0 (managers/disagg_service.py); it runs
            # beside the schedulers, so with ``registry_delay`` every rank starts before it is up.
            if delay:
                self.registry_starter = threading.Thread(target=self._start_registry_after, args=(delay,))
                self.registry_starter.start()
            else:
                self.bootstrap_server = start_disagg_service()
        dist.barrier(group=world_group)  # the registry is up (unless delayed) before any rank goes on
        cls = PrefillScheduler if self.mode == DisaggregationMode.PREFILL else DecodeScheduler
        self.sched: Any = cls(self)
        self.sched.disaggregation_mode = self.mode
        self.sched.init_disaggregation()  # SGLang's own: metadata buffers, queues, KVArgs, manager
        self.free = self.free_counts()

    def _build_tree_cache(self) -> Any:
        """The tree cache as kv_cache_builder.build_kv_cache has SGLang's registry build it
        (create_tree_cache: a UnifiedRadixCache with the FULL, and SWA or MAMBA, components),
        disabled unless decode runs with --disaggregation-decode-enable-radix-cache, after
        build_kv_cache's validate_decode_radix_cache in that mode."""
        disagg, memory = get_disagg(), get_memory()
        if disagg.disaggregation_decode_enable_radix_cache and self.mode == DisaggregationMode.DECODE:
            validate_decode_radix_cache(
                model_config=self.model_config,
                token_to_kv_pool=self.kv_pool,
                is_hybrid_swa=self.is_hybrid_swa,
                enable_hierarchical_cache=memory.enable_hierarchical_cache,
            )
        params = CacheInitParams(
            disable=memory.disable_radix_cache,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=self.page_size,
            tp_cache_group=self.attn_tp_group,
            attn_cp_cache_group=self.attn_cp_group,
            attn_tp_cache_group=self.attn_tp_group,
            eviction_policy=memory.radix_eviction_policy,
            eviction_policy_config=memory.radix_eviction_policy_config,
            enable_mamba_extra_buffer=get_exec().mamba.enable_mamba_extra_buffer,
            enable_mamba_extra_buffer_lazy=get_exec().mamba.enable_mamba_extra_buffer_lazy,
            chunked_prefill_size=get_schedule().chunked_prefill_size,
            sliding_window_size=self.sliding_window_size,
        )
        ctx = TreeCacheBuildContext(
            server_args=self.server_args,
            params=params,
            is_hybrid_swa=self.is_hybrid_swa,
            # full-attention layers' tokens: 0 only for a pure-SWA model (PureSWARadixCache)
            full_tokens_per_layer=self.pool_tokens,
            is_hybrid_ssm=self.is_hybrid_ssm,
            enable_hierarchical_cache=memory.enable_hierarchical_cache,
            disable_radix_cache=memory.disable_radix_cache,
            tp_worker=None,  # read only with HiCache or LMCache (neither here)
            model_config=self.model_config,
            tp_size=self.tp_size,
            tp_rank=self.rank,
            tp_group=self.world_group,
        )
        return create_tree_cache(ctx)

    def _build_pools(self, par: Any, dtype: torch.dtype) -> None:
        """The request pool, KV pool and allocator SGLang's KVCacheConfigurator builds for this
        model (mem_cache/kv_cache_configurator.py: _build_req_to_token_pool,
        _build_token_to_kv_pool, _build_token_to_kv_pool_allocator), with tiny sizes."""
        mc = self.model_config
        decode = self.mode == DisaggregationMode.DECODE
        layers = mc.num_hidden_layers
        local = mc.get_total_num_kv_heads() // par.attn_tp_size
        # The global KV heads this rank holds (the model shards them over attention TP).
        self.heads = torch.arange(par.attn_tp_rank * local, (par.attn_tp_rank + 1) * local)
        self.shard = par.attn_tp_rank  # whose share of the mamba state this rank holds
        self.head_dim = HEAD_DIM if not (self.is_hybrid_swa or self.is_hybrid_ssm) else mc.head_dim
        #: Layers whose KV is paged by the full-attention pool (every token), and the SWA layers.
        self.kv_layers: list[int] = list(range(layers))
        self.swa_layers: list[int] = []
        if self.is_hybrid_ssm:
            # _build_hybrid_req_pool / _build_hybrid_mamba_decode_req_pool
            cache_params = self.mamba_config.mamba2_cache_params
            common: dict[str, Any] = {
                "max_context_len": self.max_context,
                "device": "cpu",
                "enable_memory_saver": False,
                "cache_params": cache_params,
                "mamba_layer_ids": list(cache_params.layers),
                "enable_mamba_extra_buffer": get_exec().mamba.enable_mamba_extra_buffer,
                "enable_overlap_schedule": not get_schedule().disable_overlap_schedule,
                "start_layer": 0,
            }
            if decode:
                self.req_to_token_pool: Any = HybridMambaDecodeReqToTokenPool(
                    size=MAX_RUNNING,
                    speculative_num_draft_tokens=None,
                    pre_alloc_size=MAX_RUNNING,
                    mamba_size=get_schedule().max_mamba_cache_size,
                    **common,
                )
            else:
                # --max-mamba-cache-size, or what _handle_max_mamba_cache would derive from
                # the memory left (here: a slot per request row).
                self.req_to_token_pool = HybridReqToTokenPool(
                    size=MAX_RUNNING,
                    mamba_size=get_schedule().max_mamba_cache_size or MAX_RUNNING,
                    mamba_spec_state_size=MAX_RUNNING,
                    speculative_num_draft_tokens=None,
                    **common,
                )
        elif decode:
            self.req_to_token_pool = DecodeReqToTokenPool(
                MAX_RUNNING, self.max_context, "cpu", enable_memory_saver=False, pre_alloc_size=MAX_RUNNING
            )
        else:
            self.req_to_token_pool = ReqToTokenPool(MAX_RUNNING, self.max_context, "cpu", enable_memory_saver=False)
        if self.mla:
            self.kv_pool: Any = MLATokenToKVPool(
                self.pool_tokens,
                self.page_size,
                dtype,
                KV_LORA_RANK,
                QK_ROPE_HEAD_DIM,
                layers,
                device="cpu",
                enable_memory_saver=False,
            )
            self.heads = torch.zeros(1, dtype=torch.int64)
        elif self.is_hybrid_swa:
            # _build_hybrid_swa_kv_pool: an MHA pool for the full-attention layers and one for the
            # sliding-window layers.
            self.kv_layers = list(mc.full_attention_layer_ids)
            self.swa_layers = list(mc.swa_attention_layer_ids)
            self.kv_pool = SWAKVPool(
                size=self.pool_tokens,
                size_swa=self.swa_tokens,
                page_size=self.page_size,
                dtype=dtype,
                head_num=local,
                head_dim=mc.head_dim,
                swa_attention_layer_ids=self.swa_layers,
                full_attention_layer_ids=self.kv_layers,
                device="cpu",
                enable_kv_cache_copy=False,
                token_to_kv_pool_class=MHATokenToKVPool,
                enable_memory_saver=False,
            )
        elif self.is_hybrid_ssm:
            # _build_hybrid_linear_kv_pool: MHA KV for the full-attention layers; the mamba state
            # is the request pool's MambaPool.
            self.kv_layers = list(self.mamba_config.full_attention_layer_ids)
            self.kv_pool = HybridLinearKVPool(
                page_size=self.page_size,
                size=self.pool_tokens,
                dtype=dtype,
                head_num=local,
                head_dim=mc.head_dim,
                full_attention_layer_ids=self.kv_layers,
                device="cpu",
                mamba_pool=self.req_to_token_pool.mamba_pool,
                enable_memory_saver=False,
                enable_kv_cache_copy=False,
                start_layer=0,
                full_kv_pool_class=MHATokenToKVPool,
                quant_method=None,
                use_mla=False,
            )
        else:
            self.kv_pool = MHATokenToKVPool(
                self.pool_tokens,
                self.page_size,
                dtype,
                local,
                HEAD_DIM,
                layers,
                device="cpu",
                enable_memory_saver=False,
            )
        if self.is_hybrid_swa:
            # need_sort as SGLang sets it for a disaggregation mode.
            self.allocator: Any = SWATokenToKVPoolAllocator(
                self.pool_tokens,
                self.swa_tokens,
                page_size=self.page_size,
                dtype=dtype,
                device="cpu",
                kvcache=self.kv_pool,
                need_sort=True,
                req_to_token_pool=self.req_to_token_pool,
            )
        elif self.page_size == 1:
            self.allocator = TokenToKVPoolAllocator(self.pool_tokens, dtype, "cpu", self.kv_pool, need_sort=False)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                self.pool_tokens, self.page_size, dtype, "cpu", self.kv_pool, need_sort=False
            )

    def free_counts(self) -> dict[str, int]:
        """What is free in each pool: KV tokens (of the full-attention pool), request rows,
        metadata slots, and SWA tokens or mamba slots where the model has them. What decode's
        radix tree holds unlocked (evictable: SGLang's allocation evicts it when it needs the
        room) counts as free; what it holds locked does not."""
        a, tree = self.allocator, self.tree_cache
        counts = {
            "kv_tokens": (a.full_available_size() if self.is_hybrid_swa else a.available_size())
            + (tree.full_evictable_size() if self.is_hybrid_swa else tree.evictable_size()),
            "req_rows": self.req_to_token_pool.available_size(),
            "metadata_slots": self.sched.req_to_metadata_buffer_idx_allocator.available_size(),
        }
        if self.is_hybrid_swa:
            counts["swa_tokens"] = a.swa_available_size() + tree.swa_evictable_size()
        if self.is_hybrid_ssm:
            counts["mamba_slots"] = self.req_to_token_pool.mamba_allocator.available_size()
            if not tree.disable:
                counts["mamba_slots"] += tree.mamba_evictable_size()
        return counts

    def _start_registry_after(self, delay: float) -> None:
        time.sleep(delay)
        self.bootstrap_server = start_disagg_service()

    @property
    def kv_manager(self) -> Any:
        s = self.sched
        q = (
            s.disagg_prefill_bootstrap_queue
            if self.mode == DisaggregationMode.PREFILL
            else s.disagg_decode_prealloc_queue
        )
        return q.kv_manager

    def info(self) -> dict[str, Any]:
        par = get_parallel()
        args = self.kv_manager.kv_args
        return {
            "tp_rank": par.tp_rank,
            "attn_tp_rank": par.attn_tp_rank,
            "attn_tp_size": par.attn_tp_size,
            "attn_dp_rank": par.attn_dp_rank,
            "attn_dp_size": par.attn_dp_size,
            "dp_rank": par.dp_rank,
            "engine_rank": args.engine_rank,
            "kv_item_lens": list(args.kv_item_lens),
            "aux_item_lens": list(args.aux_item_lens),
            "state_types": [str(getattr(t, "name", t)) for t in getattr(args, "state_types", [])],
            "state_item_lens": [list(lens) for lens in getattr(args, "state_item_lens", [])],
            "manager": type(self.kv_manager).__qualname__,
            "kv_pool": type(self.kv_pool).__qualname__,
            "req_pool": type(self.req_to_token_pool).__qualname__,
            "allocator": type(self.allocator).__qualname__,
            "kv_cache_dtype_str": self.kv_cache_dtype_str,
            "dtype": str(self.dtype),
            "element_size": torch.empty((), dtype=self.dtype).element_size(),
            "kv_heads": len(self.heads),
            "layers": len(self.kv_layers),
            "swa_layers": len(self.swa_layers),
            "sliding_window_size": self.sliding_window_size,
            "mamba_row_bytes": sum(t[0].nbytes for _, t in self.mamba_entries()),
        }

    def close(self) -> None:
        teardown = getattr(self.kv_manager, "teardown", None) or getattr(self.kv_manager, "close", None)
        if teardown is not None:
            teardown()
        if self.registry_starter is not None:
            self.registry_starter.join()
        if self.bootstrap_server is not None:
            self.bootstrap_server.close()

    # -- content --------------------------------------------------------------------------------

    def write_kv(self, keys: torch.Tensor, locs: torch.Tensor, start: int, end: int, corrupt: str = "") -> None:
        """What the model forward would do for tokens [start, end) of a prompt (``keys``: its
        ``token_keys``): write each full-attention layer's KV, and each sliding-window layer's KV
        at the tokens' SWA slots (``corrupt``: "kv" writes another prompt's V into layer 1,
        "state" another prompt's into one state buffer, for the tests that show the checks bite)."""
        positions = torch.arange(start, end)
        keys = keys[start:end]
        # One write per full-attention layer through the pool's set_kv_buffer, as an attention
        # backend makes it (its layer object: the id; a SWA or hybrid pool routes it itself).
        # With ``direct_kv_writes`` the writes go straight into the buffers, as a pool that
        # overrides set_kv_buffer (FP4) or a CUDA graph replay makes them: no hook sees them.
        direct = bool(self.cfg.get("direct_kv_writes"))
        for layer in self.kv_layers:
            attn = SimpleNamespace(layer_id=layer, is_cross_attention=False)
            if direct:
                bad = int(corrupt == "kv" and layer == 1)
                kind, dim = (2, KV_LORA_RANK + QK_ROPE_HEAD_DIM) if self.mla else (0, self.head_dim)
                self.kv_pool.get_key_buffer(layer)[locs] = kv_content(
                    keys, layer, positions, self.heads, dim, kind, self.dtype
                )
                if not self.mla:
                    self.kv_pool.get_value_buffer(layer)[locs] = kv_content(
                        keys + bad, layer, positions, self.heads, self.head_dim, 1, self.dtype
                    )
            elif self.mla:
                dim = KV_LORA_RANK + QK_ROPE_HEAD_DIM
                latent = kv_content(keys, layer, positions, self.heads, dim, 2, self.dtype)
                self.kv_pool.set_kv_buffer(attn, locs, latent, latent)
            else:
                bad = int(corrupt == "kv" and layer == 1)
                self.kv_pool.set_kv_buffer(
                    attn,
                    locs,
                    kv_content(keys, layer, positions, self.heads, self.head_dim, 0, self.dtype),
                    kv_content(keys + bad, layer, positions, self.heads, self.head_dim, 1, self.dtype),
                )
            time.sleep(float(self.cfg.get("layer_compute_s", 0)))  # the rest of the layer's compute
        if self.swa_layers:
            swa_locs = self.allocator.translate_loc_from_full_to_swa(locs.to(torch.int64))
            swa = self.kv_pool.swa_kv_pool
            for i, layer in enumerate(self.swa_layers):
                k, v = swa.get_key_buffer(i), swa.get_value_buffer(i)
                k[swa_locs] = kv_content(keys, layer, positions, self.heads, self.head_dim, 0, self.dtype)
                bad = int(corrupt == "state" and i == len(self.swa_layers) - 1)
                v[swa_locs] = kv_content(keys + bad, layer, positions, self.heads, self.head_dim, 1, self.dtype)

    def write_mamba(self, keys: torch.Tensor, slot: int, tokens: int, corrupt: str = "") -> None:
        """The state the forward leaves in the request's mamba slot after ``tokens`` tokens."""
        entries = self.mamba_entries()
        key = int(keys[tokens - 1])
        for n, (_, t) in enumerate(entries):
            bad = int(corrupt == "state" and n == len(entries) - 1)
            t[slot] = state_content(key + bad, n, self.shard, tokens, tuple(t.shape[1:]), t.dtype)

    def mamba_entries(self) -> list[tuple[str, torch.Tensor]]:
        """Every per-slot tensor of the mamba pool's state ([slots, ...] for one layer): each conv
        state and the temporal (SSM) state of every mamba layer."""
        if not self.is_hybrid_ssm:
            return []
        pool = self.req_to_token_pool.mamba_pool
        cache, layers = pool.mamba_cache, pool.mamba_layer_ids
        out = [
            (f"conv{c} of layer {layer}", conv[i])
            for c, conv in enumerate(cache.conv)
            for i, layer in enumerate(layers)
        ]
        out += [(f"temporal of layer {layer}", cache.temporal[i]) for i, layer in enumerate(layers)]
        return out

    def mamba_slot(self, req: Req) -> int:
        """The request's mamba slot, read as SGLang's ``_mamba_payload`` reads it."""
        pool = self.req_to_token_pool
        return int(pool.translate_mamba_indices(pool.req_index_to_mamba_index_mapping[req.kv.req_pool_idx]))

    def window_start(self, tokens: int, prefix: int = 0) -> int:
        """The first token of the SWA window SGLang transfers (page-aligned; not before the
        ``prefix`` decode holds already: _swa_payload on both sides)."""
        assert self.sliding_window_size is not None
        return max(prefix, tokens - self.sliding_window_size) // self.page_size * self.page_size

    def kv_buffers(self) -> list[torch.Tensor]:
        if self.mla:
            return [self.kv_pool.get_key_buffer(layer) for layer in self.kv_layers]
        return [self.kv_pool.get_key_buffer(layer) for layer in self.kv_layers] + [
            self.kv_pool.get_value_buffer(layer) for layer in self.kv_layers
        ]

    def swa_buffers(self) -> list[torch.Tensor]:
        if not self.swa_layers:
            return []
        swa = self.kv_pool.swa_kv_pool
        n = len(self.swa_layers)
        return [swa.get_key_buffer(i) for i in range(n)] + [swa.get_value_buffer(i) for i in range(n)]

    def written_pages(self, buffers: list[torch.Tensor] | None = None) -> set[int]:
        """Pages holding anything but zeros, in any layer (of the full-attention pool, or of
        ``buffers``)."""
        pages: set[int] = set()
        for buf in self.kv_buffers() if buffers is None else buffers:
            rows = buf.view(buf.shape[0], -1).view(_INT_OF[buf.element_size()]).ne(0).any(dim=1)
            pages |= {int(p) for p in (rows.nonzero().flatten() // self.page_size).unique().tolist()}
        return pages

    def tree_held(self) -> dict[str, set[int]]:
        """The pages (and SWA pages, mamba slots) decode's radix tree holds: what requests that
        finished left cached (nothing while the cache is disabled)."""
        tree = self.tree_cache
        if tree.disable:
            return {}
        full = tree.all_values_flatten().to(torch.int64)
        out = {"kv": {int(p) for p in (full // self.page_size).unique().tolist()}}
        if self.swa_layers:
            # The tree's SWA values are the full indices' SWA slots (0: outside the window kept).
            swa = self.allocator.translate_swa_indices_for_transfer(full)
            out["swa"] = {int(p) for p in (swa[swa > 0] // self.page_size).unique().tolist()}
        if self.is_hybrid_ssm:
            slots = self.req_to_token_pool.translate_mamba_indices(tree.all_mamba_values_flatten())
            out["mamba"] = {int(x) for x in slots.tolist()}
        return out

    def zero_pools(self, keep: dict[str, set[int]]) -> None:
        """Zero every KV page, SWA page and mamba slot but those in ``keep``."""

        def page_rows(pages: set[int]) -> torch.Tensor:
            first = torch.tensor(sorted(pages), dtype=torch.int64)[:, None] * self.page_size
            return (first + torch.arange(self.page_size)[None, :]).flatten()

        for buffers, kept in (
            (self.kv_buffers(), page_rows(keep.get("kv", set()))),
            (self.swa_buffers(), page_rows(keep.get("swa", set()))),
            ([t for _, t in self.mamba_entries()], torch.tensor(sorted(keep.get("mamba", ())), dtype=torch.int64)),
        ):
            for buf in buffers:
                saved = buf[kept].clone()
                buf.zero_()
                buf[kept] = saved

    def written_mamba_slots(self) -> set[int]:
        slots: set[int] = set()
        for _, t in self.mamba_entries():
            rows = t.reshape(t.shape[0], -1).view(_INT_OF[t.element_size()]).ne(0).any(dim=1)
            slots |= {int(s) for s in rows.nonzero().flatten().tolist()}
        return slots

    def destinations(self, req: Req) -> dict[str, set[int]]:
        """The pages (and SWA pages, mamba slot) a decode request's row points at."""
        locs = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(req.origin_input_ids)].to(torch.int64)
        out = {"kv": {int(p) for p in (locs // self.page_size).unique().tolist()}}
        if self.swa_layers:
            swa_locs = self.allocator.translate_swa_indices_for_transfer(locs)
            out["swa"] = {int(p) for p in (swa_locs[swa_locs > 0] // self.page_size).unique().tolist()}
        if self.is_hybrid_ssm:
            out["mamba"] = {self.mamba_slot(req)}
        return out

    def verify_kv(self, keys: torch.Tensor, locs: torch.Tensor) -> tuple[int, str]:
        """Compare every element of the request's full-attention KV (``keys``: its prompt's
        ``token_keys``) with the content a prefill forward of the prompt writes."""
        positions = torch.arange(len(locs))
        checked = 0
        for layer in self.kv_layers:
            if self.mla:
                dim = KV_LORA_RANK + QK_ROPE_HEAD_DIM
                parts = [(self.kv_pool.get_key_buffer(layer), 2, dim)]
            else:
                parts = [
                    (self.kv_pool.get_key_buffer(layer), 0, self.head_dim),
                    (self.kv_pool.get_value_buffer(layer), 1, self.head_dim),
                ]
            for buf, kind, dim in parts:
                got = buf[locs]
                error = compare(got, kv_content(keys, layer, positions, self.heads, dim, kind, self.dtype))
                if error:
                    return checked, f"layer {layer} {'KVL'[kind]}: {error}"
                checked += got.numel() * got.element_size()
        return checked, ""

    def verify_swa(self, keys: torch.Tensor, locs: torch.Tensor, prefix: int = 0) -> tuple[int, str]:
        """Every element of the request's SWA window (the sliding-window layers' K and V of the
        last window tokens, page-aligned, after decode's ``prefix``) at the SWA slots decode's
        allocator mapped them to."""
        start = self.window_start(len(locs), prefix)
        swa_locs = self.allocator.translate_swa_indices_for_transfer(locs[start:])
        if bool((swa_locs <= 0).any()):
            return 0, f"SWA window [{start}, {len(locs)}) not allocated: {swa_locs.tolist()[:8]}"
        positions = torch.arange(start, len(locs))
        checked = 0
        swa = self.kv_pool.swa_kv_pool
        for i, layer in enumerate(self.swa_layers):
            for buf, kind in ((swa.get_key_buffer(i), 0), (swa.get_value_buffer(i), 1)):
                got = buf[swa_locs]
                want = kv_content(keys[start:], layer, positions, self.heads, self.head_dim, kind, self.dtype)
                error = compare(got, want, first=start)
                if error:
                    return checked, f"SWA layer {layer} {'KV'[kind]} (window from {start}): {error}"
                checked += got.numel() * got.element_size()
        return checked, ""

    def verify_mamba(self, keys: torch.Tensor, slot: int, tokens: int) -> tuple[int, str]:
        """Every byte of the request's mamba slot, in every state tensor."""
        checked = 0
        for n, (label, t) in enumerate(self.mamba_entries()):
            got = t[slot]
            want = state_content(int(keys[tokens - 1]), n, self.shard, tokens, tuple(t.shape[1:]), t.dtype)
            error = compare(got.reshape(-1, 1), want.reshape(-1, 1), rows="elements", row="element")
            if error:
                return checked, f"mamba {label} (slot {slot}): {error}"
            checked += got.numel() * got.element_size()
        return checked, ""


# ---------------------------------------------------------------------------------------------
# The scheduler loops
# ---------------------------------------------------------------------------------------------


def new_req(spec: dict[str, Any], mode: DisaggregationMode, bootstrap_port: int) -> Req:
    """A request as the tokenizer manager hands it to the scheduler (``Scheduler.handle_generate_request``
    builds ``Req`` from the same fields)."""
    params = SamplingParams(max_new_tokens=int(spec.get("max_new_tokens", 4)))
    params.normalize(None)
    req = Req(
        spec["rid"],
        "",
        prompt_of(spec),
        params,
        return_logprob=bool(spec.get("return_logprob", True)),
        top_logprobs_num=TOP_LOGPROBS if spec.get("return_logprob", True) else 0,
        bootstrap_host="127.0.0.1",
        bootstrap_port=bootstrap_port,
        bootstrap_room=spec["room"],
        disagg_mode=mode,
        # A router that picks the prefill DP rank itself sends it to both instances: prefill's
        # DP controller routes by routed_dp_rank, and both schedulers read disagg_prefill_dp_rank.
        routed_dp_rank=spec.get("prefill_dp") if mode == DisaggregationMode.PREFILL else None,
        disagg_prefill_dp_rank=spec.get("prefill_dp"),
        vocab_size=VOCAB,
    )
    return req


class Consensus:
    """Harness decisions every rank of an attention-TP group must take together (like SGLang's
    own polls): a MIN all-reduce of per-request flags over that group."""

    def __init__(self, inst: Instance) -> None:
        self.group = inst.attn_tp_group
        self.size = get_parallel().attn_tp_size

    def all(self, flags: list[bool]) -> list[bool]:
        if not flags or self.size == 1:
            return flags
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [bool(x) for x in t.tolist()]


def side_all_done(inst: Instance, done: bool) -> bool:
    t = torch.tensor([int(done)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=inst.world_group)
    return bool(t.item())


def outcome_of(reason: Any) -> tuple[str, str]:
    if isinstance(reason, FINISH_ABORT):
        return "failed", str(reason.message)
    if reason is None:
        return "timeout", ""
    return "success", ""


def run_prefill(inst: Instance, specs: list[dict[str, Any]], timeout: float) -> dict[str, Any]:
    s: PrefillScheduler = inst.sched
    queue = s.disagg_prefill_bootstrap_queue
    consensus = Consensus(inst)
    streamer: OutputStreamer = s.output_streamer
    reqs: dict[str, Req] = {}
    plans: dict[str, dict[str, Any]] = {}
    t0 = time.time()
    for spec in specs:
        req = new_req(spec, inst.mode, inst.server_args.disaggregation_bootstrap_port)
        reqs[req.rid] = req
        plans[req.rid] = {"spec": spec, "chunks": list(spec.get("chunks") or [spec["prompt_len"]]), "ready_at": None}
        s._add_request_to_queue(req)  # -> PrefillBootstrapQueue.add(req, num_kv_heads)
    events: dict[str, dict[str, float]] = {rid: {"created": t0} for rid in reqs}
    deadline = time.monotonic() + timeout
    running: list[Req] = []  # admitted, being prefilled (one chunked request at a time, as SGLang)
    longest_step = 0.0
    while True:
        step_start = time.monotonic()
        # -- event_loop_normal_disagg_prefill, one iteration (prefill.py) -----------------------
        s.waiting_queue.extend(queue.pop_bootstrapped())
        for req in s.waiting_queue:
            if not req.pending_bootstrap and plans[req.rid]["ready_at"] is None:
                plans[req.rid]["ready_at"] = time.time()
                events[req.rid]["bootstrapped"] = time.time()
        # Aborts asked for by the test: SGLang's abort path for a client abort (Scheduler.abort_request),
        # for a request in the bootstrap queue ("bootstrap"), bootstrapped in the waiting queue, or
        # being chunked with a chunk sent ("chunking": it holds pages, and SWA pages or a mamba slot).
        places = [(req, "bootstrap") for req in queue.queue] + [(req, "waiting") for req in s.waiting_queue]
        if s.chunked_req is not None and s.chunked_req.start_send_idx > 0:
            places.append((s.chunked_req, "chunking"))
        due = [
            req
            for req, place in places
            if aborts_in(plans[req.rid]["spec"].get("prefill_abort"), place) and "abort" not in events[req.rid]
        ]
        for req, ok in zip(due, consensus.all([True] * len(due)), strict=True):
            if ok:
                events[req.rid]["abort"] = time.time()
                s.abort_request(AbortReq(rid=req.rid))
        # -- get_next_disagg_prefill_batch_to_run (prefill.py:654) ------------------------------
        s.process_pending_chunked_abort()
        s.resolve_waiting_queue_bootstrap()
        if s.chunked_req is not None:
            # process_prefill_chunk: the chunk computed last iteration goes out (send_kv_chunk)
            s.process_prefill_chunk(last_batch=None, running_batch=s.running_batch)
        # -- get_new_batch_prefill: admit what is bootstrapped and due --------------------------
        now = time.time()
        candidates = [
            req
            for req in s.waiting_queue
            if not req.pending_bootstrap
            and req.finished_reason is None
            and plans[req.rid]["spec"].get("prefill_abort") in (None, "chunking")
            and now - plans[req.rid]["ready_at"] >= float(plans[req.rid]["spec"].get("prefill_delay", 0))
        ]
        chunking = s.chunked_req  # SGLang prefills one chunked request at a time
        for req, ok in zip(candidates, consensus.all([True] * len(candidates)), strict=True):
            if not ok:
                continue
            if len(plans[req.rid]["chunks"]) > 1:
                if chunking is not None:
                    continue
                chunking = req
            s.waiting_queue.remove(req)
            running.append(req)
        # -- run_batch + process_batch_result_disagg_prefill (the forward is this harness) -------
        batch, running = running, []
        # A request whose remaining (page-less) last chunk is not due yet stays for later.
        waits = [time.time() - plans[r.rid].get("sent_all_at", 0.0) < FORWARD_S for r in batch]
        waits = [not ok for ok in consensus.all([not w for w in waits])]
        for req, wait in zip(list(batch), waits, strict=True):
            if wait:
                batch.remove(req)
                running.append(req)
        for req in batch:
            plan = plans[req.rid]
            if req.finished_reason is not None:
                continue  # failed (its bootstrap check) while chunking: SGLang dropped it
            if plan.get("finish_only"):
                finish_prefill(inst, req)
                continue
            start = req.prefix_len
            end = plan["chunks"].pop(0)
            if end > start:
                corrupt = plan["spec"].get("prefill_corrupt") or ""
                if plan["spec"].get("corrupt_rank", inst.shard) != inst.shard:
                    corrupt = ""  # only that attention-TP rank's forward writes the wrong content
                forward_chunk(inst, req, start, end, corrupt="kv" if corrupt is True else corrupt)
            if plan["chunks"]:
                s.chunked_req = req  # still chunking: sent next iteration by process_prefill_chunk
                running.append(req)
                continue
            events[req.rid].setdefault("computed", time.time())  # its last layer is written
            if s.chunked_req is req:
                s.chunked_req = None
            if plan["spec"].get("zero_page_last") and "sent_all_at" not in plan:
                # Every page goes out as a non-last chunk (send_kv_chunk with an explicit end, as
                # the overlap path's send_kv_chunk(req, last_chunk=False, end_idx=tmp_end_idx) is
                # called, prefill.py:1125); the last chunk's result comes a forward later and its
                # send carries no new page, only the aux row that set_buf writes just before it.
                s.send_kv_chunk(req, last_chunk=False, end_idx=len(req.origin_input_ids))
                plan["sent_all_at"] = time.time()
                plan["finish_only"] = True
                running.append(req)
                continue
            finish_prefill(inst, req)
        # -- process_disagg_prefill_inflight_queue (prefill.py:1151) -----------------------------
        s.process_disagg_prefill_inflight_queue()
        longest_step = max(longest_step, time.monotonic() - step_start)
        concluded = all(rid in streamer.finished or rid in s.aborted_outputs for rid in reqs)
        idle = not (queue.queue or s.waiting_queue or s.disagg_prefill_inflight_queue or running or s.chunked_req)
        timed_out = time.monotonic() > deadline
        if side_all_done(inst, (concluded and idle) or timed_out):
            break
        time.sleep(0.002)
    results = {}
    for rid, req in reqs.items():
        reason, at = streamer.finished.get(rid, (None, None))
        if reason is None and rid in s.aborted_outputs:
            reason, at = FINISH_ABORT("aborted by the client (send_abort_output)"), s.aborted_outputs[rid]
        state, error = outcome_of(reason)
        results[rid] = {"state": state, "error": error, "at": at, **events[rid]}
        sender = getattr(req, "disagg_kv_sender", None)
        if state == "timeout" and sender is not None:
            results[rid]["poll"] = int(sender.poll())
        # What decode said it holds (finalize_bootstrap: the sends start there), and what the
        # backend says went over the wire (SGLang's transfer metric, read as
        # process_disagg_prefill_inflight_queue reads it).
        results[rid]["decode_prefix_len"] = int(req.disagg_decode_prefix_len)
        metric = sender.get_transfer_metric() if sender is not None else None
        results[rid]["sent_bytes"] = metric.transfer_total_bytes if metric is not None else None
        # KVTRANSPORT_LAYERWISE: the chunks that left layer by layer, and their layer groups.
        results[rid]["layerwise"] = [getattr(sender, "layerwise_chunks", 0), getattr(sender, "layerwise_groups", 0)]
    return {"outcomes": results, "leaks": leaks(inst), "t0": t0, "longest_step_s": longest_step}


def aborts_in(when: Any, place: str) -> bool:
    """``prefill_abort``: "bootstrap" (in PrefillBootstrapQueue), "waiting" or true (bootstrapped),
    "chunking" (the chunked request, once a chunk of it went out)."""
    return when == place or (when is True and place == "waiting")


def forward_chunk(inst: Instance, req: Req, start: int, end: int, corrupt: str = "") -> None:
    """ScheduleBatch.prepare_for_extend's allocation, for real (alloc_for_extend with a batch of
    one), then the forward's writes for tokens [start, end): KV (and SWA KV), and the mamba state
    the request's slot holds after them."""
    req.extend_end = end
    seq_lens = torch.tensor([end], dtype=torch.int64)
    # Stand-in for the ScheduleBatch of the forward (a batch of one): what alloc_for_extend reads.
    batch = SimpleNamespace(
        reqs=[req],
        prefix_lens=[start],
        extend_lens=[end - start],
        extend_num_tokens=end - start,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens,
        req_to_token_pool=inst.req_to_token_pool,
        tree_cache=inst.tree_cache,
        device="cpu",
        hisparse_coordinator=None,
        is_dllm=lambda: False,
        # ScheduleBatch.maybe_evict_swa, for real: a chunk of a hybrid-SWA request frees the SWA
        # slots that slid out of the window before the next chunk allocates (no-op otherwise).
        forward_mode=ForwardMode.EXTEND,
        enable_overlap=False,
        token_to_kv_pool_allocator=inst.allocator,
    )
    batch.maybe_evict_swa = lambda: ScheduleBatch.maybe_evict_swa(batch)
    batch._swa_eviction_trigger = lambda *args: ScheduleBatch._swa_eviction_trigger(batch, *args)
    batch._evict_swa = lambda *args, **kwargs: ScheduleBatch._evict_swa(batch, *args, **kwargs)
    out_cache_loc, _, _ = alloc_for_extend(batch)
    # What run_batch reads of the batch (prepare_for_extend sets it), then SGLang's run_batch
    # itself: the early send of a cached prefix, the forward (ModelWorker's KV writes).
    batch.out_cache_loc = out_cache_loc
    batch.writes = [(req, start, end, corrupt)]
    batch.prefill_input_ids_cpu = torch.tensor(req.origin_input_ids[start:end], dtype=torch.int64)
    batch.mix_running_indices = None
    batch.input_ids = None
    batch.hicache_consumer_index = -1
    batch.spec_algorithm = SpeculativeAlgorithm.NONE
    batch.return_logprob = batch.return_hidden_states = False
    inst.sched.run_batch(batch)


def finish_prefill(inst: Instance, req: Req) -> None:
    """The per-request part of process_batch_result_disagg_prefill (prefill.py:1012-1074) for a
    request whose last chunk was computed: the sampled token and its logprobs (the forward's
    output), the checkpoint, the inflight queue, and the last send_kv_chunk (set_buf inside)."""
    s = inst.sched
    room = req.bootstrap_room
    req.output_ids.append(output_token(room))
    req.cached_tokens = cached_tokens(room)
    req.logprob.output_token_logprobs_val = [token_logprob(room)]
    req.logprob.output_token_logprobs_idx = [output_token(room)]
    vals, idxs = top_logprobs(room)
    req.logprob.output_top_logprobs_val = [vals]
    req.logprob.output_top_logprobs_idx = [idxs]
    s.checkpoint_disagg_prefill(req)
    s.disagg_prefill_inflight_queue.append(req)
    if not req.pending_bootstrap:
        s.send_kv_chunk(req, last_chunk=True)


def run_decode(inst: Instance, specs: list[dict[str, Any]], timeout: float) -> dict[str, Any]:
    s: DecodeScheduler = inst.sched
    pq, tq = s.disagg_decode_prealloc_queue, s.disagg_decode_transfer_queue
    consensus = Consensus(inst)
    streamer: OutputStreamer = s.output_streamer
    reqs: dict[str, Req] = {}
    specs_by_rid = {spec["rid"]: spec for spec in specs}
    results: dict[str, dict[str, Any]] = {}
    events: dict[str, dict[str, float]] = {}
    t0 = time.time()
    arriving = list(specs)
    for spec in specs:
        events[spec["rid"]] = {}
    sources: dict[str, int] = {}  # rid -> most prefill ranks its receiver listed (bootstrap_infos)
    # A clean pool: afterwards, any page (or SWA page, or mamba slot) that holds data and was not
    # announced as a request's destination is a write that landed where no request of this run
    # was told to expect it. What decode's radix tree holds (what earlier requests left cached,
    # with --disaggregation-decode-enable-radix-cache) keeps its content: a request may reuse it.
    held = inst.tree_held()
    inst.zero_pools(keep=held)
    for spec in specs:  # the controls for the check above
        if spec.get("stray_write") is True:
            inst.kv_buffers()[-1][0] = 1  # slot 0: the padding page, never handed to a request
        elif spec.get("stray_write") == "state":
            # SWA slot 0 (the padding page) or mamba slot 0 (the dummy slot): never a request's
            for buf in inst.swa_buffers()[-1:] + [t for _, t in inst.mamba_entries()[-1:]]:
                buf[0] = 1
    given: dict[str, set[int]] = {pool: set(held.get(pool, ())) for pool in ("kv", "swa", "mamba")}

    def announced(req: Req) -> None:
        for pool, where in inst.destinations(req).items():
            given[pool] |= where

    deadline = time.monotonic() + timeout
    longest_step = 0.0
    while True:
        step_start = time.monotonic()
        # -- event_loop_normal_disagg_decode, one iteration (decode.py:3123) --------------------
        pq.prefetch_prefill_dp_rank_queries()
        # ingest_requests: what the router sent this rank (a request may arrive late).
        # ``decode_after``: only once those requests concluded here (their KV is in decode's tree).
        due_in = [
            time.time() - t0 >= float(spec.get("decode_delay", 0))
            and all(rid in results or rid in streamer.finished for rid in spec.get("decode_after", ()))
            for spec in arriving
        ]
        for spec, ok in zip(list(arriving), consensus.all(due_in), strict=True):
            if ok:
                arriving.remove(spec)
                req = new_req(spec, inst.mode, int(spec["bootstrap_port"]))
                reqs[req.rid] = req
                events[req.rid]["arrived"] = time.time()
                s._add_request_to_queue(req)  # -> DecodePreallocQueue.add(req)
        # Aborts asked for by the test, where the spec says: SGLang's client-abort path.
        due = []
        for decode_req in pq.queue:
            # "prealloc": its prefill rank is known and ready (SGLang's waiting_for_input), but
            # decode has no memory for it yet, so its pages were never announced.
            if specs_by_rid[decode_req.req.rid].get("decode_abort") == "prealloc" and decode_req.waiting_for_input:
                due.append(decode_req.req)
        for decode_req in tq.queue:
            if specs_by_rid[decode_req.req.rid].get("decode_abort") == "transfer":
                due.append(decode_req.req)
        due = [req for req in due if "abort" not in events[req.rid]]
        for req, ok in zip(due, consensus.all([True] * len(due)), strict=True):
            if ok:
                events[req.rid]["abort"] = time.time()
                s.abort_request(AbortReq(rid=req.rid))
        for decode_req in tq.queue:
            events[decode_req.req.rid].setdefault("metadata_sent", time.time())
        s.process_decode_queue()  # SGLang's: pop_preallocated -> transfer queue -> pop_transferred
        for decode_req in tq.queue:  # pages announced (a request that fails later got writes too)
            announced(decode_req.req)
            if decode_req.kv_receiver is not None:
                # The prefill ranks whose drain SGLang waits for (_defer_release's required_acks).
                rid = decode_req.req.rid
                sources[rid] = max(sources.get(rid, 0), len(decode_req.kv_receiver.bootstrap_infos))
        # Transferred requests wait for a prebuilt batch: checked here first, then run through it.
        for req in s.waiting_queue:
            transferred = time.time()  # SGLang's pop_transferred saw the transfer succeed
            results[req.rid] = {**verify_decode(inst, req, specs_by_rid[req.rid]), "transferred": transferred}
            announced(req)
        run_prebuilt(inst)
        # When a failed request's pages went back (at once, or after SGLang's deferred release).
        for rid, req in reqs.items():
            if rid in streamer.finished and "released" not in events[rid] and not req.kv.holds_kv:
                events[rid]["released"] = time.time()
        longest_step = max(longest_step, time.monotonic() - step_start)
        concluded = not arriving and all(rid in results or rid in streamer.finished for rid in reqs)
        idle = not (pq.queue or pq.pending_reqs or tq.queue or tq.has_pending_deferred_releases())
        timed_out = time.monotonic() > deadline
        if side_all_done(inst, (concluded and idle) or timed_out):
            break
        time.sleep(0.002)
    where = {d.req.rid: ("prealloc", d) for d in pq.queue} | {d.req.rid: ("transfer", d) for d in tq.queue}
    for spec in arriving:  # never arrived (the run timed out first)
        results[spec["rid"]] = {"state": "timeout", "error": "never added", "at": None}
    for rid in reqs:
        if rid not in results:
            reason, at = streamer.finished.get(rid, (None, None))
            state, error = outcome_of(reason)
            results[rid] = {"state": state, "error": error, "at": at}
            if rid in where:  # still queued: where, and what its receiver and aux row say
                name, d = where[rid]
                results[rid]["queue"] = name
                results[rid]["poll"] = int(d.kv_receiver.poll()) if d.kv_receiver is not None else None
                if d.metadata_buffer_index >= 0:
                    results[rid]["aux_room"] = int(tq.metadata_buffers.bootstrap_room[d.metadata_buffer_index, 0])
        results[rid].update(events[rid])
        if rid in sources:
            results[rid]["sources"] = sources[rid]
    # What the tree holds now was a request's (KV, SWA pages), or is the tree's own copy of a
    # request's mamba state (its insert forks the slot): SGLang wrote it, not a transfer.
    for pool, cached in inst.tree_held().items():
        given[pool] |= cached
    stray = sorted(inst.written_pages() - given["kv"])
    stray_state = {}
    if inst.swa_layers:
        stray_state["swa_pages"] = sorted(inst.written_pages(inst.swa_buffers()) - given["swa"])
    if inst.is_hybrid_ssm:
        dirty = inst.written_mamba_slots() - given["mamba"]
        if not inst.tree_cache.disable:
            # The tree forks an unfinished request's state into a slot of its own (its checkpoint
            # from process_prebuilt) and frees the fork when the finished request's own slot, or
            # another node, supersedes it: a slot holding exactly the state a delivered request
            # ended with is such a copy, made by SGLang on this side.
            delivered = [r for rid, r in reqs.items() if results.get(rid, {}).get("state") == "success"]
            states = [(token_keys(r.origin_input_ids), len(r.origin_input_ids)) for r in delivered]
            dirty = {slot for slot in dirty if all(inst.verify_mamba(k, slot, n)[1] for k, n in states)}
        stray_state["mamba_slots"] = sorted(dirty)
    return {
        "outcomes": results,
        "leaks": leaks(inst),
        "t0": t0,
        "longest_step_s": longest_step,
        "stray_pages": stray[:20],
        "stray_page_count": len(stray),
        # what decode's radix tree holds (unlocked, so not counted by ``leaks``) after the run
        "tree_tokens": 0 if inst.tree_cache.disable else int(inst.tree_cache.evictable_size()),
        # pages/slots of the state pools written that no request was given
        "stray_state": {k: (len(v), v[:20]) for k, v in stray_state.items()},
    }


def run_prebuilt(inst: Instance) -> None:
    """What decode's event loop does with the transferred requests in its waiting queue, SGLang's
    own code but for the forward: get_new_prebuilt_batch (_get_new_prebuilt_batch:
    init_next_round_input, ScheduleBatch.init_new, prepare_for_prebuilt; then process_prebuilt,
    which with the radix cache checkpoints each prompt into decode's tree), run_batch (a
    PREBUILT batch runs no forward), and process_batch_result_prebuilt: a request whose
    max_new_tokens the token from prefill reached finishes there (release_kv_cache with
    checkpoint=True: the tree keeps its prompt's whole pages). No decode batch runs here: a
    request with tokens left to generate ends as its last decode step would end it
    (_handle_finish_state_updated_req -> release_kv_cache(checkpoint=True)), without them."""
    s: DecodeScheduler = inst.sched
    while s.waiting_queue:
        batch = s.get_new_prebuilt_batch(s.running_batch)
        if batch is None:
            break
        s.batch_result_processor.process_batch_result_prebuilt(batch)
        for req in batch.reqs:
            if not req.finished():
                req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
                release_kv_cache(req, inst.tree_cache, checkpoint=True)


def verify_decode(inst: Instance, req: Req, spec: dict[str, Any]) -> dict[str, Any]:
    """Every KV byte of the request's whole prompt (with a decode-side prefix: the prefix pages
    its radix tree gave, and the pages that came over the wire), every byte of its state (the
    SWA window, the mamba slot), and what _commit_transfer_to_req read from its aux row (what
    the harness's prefill writes there, or the spec's ``expect_aux``: another engine's prefill)."""
    room = req.bootstrap_room
    n = len(req.origin_input_ids)
    # What decode's DecodePreallocQueue promised prefill as decode_prefix_len (its tree's match).
    prefix = int(req.kv.cache_protected_len or 0)
    keys = token_keys(req.origin_input_ids)
    locs = inst.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
    kv_bytes, error = inst.verify_kv(keys, locs)
    state_bytes = 0
    if inst.swa_layers:
        state_bytes, state_error = inst.verify_swa(keys, locs, prefix)
        error = error or state_error
    if inst.is_hybrid_ssm:
        state_bytes, state_error = inst.verify_mamba(keys, inst.mamba_slot(req), n)
        error = error or state_error
    aux = {
        "output_id": int(req.output_ids[-1]) if req.output_ids else None,
        "cached_tokens": int(req.cached_tokens),
        "logprob": req.logprob.output_token_logprobs_val[-1] if req.logprob.output_token_logprobs_val else None,
        "logprob_idx": req.logprob.output_token_logprobs_idx[-1] if req.logprob.output_token_logprobs_idx else None,
        "top_val": req.logprob.output_top_logprobs_val[-1] if req.logprob.output_top_logprobs_val else None,
        "top_idx": req.logprob.output_top_logprobs_idx[-1] if req.logprob.output_top_logprobs_idx else None,
    }
    vals, idxs = top_logprobs(room)
    want = {
        "output_id": output_token(room),
        "cached_tokens": cached_tokens(room),
        "logprob": token_logprob(room),
        "logprob_idx": output_token(room),
        "top_val": [float(torch.tensor(v, dtype=torch.float32)) for v in vals],
        "top_idx": idxs,
    }
    if spec.get("expect_aux") is not None:
        want = dict(spec["expect_aux"])
    bad = {k: (aux[k], want[k]) for k in want if aux[k] != want[k]}
    if bad and not error:
        error = f"aux row differs: {bad}"
    return {
        "state": "success" if not error else "corrupt",
        "error": error,
        "kv_bytes": kv_bytes,
        "state_bytes": state_bytes,
        "tokens": n,
        "decode_prefix_len": prefix,
        "aux": aux,
        "at": time.time(),
    }


def leaks(inst: Instance) -> dict[str, int]:
    """What is still allocated once every request concluded (all of it must be back; what
    decode's radix tree holds unlocked is not allocated to anyone, what it holds locked, a
    request's lock never released, is a leak: ``tree_locked_tokens``)."""
    out = {k: inst.free[k] - n for k, n in inst.free_counts().items()}
    tree = inst.tree_cache
    if not tree.disable:
        out["tree_locked_tokens"] = int(tree.protected_size()) + (
            int(tree.swa_protected_size()) if inst.swa_layers else 0
        )
    return out


# ---------------------------------------------------------------------------------------------
# The process
# ---------------------------------------------------------------------------------------------


def reply(doc: dict[str, Any]) -> None:
    _PROTO.write(json.dumps(doc) + "\n")
    _PROTO.flush()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--dp-attention", action="store_true")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--model-path", required=True)
    args = p.parse_args()
    logging.basicConfig(level=os.environ.get("SGLANG_HARNESS_LOG", "WARNING"), stream=sys.stderr)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.master_port}",
        rank=args.rank,
        world_size=args.tp_size,
        timeout=datetime.timedelta(seconds=180),
    )
    attn_tp = args.tp_size // args.dp_size if args.dp_attention else args.tp_size
    world = dist.group.WORLD
    # Every rank creates every group, in the same order (torch.distributed's rule).
    attn_tp_groups = [
        dist.new_group(list(range(d * attn_tp, (d + 1) * attn_tp))) for d in range(args.tp_size // attn_tp)
    ]
    attn_cp_groups = [dist.new_group([r]) for r in range(args.tp_size)]
    topo = {
        "role": args.role,
        "tp_size": args.tp_size,
        "dp_size": args.dp_size,
        "dp_attention": args.dp_attention,
        "model_path": args.model_path,
        "attn_tp_groups": attn_tp_groups,
        "attn_cp_groups": attn_cp_groups,
    }
    inst: Instance | None = None
    env_keys: set[str] = set()
    reply({"ready": True, "pid": os.getpid()})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                op = cmd["cmd"]
                if op == "configure":
                    if inst is not None:
                        inst.close()
                        inst = None
                    for key in env_keys:
                        os.environ.pop(key, None)
                    env = {k: str(v) for k, v in cmd["config"].get("env", {}).items()}
                    os.environ.update(env)
                    env_keys = set(env)
                    inst = Instance(args.rank, topo, cmd["config"], world)
                    result: dict[str, Any] = {"ok": True, "info": inst.info()}
                elif op == "run":
                    assert inst is not None, "run before configure"
                    runner = run_prefill if args.role == "prefill" else run_decode
                    result = {"ok": True, **runner(inst, cmd["requests"], float(cmd.get("timeout", 60)))}
                elif op == "close":
                    reply({"ok": True})
                    break
                else:
                    raise ValueError(f"unknown command {op!r}")
            except Exception as exc:  # noqa: BLE001 - reported to the test, with the traceback
                result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            reply({**result, "seq": cmd.get("seq")})
    finally:
        t = time.monotonic()
        if inst is not None:
            try:
                inst.close()
            except Exception:  # noqa: BLE001 - exiting anyway
                traceback.print_exc()
        log.info("closed in %.2f s", time.monotonic() - t)
    return 0


if __name__ == "__main__":
    code = main()
    # The instance is torn down; skip the interpreter's exit, which waits seconds on the
    # transfer engines' and gloo's threads.
    sys.stderr.flush()
    _PROTO.flush()
    os._exit(code)
