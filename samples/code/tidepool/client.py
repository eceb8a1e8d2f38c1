"""The GaugeClient class uploads readings from one tide gauge station."""

import time

from tidepool.config import (
    DEFAULT_ENDPOINT,
    DEFAULT_RETRY_LIMIT,
    DEFAULT_TIMEOUT_SECONDS,
    MAX_BATCH_SIZE,
    STORM_SURGE_THRESHOLD_CM,
)


def smooth_tide_curve(levels, window=5):
    """Smooth a list of water levels with a moving average of `window` readings."""
    smoothed = []
    for i in range(len(levels)):
        part = levels[max(0, i - window + 1): i + 1]
        smoothed.append(sum(part) / len(part))
    return smoothed


class UploadError(Exception):
    """Raised when an upload still fails after all retries."""


class GaugeClient:
    """Client for one tide gauge station, for example station "RTM-042"."""

    def __init__(self, station_id, endpoint=DEFAULT_ENDPOINT,
                 retry_limit=DEFAULT_RETRY_LIMIT, timeout=DEFAULT_TIMEOUT_SECONDS):
        self.station_id = station_id
        self.endpoint = endpoint
        self.retry_limit = retry_limit
        self.timeout = timeout

    def flag_storm_surge(self, level_cm):
        """Return True if a water level is above the storm surge threshold."""
        return level_cm > STORM_SURGE_THRESHOLD_CM

    def upload_readings(self, readings):
        """Upload readings in batches of at most MAX_BATCH_SIZE."""
        for start in range(0, len(readings), MAX_BATCH_SIZE):
            batch = readings[start:start + MAX_BATCH_SIZE]
            self._send_with_retry(batch)

    def _send_with_retry(self, batch):
        for attempt in range(1, self.retry_limit + 1):
            try:
                return self._post(batch)
            except OSError:
                time.sleep(2 ** attempt)
        raise UploadError(f"upload failed after {self.retry_limit} attempts")

    def _post(self, batch):
        # Network code is left out of this sample.
        return len(batch)
