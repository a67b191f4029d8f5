"""A faithful fake of the ``pynvml`` module (nvidia-ml-py 13.x) for the calls gpupipe makes.

Only the *functions* are faked. Everything else is the real module's: constants
(``NVML_CLOCK_SM``, ``nvmlMemory_v2``, ``NVML_FI_*``, ``NVML_GPM_METRIC_*``...), the ctypes
structures the functions return (``c_nvmlUtilization_t``, ``c_nvmlMemory_v2_t``, ``nvmlPciInfo_t``,
``c_nvmlFieldValue_t``, ``c_nvmlGpmMetricsGet_t``, ``c_nvmlEventData_t``...) and the error classes
(``NVMLError`` and the ``NVMLError_*`` subclasses), so ``except pynvml.NVMLError_NotSupported``
behaves identically against the fake and the real module. Handles, event sets and GPM samples
are real ctypes pointers (``c_nvmlDevice_t``...) to private buffers: they fit into the real
structures (``c_nvmlGpmMetricsGet_t.sample1``, ``c_nvmlEventData_t.device``), and, as with real
NVML, two handles of the same GPU are different Python objects with the same address.

Units are NVML's: mW, mJ, KB/s, bytes, %, MHz, C, ns; GPM metrics in % or MiB/s.

Usage::

    from tests.fake_nvml import FakeGpu, FakeNvml

    nvml = FakeNvml.node("H100", count=8)             # 8 H100s with plausible values
    nvml.set_values(0, power_mw=350_000, util_gpu=97) # NVML units; unknown names raise
    nvml.gpus[3].lose()                               # every call on GPU 3: NVMLError_GpuIsLost
    nvml.gpus[1].inject_xid(79)                       # delivered to registered event sets
    source = NvmlSource(nvml, "node-1")               # the module object is injected
    nvml.count("nvmlDeviceGetPowerUsage", gpu=0)      # calls made, for "asked only once" tests

Support is scripted per GPU: ``unsupported`` holds function names that answer NotSupported,
``unsupported_fields`` field ids whose per-field return is NotSupported, and a value set to
``None`` is NotSupported too. MIG-enabled parents refuse utilisation, per-process utilisation
and remapped rows; MIG handles answer only identity, memory, processes and GPM (as NVML
documents). Pre-Hopper GPUs answer ``isSupportedDevice=0`` to GPM. Ampere+ GPUs refuse retired
pages (row remapping replaced them). Values are returned as set, including impossible ones,
so tests can feed garbage; structure fields go through ctypes (a negative ``c_uint`` wraps as
in C).

Functions of the real module the fake does not implement raise ``NVMLError_FunctionNotFound``
when called and are listed in ``FakeNvml.unimplemented_calls``: a test can assert it is empty.
"""

from __future__ import annotations

import ctypes
import json
import threading
import time
import types
import uuid as _uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml as _real

from tests.fake_nvml_events import EventSetsMixin, _EventSet
from tests.fake_nvml_operational import OperationalEventsMixin, _OpSet
from tests.fake_nvml_session import SessionMixin
from tests.fake_nvml_topology import TopologyMixin, default_cpus

FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures" / "nvml"
GIB = 1024**3
MIB = 1024**2
NO_INSTANCE = 0xFFFFFFFF
#: How an event reaches the waiting sets (FakeNvml(event_delivery=...); tests/fake_nvml_events.py).
EVENT_DELIVERY = ("own-set", "any-set")
UINT_MAX = 0xFFFFFFFF

KEPLER = _real.NVML_DEVICE_ARCH_KEPLER
VOLTA = _real.NVML_DEVICE_ARCH_VOLTA
AMPERE = _real.NVML_DEVICE_ARCH_AMPERE
ADA = _real.NVML_DEVICE_ARCH_ADA
HOPPER = _real.NVML_DEVICE_ARCH_HOPPER
BLACKWELL = _real.NVML_DEVICE_ARCH_BLACKWELL

# DGX H100 PCI bus ids of GPUs 0..7 and their NUMA nodes.
DGX_BUS_IDS = ("1B", "43", "52", "61", "9D", "C3", "D1", "DF")

GPM_DEFAULTS: dict[int, float] = {
    _real.NVML_GPM_METRIC_GRAPHICS_UTIL: 92.5,
    _real.NVML_GPM_METRIC_SM_UTIL: 80.0,
    _real.NVML_GPM_METRIC_SM_OCCUPANCY: 35.0,
    _real.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 45.0,
    _real.NVML_GPM_METRIC_DRAM_BW_UTIL: 55.0,
    _real.NVML_GPM_METRIC_FP64_UTIL: 0.5,
    _real.NVML_GPM_METRIC_FP32_UTIL: 20.0,
    _real.NVML_GPM_METRIC_FP16_UTIL: 5.0,
    _real.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 100.0,
    _real.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 200.0,
    _real.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: 1000.0,
    _real.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: 1500.0,
}


@dataclass(frozen=True)
class GpuModel:
    name: str
    arch: int
    fb_total: int
    fb_reserved: int
    power_limit_mw: int
    sm_clock_mhz: int
    mem_clock_mhz: int
    mig_max_slices: int  # 0: not MIG-capable
    mig_memory: Mapping[int, str]  # GI slices -> memory part of the profile name ("40gb")
    nvlink_links: int


MODELS: dict[str, GpuModel] = {
    "H100": GpuModel(
        "NVIDIA H100 80GB HBM3",
        HOPPER,
        81559 * MIB,
        531 * MIB,
        700_000,
        1980,
        2619,
        7,
        {1: "10gb", 2: "20gb", 3: "40gb", 4: "40gb", 7: "80gb"},
        18,
    ),
    "H200": GpuModel(
        "NVIDIA H200",
        HOPPER,
        143771 * MIB,
        590 * MIB,
        700_000,
        1980,
        3201,
        7,
        {1: "18gb", 2: "35gb", 3: "71gb", 4: "71gb", 7: "141gb"},
        18,
    ),
    "A100": GpuModel(
        "NVIDIA A100-SXM4-80GB",
        AMPERE,
        81920 * MIB,
        463 * MIB,
        400_000,
        1410,
        1593,
        7,
        {1: "10gb", 2: "20gb", 3: "40gb", 4: "40gb", 7: "80gb"},
        12,
    ),
    "L40S": GpuModel("NVIDIA L40S", ADA, 46068 * MIB, 420 * MIB, 350_000, 2520, 9001, 0, {}, 0),
}

# Profile constants of nvmlDeviceGetGpuInstanceProfileInfo -> slice count.
_GI_PROFILE_SLICES = {
    _real.NVML_GPU_INSTANCE_PROFILE_1_SLICE: 1,
    _real.NVML_GPU_INSTANCE_PROFILE_2_SLICE: 2,
    _real.NVML_GPU_INSTANCE_PROFILE_3_SLICE: 3,
    _real.NVML_GPU_INSTANCE_PROFILE_4_SLICE: 4,
    _real.NVML_GPU_INSTANCE_PROFILE_6_SLICE: 6,
    _real.NVML_GPU_INSTANCE_PROFILE_7_SLICE: 7,
    _real.NVML_GPU_INSTANCE_PROFILE_8_SLICE: 8,
}

# What a MIG device handle answers; everything else is NotSupported on it.
_MIG_HANDLE_FUNCTIONS = frozenset(
    {
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetGpuInstanceId",
        "nvmlDeviceGetComputeInstanceId",
        "nvmlDeviceIsMigDeviceHandle",
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
        "nvmlGpmQueryDeviceSupport",
        "nvmlDeviceGetIndex",
    }
)
# What a GPU in MIG mode no longer answers on its whole-GPU handle.
_NOT_IN_MIG_MODE = frozenset(
    {"nvmlDeviceGetUtilizationRates", "nvmlDeviceGetProcessUtilization", "nvmlDeviceGetRemappedRows"}
)
# Helpers of the real module that are pure Python (no library call): passed through.
_PURE_HELPERS = frozenset({"nvmlExceptionClass", "nvmlStructToFriendlyObject", "nvmlFriendlyObjectToStruct"})


def _err(code: int) -> _real.NVMLError:
    return _real.NVMLError(code)


def _det_uuid(prefix: str, *parts: object) -> str:
    return f"{prefix}-{_uuid.uuid5(_uuid.NAMESPACE_URL, '/'.join(map(str, parts)))}"


@dataclass
class FakeProcess:
    """One compute process. ``sm_util``/``mem_util`` (%) None: no per-process samples."""

    pid: int
    name: str | None = "python3"
    used_memory: int | None = 4 * GIB
    sm_util: int | None = 50
    mem_util: int | None = 20
    gpu_instance_id: int = NO_INSTANCE
    compute_instance_id: int = NO_INSTANCE


