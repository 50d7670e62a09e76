"""The KV a stand-in model computes, shared by the stand-in models of both serving engines'
harnesses (tests/sglang_scheduler.py, tests/vllm_engine.py): one model has one KV whichever engine
runs it, so a vLLM decode can check what an SGLang prefill's forward wrote. Each element is a
pure function of (the prompt's tokens up to its position, layer, position, global KV head, dim,
K/V/latent); where each engine keeps it is that engine's own code."""

from __future__ import annotations

from collections.abc import Sequence

import torch

INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Bit patterns below these are finite, non-negative numbers in every float format of that width.
FINITE_BELOW = {1: 0x70, 2: 0x7800, 4: 0x7F000000, 8: 0x7FE0000000000000}


def token_keys(ids: Sequence[int]) -> torch.Tensor:
    """[tokens] int64: each position's key, a running hash of the prompt's token ids up to and
    including it. What a causal model computes at a position depends on every token before it:
    two prompts share the keys (and so the KV and state) of a position exactly when they share
    the tokens up to it, which is what a radix cache's prefix match relies on."""
    keys = []
    h = 0
    for t in ids:
        h = (h * 1_009 + int(t) + 1) % 2_147_483_629  # a prime below 2**31
        keys.append(h)
    return torch.tensor(keys, dtype=torch.int64)


def kv_content(
    keys: torch.Tensor,
    layer: int,
    positions: torch.Tensor,
    heads: torch.Tensor,
    dim: int,
    kind: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[tokens, heads, dim] of ``dtype``: each element's bit pattern a function of the token's key
    (``token_keys`` of the prompt, at ``positions``), layer, token position, global KV head, dim
    and K(0)/V(1)/latent(2); all finite numbers."""
    key = keys.to(torch.int64)[:, None, None]
    pos = positions.to(torch.int64)[:, None, None]
    head = heads.to(torch.int64)[None, :, None]
    d = torch.arange(dim, dtype=torch.int64)[None, None, :]
    value = key * 1_000_003 + layer * 7_919 + pos * 104_729 + head * 131 + d * 17 + kind * 65_537 + 1
    size = torch.empty((), dtype=dtype).element_size()
    return (value % FINITE_BELOW[size]).to(INT_OF[size]).view(dtype)
