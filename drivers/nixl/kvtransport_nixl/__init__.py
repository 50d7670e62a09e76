"""kvtransport driver over NIXL with the UCX backend (nixl-ucx)."""