@dataclass
class FakeMigSlice:
    """One MIG device. ``profile`` as NVML names it: ``3g.40gb``, or ``1c.3g.40gb`` for a CI."""

    profile: str
    gpu_instance_id: int
    compute_instance_id: int = 0
    uuid: str = ""
    fb_total: int = 40 * GIB
    fb_used: int = 10 * GIB
    fb_reserved: int = 0
    processes: list[FakeProcess] = field(default_factory=list)
    gpm: dict[int, float] = field(default_factory=lambda: dict(GPM_DEFAULTS))
    index: int | None = None  # MIG device index under the parent (None: next free one)
    lost: bool = False  # not used by NVML (the parent is what gets lost); kept for symmetry


class FakeGpu:
    """The scripted state of one GPU; value attributes are in NVML's units."""

    VALUE_NAMES = (
        "util_gpu",
        "util_memory",
        "enc_util",
        "dec_util",
        "fb_total",
        "fb_used",
        "fb_reserved",
        "power_mw",
        "power_limit_mw",
        "energy_mj",
        "gpu_temp_c",
        "memory_temp_c",
        "sm_clock_mhz",
        "mem_clock_mhz",
        "clock_event_reasons",
        "power_violation_ns",
        "thermal_violation_ns",
        "pcie_tx_kbps",
        "pcie_rx_kbps",
        "pcie_replay",
        "ecc_sbe_volatile",
        "ecc_dbe_volatile",
        "ecc_sbe_aggregate",
        "ecc_dbe_aggregate",
        "retired_pages_sbe",
        "retired_pages_dbe",
        "retired_pending",
        "remapped_correctable",
        "remapped_uncorrectable",
        "remap_pending",
        "remap_failure",
        "recovery_action",
        "bank_remap_pending",
        "bank_remaps_active",
        "memory_unrepairable",
        "nvlink_tx_kib",
        "nvlink_rx_kib",
        "numa_node",
    )

    def __init__(
        self,
        index: int = 0,
        *,
        model: str | GpuModel = "H100",
        uuid: str | None = None,
        pci_bus_id: str | None = None,
        numa_node: int | None = None,
        mig: Iterable[str | FakeMigSlice] | None = None,
        processes: Iterable[FakeProcess] | None = None,
        unsupported: Iterable[str] = (),
        unsupported_fields: Iterable[int] = (),
        unsupported_gpm_metrics: Iterable[int] = (),
        events_supported: bool = True,
        gpm: Mapping[int, float] | None = None,
        **values: Any,
    ) -> None:
        m = MODELS[model] if isinstance(model, str) else model
        self.model = m
        self.index = index
        self.name = m.name
        self.arch = m.arch
        self.uuid = uuid or _det_uuid("GPU", m.name, index)
        self.pci_bus_id = pci_bus_id or f"00000000:{DGX_BUS_IDS[index % 8]}:00.0"
        self.mig_capable = m.mig_max_slices > 0
        self.mig_max_slices = m.mig_max_slices
        self.nvlink_links = m.nvlink_links
        self.unsupported = set(unsupported)
        if m.arch >= AMPERE:
            self.unsupported |= {
                "nvmlDeviceGetRetiredPages",
                "nvmlDeviceGetRetiredPages_v2",
                "nvmlDeviceGetRetiredPagesPendingStatus",
            }
        self.unsupported_fields = set(unsupported_fields)
        self.unsupported_gpm_metrics = set(unsupported_gpm_metrics)
        self.gpm_supported = m.arch >= HOPPER
        self.gpm: dict[int, float] = dict(GPM_DEFAULTS if gpm is None else gpm)
        self.events_supported = events_supported
        self.supported_event_types = _real.nvmlEventTypeAll if events_supported else 0
        self.processes: list[FakeProcess] = list(processes or [])
        #: Graphics contexts (nvmlDeviceGetGraphicsRunningProcesses; the mock answers []).
        self.graphics_processes: list[FakeProcess] = []
        #: MPS clients (nvmlDeviceGetMPSComputeRunningProcesses); None: NotSupported, as the mock.
        self.mps_processes: list[FakeProcess] | None = None
        #: Explicit per-process utilisation samples ``(timestamp_us, pid, sm %, mem %)``: NVML returns
        #: one only for a sample period in which the process was busy. None: one sample per call
        #: from FakeProcess.sm_util/mem_util.
        self.util_samples: list[tuple[int, int, int, int]] | None = None
        #: Device utilisation sample times (nvmlDeviceGetSamples): every period, busy or not.
        #: None: NotSupported, as the mock.
        self.util_periods: list[int] | None = None
        #: What the binding raises when no process sample is newer than lastSeen: the mock (and a
        #: driver whose size query answers SUCCESS) makes pynvml raise NVMLError(NVML_SUCCESS);
        #: nvml.h documents NVML_ERROR_NOT_FOUND.
        self.no_process_samples_code = _real.NVML_SUCCESS
        self.lost = False
        #: An NVML error code every event-set wait where this GPU is registered raises (a broken
        #: event channel; see tests/fake_nvml_events.py). None: events work.
        self.event_wait_error: int | None = None
        self.reset_pending = False  # reset while lost: back at the next NVML session
        self.failures: dict[str, deque[int]] = {}  # fn name -> NVML error codes to raise next
        #: Seconds every device call on this GPU blocks before answering (a hung GPU, ``hang``).
        self.call_delay_s = 0.0
        self._hang_over = threading.Event()  # set by hang(0): calls blocked in a hang return at once
        #: /dev/nvidia<minor>: usually the index, but nothing guarantees it (nvmlDeviceGetMinorNumber).
        self.minor = index
        # Blackwell / GB200 (see producer/nvml/fabric.py for what the mock showed).
        #: nvmlDeviceGetGpuFabricInfoV answer (state, status, cliqueId, healthMask, healthSummary,
        #: clusterUuid bytes); None: NotSupported (no fabric).
        self.fabric: dict[str, Any] | None = None
        #: nvmlDeviceGetPlatformInfo answer (chassisSerialNumber, slotNumber, trayIndex, hostId,
        #: moduleId); None: NotSupported (the mock's GB200 profile).
        self.platform: dict[str, Any] | None = None
        self.nvlink_down: set[int] = set()  # link ids whose state (FI 165) is 0
        #: Per-link error counters (FI 208 / 221 / 214): link id -> count (0 elsewhere, as the mock).
        self.nvlink_rcv_errors: dict[int, int] = {}
        self.nvlink_symbol_errors: dict[int, int] = {}
        self.nvlink_recovery_failed: dict[int, int] = {}
        #: Device-wide NVLink error totals by field id (38 CRC FLIT, 45 CRC data, 52 replay, 59
        #: recovery); 0 where the GPU has links (the mock's H100 and GB200 answer 0), else NotSupported.
        self.nvlink_error_totals: dict[int, int] = {}
        #: nvmlDeviceGetNvLinkErrorCounter: (link, NVML_NVLINK_ERROR_DL_*) -> count (0 elsewhere, as the
        #: mock on every profile); see tests/fake_nvml_topology.py.
        self.nvlink_dl_errors: dict[tuple[int, int], int] = {}
        self.c2c_links = 0  # FI 170; 0: NotSupported (the mock on every profile)
        self.c2c_down: set[int] = set()
        #: PCIe byte counters (FI 197/198); None: NotSupported (the mock, every profile).
        #: The mock answers 0 for NVLink throughput at scope UINT_MAX (all links) while the
        #: per-link values carry traffic; True reproduces that.
        self.nvlink_aggregate_zero = False
        self.pcie_tx_count_bytes: int | None = None
        self.pcie_rx_count_bytes: int | None = None
        #: Superchip module scope (FI 185/191, scope 1); None: NotSupported (the mock).
        self.module_power_mw: int | None = None
        self.module_energy_mj: int | None = None
        self._fake: FakeNvml | None = None
        # Values (NVML units): a busy training GPU.
        self.util_gpu: Any = 87
        self.util_memory: Any = 42
        self.enc_util: Any = 0
        self.dec_util: Any = 3
        self.fb_total: Any = m.fb_total
        self.fb_reserved: Any = m.fb_reserved
        self.fb_used: Any = m.fb_total * 3 // 4
        self.power_mw: Any = 512_345
        self.power_limit_mw: Any = m.power_limit_mw
        self.energy_mj: Any = 123_456_789_012
        self.gpu_temp_c: Any = 61
        #: FI 82 (NVML_FI_DEV_MEMORY_TEMP) is for HBM boards only (nvml.h): NotSupported on GDDR (L40S).
        self.memory_temp_c: Any = None if m.arch == ADA else 70
        self.sm_clock_mhz: Any = m.sm_clock_mhz
        self.mem_clock_mhz: Any = m.mem_clock_mhz
        self.clock_event_reasons: Any = 0x4  # SwPowerCap
        self.power_violation_ns: Any = 1_500_000_000
        self.thermal_violation_ns: Any = 0
        self.pcie_tx_kbps: Any = 123_456
        self.pcie_rx_kbps: Any = 654_321
        self.pcie_replay: Any = 2
        self.ecc_sbe_volatile: Any = 5
        self.ecc_dbe_volatile: Any = 0
        self.ecc_sbe_aggregate: Any = 17
        self.ecc_dbe_aggregate: Any = 1
        self.retired_pages_sbe: Any = []
        self.retired_pages_dbe: Any = []
        self.retired_pending: Any = 0
        self.remapped_correctable: Any = 3
        self.remapped_uncorrectable: Any = 1
        self.remap_pending: Any = 0
        self.remap_failure: Any = 0
        self.recovery_action: Any = _real.NVML_GPU_RECOVERY_ACTION_NONE
        #: nvmlDeviceGetBankRemapperStatus_v1 (R615+) and nvmlDeviceGetUnrepairableMemoryFlag_v1
        #: (R590+); None: NotSupported (an older driver, and NVIDIA's mock, which has neither).
        self.bank_remap_pending: Any = None
        self.bank_remaps_active: Any = 0
        self.memory_unrepairable: Any = None
        #: Power-smoothing fields (NVML_FI_PWR_SMOOTHING_*, Blackwell+, in-band access granted) by
        #: field id; None: every one answers NotSupported.
        self.power_smoothing: dict[int, Any] | None = None
        self.nvlink_tx_kib: Any = 1_000_000 if m.nvlink_links else None
        self.nvlink_rx_kib: Any = 2_000_000 if m.nvlink_links else None
        self.numa_node: Any = (index // 4) if numa_node is None else numa_node
        #: nvmlDeviceGetNumaNodeId: only where GPU memory is a NUMA node (GB200); None: NotSupported.
        self.gpu_numa_node: int | None = None
        # Topology (tests/fake_nvml_topology.py): an HGX board puts each GPU behind its own PCIe
        # switch; a PCIe-only server two GPUs per switch. CPUs: the NUMA node's cores and siblings.
        self.pcie_switch: int | None = index if m.nvlink_links else index // 2
        self.cpus: tuple[int, ...] | None = default_cpus(self.numa_node)
        #: link id -> (NVML_NVLINK_DEVICE_TYPE_*, remote PCI bus id); unset links: an NVSwitch.
        self.nvlink_remote: dict[int, tuple[int, str]] = {}
        self.set_values(**values)
        # MIG
        self.mig_enabled = False
        self.mig_slices: list[FakeMigSlice] = []
        if mig is not None:
            self.enable_mig(mig)

    # -- presets --------------------------------------------------------------------------------
    @classmethod
    def h100(cls, index: int = 0, **kw: Any) -> FakeGpu:
        return cls(index, model="H100", **kw)

    @classmethod
    def h200(cls, index: int = 0, **kw: Any) -> FakeGpu:
        return cls(index, model="H200", **kw)

    @classmethod
    def a100(cls, index: int = 0, **kw: Any) -> FakeGpu:
        return cls(index, model="A100", **kw)

    @classmethod
    def l40s(cls, index: int = 0, **kw: Any) -> FakeGpu:
        return cls(index, model="L40S", **kw)

    # -- scripting ------------------------------------------------------------------------------
    def set_values(self, **values: Any) -> None:
        for name, value in values.items():
            if name not in self.VALUE_NAMES:
                raise TypeError(f"FakeGpu has no value {name!r}; known: {self.VALUE_NAMES}")
            setattr(self, name, value)

    def enable_mig(self, slices: Iterable[str | FakeMigSlice]) -> None:
        """Put the GPU in MIG mode with these slices (profile names or FakeMigSlice objects)."""
        if not self.mig_capable:
            raise ValueError(f"{self.name} is not MIG-capable")
        self.mig_enabled = True
        self.mig_slices = []
        used: set[int] = set()
        for n, s in enumerate(slices):
            if isinstance(s, str):
                gi_slices = int(s.split("g.")[0].split(".")[-1])
                s = FakeMigSlice(
                    s,
                    gpu_instance_id=n + 1,
                    fb_total=int(self.model.fb_total * gi_slices / 8),
                    fb_used=int(self.model.fb_total * gi_slices / 16),
                )
            if not s.uuid:
                s.uuid = _det_uuid("MIG", self.uuid, s.gpu_instance_id, s.compute_instance_id)
            if s.index is None:
                s.index = min(i for i in range(64) if i not in used)
            used.add(s.index)
            for p in s.processes:
                p.gpu_instance_id, p.compute_instance_id = s.gpu_instance_id, s.compute_instance_id
            self.mig_slices.append(s)
        if self._fake is not None:
            self._fake._register_slices(self)

    def disable_mig(self) -> None:
        self.mig_enabled = False
        self.mig_slices = []

    def fail(self, fn_name: str, code: int = _real.NVML_ERROR_UNKNOWN, times: int = 1) -> None:
        """The next ``times`` calls of ``fn_name`` on this GPU raise NVMLError(code) (transient)."""
        self.failures.setdefault(fn_name, deque()).extend([code] * times)

    def inject_recovery_action(self, action: int) -> None:
        """NVML's GPU recovery-action event (R570+, Blackwell): delivered where it is registered.

        The GPU must offer it (``supported_event_types``); the mock lists only XIDs (0x8).
        """
        if self._fake is None:
            raise RuntimeError("add the GPU to a FakeNvml first")
        self._fake._inject_event(self, _real.nvmlEventTypeGpuRecoveryAction, action, NO_INSTANCE, NO_INSTANCE)

    def inject_gpu_unavailable(self, data: int = 0) -> None:
        """NVML's GPU-unavailable error event (R570+): delivered where it is registered."""
        if self._fake is None:
            raise RuntimeError("add the GPU to a FakeNvml first")
        self._fake._inject_event(self, _real.nvmlEventTypeGpuUnavailableError, data, NO_INSTANCE, NO_INSTANCE)

    def hang(self, seconds: float) -> None:
        """Every device call on this GPU blocks ``seconds`` before answering (0 ends the hang).

        A real driver can block an NVML call in the kernel (a GPU in a bad state, an RM lock held
        by a reset); the call then returns late or with an error, and cannot be cancelled.
        """
        self._hang_over.set()  # calls still blocked in an earlier hang answer now (late)
        self.call_delay_s = float(seconds)
        if seconds:
            self._hang_over = threading.Event()

    def lose(self) -> None:
        """The GPU falls off the bus: every call on it raises NVMLError_GpuIsLost from now on."""
        self.lost = True
        if self._fake is not None:
            self._fake._notify_events()

    def reset(self) -> None:
        """The GPU was reset or rebound after falling off the bus: a *new* NVML session sees it
        answer again; the session that saw it lost keeps seeing it lost (tests/fake_nvml_session.py)."""
        if self.lost:
            self.reset_pending = True

    def recover(self) -> None:
        """The GPU is back: calls on it answer again, in this NVML session (see ``reset`` for the
        usual case, where only a new session sees it)."""
        self.lost = False
        if self._fake is not None:
            self._fake._notify_events()

    def inject_xid(
        self, xid: int, gpu_instance_id: int | None = None, compute_instance_id: int | None = None
    ) -> None:
        """An XID on this GPU: delivered to every event set where it registered XID events."""
        if self._fake is None:
            raise RuntimeError("add the GPU to a FakeNvml first")
        self._fake._inject_event(
            self,
            _real.nvmlEventTypeXidCriticalError,
            xid,
            NO_INSTANCE if gpu_instance_id is None else gpu_instance_id,
            NO_INSTANCE if compute_instance_id is None else compute_instance_id,
        )


class FakeClock:
    """A settable clock for ``NvmlSource(clock=..., wall_clock=...)`` and ``FakeNvml(clock=...)``.

    ``clock()`` is monotonic seconds (starts at ``start``); ``wall()`` is epoch seconds
    (``wall_offset + clock()``), so sample timestamps are deterministic.
    """

    def __init__(self, start: float = 1000.0, wall_offset: float = 1_767_225_600.0 - 1000.0) -> None:
        self.t = start
        self.wall_offset = wall_offset

    def __call__(self) -> float:
        return self.t

    def wall(self) -> float:
        return self.wall_offset + self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t


def load_fixture(name: str, **kw: Any) -> FakeNvml:
    """``FakeNvml.from_spec`` of ``tests/fixtures/nvml/<name>.json``."""
    with open(FIXTURES_DIR / f"{name}.json", encoding="utf-8") as f:
        return FakeNvml.from_spec(json.load(f), **kw)


class _GpmSample:
    __slots__ = ("buf", "filled", "freed", "gpu", "gpu_instance_id", "time")

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.filled = False
        self.freed = False
        self.gpu: FakeGpu | None = None
        self.gpu_instance_id: int | None = None
        self.time = 0.0


class FakeNvml(SessionMixin, EventSetsMixin, OperationalEventsMixin, TopologyMixin):
    """The fake module object: pass it wherever ``pynvml`` is expected."""

    def __init__(
        self,
        gpus: Iterable[FakeGpu] = (),
        *,
        driver_version: str = "570.124.06",
        init_error: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        event_delivery: str = "own-set",
        operational_events: bool | None = None,
    ) -> None:
        if event_delivery not in EVENT_DELIVERY:
            raise ValueError(f"event_delivery: one of {EVENT_DELIVERY}, not {event_delivery!r}")
        self.gpus: list[FakeGpu] = []
        #: How events reach sets: see tests/fake_nvml_events.py ("any-set": as NVIDIA's mock).
        self.event_delivery = event_delivery
        self._pending_any: deque[tuple[FakeGpu, int, int, int, int]] = deque()
        self._ever_registered: dict[int, int] = {}  # gpu index -> event types it registered
        self.driver_version = driver_version
        #: GPU Operational Events (tests/fake_nvml_operational.py): by default where the driver has them.
        self.operational_events = (
            _driver_major(driver_version) >= 615 if operational_events is None else operational_events
        )
        self._op_sets: dict[int, _OpSet] = {}
        self._op_ever: set[int] = set()
        self._op_pending_any: deque[Any] = deque()
        self._op_trace = 0
        self.init_error = init_error
        self.clock = clock
        self.process_names: dict[int, str] = {}
        self.calls: Counter[tuple[str, int | None]] = Counter()
        self.field_requests: Counter[tuple[int, int]] = Counter()  # (gpu index, field id)
        self.unimplemented_calls: set[str] = set()
        self.gpm_too_close = 0  # nvmlGpmMetricsGet on samples < 100 ms apart
        self.free_while_waiting = 0  # nvmlEventSetFree while a wait was in flight
        self._lock = threading.Condition()
        self._keep: list[Any] = []  # buffers behind handed-out pointers
        self._handles: dict[int, tuple[FakeGpu, FakeMigSlice | None]] = {}
        self._gpu_handle: dict[int, Any] = {}  # gpu index -> its handle
        self._slice_handle: dict[tuple[int, int], Any] = {}  # (gpu index, slice idx) -> handle
        self._gpm: dict[int, _GpmSample] = {}
        self._sets: dict[int, _EventSet] = {}
        self._stuck: dict[int, threading.Event] = {}  # gpu index -> set when its waits return
        self.stuck_waits = 0  # event waits blocked in "the driver" now (stick_event_waits)
        self._util_ts = 0
        self.ancestor_overrides: dict[tuple[int, int], int] = {}
        for g in gpus:
            self.add_gpu(g)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def node(cls, model: str = "H100", count: int = 8, **kw: Any) -> FakeNvml:
        """A node of ``count`` identical GPUs (DGX bus ids, NUMA 0 for 0-3, 1 for 4-7)."""
        return cls([FakeGpu(i, model=model) for i in range(count)], **kw)

    @classmethod
    def from_values(cls, values: Sequence[Mapping[str, Any]], model: str = "H100", **kw: Any) -> FakeNvml:
        """One GPU per mapping of NVML-unit values (``FakeGpu.VALUE_NAMES``)."""
        return cls([FakeGpu(i, model=model, **dict(v)) for i, v in enumerate(values)], **kw)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], **kw: Any) -> FakeNvml:
        """A node from a JSON-able description (the format of ``tests/fixtures/nvml/*.json``).

        ``{"driver_version": ..., "process_names": {pid: name}, "gpus": [{"model": "H100",
        "values": {...NVML units...}, "unsupported": [fn names], "unsupported_fields": [ids],
        "unsupported_gpm_metrics": [ids], "gpm": {metric id: value}, "events_supported": bool,
        "processes": [{FakeProcess fields}], "mig": ["3g.40gb" or {FakeMigSlice fields}]}]}``.
        """
        gpus = []
        for i, g in enumerate(spec.get("gpus", [])):
            mig = None
            if g.get("mig") is not None:
                mig = [
                    m
                    if isinstance(m, str)
                    else FakeMigSlice(
                        **{k: v for k, v in m.items() if k not in ("processes", "gpm")},
                        processes=[FakeProcess(**p) for p in m.get("processes", [])],
                        gpm={int(k): v for k, v in m.get("gpm", GPM_DEFAULTS).items()},
                    )
                    for m in g["mig"]
                ]
            gpus.append(
                FakeGpu(
                    i,
                    model=g.get("model", "H100"),
                    uuid=g.get("uuid"),
                    pci_bus_id=g.get("pci_bus_id"),
                    mig=mig,
                    processes=[FakeProcess(**p) for p in g.get("processes", [])],
                    unsupported=g.get("unsupported", ()),
                    unsupported_fields=g.get("unsupported_fields", ()),
                    unsupported_gpm_metrics=g.get("unsupported_gpm_metrics", ()),
                    events_supported=g.get("events_supported", True),
                    gpm=None if "gpm" not in g else {int(k): v for k, v in g["gpm"].items()},
                    **g.get("values", {}),
                )
            )
        fake = cls(gpus, driver_version=spec.get("driver_version", "570.124.06"), **kw)
        fake.process_names.update({int(k): v for k, v in spec.get("process_names", {}).items()})
        return fake

    def add_gpu(self, gpu: FakeGpu) -> FakeGpu:
        gpu.index = len(self.gpus)
        gpu._fake = self
        self.gpus.append(gpu)
        self._gpu_handle[gpu.index] = self._pointer(_real.c_nvmlDevice_t, (gpu, None))
        self._register_slices(gpu)
        for p in gpu.processes:
            self.process_names.setdefault(p.pid, p.name or "")
        return gpu

    def set_values(self, index: int, **values: Any) -> None:
        """Set NVML-unit values of GPU ``index`` (see ``FakeGpu.VALUE_NAMES``)."""
        self.gpus[index].set_values(**values)

    def set_gpm(self, index: int, metrics: Mapping[int, float], gpu_instance_id: int | None = None) -> None:
        gpu = self.gpus[index]
        target = gpu.gpm if gpu_instance_id is None else self._slice(gpu, gpu_instance_id).gpm
        target.update(metrics)

    def set_from_sample(self, index: int, **sample: Any) -> None:
        """Drive GPU ``index`` from GpuSample-unit values (``power_w=350.0``, ``gpu_util_ratio=0.9``...).

        For the simulated fleet: what it would publish, converted back to what NVML would say.
        """
        gpu = self.gpus[index]
        for name, value in sample.items():
            conv = _FROM_SAMPLE.get(name)
            if conv is None:
                raise TypeError(f"no NVML source for GpuSample field {name!r}")
            conv(gpu, value)

    def count(self, fn_name: str, gpu: int | None = None) -> int:
        """How many times ``fn_name`` was called (on GPU ``gpu``, or in total)."""
        if gpu is not None:
            return self.calls[(fn_name, gpu)]
        return sum(n for (name, _), n in self.calls.items() if name == fn_name)

    def reset_counts(self) -> None:
        self.calls.clear()
        self.field_requests.clear()

    @property
    def allocated_gpm_samples(self) -> int:
        return sum(1 for s in self._gpm.values() if not s.freed)

    # -- module surface: attribute fallback ---------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        value = getattr(_real, name)  # AttributeError like the real module for unknown names
        if isinstance(value, types.FunctionType) and name.startswith("nvml") and name not in _PURE_HELPERS:
            return self._unimplemented(name)
        return value

    def _unimplemented(self, name: str) -> Callable[..., Any]:
        def stub(*args: Any, **kwargs: Any) -> Any:
            self.unimplemented_calls.add(name)
            raise _err(_real.NVML_ERROR_FUNCTION_NOT_FOUND)

        stub.__name__ = name
        return stub

    # -- internals ------------------------------------------------------------------------------
    def _pointer(self, ptr_type: Any, target: Any = None) -> Any:
        buf = ctypes.create_string_buffer(8)
        self._keep.append(buf)
        if target is not None:
            self._handles[ctypes.addressof(buf)] = target
        return ctypes.cast(buf, ptr_type)

    def _register_slices(self, gpu: FakeGpu) -> None:
        """New handles for the current slices (older MIG handles go stale, as after a GI reset)."""
        for s in gpu.mig_slices:
            self._slice_handle[(gpu.index, s.index or 0)] = self._pointer(_real.c_nvmlDevice_t, (gpu, s))
            for p in s.processes:
                self.process_names.setdefault(p.pid, p.name or "")

    @staticmethod
    def _addr(ptr: Any) -> int | None:
        try:
            return ctypes.cast(ptr, ctypes.c_void_p).value
        except (TypeError, ctypes.ArgumentError):
            return None

    def _check_init(self) -> None:
        if self.init_count <= 0:
            raise _err(_real.NVML_ERROR_UNINITIALIZED)

    def _target(self, fn: str, handle: Any) -> tuple[FakeGpu, FakeMigSlice | None]:
        self._check_init()
        target = self._handles.get(self._addr(handle))  # type: ignore[arg-type]
        if target is None:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        gpu, sl = target
        self.calls[(fn, gpu.index)] += 1
        if gpu.call_delay_s:
            gpu._hang_over.wait(gpu.call_delay_s)
        if gpu.lost:
            raise _err(_real.NVML_ERROR_GPU_IS_LOST)
        pending = gpu.failures.get(fn)
        if pending:
            raise _err(pending.popleft())
        if sl is not None:
            if not any(sl is s for s in gpu.mig_slices):
                raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)  # a stale MIG handle
            if fn not in _MIG_HANDLE_FUNCTIONS:
                raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        elif gpu.mig_enabled and fn in _NOT_IN_MIG_MODE:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        if fn in gpu.unsupported:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        return gpu, sl

    def _gpu(self, fn: str, handle: Any) -> FakeGpu:
        """A whole-GPU call (MIG handles refused by ``_target``)."""
        return self._target(fn, handle)[0]

    @staticmethod
    def _value(v: Any) -> Any:
        if v is None:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        return v

    def _slice(self, gpu: FakeGpu, gpu_instance_id: int) -> FakeMigSlice:
        for s in gpu.mig_slices:
            if s.gpu_instance_id == gpu_instance_id:
                return s
        raise _err(_real.NVML_ERROR_NOT_FOUND)

    def _now_us(self) -> int:
        self._util_ts = max(self._util_ts + 1, int(self.clock() * 1e6))
        return self._util_ts

    # -- system (init and shutdown: tests/fake_nvml_session.py) ---------------------------------
    def nvmlSystemGetDriverVersion(self) -> str:
        self._check_init()
        self.calls[("nvmlSystemGetDriverVersion", None)] += 1
        return self.driver_version

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        self._check_init()
        self.calls[("nvmlSystemGetProcessName", None)] += 1
        name = self.process_names.get(pid)
        if name is None:
            raise _err(_real.NVML_ERROR_NOT_FOUND)
        return name

    # -- enumeration / identity -----------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        self.calls[("nvmlDeviceGetCount", None)] += 1
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._check_init()
        if not 0 <= index < len(self.gpus):
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        self.calls[("nvmlDeviceGetHandleByIndex", index)] += 1
        if gpu.lost:
            raise _err(_real.NVML_ERROR_GPU_IS_LOST)
        # A new pointer object to the same address, as ctypes gives for every call.
        return ctypes.cast(self._gpu_handle[index], _real.c_nvmlDevice_t)

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return self._gpu("nvmlDeviceGetMinorNumber", handle).minor

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return self._target("nvmlDeviceGetIndex", handle)[0].index

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        gpu, sl = self._target("nvmlDeviceGetUUID", handle)
        return sl.uuid if sl is not None else gpu.uuid

    # Identity label rows (values shaped like an HGX H100's nvidia-smi -q; MIG handles answer for the parent).
    def nvmlDeviceGetSerial(self, handle: Any) -> str:
        gpu, _ = self._target("nvmlDeviceGetSerial", handle)
        return f"165322{int(gpu.uuid[-6:], 16) % 10**7:07d}"

    def nvmlDeviceGetVbiosVersion(self, handle: Any) -> str:
        self._target("nvmlDeviceGetVbiosVersion", handle)
        return "96.00.99.00.01"

    def nvmlDeviceGetInforomImageVersion(self, handle: Any) -> str:
        self._target("nvmlDeviceGetInforomImageVersion", handle)
        return "G520.0200.00.05"

    def nvmlDeviceGetBrand(self, handle: Any) -> int:
        self._target("nvmlDeviceGetBrand", handle)
        return 14  # NVML_BRAND_NVIDIA: what data-center GPUs report

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._check_init()
        self.calls[("nvmlSystemGetNVMLVersion", None)] += 1
        return "12." + self.driver_version

    def nvmlDeviceGetName(self, handle: Any) -> str:
        gpu, sl = self._target("nvmlDeviceGetName", handle)
        return f"{gpu.name} MIG {sl.profile}" if sl is not None else gpu.name

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        gpu = self._gpu("nvmlDeviceGetPciInfo", handle)
        info = _real.nvmlPciInfo_t()
        domain, bus, rest = gpu.pci_bus_id.split(":")
        dev, _fn = rest.split(".")
        info.busIdLegacy = gpu.pci_bus_id[4:]
        info.busId = gpu.pci_bus_id
        info.domain = int(domain, 16)
        info.bus = int(bus, 16)
        info.device = int(dev, 16)
        info.pciDeviceId = 0x233010DE
        info.pciSubSystemId = 0x16C110DE
        return info

    nvmlDeviceGetPciInfo_v3 = nvmlDeviceGetPciInfo

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        # The GPU's own NUMA node where its memory is onlined as one (GB200); NotSupported on x86.
        return self._value(self._gpu("nvmlDeviceGetNumaNodeId", handle).gpu_numa_node)

    def nvmlDeviceGetMemoryAffinity(self, handle: Any, nodeSetSize: int, scope: int) -> list[int]:
        # The CPU NUMA node(s) the GPU is attached to, as a bitmask (the mock answers [1, 0, ...]).
        node = self._value(self._gpu("nvmlDeviceGetMemoryAffinity", handle).numa_node)
        return [1 << node if node >= 0 else 0] + [0] * (nodeSetSize - 1)

    def nvmlDeviceGetArchitecture(self, handle: Any) -> int:
        return self._gpu("nvmlDeviceGetArchitecture", handle).arch

    # -- fast-group calls -----------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu = self._gpu("nvmlDeviceGetUtilizationRates", handle)
        u = _real.c_nvmlUtilization_t()
        u.gpu = self._value(gpu.util_gpu)
        u.memory = self._value(gpu.util_memory)
        return u

    def nvmlDeviceGetEncoderUtilization(self, handle: Any) -> list[int]:
        gpu = self._gpu("nvmlDeviceGetEncoderUtilization", handle)
        return [self._value(gpu.enc_util), 167_000]

    def nvmlDeviceGetDecoderUtilization(self, handle: Any) -> list[int]:
        gpu = self._gpu("nvmlDeviceGetDecoderUtilization", handle)
        return [self._value(gpu.dec_util), 167_000]

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        gpu, sl = self._target("nvmlDeviceGetMemoryInfo", handle)
        src = sl if sl is not None else gpu
        total, used, reserved = (self._value(src.fb_total), self._value(src.fb_used), src.fb_reserved or 0)
        if not version:
            m = _real.c_nvmlMemory_t()
            m.total, m.used = total, used + reserved  # v1 counts the reserved memory as used
            m.free = total - used - reserved
            return m
        if version != _real.nvmlMemory_v2:
            raise _err(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if "nvmlDeviceGetMemoryInfo_v2" in gpu.unsupported:
            raise _err(_real.NVML_ERROR_FUNCTION_NOT_FOUND)  # an older driver without the v2 symbol
        m2 = _real.c_nvmlMemory_v2_t()
        m2.version = version
        m2.total, m2.used, m2.reserved = total, used, reserved
        m2.free = total - used - reserved
        return m2

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> Any:
        return self._value(self._gpu("nvmlDeviceGetPowerUsage", handle).power_mw)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> Any:
        return self._value(self._gpu("nvmlDeviceGetEnforcedPowerLimit", handle).power_limit_mw)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> Any:
        return self._value(self._gpu("nvmlDeviceGetTotalEnergyConsumption", handle).energy_mj)

    def nvmlDeviceGetTemperatureV(
        self, handle: Any, sensor: int, version: int = _real.nvmlTemperature_v1
    ) -> Any:
        gpu = self._gpu("nvmlDeviceGetTemperatureV", handle)
        if version != _real.nvmlTemperature_v1:
            raise _err(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if sensor != _real.NVML_TEMPERATURE_GPU:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self._value(gpu.gpu_temp_c)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> Any:
        gpu = self._gpu("nvmlDeviceGetTemperature", handle)
        if sensor != _real.NVML_TEMPERATURE_GPU:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self._value(gpu.gpu_temp_c)

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> Any:
        gpu = self._gpu("nvmlDeviceGetClockInfo", handle)
        if type == _real.NVML_CLOCK_SM:
            return self._value(gpu.sm_clock_mhz)
        if type == _real.NVML_CLOCK_MEM:
            return self._value(gpu.mem_clock_mhz)
        raise _err(_real.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> Any:
        return self._value(self._gpu("nvmlDeviceGetCurrentClocksEventReasons", handle).clock_event_reasons)

    def nvmlDeviceGetViolationStatus(self, device: Any, perfPolicyType: int) -> Any:
        gpu = self._gpu("nvmlDeviceGetViolationStatus", device)
        if perfPolicyType == _real.NVML_PERF_POLICY_POWER:
            value = gpu.power_violation_ns
        elif perfPolicyType == _real.NVML_PERF_POLICY_THERMAL:
            value = gpu.thermal_violation_ns
        else:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        v = _real.c_nvmlViolationTime_t()
        v.referenceTime = int(self.clock() * 1e6)
        v.violationTime = self._value(value)
        return v

    def nvmlDeviceGetPcieThroughput(self, device: Any, counter: int) -> Any:
        gpu = self._gpu("nvmlDeviceGetPcieThroughput", device)
        if counter == _real.NVML_PCIE_UTIL_TX_BYTES:
            return self._value(gpu.pcie_tx_kbps)
        if counter == _real.NVML_PCIE_UTIL_RX_BYTES:
            return self._value(gpu.pcie_rx_kbps)
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)

    # -- slow-group calls -----------------------------------------------------------------------
    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> Any:
        return self._value(self._gpu("nvmlDeviceGetPcieReplayCounter", handle).pcie_replay)

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> Any:
        gpu = self._gpu("nvmlDeviceGetTotalEccErrors", handle)
        table = {
            (_real.NVML_MEMORY_ERROR_TYPE_CORRECTED, _real.NVML_VOLATILE_ECC): gpu.ecc_sbe_volatile,
            (_real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, _real.NVML_VOLATILE_ECC): gpu.ecc_dbe_volatile,
            (_real.NVML_MEMORY_ERROR_TYPE_CORRECTED, _real.NVML_AGGREGATE_ECC): gpu.ecc_sbe_aggregate,
            (_real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, _real.NVML_AGGREGATE_ECC): gpu.ecc_dbe_aggregate,
        }
        if (errorType, counterType) not in table:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self._value(table[(errorType, counterType)])

    def nvmlDeviceGetRetiredPages(self, device: Any, sourceFilter: int) -> list[int]:
        gpu = self._gpu("nvmlDeviceGetRetiredPages", device)
        if sourceFilter == _real.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS:
            return list(self._value(gpu.retired_pages_sbe))
        if sourceFilter == _real.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR:
            return list(self._value(gpu.retired_pages_dbe))
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        return int(self._value(self._gpu("nvmlDeviceGetRetiredPagesPendingStatus", device).retired_pending))

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[Any, Any, Any, Any]:
        gpu = self._gpu("nvmlDeviceGetRemappedRows", device)
        return (
            self._value(gpu.remapped_correctable),
            self._value(gpu.remapped_uncorrectable),
            self._value(gpu.remap_pending),
            self._value(gpu.remap_failure),
        )

    def nvmlDeviceGetBankRemapperStatus_v1(self, device: Any, status: Any) -> int:
        gpu = self._gpu("nvmlDeviceGetBankRemapperStatus_v1", device)
        status = _by_reference(status, "nvmlDeviceGetBankRemapperStatus_v1")
        status.bPending = self._value(gpu.bank_remap_pending)
        status.activeRemappings = self._value(gpu.bank_remaps_active)
        return _real.NVML_SUCCESS

    def nvmlDeviceGetUnrepairableMemoryFlag_v1(self, device: Any) -> int:
        gpu = self._gpu("nvmlDeviceGetUnrepairableMemoryFlag_v1", device)
        flag = _real.c_nvmlUnrepairableMemory_v1_t()  # what the binding returns: its c_uint member
        flag.unrepairableMemory = self._value(gpu.memory_unrepairable)
        return int(flag.unrepairableMemory)

    # -- field values ---------------------------------------------------------------------------
    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Sequence[Any]) -> Any:
        gpu = self._gpu("nvmlDeviceGetFieldValues", handle)
        values = (_real.c_nvmlFieldValue_t * len(fieldIds))()
        ts = int(self.clock() * 1e6)
        for i, spec in enumerate(fieldIds):
            fv = values[i]
            try:
                fv.fieldId, fv.scopeId = spec
            except TypeError:
                fv.fieldId = spec
            fv.timestamp = ts
            fv.latencyUsec = 0
            self.field_requests[(gpu.index, int(fv.fieldId))] += 1
            ret, vtype, value = self._field(gpu, int(fv.fieldId), int(fv.scopeId))
            fv.nvmlReturn = ret
            if ret == _real.NVML_SUCCESS:
                if isinstance(value, float):
                    vtype = _real.NVML_VALUE_TYPE_DOUBLE
                fv.valueType = vtype
                member = _VALUE_MEMBER[vtype]
                setattr(fv.value, member, value)
        return values

    def _field(self, gpu: FakeGpu, fid: int, scope: int) -> tuple[int, int, Any]:
        if fid in gpu.unsupported_fields:
            return _real.NVML_ERROR_NOT_SUPPORTED, 0, None
        scoped = _scoped_field(gpu, fid, scope)
        if scoped is not None:
            return scoped
        getter = _FIELDS.get(fid)
        if getter is None:
            return _real.NVML_ERROR_NOT_SUPPORTED, 0, None
        vtype, read, per_link = getter
        if per_link:
            if gpu.nvlink_links == 0:
                return _real.NVML_ERROR_NOT_SUPPORTED, 0, None
            if scope != UINT_MAX and scope >= gpu.nvlink_links:
                return _real.NVML_ERROR_INVALID_ARGUMENT, 0, None
        value = read(gpu)
        if value is None:
            return _real.NVML_ERROR_NOT_SUPPORTED, 0, None
        if per_link and scope != UINT_MAX and isinstance(value, int):
            value //= gpu.nvlink_links
        elif per_link and gpu.nvlink_aggregate_zero:
            value = 0
        return _real.NVML_SUCCESS, vtype, value

    def nvmlDeviceGetGpuFabricInfoV(self, device: Any, gpuFabricInfo: Any) -> int:
        gpu = self._gpu("nvmlDeviceGetGpuFabricInfoV", device)
        gpuFabricInfo = _by_reference(gpuFabricInfo, "nvmlDeviceGetGpuFabricInfoV")
        if gpu.fabric is None:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        for key, value in gpu.fabric.items():
            if key == "clusterUuid":
                ctypes.memmove(gpuFabricInfo.clusterUuid, bytes(value), min(16, len(value)))
            elif key != "healthSummary" or hasattr(gpuFabricInfo, "healthSummary"):
                setattr(gpuFabricInfo, key, value)
        return _real.NVML_SUCCESS

    def nvmlDeviceGetPlatformInfo(self, device: Any, platformInfo: Any) -> int:
        gpu = self._gpu("nvmlDeviceGetPlatformInfo", device)
        platformInfo = _by_reference(platformInfo, "nvmlDeviceGetPlatformInfo")
        if gpu.platform is None:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        for key, value in gpu.platform.items():
            setattr(platformInfo, key, bytes([value]) if isinstance(value, int) else value)
        return _real.NVML_SUCCESS

    # -- GPM --------------------------------------------------------------------------------------
    def nvmlGpmQueryDeviceSupport(self, device: Any) -> Any:
        gpu, _ = self._target("nvmlGpmQueryDeviceSupport", device)
        s = _real.c_nvmlGpmSupport_t()
        s.version = _real.NVML_GPM_SUPPORT_VERSION
        s.isSupportedDevice = 1 if gpu.gpm_supported else 0
        return s

    def nvmlGpmSampleAlloc(self) -> Any:
        self._check_init()
        self.calls[("nvmlGpmSampleAlloc", None)] += 1
        ptr = self._pointer(_real.c_nvmlGpmSample_t)
        self._gpm[self._addr(ptr)] = _GpmSample(self._keep[-1])  # type: ignore[index]
        return ptr

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        self._check_init()
        self.calls[("nvmlGpmSampleFree", None)] += 1
        s = self._gpm.get(self._addr(gpmSample))  # type: ignore[arg-type]
        if s is None or s.freed:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        s.freed = True

    def _fill(self, gpmSample: Any, gpu: FakeGpu, gpu_instance_id: int | None) -> Any:
        s = self._gpm.get(self._addr(gpmSample))  # type: ignore[arg-type]
        if s is None or s.freed:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        if not gpu.gpm_supported:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        s.filled, s.gpu, s.gpu_instance_id, s.time = True, gpu, gpu_instance_id, self.clock()
        return gpmSample

    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> Any:
        gpu = self._gpu("nvmlGpmSampleGet", device)
        return self._fill(gpmSample, gpu, None)

    def nvmlGpmMigSampleGet(self, device: Any, gpuInstanceId: int, gpmSample: Any) -> Any:
        gpu = self._gpu("nvmlGpmMigSampleGet", device)
        if not gpu.mig_enabled:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        self._slice(gpu, gpuInstanceId)
        return self._fill(gpmSample, gpu, gpuInstanceId)

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        self._check_init()
        self.calls[("nvmlGpmMetricsGet", None)] += 1
        mg = metricsGet
        if mg.version != _real.NVML_GPM_METRICS_GET_VERSION:
            raise _err(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        s1 = self._gpm.get(self._addr(mg.sample1))  # type: ignore[arg-type]
        s2 = self._gpm.get(self._addr(mg.sample2))  # type: ignore[arg-type]
        for s in (s1, s2):
            if s is None or s.freed or not s.filled:
                raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        assert s1 is not None and s2 is not None and s2.gpu is not None
        if s1.gpu is not s2.gpu or s1.gpu_instance_id != s2.gpu_instance_id:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        if s2.gpu.lost:
            raise _err(_real.NVML_ERROR_GPU_IS_LOST)
        if abs(s2.time - s1.time) < 0.1:
            self.gpm_too_close += 1
        gpu = s2.gpu
        values = gpu.gpm if s2.gpu_instance_id is None else self._slice(gpu, s2.gpu_instance_id).gpm
        if not 0 < mg.numMetrics <= _real.NVML_GPM_METRIC_MAX:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        for i in range(mg.numMetrics):
            m = mg.metrics[i]
            v = values.get(int(m.metricId))
            if v is None or m.metricId in gpu.unsupported_gpm_metrics:
                m.nvmlReturn, m.value = _real.NVML_ERROR_NOT_SUPPORTED, 0.0
            else:
                m.nvmlReturn, m.value = _real.NVML_SUCCESS, float(v)
        return mg

    # -- MIG --------------------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        gpu = self._gpu("nvmlDeviceGetMigMode", device)
        if not gpu.mig_capable:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        mode = _real.NVML_DEVICE_MIG_ENABLE if gpu.mig_enabled else _real.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        gpu = self._gpu("nvmlDeviceGetMaxMigDeviceCount", device)
        return gpu.mig_max_slices if gpu.mig_enabled else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        gpu = self._gpu("nvmlDeviceGetMigDeviceHandleByIndex", device)
        if not gpu.mig_enabled:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        for s in gpu.mig_slices:
            if s.index == index:
                return ctypes.cast(self._slice_handle[(gpu.index, index)], _real.c_nvmlDevice_t)
        raise _err(_real.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> Any:
        _, sl = self._target("nvmlDeviceIsMigDeviceHandle", device)
        return ctypes.c_uint(1 if sl is not None else 0)  # the binding returns the c_uint itself

    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        _, sl = self._target("nvmlDeviceGetGpuInstanceId", device)
        if sl is None:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return sl.gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        _, sl = self._target("nvmlDeviceGetComputeInstanceId", device)
        if sl is None:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return sl.compute_instance_id

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> Any:
        gpu, sl = self._target("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", migDevice)
        if sl is None:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return ctypes.cast(self._gpu_handle[gpu.index], _real.c_nvmlDevice_t)

    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: Any, profile: int, version: int = 2) -> Any:
        gpu = self._gpu("nvmlDeviceGetGpuInstanceProfileInfo", device)
        if not gpu.mig_capable:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        slices = _GI_PROFILE_SLICES.get(profile)
        if slices is None or slices > gpu.mig_max_slices or slices not in gpu.model.mig_memory:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        info = (
            _real.c_nvmlGpuInstanceProfileInfo_v2_t()
            if version == 2
            else _real.c_nvmlGpuInstanceProfileInfo_t()
        )
        info.id = profile
        info.sliceCount = slices
        info.instanceCount = gpu.mig_max_slices // slices
        info.memorySizeMB = gpu.model.fb_total * slices // 8 // MIB
        if version == 2:
            info.name = f"MIG {slices}g.{gpu.model.mig_memory[slices]}"
        return info

    # -- processes ------------------------------------------------------------------------------
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        gpu, sl = self._target("nvmlDeviceGetComputeRunningProcesses", handle)
        if sl is not None:
            procs = sl.processes
        elif gpu.mig_enabled:
            procs = [p for s in gpu.mig_slices for p in s.processes]
        else:
            procs = gpu.processes
        return [
            _real.nvmlFriendlyObject(
                {
                    "pid": p.pid,
                    "usedGpuMemory": p.used_memory,
                    "gpuInstanceId": p.gpu_instance_id,
                    "computeInstanceId": p.compute_instance_id,
                }
            )
            for p in procs
        ]

    nvmlDeviceGetComputeRunningProcesses_v3 = nvmlDeviceGetComputeRunningProcesses

    @staticmethod
    def _proc_objects(procs: Iterable[FakeProcess]) -> list[Any]:
        return [
            _real.nvmlFriendlyObject(
                {
                    "pid": p.pid,
                    "usedGpuMemory": p.used_memory,
                    "gpuInstanceId": p.gpu_instance_id,
                    "computeInstanceId": p.compute_instance_id,
                }
            )
            for p in procs
        ]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        gpu, sl = self._target("nvmlDeviceGetGraphicsRunningProcesses", handle)
        return self._proc_objects([] if sl is not None else gpu.graphics_processes)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[Any]:
        gpu, sl = self._target("nvmlDeviceGetMPSComputeRunningProcesses", handle)
        if gpu.mps_processes is None:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        return self._proc_objects([] if sl is not None else gpu.mps_processes)

    def nvmlDeviceGetSamples(self, device: Any, sampling_type: int, timeStamp: int) -> Any:
        gpu = self._gpu("nvmlDeviceGetSamples", device)
        if gpu.util_periods is None:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        out = []
        for ts in gpu.util_periods:
            if ts > timeStamp:
                s = _real.c_nvmlSample_t()
                s.timeStamp = ts
                out.append(s)
        if not out:
            raise _err(_real.NVML_ERROR_NOT_FOUND)
        return _real.NVML_VALUE_TYPE_UNSIGNED_INT, out

    def nvmlDeviceGetProcessUtilization(self, handle: Any, timeStamp: int) -> list[Any]:
        gpu = self._gpu("nvmlDeviceGetProcessUtilization", handle)
        if gpu.util_samples is not None:
            out = []
            for ts_us, pid, sm, mem in gpu.util_samples:
                if ts_us > timeStamp:
                    s = _real.c_nvmlProcessUtilizationSample_t()
                    s.pid, s.timeStamp, s.smUtil, s.memUtil, s.encUtil, s.decUtil = pid, ts_us, sm, mem, 0, 0
                    out.append(s)
            if not out:
                raise _err(gpu.no_process_samples_code)
            return out
        ts = self._now_us()
        out = []
        for p in gpu.processes:
            if p.sm_util is None and p.mem_util is None:
                continue
            s = _real.c_nvmlProcessUtilizationSample_t()
            s.pid, s.timeStamp = p.pid, ts
            s.smUtil, s.memUtil, s.encUtil, s.decUtil = p.sm_util or 0, p.mem_util or 0, 0, 0
            if ts > timeStamp:
                out.append(s)
        if not out:
            raise _err(gpu.no_process_samples_code)
        return out


_VALUE_MEMBER = {
    _real.NVML_VALUE_TYPE_DOUBLE: "dVal",
    _real.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    _real.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    _real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    _real.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    _real.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    _real.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}
_UI = _real.NVML_VALUE_TYPE_UNSIGNED_INT
_ULL = _real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG

# field id -> (value type, reader, per-link field)
_FIELDS: dict[int, tuple[int, Callable[[FakeGpu], Any], bool]] = {
    _real.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: (_ULL, lambda g: g.ecc_sbe_volatile, False),
    _real.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: (_ULL, lambda g: g.ecc_dbe_volatile, False),
    _real.NVML_FI_DEV_ECC_SBE_AGG_TOTAL: (_ULL, lambda g: g.ecc_sbe_aggregate, False),
    _real.NVML_FI_DEV_ECC_DBE_AGG_TOTAL: (_ULL, lambda g: g.ecc_dbe_aggregate, False),
    _real.NVML_FI_DEV_MEMORY_TEMP: (_UI, lambda g: g.memory_temp_c, False),
    _real.NVML_FI_DEV_PCIE_REPLAY_COUNTER: (_UI, lambda g: g.pcie_replay, False),
    _real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: (_ULL, lambda g: g.nvlink_tx_kib, True),
    _real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: (_ULL, lambda g: g.nvlink_rx_kib, True),
    _real.NVML_FI_DEV_REMAPPED_COR: (_UI, lambda g: g.remapped_correctable, False),
    _real.NVML_FI_DEV_REMAPPED_UNC: (_UI, lambda g: g.remapped_uncorrectable, False),
    _real.NVML_FI_DEV_REMAPPED_PENDING: (_UI, lambda g: g.remap_pending, False),
    _real.NVML_FI_DEV_REMAPPED_FAILURE: (_UI, lambda g: g.remap_failure, False),
    _real.NVML_FI_DEV_POWER_AVERAGE: (_UI, lambda g: g.power_mw, False),
    _real.NVML_FI_DEV_POWER_CURRENT_LIMIT: (_UI, lambda g: g.power_limit_mw, False),
    _real.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: (_ULL, lambda g: g.pcie_tx_count_bytes, False),
    _real.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: (_ULL, lambda g: g.pcie_rx_count_bytes, False),
    _real.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION: (_ULL, lambda g: g.energy_mj, False),
    _real.NVML_FI_DEV_PERF_POLICY_POWER: (_ULL, lambda g: g.power_violation_ns, False),
    _real.NVML_FI_DEV_PERF_POLICY_THERMAL: (_ULL, lambda g: g.thermal_violation_ns, False),
    _real.NVML_FI_DEV_POWER_INSTANT: (_UI, lambda g: g.power_mw, False),
    _real.NVML_FI_DEV_ENERGY: (_ULL, lambda g: g.energy_mj, False),
    _real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: (_UI, lambda g: g.recovery_action, False),
    **{
        fid: (
            _UI,
            lambda g, fid=fid: None if g.power_smoothing is None else g.power_smoothing.get(fid),
            False,
        )
        for fid in (
            _real.NVML_FI_PWR_SMOOTHING_ENABLED,
            _real.NVML_FI_PWR_SMOOTHING_ACTIVE_PRESET_PROFILE,
            _real.NVML_FI_PWR_SMOOTHING_APPLIED_TMP_CEIL,
            _real.NVML_FI_PWR_SMOOTHING_APPLIED_TMP_FLOOR,
            _real.NVML_FI_PWR_SMOOTHING_HW_CIRCUITRY_PERCENT_LIFETIME_REMAINING,
        )
    },
    **{
        fid: (_ULL, lambda g, fid=fid: g.nvlink_error_totals.get(fid, 0) if g.nvlink_links else None, False)
        for fid in (
            _real.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
            _real.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
            _real.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
            _real.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL,
        )
    },
}


def _by_reference(arg: Any, fn: str) -> Any:
    """The struct behind ``ctypes.byref(struct)``. A struct passed by value is refused loudly: the
    real binding would hand it to C as is, and the C function reads it as a pointer (NVIDIA's mock
    crashes with a wild pointer)."""
    target = getattr(arg, "_obj", None)
    if target is None:
        raise TypeError(f"{fn} takes ctypes.byref(struct), got {type(arg).__name__}")
    return target


def _scoped_field(gpu: FakeGpu, fid: int, scope: int) -> tuple[int, int, Any] | None:
    """Fields whose answer depends on the scope (link id, module): None for the others."""
    ok, nsup, inval = _real.NVML_SUCCESS, _real.NVML_ERROR_NOT_SUPPORTED, _real.NVML_ERROR_INVALID_ARGUMENT
    if fid in (_real.NVML_FI_DEV_POWER_AVERAGE, _real.NVML_FI_DEV_ENERGY) and scope == 1:
        value = gpu.module_power_mw if fid == _real.NVML_FI_DEV_POWER_AVERAGE else gpu.module_energy_mj
        return (nsup, 0, None) if value is None else (ok, _ULL, value)
    if fid == _real.NVML_FI_DEV_NVLINK_LINK_COUNT:
        return ok, _UI, gpu.nvlink_links
    per_link = {
        _real.NVML_FI_DEV_NVLINK_GET_STATE: lambda link: 0 if link in gpu.nvlink_down else 1,
        _real.NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS: lambda link: gpu.nvlink_rcv_errors.get(link, 0),
        _real.NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS: lambda link: gpu.nvlink_symbol_errors.get(link, 0),
        _real.NVML_FI_DEV_NVLINK_COUNT_LINK_RECOVERY_FAILED_EVENTS: lambda link: (
            gpu.nvlink_recovery_failed.get(link, 0)
        ),
    }
    if fid in per_link:
        if gpu.nvlink_links == 0:
            return nsup, 0, None
        if scope >= gpu.nvlink_links:
            return inval, 0, None
        return ok, _ULL if fid != _real.NVML_FI_DEV_NVLINK_GET_STATE else _UI, per_link[fid](scope)
    if fid == _real.NVML_FI_DEV_C2C_LINK_COUNT:
        return (nsup, 0, None) if not gpu.c2c_links else (ok, _UI, gpu.c2c_links)
    if fid == _real.NVML_FI_DEV_C2C_LINK_GET_STATUS:
        if not gpu.c2c_links:
            return nsup, 0, None
        return (inval, 0, None) if scope >= gpu.c2c_links else (ok, _UI, 0 if scope in gpu.c2c_down else 1)
    return None


def _pct(attr: str) -> Callable[[FakeGpu, Any], None]:
    return lambda g, v: setattr(g, attr, None if v is None else round(v * 100))


def _scaled(attr: str, factor: float) -> Callable[[FakeGpu, Any], None]:
    return lambda g, v: setattr(g, attr, None if v is None else round(v * factor))


def _same(attr: str) -> Callable[[FakeGpu, Any], None]:
    return lambda g, v: setattr(g, attr, v)


def _gpm(metric: int, factor: float) -> Callable[[FakeGpu, Any], None]:
    def put(g: FakeGpu, v: Any) -> None:
        if v is None:
            g.gpm.pop(metric, None)
        else:
            g.gpm[metric] = v * factor

    return put


def _pages(attr: str) -> Callable[[FakeGpu, Any], None]:
    return lambda g, v: setattr(g, attr, None if v is None else [0x1000 * (i + 1) for i in range(v)])


def _flag(attr: str) -> Callable[[FakeGpu, Any], None]:
    return lambda g, v: setattr(g, attr, None if v is None else int(bool(v)))


def _nvlink_total(g: FakeGpu, v: Any) -> None:
    g.nvlink_tx_kib = None if v is None else v // 2
    g.nvlink_rx_kib = None if v is None else v - v // 2


# GpuSample field -> how to set the NVML-unit value behind it.
_FROM_SAMPLE: dict[str, Callable[[FakeGpu, Any], None]] = {
    "gpu_util_ratio": _pct("util_gpu"),
    "mem_copy_util_ratio": _pct("util_memory"),
    "enc_util_ratio": _pct("enc_util"),
    "dec_util_ratio": _pct("dec_util"),
    "fb_total_bytes": _same("fb_total"),
    "fb_used_bytes": _same("fb_used"),
    "fb_reserved_bytes": _same("fb_reserved"),
    "power_w": _scaled("power_mw", 1000),
    "power_limit_w": _scaled("power_limit_mw", 1000),
    "total_energy_mj": _same("energy_mj"),
    "gpu_temp_c": _same("gpu_temp_c"),
    "memory_temp_c": _same("memory_temp_c"),
    "sm_clock_mhz": _same("sm_clock_mhz"),
    "mem_clock_mhz": _same("mem_clock_mhz"),
    "clock_event_reasons": _same("clock_event_reasons"),
    "power_violation_ns": _same("power_violation_ns"),
    "thermal_violation_ns": _same("thermal_violation_ns"),
    "pcie_tx_bytes_per_s": _scaled("pcie_tx_kbps", 1 / 1024),
    "pcie_rx_bytes_per_s": _scaled("pcie_rx_kbps", 1 / 1024),
    "pcie_replay_count": _same("pcie_replay"),
    "nvlink_bandwidth_total_kib": _nvlink_total,
    "ecc_sbe_volatile_total": _same("ecc_sbe_volatile"),
    "ecc_dbe_volatile_total": _same("ecc_dbe_volatile"),
    "ecc_sbe_aggregate_total": _same("ecc_sbe_aggregate"),
    "ecc_dbe_aggregate_total": _same("ecc_dbe_aggregate"),
    "retired_pages_sbe": _pages("retired_pages_sbe"),
    "retired_pages_dbe": _pages("retired_pages_dbe"),
    "retired_pages_pending": _flag("retired_pending"),
    "remapped_rows_correctable": _same("remapped_correctable"),
    "remapped_rows_uncorrectable": _same("remapped_uncorrectable"),
    "row_remap_pending": _flag("remap_pending"),
    "row_remap_failure": _flag("remap_failure"),
    "gpu_recovery_action": _same("recovery_action"),
    "bank_remap_pending": _flag("bank_remap_pending"),
    "bank_remaps_active": _same("bank_remaps_active"),
    "memory_unrepairable": _flag("memory_unrepairable"),
    "gr_engine_active_ratio": _gpm(_real.NVML_GPM_METRIC_GRAPHICS_UTIL, 100),
    "sm_active_ratio": _gpm(_real.NVML_GPM_METRIC_SM_UTIL, 100),
    "sm_occupancy_ratio": _gpm(_real.NVML_GPM_METRIC_SM_OCCUPANCY, 100),
    "tensor_active_ratio": _gpm(_real.NVML_GPM_METRIC_ANY_TENSOR_UTIL, 100),
    "dram_active_ratio": _gpm(_real.NVML_GPM_METRIC_DRAM_BW_UTIL, 100),
    "fp64_active_ratio": _gpm(_real.NVML_GPM_METRIC_FP64_UTIL, 100),
    "fp32_active_ratio": _gpm(_real.NVML_GPM_METRIC_FP32_UTIL, 100),
    "fp16_active_ratio": _gpm(_real.NVML_GPM_METRIC_FP16_UTIL, 100),
    "nvlink_tx_bytes_per_s": _gpm(_real.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC, 1 / MIB),
    "nvlink_rx_bytes_per_s": _gpm(_real.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, 1 / MIB),
}


def _driver_major(version: str) -> int:
    try:
        return int(version.split(".", 1)[0])
    except ValueError:
        return 0
