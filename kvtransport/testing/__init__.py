"""Test helpers for kvtransport and for driver authors: a fake driver, shared KV buffers, a
scriptable peer process, and the driver conformance suite (``kvtransport.testing.conformance``).
Nothing here is registered as a production driver."""
