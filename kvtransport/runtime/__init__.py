"""The endpoint at run time: control channel, sessions, transfers, timers and metrics.

``endpoint`` owns the I/O thread and drives everything else, through ``driver_context`` (its
drivers: opening, closing, their context and notices), ``routing`` (frames in, authentication,
dispatch, violations) and ``session_setup`` (the handshake, lanes, heartbeats); ``session`` is
one peer's connection, which carries out what its ``peer_protocol`` machine decides, with
``driver_side`` (its driver calls) and ``ordered`` (ordered mode); ``handles`` what callers hold
(``Transfer``, ``Connection``); ``peer_protocol`` (one peer's transfers and messages), ``tags``
(tag ownership, early announcements) and ``admission`` (the authentication exchange) are state
machines that do no I/O; ``checks`` what a caller or a peer
names; ``control``, ``express``, ``wire``, ``auth`` and ``unclaimed`` the authenticated control
plane; ``runner`` the driver threads; ``lane``, ``metrics``, ``prometheus`` what is observed;
``config`` and ``environment`` the settings.
"""
