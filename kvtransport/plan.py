"""Deprecated alias of :mod:`kvtransport.spi.plan`, where this module moved in 0.2."""

import warnings

from kvtransport.spi.plan import *  # noqa: F403

warnings.warn(
    "kvtransport.plan moved to kvtransport.spi.plan; the old path goes in a later release",
    DeprecationWarning,
    stacklevel=2,
)
