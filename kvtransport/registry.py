"""Deprecated alias of :mod:`kvtransport.negotiation.registry`, where this module moved in 0.2."""

import warnings

from kvtransport.negotiation.registry import *  # noqa: F403

warnings.warn(
    "kvtransport.registry moved to kvtransport.negotiation.registry; the old path goes in a later release",
    DeprecationWarning,
    stacklevel=2,
)
