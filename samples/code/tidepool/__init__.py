"""tidepool: upload tide gauge readings to the data platform."""

from tidepool.client import GaugeClient, smooth_tide_curve
from tidepool.config import DEFAULT_RETRY_LIMIT, DEFAULT_TIMEOUT_SECONDS

__version__ = "0.9.3"

__all__ = [
    "GaugeClient",
    "smooth_tide_curve",
    "DEFAULT_RETRY_LIMIT",
    "DEFAULT_TIMEOUT_SECONDS",
]
