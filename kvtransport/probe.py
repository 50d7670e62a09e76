"""The public path of :mod:`kvtransport.spi.probe` (the driver SPI), kept for users and driver packages."""

from kvtransport.spi.probe import *  # noqa: F403
