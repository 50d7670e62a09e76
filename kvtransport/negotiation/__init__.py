"""Choosing a driver for a pair of peers: discovery, hellos, cost models and the decision.

``registry`` (entry points, env-var policy), ``hello`` (what a side says about itself), ``cost_model``
and ``calibration_cache`` (measured predictions), ``negotiate`` (the pure decision) and ``handshake``
(reading and cross-checking a peer's hello). ``negotiate`` and ``handshake`` are pure functions
over data; ``registry`` and ``hello`` load drivers from entry points and probe them.
"""
