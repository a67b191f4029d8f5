"""The topology part of the fake NVML module (``tests/fake_nvml.py``): PCIe common ancestors, CPU
affinity, NVLink state and remote ends, NVLink peer-to-peer status.

What it models (nvml.h and NVIDIA's mock libnvidia-ml, H100 / A100 / GB200 / L40S profiles, read
through the real pynvml):

* ``nvmlDeviceGetTopologyCommonAncestor``: from each GPU's ``pcie_switch`` and ``numa_node``: the
  same switch SINGLE (PIX), the same NUMA node NODE, else SYSTEM; ``FakeNvml.ancestor_overrides``
  (``{(a, b): level}``) sets any pair;
* ``nvmlDeviceGetCpuAffinity``: ``FakeGpu.cpus`` as 64-bit words (the mock: a full word per NUMA node);
  None: NotSupported;
* ``nvmlDeviceGetNvLinkState`` / ``...RemoteDeviceType`` / ``...RemotePciInfo``: links
  ``0..nvlink_links-1``; a link id beyond them answers InvalidArgument (the mock, and GB200 for
  18..35); a GPU without NVLink answers NotSupported. A link in ``nvlink_down`` is inactive. The
  remote end is ``FakeGpu.nvlink_remote[link]`` = (device type, bus id), by default an NVSwitch whose
  PCI address NVML does not resolve: the mock answers bus id ``FFFFFFFF:FF:FF.0`` and type SWITCH;
* ``nvmlDeviceGetNvLinkErrorCounter`` / ``nvmlDeviceResetNvLinkErrorCounters``: the per-link
  data-link counters (``FakeGpu.nvlink_dl_errors[(link, counter)]``, 0 by default: the mock answers
  0 for links 0..17 on every profile, InvalidArgument beyond); a counter id past
  ``NVML_NVLINK_ERROR_DL_ECC_DATA`` answers InvalidArgument, a GPU without NVLink NotSupported (nvml.h);
  the reset sets the link's counters to 0, as a driver reload does;
* ``nvmlDeviceGetP2PStatus`` with ``NVML_P2P_CAPS_INDEX_NVLINK``: OK when both GPUs have an active
  link to an NVSwitch, or a direct active link joins them; else NOT_SUPPORTED (the mock's L40S);
* ``nvmlDeviceGetNumaNodeId`` is in ``tests/fake_nvml.py`` (``FakeGpu.gpu_numa_node``).

``FakeNvml`` inherits :class:`TopologyMixin`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pynvml as _real

if TYPE_CHECKING:
    from tests.fake_nvml import FakeGpu

#: What NVML answers for the PCI address of a remote end it cannot resolve (an NVSwitch; the mock).
UNRESOLVED_BUS_ID = "FFFFFFFF:FF:FF.0"
SWITCH = _real.NVML_NVLINK_DEVICE_TYPE_SWITCH
GPU = _real.NVML_NVLINK_DEVICE_TYPE_GPU


def _err(code: int) -> _real.NVMLError:
    return _real.NVMLError(code)


def default_cpus(numa_node: int | None, cores_per_node: int = 56, nodes: int = 2) -> tuple[int, ...] | None:
    """A two-socket host's CPUs of ``numa_node``: its cores and their hyperthread siblings."""
    if numa_node is None or numa_node < 0:
        return None
    first = numa_node * cores_per_node
    cores = range(first, first + cores_per_node)
    return (*cores, *(c + nodes * cores_per_node for c in cores))


