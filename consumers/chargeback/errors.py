"""Errors of the chargeback consumer: its pure parts and its service."""

from gpupipe.common.errors import ConfigError, GpupipeError


class ChargebackConfigError(ConfigError):
    """A chargeback setting (window, grace, accounting knob) is invalid."""


class ChargebackStateError(GpupipeError):
    """The engine was driven against its protocol (e.g. a checkpoint with output not yet polled).

    A bug in the service driving the engine, never bad input data.
    """


class CheckpointMismatchError(ConfigError):
    """A committed checkpoint was written with other window settings than the engine now has."""


class ChargebackFatalError(GpupipeError):
    """The service cannot go on (fenced by another instance, fatal client error, broken protocol)."""


class PriceChangeError(ConfigError):
    """The price table would re-price usage that was already billed with other prices."""


class GpuCapReached(GpupipeError):
    """A sample of a new GPU while the engine holds ``max_gpus`` GPU references (dead-lettered with
    reason ``gpu-cap``, counted; see ``windows.py``, "Bounded state")."""
