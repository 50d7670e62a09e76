"""The driver SPI and the data model it speaks: what a transfer-engine driver sees.

``driver`` (the :class:`KVTransport` contract), ``memory`` (regions, KV layout), ``plan`` (page indices
-> coalesced runs), ``inbound`` (what a peer may write where), ``tp_map`` (unequal TP), ``errors`` (the
one hierarchy), ``probe`` (host capabilities) and ``diagnose`` (engine import failures).
Nothing here imports a transfer engine or any other part of kvtransport.
"""
