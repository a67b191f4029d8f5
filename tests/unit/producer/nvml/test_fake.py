"""The fake NVML module is only useful if it behaves like pynvml: these tests pin the surface the
producer relies on (names, return shapes, units, error classes) to the real binding's."""

from __future__ import annotations

import ctypes
import inspect

import pynvml
import pytest

from tests.fake_nvml import GIB, FakeGpu, FakeMigSlice, FakeNvml, FakeProcess, load_fixture

# Every function the producer calls: each must exist in the real binding with compatible arguments.
USED = (
    "nvmlInit",
    "nvmlShutdown",
    "nvmlSystemGetDriverVersion",
    "nvmlSystemGetProcessName",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetNumaNodeId",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetEncoderUtilization",
    "nvmlDeviceGetDecoderUtilization",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetViolationStatus",
    "nvmlDeviceGetPcieThroughput",
    "nvmlDeviceGetPcieReplayCounter",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRetiredPages",
    "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetFieldValues",
    "nvmlGpmQueryDeviceSupport",
    "nvmlGpmSampleAlloc",
    "nvmlGpmSampleFree",
    "nvmlGpmSampleGet",
    "nvmlGpmMigSampleGet",
    "nvmlGpmMetricsGet",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId",
    "nvmlDeviceIsMigDeviceHandle",
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
    "nvmlDeviceGetGpuInstanceProfileInfo",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetProcessUtilization",
    "nvmlEventSetCreate",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlDeviceRegisterEvents",
    "nvmlEventSetWait_v2",
    "nvmlEventSetFree",
    "nvmlDeviceGetHandleByUUID",
)


@pytest.fixture
def nvml() -> FakeNvml:
    fake = FakeNvml.node("H100", 2)
    fake.nvmlInit()
    return fake


@pytest.mark.parametrize("name", USED)
def test_every_used_function_is_faked_with_the_real_signature(name):
    real = inspect.signature(getattr(pynvml, name))
    fake = inspect.signature(getattr(FakeNvml, name))
    fake_params = list(fake.parameters)[1:]  # drop self
    assert fake_params == list(real.parameters), name
    # Defined on the fake or one of its role modules (tests/fake_nvml_*.py), not the stub fallback.
    assert any(name in vars(k) for k in FakeNvml.__mro__[:-1]), f"{name} falls through to the stub"


def test_constants_structures_and_errors_are_the_real_ones(nvml):
    assert nvml.NVMLError is pynvml.NVMLError
    assert nvml.NVMLError_NotSupported is pynvml.NVMLError_NotSupported
    assert nvml.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost
    assert nvml.nvmlMemory_v2 == pynvml.nvmlMemory_v2
    assert nvml.NVML_FI_DEV_MEMORY_TEMP == 82
    assert nvml.c_nvmlGpmMetricsGet_t is pynvml.c_nvmlGpmMetricsGet_t
    with pytest.raises(AttributeError):
        nvml.no_such_thing  # noqa: B018


def test_errors_raise_the_real_subclasses(nvml):
    nvml.gpus[0].unsupported.add("nvmlDeviceGetPowerUsage")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported) as info:
        nvml.nvmlDeviceGetPowerUsage(h)
    assert str(info.value) == "Not Supported" and info.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
    nvml.gpus[1].lose()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(7)


def test_a_new_session_refuses_old_handles_and_sees_a_reset_gpu(nvml):
    # tests/fake_nvml_session.py: what re-initialising NVML changes.
    old = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.gpus[1].lose()
    nvml.gpus[1].reset()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):  # this session keeps seeing it lost
        nvml.nvmlDeviceGetHandleByIndex(1)
    es = nvml.nvmlEventSetCreate()
    nvml.nvmlInit()
    nvml.nvmlShutdown()  # one reference left: the same session
    assert nvml.sessions == 1 and nvml.nvmlDeviceGetPowerUsage(old) > 0
    nvml.nvmlShutdown()
    assert nvml.live_event_sets() == 0  # the session's sets went with it
    nvml.nvmlInit()
    assert nvml.sessions == 2
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetPowerUsage(old)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlEventSetWait_v2(es, 0)
    h1 = nvml.nvmlDeviceGetHandleByIndex(1)
    assert nvml.nvmlDeviceGetUUID(h1) == nvml.gpus[1].uuid
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByUUID(nvml.gpus[1].uuid)) == nvml.gpus[1].uuid
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetHandleByUUID("GPU-nope")


def test_a_broken_event_channel_fails_every_wait_of_its_sets_before_other_gpus_events(nvml):
    es = nvml.nvmlEventSetCreate()
    for i in (0, 1):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        nvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    nvml.gpus[0].inject_xid(13)
    nvml.gpus[1].event_wait_error = pynvml.NVML_ERROR_UNKNOWN
    for _ in range(2):  # for as long as it is broken, and ahead of GPU 0's queued event
        with pytest.raises(pynvml.NVMLError_Unknown):
            nvml.nvmlEventSetWait_v2(es, 0)
    nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(1), 8, es)  # still registers
    nvml.gpus[1].event_wait_error = None
    assert nvml.nvmlEventSetWait_v2(es, 0).eventData == 13
    nvml.nvmlEventSetFree(es)


