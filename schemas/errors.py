"""Errors of the Avro contract layer."""

from gpupipe.common.errors import GpupipeError


class SchemaError(GpupipeError):
    """A schema file is missing or invalid (fails at startup, never mid-stream)."""


class DecodeError(GpupipeError):
    """Bytes that are not one of our records. `reason` is short and goes into dead-letter headers."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class EncodeError(GpupipeError):
    """A record does not fit its schema (a bug in the record builder, never bad input)."""
