"""What the two Mooncake drivers' offers share: the protocol-compatibility check."""

from __future__ import annotations

from kvtransport.spi.driver import PeerView, Rejection


def protocol_mismatch(local: PeerView, remote: PeerView) -> Rejection | None:
    """Both engines must run the same protocol (an RDMA engine cannot talk to a TCP one)."""
    assert local.status is not None and remote.status is not None
    mine, theirs = local.status.info.get("protocol", ""), remote.status.info.get("protocol", "")
    if mine != theirs:
        return Rejection(
            f"Mooncake protocol differs: {mine or '?'} on one side, {theirs or '?'} on the other; "
            "set KVTRANSPORT_MOONCAKE_PROTOCOL=tcp on the RDMA side to bridge them"
        )
    return None
