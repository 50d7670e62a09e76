"""The public path of :mod:`kvtransport.spi.plan` (the driver SPI), kept for users and driver packages."""

from kvtransport.spi.plan import *  # noqa: F403