def test_unimplemented_functions_raise_function_not_found_and_are_recorded(nvml):
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        nvml.nvmlDeviceGetFanSpeed(h)
    assert nvml.unimplemented_calls == {"nvmlDeviceGetFanSpeed"}
    assert nvml.nvmlExceptionClass(3) is pynvml.NVMLError_NotSupported  # pure helper passes through


def test_uninitialised_calls_fail_like_nvml():
    fake = FakeNvml.node("H100", 1)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    fake.nvmlInit()
    fake.nvmlShutdown()
    assert fake.nvmlDeviceGetCount() == 1  # still one reference
    fake.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlShutdown()


def test_handles_are_ctypes_pointers_with_a_stable_address(nvml):
    a = nvml.nvmlDeviceGetHandleByIndex(0)
    b = nvml.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(a, pynvml.c_nvmlDevice_t)
    assert a is not b
    assert ctypes.cast(a, ctypes.c_void_p).value == ctypes.cast(b, ctypes.c_void_p).value
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetUUID(pynvml.c_nvmlDevice_t())  # NULL handle


def test_identity_and_units_as_pynvml_returns_them(nvml):
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    pci = nvml.nvmlDeviceGetPciInfo(h)
    assert isinstance(pci, pynvml.nvmlPciInfo_t)
    assert pci.busId == "00000000:1B:00.0" and isinstance(pci.busId, str)  # str in 13.x
    assert pci.bus == 0x1B
    assert nvml.nvmlDeviceGetUUID(h).startswith("GPU-")
    assert nvml.nvmlDeviceGetName(h) == "NVIDIA H100 80GB HBM3"
    assert nvml.nvmlDeviceGetPowerUsage(h) == 512_345  # mW
    assert nvml.nvmlDeviceGetTotalEnergyConsumption(h) == 123_456_789_012  # mJ
    assert nvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES) == 123_456  # KB/s
    util = nvml.nvmlDeviceGetUtilizationRates(h)
    assert isinstance(util, pynvml.c_nvmlUtilization_t) and (util.gpu, util.memory) == (87, 42)
    v1 = nvml.nvmlDeviceGetMemoryInfo(h)
    v2 = nvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    assert isinstance(v1, pynvml.c_nvmlMemory_t) and isinstance(v2, pynvml.c_nvmlMemory_v2_t)
    assert v1.free == v2.free and v1.used == v2.used + v2.reserved
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        nvml.nvmlDeviceGetMemoryInfo(h, version=0x1000028)
    assert nvml.nvmlDeviceGetEncoderUtilization(h)[0] == 0
    assert nvml.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_POWER).violationTime == 1_500_000_000
    assert nvml.nvmlDeviceGetRemappedRows(h) == (3, 1, 0, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetRetiredPages(h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)


def test_field_values_carry_their_own_return_codes(nvml):
    nvml.gpus[0].unsupported_fields.add(pynvml.NVML_FI_DEV_MEMORY_TEMP)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    vals = nvml.nvmlDeviceGetFieldValues(
        h,
        [
            pynvml.NVML_FI_DEV_MEMORY_TEMP,
            (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0xFFFFFFFF),
            (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 30),  # beyond the 18 links
            pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION,
        ],
    )
    assert [v.nvmlReturn for v in vals] == [
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_SUCCESS,
        pynvml.NVML_ERROR_INVALID_ARGUMENT,
        pynvml.NVML_SUCCESS,
    ]
    assert (
        vals[1].valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG and vals[1].value.ullVal == 1_000_000
    )
    assert vals[1].scopeId == 0xFFFFFFFF


def test_gpm_through_the_real_metrics_struct(nvml):
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 1
    s1, s2 = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
    nvml.nvmlGpmSampleGet(h, s1)
    nvml.nvmlGpmSampleGet(h, s2)
    mg = pynvml.c_nvmlGpmMetricsGet_t()
    mg.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    mg.numMetrics = 2
    mg.sample1, mg.sample2 = s1, s2
    mg.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
    mg.metrics[1].metricId = 999
    nvml.nvmlGpmMetricsGet(mg)
    assert mg.metrics[0].nvmlReturn == 0 and mg.metrics[0].value == 80.0
    assert mg.metrics[1].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert nvml.gpm_too_close == 1  # the fake clock did not move: flagged
    nvml.nvmlGpmSampleFree(s1)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlGpmMetricsGet(mg)  # a freed sample
    nvml.nvmlGpmSampleFree(s2)
    assert nvml.allocated_gpm_samples == 0


def test_gpm_unsupported_before_hopper():
    fake = FakeNvml([FakeGpu.a100(0)])
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlGpmSampleGet(h, fake.nvmlGpmSampleAlloc())


def test_mig_enumeration_like_nvml():
    fake = FakeNvml(
        [FakeGpu.h100(0, mig=[FakeMigSlice("3g.40gb", 2, index=0), FakeMigSlice("2g.20gb", 5, index=4)])]
    )
    fake.nvmlInit()
    parent = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetMigMode(parent) == [1, 1]
    assert fake.nvmlDeviceGetMaxMigDeviceCount(parent) == 7
    found = []
    for i in range(7):
        try:
            mig = fake.nvmlDeviceGetMigDeviceHandleByIndex(parent, i)
        except pynvml.NVMLError_NotFound:
            continue
        found.append(i)
        flag = fake.nvmlDeviceIsMigDeviceHandle(mig)
        assert isinstance(flag, ctypes.c_uint) and flag.value == 1  # the binding returns the c_uint
        assert fake.nvmlDeviceGetUUID(mig).startswith("MIG-")
        back = fake.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
        assert ctypes.cast(back, ctypes.c_void_p).value == ctypes.cast(parent, ctypes.c_void_p).value
        with pytest.raises(pynvml.NVMLError_NotSupported):
            fake.nvmlDeviceGetPowerUsage(mig)
    assert found == [0, 4]
    mig = fake.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
    assert fake.nvmlDeviceGetName(mig) == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    assert (fake.nvmlDeviceGetGpuInstanceId(mig), fake.nvmlDeviceGetComputeInstanceId(mig)) == (2, 0)
    assert fake.nvmlDeviceIsMigDeviceHandle(parent).value == 0
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetGpuInstanceId(parent)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetUtilizationRates(parent)  # not on MIG-enabled GPUs
    info = fake.nvmlDeviceGetGpuInstanceProfileInfo(parent, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE)
    assert info.sliceCount == 7 and info.name == "MIG 7g.80gb"
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetGpuInstanceProfileInfo(parent, pynvml.NVML_GPU_INSTANCE_PROFILE_8_SLICE)


def test_processes_as_friendly_objects(nvml):
    nvml.gpus[0].processes.append(FakeProcess(42, "python3", used_memory=None))
    nvml.process_names[42] = "python3"
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    (p,) = nvml.nvmlDeviceGetComputeRunningProcesses(h)
    assert (p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId) == (
        42,
        None,
        0xFFFFFFFF,
        0xFFFFFFFF,
    )
    (u,) = nvml.nvmlDeviceGetProcessUtilization(h, 0)
    assert isinstance(u, pynvml.c_nvmlProcessUtilizationSample_t) and (u.pid, u.smUtil) == (42, 50)
    # No sample newer than that: pynvml raises NVMLError(NVML_SUCCESS), as against NVIDIA's mock
    # (its size query answers success with zero samples); nvml.h documents NOT_FOUND, also modelled.
    with pytest.raises(pynvml.NVMLError) as info:
        nvml.nvmlDeviceGetProcessUtilization(h, 2**63)
    assert info.value.value == pynvml.NVML_SUCCESS
    nvml.gpus[0].no_process_samples_code = pynvml.NVML_ERROR_NOT_FOUND
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetProcessUtilization(h, 2**63)
    assert nvml.nvmlSystemGetProcessName(42) == "python3"
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlSystemGetProcessName(43)


def test_event_wait_times_out_with_the_real_error(nvml):
    es = nvml.nvmlEventSetCreate()
    h = nvml.nvmlDeviceGetHandleByIndex(1)
    nvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(es, 5)
    nvml.gpus[1].inject_xid(79)
    data = nvml.nvmlEventSetWait_v2(es, 5)
    assert isinstance(data, pynvml.c_nvmlEventData_t)
    assert (data.eventType, data.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 79)
    assert (data.gpuInstanceId, data.computeInstanceId) == (0xFFFFFFFF, 0xFFFFFFFF)
    assert nvml.nvmlDeviceGetUUID(data.device) == nvml.gpus[1].uuid
    nvml.nvmlEventSetFree(es)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlEventSetWait_v2(es, 5)


def test_scripting_api(nvml):
    with pytest.raises(TypeError):
        nvml.set_values(0, power_watts=1)
    nvml.set_values(0, power_mw=None)
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetPowerUsage(h)
    nvml.gpus[0].fail("nvmlDeviceGetClockInfo", pynvml.NVML_ERROR_TIMEOUT, times=2)
    for _ in range(2):
        with pytest.raises(pynvml.NVMLError_Timeout):
            nvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
    assert nvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == 1980
    assert nvml.count("nvmlDeviceGetClockInfo", gpu=0) == 3
    fake = FakeNvml.from_values([{"util_gpu": 10}, {"util_gpu": 20}], model="H200")
    assert [g.util_gpu for g in fake.gpus] == [10, 20] and fake.gpus[1].name == "NVIDIA H200"


def test_fixture_files_load():
    fake = load_fixture("dgx_h100_mixed")
    assert len(fake.gpus) == 8
    assert fake.gpus[2].mig_enabled and [s.profile for s in fake.gpus[2].mig_slices] == ["3g.40gb", "4g.40gb"]
    assert fake.gpus[0].processes[0].used_memory == 64 * GIB
    assert load_fixture("a100_ampere").gpus[0].gpm_supported is False
