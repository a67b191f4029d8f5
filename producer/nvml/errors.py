"""Errors of the NVML source: NVML failures translated at the boundary into gpupipe types."""

from __future__ import annotations

from gpupipe.common.errors import GpupipeError


class NvmlSourceError(GpupipeError):
    """The NVML source could not do what it was asked (root of this package's errors)."""


class NvmlInitError(NvmlSourceError):
    """NVML could not be initialised or the GPUs could not be enumerated.

    The message carries NVML's own text, e.g. ``NVML init failed: Driver Not Loaded``; the
    original ``pynvml.NVMLError`` is chained as ``__cause__``.
    """
