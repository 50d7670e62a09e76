"""The endpoint at run time: control channel, sessions, transfers, timers and metrics.

``endpoint`` owns the I/O thread and drives everything else; ``session`` is one peer's protocol
state; ``transfer`` the caller's handle on one request; ``control``, ``express``, ``wire``, ``auth`` and
``unclaimed`` the authenticated control plane; ``runner`` the driver threads; ``lane``, ``metrics``,
``prometheus`` what is observed; ``config`` and ``environment`` the settings.
"""
