"""Deprecated alias of :mod:`kvtransport.tools.gpu_check`, where this module moved in 0.2."""

import warnings

from kvtransport.tools.gpu_check import *  # noqa: F403

warnings.warn(
    "kvtransport.testing.gpu_check moved to kvtransport.tools.gpu_check; the old path goes in a later release",
    DeprecationWarning,
    stacklevel=2,
)

if __name__ == "__main__":  # python -m kvtransport.testing.gpu_check, as 0.1 documented it
    from kvtransport.tools.gpu_check import main

    raise SystemExit(main())
