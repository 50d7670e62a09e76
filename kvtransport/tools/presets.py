"""Model presets for the bench: the KV (and state) layout one serving rank of a real model
registers, so a sweep measures the shapes serving engines actually send.

Figures are per rank, from the models' published configurations: a request's bytes are its
pages in every KV region plus, for a hybrid model, its slot in every state buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtransport.spi.errors import ConfigError


@dataclass(frozen=True)
class ModelPreset:
    key: str
    name: str
    #: Attention layers holding KV pages.
    layers: int
    #: Regions per layer: 2 (K and V) or 1 (MLA's latent, one row per token).
    kv_per_layer: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    #: State groups, each ``(bytes of one request's item, buffers)``; one slot per request.
    state: tuple[tuple[int, int], ...] = ()
    note: str = ""

    def page_bytes(self, page_tokens: int) -> int:
        """Bytes of one page in one KV region."""
        return page_tokens * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def regions(self) -> int:
        return self.layers * self.kv_per_layer

    def kv_bytes(self, page_tokens: int, pages: int) -> int:
        """Bytes of ``pages`` pages in every KV region."""
        return pages * self.page_bytes(page_tokens) * self.regions

    def request_bytes(self, page_tokens: int, pages: int) -> int:
        """One request's bytes: its pages in every KV region and its slot of every state buffer."""
        return self.kv_bytes(page_tokens, pages) + self.state_bytes

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state, all groups."""
        return sum(item * buffers for item, buffers in self.state)


# Qwen3-Next-80B-A3B: 48 layers, every 4th full attention (2 KV heads x 256); the other 36 are
# Gated DeltaNet with 32 value heads x 128 x 128 of fp32 recurrent state and a causal conv over
# (2 x 16 x 128 + 32 x 128) channels x (kernel 4 - 1) bf16 taps. Per TP-2 rank: 1 of the 2 KV
# heads, 16 value heads, half the conv channels.
_QWEN3_NEXT_SSM = 16 * 128 * 128 * 4
_QWEN3_NEXT_CONV = (2 * 16 * 128 + 32 * 128) // 2 * 3 * 2

PRESETS: dict[str, ModelPreset] = {
    p.key: p
    for p in (
        ModelPreset("llama-3-8b", "Llama-3-8B", 32, 2, 8, 128, note="GQA, 8 KV heads x 128, bf16 (TP 1)"),
        ModelPreset(
            "llama-3-70b-tp8", "Llama-3-70B/TP8", 80, 2, 1, 128, note="one TP-8 rank: 1 of 8 KV heads x 128, bf16"
        ),
        ModelPreset(
            "deepseek-v3-mla",
            "DeepSeek-V3",
            61,
            1,
            1,
            576,
            note="MLA: one latent row of 512 + 64 rope dims a token, bf16, replicated on every rank",
        ),
        ModelPreset(
            "qwen3-next-tp2",
            "Qwen3-Next/TP2",
            12,
            2,
            1,
            256,
            state=((_QWEN3_NEXT_CONV, 36), (_QWEN3_NEXT_SSM, 36)),
            note="hybrid, one TP-2 rank: 12 attention layers (1 KV head x 256) + 36 linear-attention layers, "
            "each with 24 KiB of conv and 1 MiB of fp32 recurrent state per request (36.8 MiB a request)",
        ),
    )
}


def preset(key: str) -> ModelPreset:
    try:
        return PRESETS[key.lower()]
    except KeyError:
        raise ConfigError(f"unknown model preset {key!r}; known: {', '.join(PRESETS)}") from None
