"""Deprecated alias of :mod:`kvtransport.spi.diagnose`, where this module moved in 0.2."""

import warnings

from kvtransport.spi.diagnose import *  # noqa: F403

warnings.warn(
    "kvtransport.diagnose moved to kvtransport.spi.diagnose; the old path goes in a later release",
    DeprecationWarning,
    stacklevel=2,
)
