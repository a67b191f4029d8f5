"""The NVML source of the node producer.

* :class:`~gpupipe_producer.nvml.source.NvmlSource`: polls every GPU (and MIG slice) into GpuSample dicts,
  one collector per field group (``identity``, ``fast``, ``slow``, ``gpm``, ``processes``).
* :class:`~gpupipe_producer.nvml.events.XidEventWatcher`: XID events from an NVML event set, on a thread.
* :mod:`~gpupipe_producer.nvml.records`: XidEvent builders (``gpu_lost_xid_event``, ``nvml_xid_event``).

The NVML module (``pynvml`` from nvidia-ml-py) is always injected; only
:func:`~gpupipe_producer.nvml.source.default_nvml_module` imports it.
"""

from gpupipe_producer.nvml.errors import NvmlInitError, NvmlSourceError
from gpupipe_producer.nvml.events import XidEventWatcher
from gpupipe_producer.nvml.records import GpuRef, LostGpu, gpu_lost_xid_event, nvml_xid_event
from gpupipe_producer.nvml.source import DEFAULT_INTERVALS, NvmlSource, SourceHooks, default_nvml_module

__all__ = [
    "DEFAULT_INTERVALS",
    "GpuRef",
    "LostGpu",
    "NvmlInitError",
    "NvmlSource",
    "NvmlSourceError",
    "SourceHooks",
    "XidEventWatcher",
    "default_nvml_module",
    "gpu_lost_xid_event",
    "nvml_xid_event",
]
