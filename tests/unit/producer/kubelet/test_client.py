"""PodResourcesClient and AllocationRefresher against a real gRPC server on a unix socket."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import grpc
import pytest

from gpupipe_producer.kubelet import api_pb2, api_pb2_grpc
from gpupipe_producer.kubelet.client import (
    ERROR_KINDS,
    LIST_METHOD,
    LOGGER_NAME,
    AllocationRefresher,
    KubeletSocketAbsent,
    PodResourcesClient,
)
from gpupipe_producer.kubelet.mapping import (
    AllocationMapper,
    ContainerDevices,
    DraDeviceKey,
    PodRef,
    lookup,
    pod_resources_from_dict,
)
from gpupipe_producer.nvml.records import empty_sample
from gpupipe_producer.samples.enrich import enrich_sample
from tests.paths import REPO

try:
    from tests.kubelet_fake import FakeKubelet, fixture_names, load_fixture
except ModuleNotFoundError:  # plain `pytest` without pythonpath = ["."]: the repo root is not on sys.path
    sys.path.insert(0, str(REPO))
    from tests.kubelet_fake import FakeKubelet, fixture_names, load_fixture

TIMEOUT_S = 0.3


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def kubelet():
    with FakeKubelet(load_fixture("whole_gpus")) as k:
        yield k


def make_refresher(
    path: str, timeout_s: float = TIMEOUT_S, **kw
) -> tuple[AllocationRefresher, list[str], FakeClock]:
    hooked: list[str] = []
    clock = FakeClock()
    r = AllocationRefresher(
        PodResourcesClient(path, timeout_s=timeout_s),
        on_error=hooked.append,
        monotonic=clock,
        wall_clock=lambda: 1_700_000_000.0 + clock.t,
        **kw,
    )
    return r, hooked, clock


def only_errors(r: AllocationRefresher) -> dict[str, int]:
    return {k: v for k, v in r.error_counts.items() if v}


# -- client ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", fixture_names())
def test_each_fixture_maps_the_same_over_grpc(name):
    fx = load_fixture(name)
    mapper = AllocationMapper(tuple(fx.get("extra_resource_names", ())))
    with FakeKubelet(fx) as k, PodResourcesClient(k.socket_path, timeout_s=TIMEOUT_S) as client:
        amap = client.list_allocations(mapper=mapper)
    advertised = [
        ContainerDevices(d["resource_name"], tuple(d["device_ids"]))
        for d in fx.get("allocatable", {}).get("devices", ())
    ]
    assert amap == mapper.build(pod_resources_from_dict(fx)).with_replicas(mapper.replica_counts(advertised))
    assert set(amap) == set(fx["expected"]["devices"])


def test_list_allocations_extra_names_and_dra_over_grpc():
    with FakeKubelet(load_fixture("odd")) as k, PodResourcesClient(k.socket_path, timeout_s=TIMEOUT_S) as c:
        assert "accel-0" not in c.list_allocations()
        assert lookup(c.list_allocations(["example.com/accel"]), "accel-0") == (
            PodRef("misc", "accel", "app", "example.com/accel"),
        )
        k.set_fixture(load_fixture("dra"))
        amap = c.list_allocations()
    (share,) = [
        r for r in amap.dra[DraDeviceKey("gpu.nvidia.com", "node-a", "gpu-1")] if r.pod == "trainer-0"
    ]
    assert share.claim_name == "trainer-0-gpus"


def test_share_id_and_cdi_survive_conversion():
    with FakeKubelet(load_fixture("dra")) as k, PodResourcesClient(k.socket_path, timeout_s=TIMEOUT_S) as c:
        pods = {p.name: p for p in c.list_pod_resources()}
    claims = pods["trainer-0"].containers[0].dynamic_resources[0].claim_resources
    assert [(x.device_name, x.share_id, x.cdi_devices) for x in claims] == [
        ("gpu-0", None, ("k8s.gpu.nvidia.com/device=gpu-0",)),
        ("gpu-1", "s-1", ("k8s.gpu.nvidia.com/device=gpu-1",)),
    ]


def test_fake_serves_allocatable_and_get(kubelet):
    with PodResourcesClient(kubelet.socket_path, timeout_s=TIMEOUT_S) as c:
        alloc = c.get_allocatable()
    assert len(alloc.devices[0].device_ids) == 8
    with grpc.insecure_channel("unix://" + kubelet.socket_path) as ch:
        stub = api_pb2_grpc.PodResourcesListerStub(ch)
        got = stub.Get(api_pb2.GetPodResourcesRequest(pod_name="bert-sweep-7", pod_namespace="ml-train"))
        assert got.pod_resources.containers[0].name == "worker"
        with pytest.raises(grpc.RpcError) as err:
            stub.Get(api_pb2.GetPodResourcesRequest(pod_name="nope", pod_namespace="x"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert err.value.details() == "pod nope in namespace x not found"


def test_list_method_path_matches_descriptor():
    method = api_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"].methods_by_name["List"]
    assert f"/{method.containing_service.full_name}/{method.name}" == LIST_METHOD


def test_client_raises_and_validates(tmp_path):
    with pytest.raises(ValueError):
        PodResourcesClient("relative/kubelet.sock")
    with pytest.raises(ValueError):
        PodResourcesClient("/x.sock", timeout_s=0)
    c = PodResourcesClient(str(tmp_path / "absent.sock"))
    assert c.target == "unix://" + str(tmp_path / "absent.sock")
    with pytest.raises(KubeletSocketAbsent):
        c.list_allocations()


# -- refresher ---------------------------------------------------------------------------------------


def test_churn_ended_pod_loses_attribution_at_next_refresh():
    with FakeKubelet(load_fixture("churn_before")) as k:
        r, hooked, _ = make_refresher(k.socket_path)
        gpu0 = "GPU-d3e4f5a6-b7c8-d9e0-f1a2-b3c4d5e6f7a0"
        gpu1 = "GPU-d3e4f5a6-b7c8-d9e0-f1a2-b3c4d5e6f7a1"
        first = r.refresh()
        assert [p.pod for p in lookup(first, gpu0)] == ["job-old"]
        k.set_fixture(load_fixture("churn_after"))
        second = r.refresh()
    assert [p.pod for p in lookup(second, gpu0)] == ["job-new"]
    assert lookup(second, gpu1) == ()
    assert ("team-a", "job-old") not in second.pods()
    assert r.healthy and hooked == [] and only_errors(r) == {}
    assert r.current is second


def test_socket_absent_gives_empty_map_counter_and_unhealthy(tmp_path, caplog):
    r, hooked, _ = make_refresher(str(tmp_path / "kubelet.sock"))
    assert not r.healthy and r.last_success_time is None
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    amap = r.refresh()
    assert not amap and len(amap) == 0
    assert not r.healthy
    assert only_errors(r) == {"socket_absent": 1}
    assert set(r.error_counts) == set(ERROR_KINDS)
    assert hooked == ["socket_absent"]
    assert r.last_error.startswith("socket_absent")
    assert "socket_absent" in caplog.text


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.UNAVAILABLE, "unavailable"),
        (grpc.StatusCode.INTERNAL, "rpc_error"),
        (grpc.StatusCode.PERMISSION_DENIED, "rpc_error"),
        (grpc.StatusCode.UNIMPLEMENTED, "rpc_error"),
    ],
)
def test_server_error_gives_empty_map_not_stale_one(kubelet, code, kind):
    r, hooked, _ = make_refresher(kubelet.socket_path)
    assert r.refresh()  # a good map first: it must not survive the failure
    ok_time = r.last_success_time
    kubelet.fail_with(code, "boom")
    amap = r.refresh()
    assert not amap
    assert not r.healthy
    assert only_errors(r) == {kind: 1}
    assert hooked == [kind]
    assert r.last_success_time == ok_time
    assert "boom" in r.last_error


def test_garbage_response_is_bad_response(kubelet, caplog):
    caplog.set_level(logging.WARNING)
    r, hooked, _ = make_refresher(kubelet.socket_path)
    kubelet.set_garbage()
    assert not r.refresh()
    assert not r.refresh()
    assert hooked == ["bad_response", "bad_response"]
    # one rate-limited line of ours, no ERROR traceback from grpc's own logger per call
    assert [(rec.name, rec.levelname) for rec in caplog.records] == [(LOGGER_NAME, "WARNING")]


def test_slow_server_times_out_within_deadline(kubelet):
    kubelet.set_delay(5.0)
    r, hooked, _ = make_refresher(kubelet.socket_path)
    t0 = time.monotonic()
    amap = r.refresh()
    elapsed = time.monotonic() - t0
    assert not amap
    assert hooked == ["deadline_exceeded"]
    assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + 0.7, elapsed
    assert kubelet.wait_for_calls(1)


def test_server_stopped_and_restarted_recovers(kubelet, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    r, hooked, _ = make_refresher(kubelet.socket_path)
    assert r.refresh() and r.healthy
    kubelet.stop()
    assert not os.path.exists(kubelet.socket_path)
    assert not r.refresh()
    assert hooked == ["socket_absent"] and not r.healthy
    kubelet.start()
    amap = r.refresh()
    assert amap and r.healthy
    assert len(amap) == 7
    recovered = [rec for rec in caplog.records if rec.levelno == logging.INFO and "recovered" in rec.message]
    assert len(recovered) == 1
    r.refresh()
    assert len([rec for rec in caplog.records if "recovered" in rec.message]) == 1


def test_socket_file_without_server_is_unavailable_then_recovers(kubelet):
    # A dead socket fails at once whatever the timeout; the first call on a new connection after
    # the restart may take longer than 0.3 s on a loaded 2-core machine (seen once in CI).
    r, hooked, _ = make_refresher(kubelet.socket_path, timeout_s=5.0)
    assert r.refresh()
    kubelet.stop()
    open(kubelet.socket_path, "w").close()  # a stale, dead socket path: connect fails
    assert not r.refresh()
    assert hooked == ["unavailable"]
    kubelet.start()  # removes the stale file and binds again
    # The agent refreshes every tick; gRPC may still be in its reconnect backoff for the first one.
    deadline = time.monotonic() + 30
    while not r.refresh():
        assert time.monotonic() < deadline, "the refresher never recovered"
        time.sleep(0.1)
    assert r.healthy


def test_warnings_are_rate_limited_per_kind(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    r, hooked, clock = make_refresher(str(tmp_path / "kubelet.sock"))

    def warnings() -> list[logging.LogRecord]:
        return [rec for rec in caplog.records if rec.levelno == logging.WARNING and rec.name == LOGGER_NAME]

    r.refresh()
    clock.t += 10
    r.refresh()
    assert len(warnings()) == 1  # two failures within the window: one line
    assert r.error_counts["socket_absent"] == 2 and hooked == ["socket_absent"] * 2
    clock.t += 30
    r.refresh()
    assert len(warnings()) == 1
    clock.t += 21  # 61 s after the first line
    r.refresh()
    assert len(warnings()) == 2
    assert "2 similar failure(s) not logged" in warnings()[-1].getMessage()


def test_other_kinds_have_their_own_window(kubelet, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    r, hooked, _ = make_refresher(kubelet.socket_path)
    kubelet.fail_with(grpc.StatusCode.UNAVAILABLE)
    r.refresh()
    r.refresh()
    kubelet.fail_with(grpc.StatusCode.INTERNAL)
    r.refresh()
    assert [rec.kubelet_error_kind for rec in caplog.records] == ["unavailable", "rpc_error"]
    assert hooked == ["unavailable", "unavailable", "rpc_error"]


def test_refresh_never_raises_even_if_mapping_or_hook_fails(kubelet):
    def resolver(driver, pool, device):
        raise RuntimeError("resolver bug")

    def bad_hook(kind):
        raise RuntimeError("hook bug")

    kubelet.set_fixture(load_fixture("dra"))
    r = AllocationRefresher(
        PodResourcesClient(kubelet.socket_path, timeout_s=TIMEOUT_S),
        mapper=AllocationMapper(dra_device_resolver=resolver),
        on_error=bad_hook,
    )
    assert not r.refresh()
    assert r.error_counts["unexpected"] == 1
    r.close()


def test_refresher_builds_its_own_client_and_extra_names():
    with FakeKubelet(load_fixture("odd")) as k:
        r = AllocationRefresher(
            socket_path=k.socket_path, timeout_s=TIMEOUT_S, extra_resource_names=["example.com/*"]
        )
        amap = r.refresh()
        r.close()
    assert "accel-0" in amap and r.client.timeout_s == TIMEOUT_S
    assert r.last_success_time is not None and abs(r.last_success_time - time.time()) < 60


def test_counters_readable_while_a_refresh_is_blocked(kubelet):
    kubelet.set_delay(5.0)
    r, _, _ = make_refresher(kubelet.socket_path)
    worker = threading.Thread(target=r.refresh)
    worker.start()
    assert kubelet.wait_for_calls(1)  # the refresh is now inside the slow RPC
    t0 = time.monotonic()
    assert r.error_counts["deadline_exceeded"] == 0
    assert time.monotonic() - t0 < 0.1
    worker.join(TIMEOUT_S + 2)
    assert not worker.is_alive()
    assert r.error_counts["deadline_exceeded"] == 1


def test_replica_counts_come_from_the_allocatable_devices() -> None:
    """Each time-sliced GPU of the fixture advertises 5 replicas; two of GPU A's are held. The
    samples then say 5, so chargeback bills the 3 free replicas' idle share as unallocated."""
    shared = "GPU-a0b1c2d3-e4f5-a6b7-c8d9-e0f1a2b3c4d5"
    with (
        FakeKubelet(load_fixture("time_slicing")) as k,
        PodResourcesClient(k.socket_path, timeout_s=TIMEOUT_S) as client,
    ):
        amap = client.list_allocations()
        assert k.call_count("GetAllocatableResources") == 1
    assert amap.replicas == {shared: 5, "GPU-b1c2d3e4-f5a6-b7c8-d9e0-f1a2b3c4d5e6": 5}
    s = empty_sample()
    s.update(timestamp_ms=1, hostname="n", gpu_index=0, uuid=shared, pci_bus_id="00000000:1B:00.0")
    assert enrich_sample(s, amap)["shared_replicas"] == 5


def test_no_replica_count_for_a_device_the_kubelet_lists_no_replicas_of() -> None:
    fixture = {k: v for k, v in load_fixture("time_slicing").items() if k != "allocatable"}
    with FakeKubelet(fixture) as k, PodResourcesClient(k.socket_path, timeout_s=TIMEOUT_S) as client:
        amap = client.list_allocations()
    assert amap and amap.replicas == {}
    s = empty_sample()
    s.update(timestamp_ms=1, hostname="n", gpu_index=0, uuid="GPU-a0b1c2d3-e4f5-a6b7-c8d9-e0f1a2b3c4d5")
    s["pci_bus_id"] = "00000000:1B:00.0"
    assert len(enrich_sample(s, amap)["allocations"]) == 2 and s["shared_replicas"] is None
