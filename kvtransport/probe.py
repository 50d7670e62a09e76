"""Deprecated alias of :mod:`kvtransport.spi.probe`, where this module moved in 0.2."""

import warnings

from kvtransport.spi.probe import *  # noqa: F403

warnings.warn(
    "kvtransport.probe moved to kvtransport.spi.probe; the old path goes in a later release",
    DeprecationWarning,
    stacklevel=2,
)
