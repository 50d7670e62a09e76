"""Deprecated alias of :mod:`kvtransport.runtime.endpoint`, where this module moved in 0.2."""

import warnings

from kvtransport.runtime.endpoint import *  # noqa: F403

warnings.warn(
    "kvtransport.endpoint moved to kvtransport.runtime.endpoint; the old path goes in a later release",
    DeprecationWarning,
    stacklevel=2,
)
