"""One exception root for the whole project.

Library errors (fastavro, confluent-kafka, grpc) are translated at the boundary
(`raise ... from exc`) so callers catch *our* types and the CLI can turn any of
them into a one-line message instead of a traceback.
"""


class GpupipeError(Exception):
    """Root of every error gpupipe raises on purpose."""


class ConfigError(GpupipeError):
    """A flag, environment variable or config file is wrong; the message says which."""


class BrokerUnavailableError(GpupipeError):
    """Kafka could not be reached within the allowed time."""
