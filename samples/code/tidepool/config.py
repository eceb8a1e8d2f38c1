"""Configuration constants for tidepool."""

# The default retry limit: how many times an upload is retried before giving up.
DEFAULT_RETRY_LIMIT = 7

# The default upload timeout, in seconds.
DEFAULT_TIMEOUT_SECONDS = 12.5

# The default API endpoint for uploads.
DEFAULT_ENDPOINT = "https://ingest.tidepool.example/v2"

# Maximum number of readings sent in one batch.
MAX_BATCH_SIZE = 250

# Readings above this water level (in centimetres) are flagged as a storm surge.
STORM_SURGE_THRESHOLD_CM = 310
