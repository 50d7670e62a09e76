"""One vLLM instance for the connector's tests, run in the vLLM environment (``.venv-vllm``):
vLLM's own v1 ``Scheduler`` on the CPU platform, its ``KVConnectorFactory`` loading
``KVTransportConnector`` by module path (both roles), its model-runner mixin binding each step's
metadata and collecting each worker's transfer results, its ``KVOutputAggregator`` merging the
TP ranks' outputs, and ``update_from_output`` acting on them. Only the model is a stand-in: its
forward writes a known value for every token it computes into the KV blocks vLLM scheduled, so
the decode side can check every transferred token of every layer, head and K/V.

Run as ``python tests/vllm_engine.py '<config json>'``; commands arrive as JSON lines on stdin,
events leave as JSON lines on stdout (tests/test_vllm.py drives two of these as a proxy would):

- ``{"op": "prefill", "id", "tokens"[, "params"]}`` -> ``{"event": "prefilled", "id", "params"}`` (for
  an SGLang decode, ``params`` name its room, and the event is ``finished``)
- ``{"op": "decode", "id", "tokens", "params", "max_tokens"[, "prompt_logprobs"]}`` -> ``{"event":
  "loaded", "id", "checked", "bad"}`` when vLLM first schedules it after the load, then
  ``{"event": "finished", "id", "reason"}``
- ``{"op": "reject", "id", "params"}``: what vLLM's serving layer does with a decode request it
  refused before the engine saw it (``AsyncLLM.notify_kv_transfer_request_rejected``: a
  placeholder prompt, aborted as it is added) -> ``{"event": "rejected", "id"}``
- ``{"op": "abort", "id"}``, ``{"op": "stats"}`` -> ``{"event": "stats", ...}``, ``{"op": "quit"}``
"""

from __future__ import annotations

import copy
import json
import logging
import os
import select
import sys
import tempfile
import threading
import time
from typing import Any

import model_content  # tests/, this script's directory
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm.v1.worker.utils import allocate_kv_cache

EOS = 2
SENTINEL = -1.0


def model_dir(cfg: dict[str, Any]) -> str:
    """A tiny Llama config in a temp dir (no weights, no tokenizer: nothing is downloaded)."""
    path = tempfile.mkdtemp(prefix="kvt-vllm-model-")
    heads = cfg["heads"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": heads * cfg["head_size"],
                "intermediate_size": 64,
                "num_attention_heads": heads,
                "num_key_value_heads": heads,
                "head_dim": cfg["head_size"],
                "num_hidden_layers": cfg["layers"],
                "vocab_size": 1000,
                "max_position_embeddings": 4096,
                "torch_dtype": cfg.get("dtype", "float16"),
                "eos_token_id": EOS,
                "bos_token_id": 1,
            },
            f,
        )
    return path


def token_value(layer: int, kv: int, pos: int, token: int, head: Any, dim: Any) -> Any:
    """What the stand-in model writes: exact in float16, different for every coordinate."""
    return ((layer * 7 + kv * 3 + pos * 11 + token * 13 + head * 5 + dim) % 251) / 8.0


