"""Whether a prefill of one serving engine can feed a decode of another, decided at handshake:
the one pairing kvtransport serves (an SGLang prefill rank writing a vLLM decode rank's blocks),
and why every other is refused.

The refused direction, a vLLM prefill feeding an SGLang decode, is refused for what SGLang's
decode needs beyond the pages: it takes the request's first output token, its logprobs and top
logprobs, the cached-token count and (with speculative decoding) hidden states from the aux
slots its prefill writes (``MetadataBuffers``), and finds prefill through SGLang's bootstrap
registry. vLLM's prefill hands a connector none of that (``request_finished`` sees the request,
not its logprobs) and registers nowhere SGLang looks. The other way round nothing is missing:
vLLM's decode recomputes the last prompt token itself, so SGLang's aux slots stay at home.
"""

from __future__ import annotations

from kvtransport.spi.errors import MemoryLayoutError
from kvtransport.spi.page_geometry import DTYPE_BYTES, engine_of, geometry_of
from kvtransport.spi.tp_map import ShardedLayout, check_shape, held_heads, total_heads_of

__all__ = ["cross_engine_problems"]

#: (prefill engine, decode engine) pairs kvtransport maps.
SERVED = frozenset({("sglang", "vllm")})


def _role(layout: ShardedLayout) -> str:
    """'prefill', 'decode', or 'both' (vLLM's ``kv_both`` instances)."""
    return str(layout.extra.get("role") or ("both" if engine_of(layout) == "vllm" else "instance of no stated role"))


def _direction_problem(a: ShardedLayout, b: ShardedLayout, mine: str, theirs: str) -> str:
    ends = {engine_of(a): (a, mine), engine_of(b): (b, theirs)}
    if set(ends) != {"sglang", "vllm"}:
        return (
            f"engine: {engine_of(a)} {mine}, {engine_of(b)} {theirs}: kvtransport maps an SGLang prefill onto a vLLM "
            "decode only (docs/vllm.md, 'Across engines')"
        )
    sglang, where = ends["sglang"]
    if _role(sglang) != "prefill":
        return (
            f"engine: an SGLang {_role(sglang)} {where} paired with a vLLM instance: a vLLM prefill cannot feed an "
            "SGLang decode, which reads the first output token, its logprobs and the cached-token count from aux slots "
            "its prefill writes, and vLLM's prefill hands a connector none of them; kvtransport feeds a vLLM decode "
            "from an SGLang prefill only (docs/vllm.md, 'Across engines')"
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
    if a.state_types or b.state_types:
        problems.append(
            f"state buffers ({', '.join(sorted(set(a.state_types) | set(b.state_types)))}): across engines kvtransport "
            "moves models whose KV is attention pages only"
        )
    for name in ("kv_split", "dtype", "num_layers"):
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            problems.append(f"{name}: {x!r} {mine}, {y!r} {theirs}")
    if a.dtype == b.dtype and a.dtype not in DTYPE_BYTES:
        problems.append(f"dtype: {a.dtype!r} on both sides is not one kvtransport can check across engines")
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
    if ga.tokens != gb.tokens:
        problems.append(
            f"page_size: pages of {ga.tokens} tokens {mine}, {gb.tokens} {theirs}: run both with the same page size "
            "(SGLang --page-size, vLLM --block-size)"
        )
    if ga.unit != gb.unit:
        problems.append(f"head size: {ga.unit} bytes a head {mine}, {gb.unit} {theirs}")
    return problems
