"""Layer-wise sends for SGLang's prefill (``KVTRANSPORT_LAYERWISE=1``): a chunk's KV leaves
layer by layer while SGLang's forward computes it, instead of after the forward, when SGLang's
``send_kv_chunk`` hands the chunk over.

SGLang computes a chunk's pages only after its forward (prefill.py ``_send_kv_chunk``), so this
module predicts them before, the way that function will compute them, and checks the
prediction when the chunk is handed over. Three hooks, installed through SGLang's
``HookRegistry`` by :mod:`kvtransport.integrations.sglang_plugin` when the flag is set:

- around ``Scheduler.run_batch`` (a prefill forward): :func:`around_run_batch` reads, for each
  request of the batch with a kvtransport sender, the token locations of the chunk it computes
  (``req_to_token`` after ``prepare_for_extend`` filled it) and opens a :class:`PrefillForward`
  for the forward's duration;
- around the KV pools' writes (``MHATokenToKVPool.set_kv_buffer``,
  ``MLATokenToKVPool.set_kv_buffer`` and ``set_mla_kv_buffer``, which every attention backend
  calls once per layer, and which SGLang's SWA and hybrid pools delegate to): at the forward's
  first write each request's stream is opened (after ``run_batch`` sent a cached prefix early,
  so the stream starts where SGLang's next send will), and a layer is marked ready once writes
  to it covered every token of the batch (two calls per layer under two-batch overlap). On a
  GPU the mark waits for a CUDA event recorded after the write;
- when ``run_batch`` returns, every layer not yet marked is marked (after an event on the
  forward's stream on a GPU): a pool whose writes are not hooked (FP4, MXFP8), or a forward
  replayed from a CUDA graph, still sends as soon as the forward ends.

The sender (:meth:`KVTransportKVSender.send`) then checks that the pages SGLang hands over are
the ones the streams reserved, in order; a difference fails the request with both lists (it
would mean SGLang computed its pages another way), never a silent resend.

Where a request cannot go layer-wise it goes per chunk, as without the flag: shorter than
``KVTRANSPORT_LAYERWISE_MIN_TOKENS``, chunks of it still queued or waiting on an event,
SGLang's staging buffer (``enable_staging``: sends must end on its grid). The last two are said
once at INFO.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtransport.runtime.layer_groups import LayerwisePolicy, region_layers
from kvtransport.runtime.layerwise import LayerStream, StreamGroup
from kvtransport.spi.env import env_flag
from kvtransport.spi.errors import KVTransportError

log = logging.getLogger(__name__)

#: Turns layer-wise sends on for SGLang's prefill (read by the plugin and the manager).
ENV_LAYERWISE = "KVTRANSPORT_LAYERWISE"

_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_POOLS = "sglang.srt.mem_cache.memory_pool"
#: (hooked method, position of ``layer_id_override`` among the arguments after ``loc_info``).
POOL_WRITES: tuple[tuple[str, int], ...] = (
    (f"{_POOLS}.MHATokenToKVPool.set_kv_buffer", 4),  # cache_k, cache_v, k_scale, v_scale, override
    (f"{_POOLS}.MLATokenToKVPool.set_kv_buffer", 2),  # cache_k, cache_v, override
    (f"{_POOLS}.MLATokenToKVPool.set_mla_kv_buffer", 2),  # cache_k_nope, cache_k_rope, override
)
RUN_BATCH = f"{_SCHEDULER}.run_batch"


def enabled(env: Any = None) -> bool:
    return env_flag(ENV_LAYERWISE, False, env)


@dataclass
class OpenStream:
    """One chunk of one request sent layer by layer: the pages it reserved (in the order
    SGLang's send will name them), the token its chunk ends at, and what of it was marked and
    handed over so far."""

    stream: LayerStream | StreamGroup
    pages: np.ndarray[Any, Any]
    end_token: int
    marked: set[int] = field(default_factory=set)
    confirmed: int = 0

    @property
    def num_layers(self) -> int:
        return self.stream.num_layers

    def mark(self, layers: Iterable[int], after: Any = None) -> None:
        todo = [x for x in layers if x not in self.marked]
        if todo:
            self.stream.layers_ready(todo, after)
            self.marked.update(todo)

    @property
    def settled(self) -> bool:
        """Every layer posted, and no group still reading the chunk's pages."""
        return self.stream.settled

    def mark_rest(self, after: Any = None) -> None:
        self.mark(range(self.num_layers), after)

    @property
    def posted_groups(self) -> int:
        """Layer groups handed to the driver so far (to the first decode rank, under a fan-out)."""
        s = self.stream
        return len(s.streams[0].groups if isinstance(s, StreamGroup) else s.groups)


class _Candidate:
    """A request of the forward that may go layer-wise: its sender and the token locations of
    the chunk being computed, from the token its sends stood at before ``run_batch``. On a GPU
    the locations are still being copied to host memory (``copied``: an event; the scheduler
    never waits for it: a chunk whose copy is not done when the forward starts writing goes
    whole)."""

    __slots__ = ("copied", "end", "locs", "sender", "start")

    def __init__(self, sender: Any, start: int, end: int, locs: Any, copied: Any = None) -> None:
        self.sender, self.start, self.end, self.locs, self.copied = sender, start, end, locs, copied

    def host_locs(self) -> np.ndarray[Any, Any] | None:
        if self.copied is not None and not self.copied.query():
            return None
        return np.asarray(self.locs.numpy() if hasattr(self.locs, "numpy") else self.locs, dtype=np.int64)


class PrefillForward:
    """One prefill forward (one ``run_batch``): its requests' streams, and how many tokens of
    each layer were written."""

    def __init__(
        self, mgr: Any, scheduler: Any, tokens: int, candidates: list[tuple[Any, _Candidate]], per_layer: bool
    ) -> None:
        self.mgr = mgr
        self.scheduler = scheduler
        self.tokens = tokens
        self._candidates = candidates
        #: False where a write to a layer does not mean its pages are in place (a HiCache
        #: load-back still copying prefix pages in): every layer is marked when the forward ends.
        self.per_layer = per_layer
        self.streams: list[tuple[Any, OpenStream]] | None = None
        self._written: dict[int, int] = {}
        self._page_size = int(scheduler.token_to_kv_pool_allocator.page_size)

    def _open(self) -> list[tuple[Any, OpenStream]]:
        opened = []
        for req, cand in self._candidates:
            sender = cand.sender
            start = sender.next_send_token(int(req.start_send_idx))
            offset = start - cand.start
            if offset < 0 or start >= cand.end:
                continue  # its prefix went early and covered the chunk, or sends moved back
            locs = cand.host_locs()
            if locs is None:
                log.debug("room %s: the chunk's locations were not copied in time; it goes whole", sender.room)
                continue
            pages = locs[offset :: self._page_size] // self._page_size  # SGLang's kv_to_page_indices
            if pages.size == 0:
                continue
            stream = sender.open_layer_stream(pages, cand.end, self.mgr.layerwise)
            if stream is not None:
                opened.append((sender, stream))
        self._candidates = []
        return opened

    def kv_written(self, pool: Any, layer: Any, override: Any, loc_info: Any) -> None:
        """A pool wrote ``loc_info``'s tokens of one layer (the hooks below)."""
        if self.streams is None:
            self.streams = self._open()
        if not self.streams or not self.per_layer:
            return
        layer_id = override if override is not None else getattr(layer, "layer_id", None)
        if layer_id is None:
            return
        local = int(layer_id) - int(getattr(pool, "start_layer", 0) or 0)
        layers = self.mgr.layers_written(pool, local, _buffers)
        if not layers:
            return  # not a buffer this rank sends (an SWA layer: its window goes as state)
        tokens = _token_count(loc_info)
        ready = []
        for x in layers:
            n = self._written.get(x, 0) + tokens
            self._written[x] = n
            if n >= self.tokens:
                ready.append(x)
        if ready:
            after = self._after(pool)  # one event for every stream
            self._mark(lambda s: s.mark(ready, after))

    def end(self) -> None:
        """The forward was launched: what was not marked is, once it has run."""
        if self.streams is None:
            self.streams = self._open()
        if self.streams:
            if not self._written:
                _say_once(
                    "unseen",
                    "layer-wise sends: a prefill forward wrote no KV through the hooked pool writes (a pool that "
                    "overrides set_kv_buffer, or a CUDA graph replay); its chunks leave when the forward ends",
                )
            after = self._forward_done()
            self._mark(lambda s: s.mark_rest(after))

    def _mark(self, how: Callable[[OpenStream], None]) -> None:
        for sender, stream in self.streams or ():
            try:
                how(stream)
            except Exception as exc:  # noqa: BLE001 - SGLang's forward must go on; the room fails
                sender.layerwise_failed(exc)

    def fail_all(self) -> None:
        for sender, _ in self.streams or ():
            sender.layerwise_failed(KVTransportError("the layer-wise part of the prefill forward failed"))

    def _after(self, pool: Any) -> Any:
        if not str(getattr(pool, "device", "cpu")).startswith("cuda"):
            return None  # on the CPU the write is done when set_kv_buffer returns
        return _cuda_event(None)  # on the stream the write was enqueued on

    def _forward_done(self) -> Any:
        device = str(getattr(self.scheduler.token_to_kv_pool_allocator, "device", "cpu"))
        if not device.startswith("cuda"):
            return None
        return _cuda_event(getattr(self.scheduler, "forward_stream", None) if self.scheduler.enable_overlap else None)


def _cuda_event(stream: Any) -> Any:
    """A CUDA event recorded on ``stream`` (None: the current one): done once the work enqueued
    there so far has run."""
    import torch

    cuda: Any = torch.cuda
    event = cuda.Event()
    if stream is None:
        event.record()
    else:
        event.record(stream)
    return event


def _buffers(pool: Any, local: int) -> list[int]:
    """The data pointers of the buffers a write to the pool's layer ``local`` fills."""
    ptrs = []
    for name in ("k_buffer", "v_buffer", "kv_buffer"):
        bufs = getattr(pool, name, None)
        if isinstance(bufs, Sequence) and 0 <= local < len(bufs):
            ptrs.append(int(bufs[local].data_ptr()))
    return ptrs


def _token_count(loc_info: Any) -> int:
    loc = getattr(loc_info, "loc", loc_info)
    numel = getattr(loc, "numel", None)
    return int(numel()) if callable(numel) else len(loc)


class _Current(threading.local):
    forward: PrefillForward | None = None


_current = _Current()
_said: set[str] = set()


def _say_once(key: str, message: str, *args: Any) -> None:
    if key not in _said:
        _said.add(key)
        log.info(message, *args)


def layer_map(kv_data_ptrs: Sequence[int], layout: Any, regions: Any) -> dict[int, int]:
    """Each KV buffer's data pointer -> the layer the streams number it by."""
    return {int(p): x for p, x in zip(kv_data_ptrs, region_layers(layout, regions), strict=True)}


def _candidates(mgr: Any, scheduler: Any, batch: Any) -> list[tuple[Any, _Candidate]]:
    policy: LayerwisePolicy = mgr.layerwise
    page_size = int(scheduler.token_to_kv_pool_allocator.page_size)
    out = []
    for req in batch.reqs:
        sender: Any = getattr(req, "disagg_kv_sender", None)
        if getattr(sender, "kv_mgr", None) is not mgr or req.pending_bootstrap or req.extend_end is None:
            continue
        n_input = len(req.origin_input_ids)
        end = min(int(req.extend_end), n_input)
        if end < n_input:
            end -= end % page_size  # a middle chunk's partial page goes with the next send
        start = sender.next_send_token(int(req.start_send_idx))
        if end - start < max(1, policy.min_tokens):
            continue  # short: one send after the forward costs less than a stream
        raw = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:end]
        locs = scheduler.token_to_kv_pool_allocator.translate_kv_indices_for_transfer(raw)
        if locs.device.type == "cpu":
            out.append((req, _Candidate(sender, start, end, locs)))
            continue
        # The schedule stream may wait on the forward in flight: copy without blocking (as
        # SGLang's own _send_kv_chunk does for senders that take host indices).
        import torch

        host = torch.empty(locs.shape, dtype=locs.dtype, device="cpu", pin_memory=True)
        host.copy_(locs, non_blocking=True)
        out.append((req, _Candidate(sender, start, end, host, _cuda_event(None))))
    return out


