"""vLLM's paged KV caches (``register_kv_caches``: one tensor per attention layer) as the
regions and layout kvtransport registers and compares at handshake.

A vLLM block is a kvtransport page. Per layer, vLLM holds either K and V in one tensor with
the K/V axis first (``(2, num_blocks, ...)``, the FlashAttention and CPU layouts) or one latent
tensor (MLA, ``(num_blocks, block_size, head_size)``). The regions are every layer's K, then
every layer's V (SGLang's order, so one handshake can pair the two engines), or every layer's
latent. A block's tokens are token-major (``NHD``: ``block_size, heads, head_size``) or
head-major (``HND``); the layout says which, and unequal TP, which cuts heads out of a page,
is refused for ``HND``.
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


def _region(name: str, tensor: Any, kind: MemoryKind) -> Region:
    if not tensor.is_contiguous():
        raise MemoryLayoutError(
            f"{name}: the KV tensor is not contiguous (strides {tuple(tensor.stride())}); kvtransport registers "
            "one contiguous range per layer (a cross-layer KV buffer is not supported)"
        )
    length = int(tensor.numel()) * int(tensor.element_size())
    return Region(int(tensor.data_ptr()), length, kind, length // int(tensor.shape[0]), name)


def _memory(tensor: Any) -> MemoryKind:
    device = tensor.device
    if device.type == "cpu":
        return HOST
    if device.type == "cuda":
        return MemoryKind(int(device.index or 0))
    raise MemoryLayoutError(f"KV on device {device}: kvtransport serves host and CUDA memory")


def describe_kv_caches(
    layers: Sequence[tuple[str, Any]],
    *,
    block_size: int,
    use_mla: bool,
    tp_rank: int,
    tp_size: int,
    total_kv_heads: int,
) -> VllmKV:
    """The regions and layout of ``layers`` (``(name, tensor)`` in layer order), or
    :class:`MemoryLayoutError` naming the layer whose tensor kvtransport cannot register."""
    if not layers:
        raise MemoryLayoutError("register_kv_caches() got no KV cache tensors")
    first = layers[0][1]
    kind = _memory(first)
    dtype = str(first.dtype).removeprefix("torch.")
    shape = tuple(int(n) for n in first.shape)
    for name, tensor in layers:
        if tuple(int(n) for n in tensor.shape) != shape or str(tensor.dtype).removeprefix("torch.") != dtype:
            raise MemoryLayoutError(
                f"layer {name}: KV tensor {tuple(tensor.shape)} {tensor.dtype}, layer {layers[0][0]}: {shape} "
                f"{first.dtype}; kvtransport needs every layer's KV alike (one KV cache group)"
            )
    if use_mla:
        if len(shape) != 3 or shape[1] != block_size:
            raise MemoryLayoutError(
                f"MLA KV tensor of shape {shape}; expected (num_blocks, block_size={block_size}, head_size)"
            )
        kv = tuple(_region(f"{name}:latent", t, kind) for name, t in layers)
        heads, head_dim, token_layout, split = 1, shape[2], "NHD", "mla"
        num_blocks = shape[0]
    else:
        if len(shape) != 5 or shape[0] != 2:
            raise MemoryLayoutError(
                f"KV tensor of shape {shape}; kvtransport reads vLLM's (2, num_blocks, block_size, heads, head_size) "
                "or (2, num_blocks, heads, block_size, head_size) layouts (K and V first)"
            )
        if shape[2] == block_size:
            token_layout, heads = "NHD", shape[3]
        elif shape[3] == block_size:
            token_layout, heads = "HND", shape[2]
        else:
            raise MemoryLayoutError(f"KV tensor of shape {shape} has no axis of the block size {block_size}")
        head_dim, split, num_blocks = shape[4], "kv", shape[1]
        keys = tuple(_region(f"{name}:k", t[0], kind) for name, t in layers)
        values = tuple(_region(f"{name}:v", t[1], kind) for name, t in layers)
        kv = keys + values
    regions = RegionSet(kv=kv)
    layout = KVLayout(
        page_size=block_size,
        dtype=dtype,
        num_layers=len(layers),
        kv_item_lens=regions.kv_item_lens,
        memory=kind,
        kv_split=split,
        num_kv_heads=heads,
        head_dim=head_dim,
        tp_rank=tp_rank,
        tp_size=tp_size,
        total_kv_heads=total_kv_heads if split == "kv" else 0,
        extra={"engine": "vllm", "token_layout": token_layout},
    )
    return VllmKV(regions, layout, num_blocks)
