"""Which prefill and decode ranks pair for one request, and the tag each decode rank announces
it under: shared by every serving-engine adapter (SGLang's, vLLM's), so that a prefill rank of
one engine and a decode rank of another agree on both without talking about it.

A decode rank receives from the prefill ranks :func:`~kvtransport.spi.tp_map.sources` names; a
prefill rank feeds those :func:`~kvtransport.spi.tp_map.targets` names. When decode runs the
wider TP a prefill rank hears from several decode ranks for one request, and a tag names one
announcer per endpoint: each decode rank but the first adds its rank (``request@rank``).
"""

from __future__ import annotations

from kvtransport.spi.memory import KVLayout
from kvtransport.spi.tp_map import sources, targets

__all__ = ["pairing_problem", "request_tag", "tp_pairing_problem"]


def request_tag(request: str, prefill_tp: int, decode_tp: int, decode_rank: int) -> str:
    """The transfer tag decode rank ``decode_rank`` announces ``request`` under: the request's
    name, or ``request@rank`` for every decode rank but the first a prefill rank feeds."""
    fed = targets(prefill_tp, sources(prefill_tp, decode_tp, decode_rank)[0], decode_tp)
    return request if decode_rank == fed[0] else f"{request}@{decode_rank}"


def tp_pairing_problem(prefill_tp: int, decode_tp: int) -> str:
    """Why prefill and decode ranks of these attention-TP sizes cannot pair ('' when they can)."""
    if prefill_tp <= 0 or decode_tp <= 0 or (prefill_tp % decode_tp and decode_tp % prefill_tp):
        return (
            f"prefill runs attention TP={prefill_tp}, this decode rank TP={decode_tp}: kvtransport pairs TP sizes "
            "of which one divides the other"
        )
    return ""


def pairing_problem(peer: KVLayout | None, peer_label: str, tp_rank: int, tp_size: int, tag: str) -> str:
    """Prefill rank ``tp_rank``/``tp_size``: "" when ``peer`` (the layout a decode rank sent at
    handshake) is a rank this one feeds and ``tag`` is the tag it must announce its request
    under, else why not. A request goes only to the decode ranks the TP map pairs with this
    rank, whoever announced it."""
    if peer is None:
        return f"{peer_label} sent no KV layout"
    problem = tp_pairing_problem(tp_size, peer.tp_size)
    if problem or not 0 <= peer.tp_rank < peer.tp_size:
        return f"{peer_label} is decode rank tp={peer.tp_rank}/{peer.tp_size}: {problem or 'no such rank'}"
    fed = targets(tp_size, tp_rank, peer.tp_size)
    if peer.tp_rank not in fed:
        return (
            f"{peer_label} is decode rank tp={peer.tp_rank}/{peer.tp_size}; this prefill rank is "
            f"tp={tp_rank}/{tp_size}, which feeds decode rank(s) tp={list(fed)} only"
        )
    request = tag.rsplit("@", 1)[0] if "@" in tag else tag
    want = request_tag(request, tp_size, peer.tp_size, peer.tp_rank)
    if tag != want:
        return f"{peer_label} (decode rank tp={peer.tp_rank}) announced tag {tag!r}, not {want!r}"
    return ""