def _forward_of(scheduler: Any, batch: Any) -> PrefillForward | None:
    """The layer-wise bookkeeping of this ``run_batch``, or None where it does not apply."""
    queue = getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
    mgr = getattr(queue, "kv_manager", None)
    if getattr(mgr, "layerwise", None) is None:
        return None  # not a prefill rank of the kvtransport backend with the flag on
    mode = getattr(batch, "forward_mode", None)
    if mode is None or not mode.is_extend() or not batch.reqs:
        return None
    if getattr(scheduler, "enable_staging", False):
        _say_once(
            "staging",
            "layer-wise sends off: SGLang's staging buffer sends chunks on its own grid; chunks go whole",
        )
        return None
    tree = getattr(scheduler, "tree_cache", None)
    if tree is not None and not getattr(tree, "disable", False):
        # Between the forward and the send, the radix cache's checkpoint may give the chunk's
        # tokens the pages another request computed them into and free the request's own,
        # which a stream may still be reading when the next forward writes them again.
        _say_once(
            "radix",
            "layer-wise sends off: the prefill radix cache may move a chunk's tokens to other pages after its "
            "forward; run the prefill instance with --disable-radix-cache to send layer by layer",
        )
        return None
    candidates = _candidates(mgr, scheduler, batch)
    if not candidates:
        return None
    tokens = int(getattr(batch, "extend_num_tokens", 0) or 0)
    # A HiCache load-back of this batch copies prefix pages in layer by layer on its own stream,
    # and the forward waits for a layer's copy only after writing it (get_key_buffer): a write
    # does not say the layer's pages are in place, the end of the forward does.
    per_layer = int(getattr(batch, "hicache_consumer_index", -1) if batch is not None else -1) < 0
    return PrefillForward(mgr, scheduler, tokens, candidates, per_layer)


