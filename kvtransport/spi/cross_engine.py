"""Whether a prefill of one serving engine can feed a decode of another, decided at handshake:
the two pairings kvtransport serves (an SGLang prefill rank writing a vLLM decode rank's blocks,
and a vLLM prefill rank writing an SGLang decode rank's pages and the first token's handoff into
its aux slot), and why every other is refused.

Each direction needs something of the other engine beyond the pages. vLLM's decode recomputes
the last prompt token itself, so an SGLang prefill keeps its aux slots at home. SGLang's decode
reads the first output token, the cached-token count and the room from the aux slot its prefill
writes (:mod:`kvtransport.spi.handoff`): a vLLM prefill writes those three; what it cannot
write (hidden states for speculative decoding) makes the pair refused here, and what a request
may ask for beyond them (logprobs) is refused by the proxy's helper for that request.
"""

from __future__ import annotations

from kvtransport.spi.errors import MemoryLayoutError
from kvtransport.spi.handoff import HANDOFF_SLOT_BYTES, handoff_problem
from kvtransport.spi.page_geometry import DTYPE_BYTES, engine_of, geometry_of, page_tokens
from kvtransport.spi.tp_map import ShardedLayout, check_shape, held_heads, total_heads_of

__all__ = ["SGLANG_DTYPES", "cross_engine_problems", "kv_dtype"]

#: (prefill engine, decode engine) pairs kvtransport maps.
SERVED = frozenset({("sglang", "vllm"), ("vllm", "sglang")})


#: SGLang's KV dtype names (``--kv-cache-dtype``, ``kv_cache_dtype_str``) as torch names.
SGLANG_DTYPES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def kv_dtype(layout: ShardedLayout) -> str:
    """The KV's element type by torch's name: what the layout resolved (``extra["kv_dtype"]``,
    SGLang's ``auto`` resolved to the model's dtype), else its ``dtype``, SGLang's names mapped."""
    name = str(layout.extra.get("kv_dtype") or layout.dtype)
    return SGLANG_DTYPES.get(name, name)


def _role(layout: ShardedLayout) -> str:
    """'prefill', 'decode', or 'both' (vLLM's ``kv_both`` instances)."""
    return str(layout.extra.get("role") or ("both" if engine_of(layout) == "vllm" else "instance of no stated role"))


def _direction_problem(a: ShardedLayout, b: ShardedLayout, mine: str, theirs: str) -> str:
    ends = {engine_of(a): (a, mine), engine_of(b): (b, theirs)}
    if set(ends) != {"sglang", "vllm"}:
        return (
            f"engine: {engine_of(a)} {mine}, {engine_of(b)} {theirs}: kvtransport maps pools of SGLang and vLLM "
            "only (docs/vllm.md, 'Across engines')"
        )
    (sglang, where), (vllm, there) = ends["sglang"], ends["vllm"]
    role = _role(sglang)
    if role == "prefill":
        if _role(vllm) == "prefill":
            return f"engine: an SGLang prefill {where} and a vLLM prefill (kv_producer) {there}: neither decodes"
        return ""  # vLLM decodes (a kv_both instance may too): its blocks take the pages
    if role != "decode":
        return (
            f"engine: an SGLang {role} {where} paired with a vLLM instance: only SGLang prefill and decode ranks pair"
        )
    if _role(vllm) == "decode":
        return f"engine: an SGLang decode {where} and a vLLM decode (kv_consumer) {there}: neither prefills"
    problem = handoff_problem(sglang)
    if problem:
        return f"engine: a vLLM prefill {there} cannot feed the SGLang decode {where}: {problem}"
    if tuple(vllm.aux_item_lens) != (HANDOFF_SLOT_BYTES,):
        return (
            f"engine: the vLLM instance {there} has no handoff slots of {HANDOFF_SLOT_BYTES} bytes (aux_item_lens "
            f"{list(vllm.aux_item_lens)[:4]}): it cannot hand SGLang's decode the first token (run the same "
            "kvtransport release on both)"
        )
    return ""


