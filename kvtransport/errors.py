"""The public path of :mod:`kvtransport.spi.errors` (the driver SPI), kept for users and driver packages."""

from kvtransport.spi.errors import *  # noqa: F403