def around_run_batch(original: Callable[..., Any], scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """``Scheduler.run_batch`` with a prefill forward's layers marked as it writes them. Nothing
    here may stop SGLang's forward: a failure of the layer-wise part fails the rooms it touched
    (or sends the batch's chunks whole), and is logged."""
    try:
        forward = _forward_of(scheduler, batch)
    except Exception:
        log.exception("layer-wise sends: preparing a prefill forward failed; its chunks go whole")
        forward = None
    if forward is None:
        return original(scheduler, batch, *args, **kwargs)
    _current.forward = forward
    try:
        return original(scheduler, batch, *args, **kwargs)
    finally:
        _current.forward = None
        try:
            forward.end()
        except Exception:
            log.exception("layer-wise sends: finishing a prefill forward failed")
            forward.fail_all()


def pool_write_hook(override_at: int) -> Callable[..., Any]:
    """An AROUND hook for a pool's KV write whose ``layer_id_override`` is the
    ``override_at``-th argument after ``loc_info``."""

    def around(original: Callable[..., Any], pool: Any, layer: Any, loc_info: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(pool, layer, loc_info, *args, **kwargs)
        forward = _current.forward
        if forward is not None:
            try:
                override = kwargs.get("layer_id_override", args[override_at] if len(args) > override_at else None)
                forward.kv_written(pool, layer, override, loc_info)
            except Exception:
                log.exception("layer-wise sends: marking a layer failed")
                forward.per_layer = False
                forward.fail_all()
        return out

    return around


def register_hooks(registry: Any, hook_type: Any) -> None:
    """Install the hooks (the plugin calls this when ``KVTRANSPORT_LAYERWISE`` is set)."""
    registry.register(RUN_BATCH, around_run_batch, hook_type.AROUND)
    for target, override_at in POOL_WRITES:
        registry.register(target, pool_write_hook(override_at), hook_type.AROUND)
