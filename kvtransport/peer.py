"""Deprecated alias of :mod:`kvtransport.tools.peer`, where this module moved in 0.2."""

import warnings

from kvtransport.tools.peer import *  # noqa: F403

warnings.warn(
    "kvtransport.peer moved to kvtransport.tools.peer; the old path goes in a later release",
    DeprecationWarning,
    stacklevel=2,
)

if __name__ == "__main__":  # python -m kvtransport.peer, as 0.1 documented it
    from kvtransport.tools.peer import main

    raise SystemExit(main())