def cross_engine_problems(
    a: ShardedLayout, b: ShardedLayout, mine: str = "here", theirs: str = "at the peer"
) -> list[str]:
    """Why pages cannot move between layouts ``a`` and ``b`` of different engines (empty: the
    page geometries map onto each other, :func:`~kvtransport.spi.tp_map.pair_shape` regroups)."""
    direction = _direction_problem(a, b, mine, theirs)
    if direction:
        return [direction]
    problems = []
    # The cheap numbers first: a peer's layout comes over the network, and the geometry is
    # built only for pools that could map (page_geometry bounds it as well).
    for layout, where in ((a, mine), (b, theirs)):
        if not (0 < layout.tp_size <= 1 << 16 and 0 <= layout.tp_rank < layout.tp_size):
            problems.append(f"tp_rank {layout.tp_rank} of tp_size {layout.tp_size} {where}")
        if not (0 <= layout.total_kv_heads <= 1 << 16 and 0 <= layout.num_kv_heads <= 1 << 16):
            problems.append(f"num_kv_heads {layout.num_kv_heads}, total_kv_heads {layout.total_kv_heads} {where}")
        if a.kv_split == "mla" and layout.num_kv_heads > 1:
            problems.append(f"num_kv_heads {layout.num_kv_heads} {where}: MLA's latent is one head")
    tokens = (page_tokens(a), page_tokens(b))
    if tokens[0] != tokens[1]:
        problems.append(
            f"page_size: pages of {tokens[0]} tokens {mine}, {tokens[1]} {theirs}: run both with the same page size "
            "(SGLang --page-size, vLLM --block-size)"
        )
    if problems:
        return problems
    if a.state_types or b.state_types:
        problems.append(
            f"state buffers ({', '.join(sorted(set(a.state_types) | set(b.state_types)))}): across engines kvtransport "
            "moves models whose KV is attention pages only"
        )
    for name in ("kv_split", "num_layers"):
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            problems.append(f"{name}: {x!r} {mine}, {y!r} {theirs}")
    dtypes = (kv_dtype(a), kv_dtype(b))
    if dtypes[0] != dtypes[1]:
        problems.append(f"dtype: {dtypes[0]!r} {mine}, {dtypes[1]!r} {theirs}")
    elif dtypes[0] not in DTYPE_BYTES:
        problems.append(f"dtype: {dtypes[0]!r} on both sides is not one kvtransport can check across engines")
    if problems:
        return problems
    if a.tp_size % b.tp_size and b.tp_size % a.tp_size:
        return [f"tp_size: {a.tp_size} {mine}, {b.tp_size} {theirs}: one must divide the other"]
    if a.kv_split == "kv":
        if a.total_kv_heads and b.total_kv_heads and a.total_kv_heads != b.total_kv_heads:
            return [f"total_kv_heads: {a.total_kv_heads} {mine}, {b.total_kv_heads} {theirs}"]
        total = total_heads_of(a, b)
        try:
            check_shape(total, a.tp_size, mine)
            check_shape(total, b.tp_size, theirs)
        except MemoryLayoutError as exc:
            return [f"{exc} (the model's total KV heads must be stated by either side)"]
        for layout, where in ((a, mine), (b, theirs)):
            held = len(held_heads(total, layout.tp_size, layout.tp_rank))
            if layout.num_kv_heads != held:
                problems.append(
                    f"num_kv_heads {where}: {layout.num_kv_heads}, but TP rank {layout.tp_rank} of {layout.tp_size} "
                    f"holds {held} of {total}"
                )
    try:
        ga, gb = geometry_of(a), geometry_of(b)
    except MemoryLayoutError as exc:
        return [*problems, f"page geometry: {exc}"]
    if ga.unit != gb.unit:
        problems.append(f"head size: {ga.unit} bytes a head {mine}, {gb.unit} {theirs}")
    return problems
