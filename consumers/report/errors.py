"""Errors of the report package."""

from gpupipe.common.errors import ConfigError


class ReportOptionError(ConfigError):
    """A report option (time range, grouping, format) is invalid."""
