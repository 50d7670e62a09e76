"""The public path of :mod:`kvtransport.spi.memory` (the driver SPI), kept for users and driver packages."""

from kvtransport.spi.memory import *  # noqa: F403
