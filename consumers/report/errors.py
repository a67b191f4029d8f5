"""Errors of the report package."""

from gpupipe.errors import ConfigError


class TeamMapError(ConfigError):
    """The namespace-to-team mapping file is missing or malformed; the message names the entry."""


class ReportOptionError(ConfigError):
    """A report option (time range, grouping, format) is invalid."""