class TopologyMixin:
    """The topology calls of the fake."""

    if TYPE_CHECKING:  # provided by FakeNvml
        gpus: list[FakeGpu]

        def _gpu(self, fn: str, handle: Any) -> FakeGpu: ...

    #: ``{(gpu a, gpu b): NVML_TOPOLOGY_*}`` replacing the level computed from switches and NUMA nodes.
    ancestor_overrides: dict[tuple[int, int], int]

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int:
        a = self._gpu("nvmlDeviceGetTopologyCommonAncestor", device1)
        b = self._gpu("nvmlDeviceGetTopologyCommonAncestor", device2)
        overrides = getattr(self, "ancestor_overrides", {})
        for key in ((a.index, b.index), (b.index, a.index)):
            if key in overrides:
                return overrides[key]
        if a is b:
            return _real.NVML_TOPOLOGY_INTERNAL
        if a.pcie_switch is not None and a.pcie_switch == b.pcie_switch:
            return _real.NVML_TOPOLOGY_SINGLE
        if a.numa_node is not None and a.numa_node == b.numa_node:
            return _real.NVML_TOPOLOGY_NODE
        return _real.NVML_TOPOLOGY_SYSTEM

    def nvmlDeviceGetCpuAffinity(self, handle: Any, cpuSetSize: int) -> Any:
        gpu = self._gpu("nvmlDeviceGetCpuAffinity", handle)
        if gpu.cpus is None:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        words = (_real.c_ulonglong * cpuSetSize)()
        for cpu in gpu.cpus:
            if cpu // 64 < cpuSetSize:  # NVML fills what fits in the caller's set
                words[cpu // 64] |= 1 << (cpu % 64)
        return words

    def _link(self, fn: str, device: Any, link: int) -> FakeGpu:
        gpu = self._gpu(fn, device)
        if not gpu.nvlink_links:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < gpu.nvlink_links:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return gpu

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        gpu = self._link("nvmlDeviceGetNvLinkState", device, link)
        return _real.NVML_NVLINK_STATE_INACTIVE if link in gpu.nvlink_down else _real.NVML_NVLINK_STATE_ACTIVE

    def nvmlDeviceGetNvLinkErrorCounter(self, device: Any, link: int, counter: int) -> int:
        gpu = self._link("nvmlDeviceGetNvLinkErrorCounter", device, link)
        if not 0 <= counter < _real.NVML_NVLINK_ERROR_COUNT:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.nvlink_dl_errors.get((link, counter), 0)

    def nvmlDeviceResetNvLinkErrorCounters(self, device: Any, link: int) -> None:
        gpu = self._link("nvmlDeviceResetNvLinkErrorCounters", device, link)
        for key in [k for k in gpu.nvlink_dl_errors if k[0] == link]:
            del gpu.nvlink_dl_errors[key]

    def _remote(self, gpu: FakeGpu, link: int) -> tuple[int, str]:
        return gpu.nvlink_remote.get(link, (SWITCH, UNRESOLVED_BUS_ID))

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        gpu = self._link("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        return self._remote(gpu, link)[0]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: Any, link: int) -> Any:
        gpu = self._link("nvmlDeviceGetNvLinkRemotePciInfo", device, link)
        info = _real.nvmlPciInfo_t()
        info.busId = self._remote(gpu, link)[1]
        return info

    def nvmlDeviceGetP2PStatus(self, device1: Any, device2: Any, p2pIndex: int) -> int:
        a = self._gpu("nvmlDeviceGetP2PStatus", device1)
        b = self._gpu("nvmlDeviceGetP2PStatus", device2)
        if p2pIndex != _real.NVML_P2P_CAPS_INDEX_NVLINK:
            return _real.NVML_P2P_STATUS_OK  # PCIe read/write: this fake's hosts allow it
        ok = _real.NVML_P2P_STATUS_OK
        if self._switched(a) and self._switched(b):
            return ok
        for x, y in ((a, b), (b, a)):
            for link in range(x.nvlink_links):
                kind, bus = self._remote(x, link)
                if link not in x.nvlink_down and kind == GPU and bus.lower() == y.pci_bus_id.lower():
                    return ok
        return _real.NVML_P2P_STATUS_NOT_SUPPORTED

    def _switched(self, gpu: FakeGpu) -> bool:
        return any(
            link not in gpu.nvlink_down and self._remote(gpu, link)[0] == SWITCH
            for link in range(gpu.nvlink_links)
        )