class Engine:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.tp = cfg["tp"]
        self.bs = cfg["block_size"]
        self.layers = cfg["layers"]
        self.heads = cfg["heads"]
        self.head_size = cfg["head_size"]
        self.num_blocks = cfg["num_blocks"]
        self.dtype = getattr(torch, cfg.get("dtype", "float16"))
        model = ModelConfig(model=model_dir(cfg), skip_tokenizer_init=True, dtype=cfg.get("dtype", "float16"), seed=0)
        self.vllm_config = VllmConfig(
            model_config=model,
            scheduler_config=SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=cfg.get("max_batched_tokens", 256),
                max_model_len=4096,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
                disable_hybrid_kv_cache_manager=cfg.get("disable_hma"),
            ),
            cache_config=CacheConfig(block_size=self.bs, enable_prefix_caching=cfg.get("prefix_caching", True)),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tp),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVTransportConnector",
                kv_connector_module_path="kvtransport.integrations.vllm",
                kv_role="kv_both",
                kv_connector_extra_config=cfg.get("extra", {}),
                kv_load_failure_policy=cfg.get("failure_policy", "fail"),
            ),
        )
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(self.layers)]
        local_heads = self.heads // self.tp
        spec = FullAttentionSpec(
            block_size=self.bs, num_kv_heads=local_heads, head_size=self.head_size, dtype=self.dtype
        )
        # The layout as vLLM's engine core resolves it: what the attention backend supports (the
        # CPU backend's, unless a test names another backend's list), the connector's wish
        # (get_required_kvcache_layout) when it is among them.
        supported = cfg.get("layouts") or [m.name for m in get_supported_kv_cache_layouts([CPUAttentionBackend])]
        self.layout = resolve_kv_cache_layout(self.vllm_config, [supported], [spec])
        self.vllm_config.cache_config.kv_cache_layout = self.layout.name
        self.vllm_config.cache_config.num_gpu_blocks_override = self.num_blocks
        groups = [KVCacheGroupSpec(self.layer_names, spec)]
        self.kv_cache_config = get_kv_cache_config_from_groups(
            self.vllm_config, groups, self.num_blocks * spec.page_size_bytes * self.layers
        )
        self.vllm_config.cache_config.num_gpu_blocks = self.num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            log_stats=False,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=self.bs,
        )
        # One worker per TP rank, each with its KV caches and its own connector, as vLLM's
        # workers build them (KVConnectorFactory, role WORKER).
        self.workers: list[Any] = []
        self.worker_configs: list[VllmConfig] = []
        self.caches: list[dict[str, torch.Tensor]] = []
        handshake = {}
        for rank in range(self.tp):
            config = copy.copy(self.vllm_config)
            config.parallel_config = copy.copy(self.vllm_config.parallel_config)
            config.parallel_config.rank = rank
            # vLLM's own allocation: one backing buffer, a [B, H, N, C] view per layer.
            caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), self.layout)
            for view in caches.values():
                view.fill_(SENTINEL)
            connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, self.kv_cache_config)
            connector.register_kv_caches(caches)
            handshake[(0, rank)] = connector.get_handshake_metadata()
            self.workers.append(connector)
            self.worker_configs.append(config)
            self.caches.append(caches)
        self.scheduler.get_kv_connector().set_xfer_handshake_metadata_pp_aware(handshake)
        self.aggregator = KVOutputAggregator(expected_finished_count=self.tp)
        self.tokens: dict[str, list[int]] = {}
        self.checked: set[str] = set()
        init_none_hash(sha256)

    # -- the stand-in model ------------------------------------------------------------------

    def write_kv(self, rank: int, req_id: str, start: int, count: int) -> None:
        if self.cfg.get("content") == "sglang":
            self.write_sglang_kv(rank, req_id, start, count)
            return
        tokens = self.tokens[req_id]
        blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        local = self.heads // self.tp
        heads = torch.arange(rank * local, (rank + 1) * local).view(-1, 1)
        dims = torch.arange(self.head_size).view(1, -1)
        d = self.head_size
        for pos in range(start, min(start + count, len(tokens))):
            block, slot = blocks[pos // self.bs], pos % self.bs
            for layer, name in enumerate(self.layer_names):
                for kv in (0, 1):  # a head's content is its K, then its V
                    value = token_value(layer, kv, pos, tokens[pos], heads, dims)
                    self.caches[rank][name][block, :, slot, kv * d : (kv + 1) * d] = value.to(self.dtype)

    def write_sglang_kv(self, rank: int, req_id: str, start: int, count: int) -> None:
        """``write_kv`` of the KV the SGLang harness's stand-in model computes
        (tests/model_content.py), where vLLM's attention writes it: a head's K in
        ``content[:head_size]`` of its token, its V in ``content[head_size:]``."""
        tokens = self.tokens[req_id]
        end = min(start + count, len(tokens))
        if end <= start:
            return
        blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        local, d = self.heads // self.tp, self.head_size
        keys = model_content.token_keys(tokens)[start:end]
        positions = torch.arange(start, end)
        heads = torch.arange(rank * local, (rank + 1) * local)
        for layer, name in enumerate(self.layer_names):
            view = self.caches[rank][name]
            for kv in (0, 1):
                content = model_content.kv_content(keys, layer, positions, heads, d, kv, self.dtype)
                for i, pos in enumerate(range(start, end)):
                    view[blocks[pos // self.bs], :, pos % self.bs, kv * d : (kv + 1) * d] = content[i]

    def check_kv(self, req_id: str, upto: int) -> tuple[int, int]:
        """(tokens checked, tokens wrong) over every rank, layer, K/V and head."""
        if self.cfg.get("content") == "sglang":
            return self.check_sglang_kv(req_id, upto)
        tokens = self.tokens[req_id]
        blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        local = self.heads // self.tp
        bad = 0
        for rank in range(self.tp):
            heads = torch.arange(rank * local, (rank + 1) * local).view(-1, 1)
            dims = torch.arange(self.head_size).view(1, -1)
            for pos in range(upto):
                block, slot = blocks[pos // self.bs], pos % self.bs
                wrong = False
                d = self.head_size
                for layer, name in enumerate(self.layer_names):
                    for kv in (0, 1):
                        want = token_value(layer, kv, pos, tokens[pos], heads, dims).to(self.dtype)
                        got = self.caches[rank][name][block, :, slot, kv * d : (kv + 1) * d]
                        if not torch.equal(got, want):
                            wrong = True
                bad += wrong
        return upto, bad

    def check_sglang_kv(self, req_id: str, upto: int) -> tuple[int, int]:
        """``check_kv`` of KV an SGLang prefill's stand-in model computed (tests/model_content.py:
        the same model's KV, bit for bit), read where vLLM's attention reads it: a head's K is
        ``content[:head_size]`` of its token, its V ``content[head_size:]``."""
        tokens = self.tokens[req_id]
        blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        local, d = self.heads // self.tp, self.head_size
        keys = model_content.token_keys(tokens)
        positions = torch.arange(upto)
        ints = model_content.INT_OF[torch.empty((), dtype=self.dtype).element_size()]
        wrong = torch.zeros(upto, dtype=torch.bool)
        for rank in range(self.tp):
            heads = torch.arange(rank * local, (rank + 1) * local)
            for layer, name in enumerate(self.layer_names):
                view = self.caches[rank][name]
                for kv in (0, 1):
                    want = model_content.kv_content(keys[:upto], layer, positions, heads, d, kv, self.dtype)
                    for pos in range(upto):
                        got = view[blocks[pos // self.bs], :, pos % self.bs, kv * d : (kv + 1) * d]
                        if not torch.equal(got.contiguous().view(ints), want[pos].view(ints)):
                            wrong[pos] = True
        return upto, int(wrong.sum())

    # -- one engine step, as vLLM's EngineCore and model runner make it ------------------------

    def step(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        out = self.scheduler.schedule()
        scheduled = dict(out.num_scheduled_tokens)
        for new in out.scheduled_new_reqs:
            req = self.scheduler.requests[new.req_id]
            if req.kv_transfer_params and new.req_id not in self.checked and self.tokens.get(new.req_id):
                if (req.kv_transfer_params or {}).get("remote_request_id"):
                    self.checked.add(new.req_id)
                    upto = new.num_computed_tokens
                    checked, bad = self.check_kv(new.req_id, upto)
                    events.append({"event": "loaded", "id": new.req_id, "checked": checked, "bad": bad})
        outputs = []
        for rank, worker in enumerate(self.workers):
            kv_transfer_state._KV_CONNECTOR_AGENT = worker
            with set_forward_context(None, self.worker_configs[rank]):
                with KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_out:
                    for req_id, count in scheduled.items():
                        req = self.scheduler.requests[req_id]
                        start = req.num_computed_tokens - count
                        self.write_kv(rank, req_id, start, count)
                        for name in self.layer_names:
                            worker.save_kv_layer(name, self.caches[rank][name], None)
            req_ids = list(scheduled)
            sampled = []
            for req_id in req_ids:
                req = self.scheduler.requests[req_id]
                done_prompt = req.num_computed_tokens >= req.num_tokens
                sampled.append([100 + len(req.output_token_ids)] if done_prompt else [])
            outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=sampled,
                    logprobs=None,
                    prompt_logprobs_dict={},
                    pooler_output=[],
                    kv_connector_output=kv_out,
                )
            )
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        merged = self.aggregator.aggregate(outputs)
        for req_id in scheduled:
            req = self.scheduler.requests.get(req_id)
            if req is not None and req.num_computed_tokens >= req.num_tokens:
                self.tokens[req_id] = self.tokens[req_id] + [100 + len(req.output_token_ids)]
        engine_outputs = self.scheduler.update_from_output(out, merged)
        for client_outputs in engine_outputs.values():
            for o in client_outputs.outputs:
                if o.finish_reason is None:
                    continue
                params = o.kv_transfer_params
                if params and params.get("do_remote_prefill"):
                    events.append({"event": "prefilled", "id": o.request_id, "params": params})
                else:
                    events.append({"event": "finished", "id": o.request_id, "reason": str(o.finish_reason)})
        return events

    # -- commands ----------------------------------------------------------------------------

    def add(
        self,
        req_id: str,
        tokens: list[int],
        max_tokens: int,
        params: dict[str, Any] | None,
        abort_immediately: bool = False,
        **sampling_args: Any,
    ) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling_args)
        sampling.update_from_generation_config({}, EOS)
        req = Request(
            request_id=req_id,
            prompt_token_ids=list(tokens),
            sampling_params=sampling,
            pooling_params=None,
            block_hasher=get_request_block_hasher(self.bs, sha256),
            abort_immediately=abort_immediately,
        )
        req.kv_transfer_params = params
        self.tokens[req_id] = list(tokens)
        self.scheduler.add_request(req)
        if req.abort_immediately:  # as vLLM's EngineCore.add_request: request_finished runs now
            self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

    def stats(self) -> dict[str, Any]:
        pool = self.scheduler.kv_cache_manager.block_pool
        return {
            "event": "stats",
            "requests": len(self.scheduler.requests),
            "free_blocks": pool.free_block_queue.num_free_blocks,
            "num_blocks": pool.num_gpu_blocks,
            "workers": [w.worker.stats() for w in self.workers],
            "holding": len(self.scheduler.get_kv_connector().scheduler.holding),
            "params_pending": len(self.scheduler.get_kv_connector().scheduler._params),
            "statuses": {rid: r.status.name for rid, r in self.scheduler.requests.items()},
            "rss": int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE"),
            "fds": len(os.listdir("/proc/self/fd")),
            "threads": threading.active_count(),
        }

    def busy(self) -> bool:
        # vLLM's EngineCore steps while the scheduler has_requests(): requests, requests finished
        # since the last step, or the connector's pending work.
        return self.scheduler.has_requests() or any(w.worker.held or w.worker.loading for w in self.workers)

    def handle(self, cmd: dict[str, Any]) -> list[dict[str, Any]]:
        op = cmd["op"]
        if op == "prefill":
            self.add(cmd["id"], cmd["tokens"], 1, cmd.get("params") or {"do_remote_decode": True})
        elif op == "decode":
            extra = {"prompt_logprobs": cmd["prompt_logprobs"]} if cmd.get("prompt_logprobs") else {}
            self.add(cmd["id"], cmd["tokens"], cmd.get("max_tokens", 2), cmd["params"], **extra)
        elif op == "reject":
            self.add(cmd["id"], [0], 1, dict(cmd["params"]), abort_immediately=True)
            return [{"event": "rejected", "id": cmd["id"]}]
        elif op == "local":
            self.add(cmd["id"], cmd["tokens"], cmd.get("max_tokens", 2), None)
        elif op == "abort":
            # A client's abort: vLLM's engine core sends no output for it (the client knows).
            aborted = self.scheduler.finish_requests(cmd["id"], RequestStatus.FINISHED_ABORTED)
            # Already finished (its own "finished" or "prefilled" went out): say so, once more.
            return [{"event": "finished", "id": cmd["id"], "reason": "abort" if aborted else "already finished"}]
        elif op == "stats":
            return [self.stats()]
        elif op == "quit":
            for w in self.workers:
                w.shutdown()
            self.scheduler.shutdown()
            return [{"event": "bye"}]
        return []


def main() -> None:
    cfg = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO if os.environ.get("KVTRANSPORT_TEST_VERBOSE") else logging.WARNING)
    engine = Engine(cfg)
    emit({"event": "ready", "addresses": [w.worker.address for w in engine.workers]})
    buffer = b""
    fd = sys.stdin.fileno()
    while True:
        wait = 0.002 if engine.busy() else 0.05
        ready, _, _ = select.select([fd], [], [], wait)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if not line.strip():
                    continue
                for event in engine.handle(json.loads(line)):
                    emit(event)
                    if event["event"] == "bye":
                        return
        if engine.busy():
            for event in engine.step():
                emit(event)
        else:
            time.sleep(0.001)


def emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
