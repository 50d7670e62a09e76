"""vLLM's paged KV caches (``register_kv_caches``: one view per attention layer) as the regions
and layout kvtransport registers and compares at handshake.

vLLM 0.33 allocates every layer's cache in one backing buffer and hands the connector a 4-D view
per layer, ``[B, H, N, C]``: blocks, KV heads, tokens of a block, and each head's content (K and
V of the token side by side, or MLA's latent). Where the bytes sit is the resolved
``KVCacheLayout``: layer-compact layouts (``LBNHC``, ``LBHNC``) keep each layer's blocks in
one contiguous range, so a layer is a region and a block of it a page; block-outermost ones
(``BLNHC``...) keep all layers of a block together, so the whole buffer is one region and a
block of every layer one page. Within a block, tokens come first (``NHC``, token-major) or heads
(``HNC``); unequal TP cuts heads out of token-major blocks only. The connector asks vLLM for
``LBNHC`` (``get_required_kvcache_layout``); vLLM may resolve another, which is described as
it is or refused with the reason.

A vLLM block is a kvtransport page (several kernel blocks of a view, when the attention kernel
uses smaller ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtransport.spi.errors import MemoryLayoutError
from kvtransport.spi.memory import HOST, KVLayout, MemoryKind, Region, RegionSet

__all__ = ["VllmKV", "describe_kv_caches"]


@dataclass(frozen=True)
class VllmKV:
    """What one worker registers: its regions, the layout it shows peers, the number of blocks."""

    regions: RegionSet
    layout: KVLayout
    num_blocks: int


def _memory(tensor: Any) -> MemoryKind:
    device = tensor.device
    if device.type == "cpu":
        return HOST
    if device.type == "cuda":
        return MemoryKind(int(device.index or 0))
    raise MemoryLayoutError(f"KV on device {device}: kvtransport serves host and CUDA memory")


def _token_order(name: str, shape: tuple[int, ...], strides: tuple[int, ...]) -> str:
    """``NHD`` (a block's tokens, each with its heads) or ``HND`` (its heads, each with its
    tokens) when a block's ``[H, N, C]`` is dense, else :class:`MemoryLayoutError`."""
    _, heads, tokens, content = shape
    _, s_head, s_token, s_content = strides
    if s_content == 1 and s_head == content and s_token == heads * content:
        return "NHD"
    if s_content == 1 and s_token == content and s_head == tokens * content:
        return "HND"
    if heads == 1 and s_content == 1 and s_token == content:
        return "NHD"  # one head (MLA's latent): both orders are the same bytes
    raise MemoryLayoutError(
        f"layer {name}: a block's heads, tokens and content are not one dense range (shape {shape}, strides "
        f"{strides}); kvtransport moves whole blocks"
    )


def describe_kv_caches(
    layers: Sequence[tuple[str, Any]],
    *,
    block_size: int,
    use_mla: bool,
    tp_rank: int,
    tp_size: int,
    total_kv_heads: int,
) -> VllmKV:
    """The regions and layout of ``layers`` (``(name, view)`` in layer order, vLLM's 4-D
    ``[B, H, N, C]`` views), or :class:`MemoryLayoutError` naming what kvtransport cannot
    register."""
    if not layers:
        raise MemoryLayoutError("register_kv_caches() got no KV cache tensors")
    first = layers[0][1]
    kind = _memory(first)
    dtype = str(first.dtype).removeprefix("torch.")
    shape = tuple(int(n) for n in first.shape)
    strides = tuple(int(n) for n in first.stride())
    if len(shape) != 4:
        raise MemoryLayoutError(
            f"KV view of shape {shape}; kvtransport reads vLLM 0.33's per-layer [blocks, heads, tokens, content] views"
        )
    for name, view in layers:
        if tuple(int(n) for n in view.shape) != shape or tuple(int(n) for n in view.stride()) != strides:
            raise MemoryLayoutError(
                f"layer {name}: KV view {tuple(view.shape)} strides {tuple(view.stride())}, layer {layers[0][0]}: "
                f"{shape} {strides}; kvtransport needs every layer's KV alike (one KV cache group)"
            )
        if str(view.dtype).removeprefix("torch.") != dtype:
            raise MemoryLayoutError(f"layer {name}: KV of {view.dtype}, layer {layers[0][0]}: {first.dtype}")
    kernel_blocks, heads, tokens, content = shape
    if block_size % tokens:
        raise MemoryLayoutError(f"blocks of {block_size} tokens are not whole kernel blocks of {tokens}")
    per_block = block_size // tokens
    if kernel_blocks % per_block:
        raise MemoryLayoutError(f"{kernel_blocks} kernel blocks do not make whole blocks of {per_block}")
    num_blocks = kernel_blocks // per_block
    token_order = _token_order(layers[0][0], shape, strides)
    element = int(first.element_size())
    page = heads * tokens * content * element * per_block
    stride = strides[0] * element  # bytes from one kernel block to the next
    ptrs = [int(view.data_ptr()) for _, view in layers]
    if stride * per_block == page:
        # Layer-compact: each layer's blocks are one range of its own.
        kv = tuple(
            Region(ptr, num_blocks * page, kind, page, name) for ptr, (name, _) in zip(ptrs, layers, strict=True)
        )
        packing = "layer"
    elif per_block == 1 and all(p == ptrs[0] + i * page for i, p in enumerate(ptrs)) and stride == page * len(layers):
        # Block-outermost: block b of every layer is one range; the buffer is one region.
        kv = (Region(ptrs[0], num_blocks * stride, kind, stride, "all-layers"),)
        packing = "block"
    else:
        raise MemoryLayoutError(
            f"KV blocks {stride} bytes apart, pages of {page} bytes, layers at {[p - ptrs[0] for p in ptrs[:4]]}...: "
            "neither a range per layer nor a range per block (set VLLM_KV_CACHE_LAYOUT=LBNHC)"
        )
    # What unequal TP needs to know: a page is ``rows`` rows of ``heads`` heads of ``head``
    # elements each, and a rank holds a slice of every row's heads. Token-major blocks have a row
    # per token (a head's K and V side by side), head-major ones a row per kernel block (a head's
    # tokens in a row); a block of every layer repeats that per layer.
    head = content if token_order == "NHD" else tokens * content
    rows = page // (heads * head * element) * (len(layers) if packing == "block" else 1)
    regions = RegionSet(kv=kv)
    layout = KVLayout(
        page_size=rows,
        dtype=dtype,
        num_layers=len(layers),
        kv_item_lens=regions.kv_item_lens,
        memory=kind,
        kv_split="mla" if use_mla else "kv",
        num_kv_heads=heads,
        head_dim=head,
        tp_rank=tp_rank,
        tp_size=tp_size,
        total_kv_heads=0 if use_mla else total_kv_heads,
        extra={"engine": "vllm", "block_size": block_size, "token_layout": token_order, "packing": packing},
    )
    return VllmKV(regions, layout, num_blocks)
